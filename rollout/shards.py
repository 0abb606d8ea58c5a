"""Rollout shards: an iteration's P tasks collected in S pieces and merged into one batch.

Several processes (docs/TPU.md) each collect their own shards; one process can collect several
shards one after the other (`config.mesh.rollout_shards`), which replays a multi-process run
exactly. Shard s holds tasks [s * P/S, (s+1) * P/S) and samples with its own keys
(`JaxPolicy.reseed(..., shard=s)`), so a shard's rollouts depend on its tasks and keys only, never
on which process collected it.

`merge_results` builds the batch one `collect` over all P tasks would have built from the same
generations: TrajectoryBatch fields concatenated along P; TokenBatch rows in collect's order
(kept strategies by (p, n), then steps by (p, n, m, t)), padded to collect's row multiple and
length bucket; counters summed and rates recomputed over all trajectories.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout.collect import RolloutConfig, RolloutResult, bucket
from strata_jax.batch import TokenBatch, TrajectoryBatch

# stats that are ratios of counters: recomputed after summing (the rest are counters or seconds)
_RATES = ("invalid_rate", "success_rate", "mean_episode_len", "judge_parse_fail_rate", "non_policy_share")
# stats that describe the merged TokenBatch itself
_SHAPE = ("rows_padded", "row_length")


def shard_tasks(tasks: Sequence[int], shards: int) -> list[list[int]]:
    """P tasks -> `shards` contiguous lists of P / shards tasks (P must divide)."""
    tasks = [int(t) for t in tasks]
    if shards < 1 or len(tasks) % shards:
        raise ValueError(
            f"{len(tasks)} tasks per iteration do not split into {shards} rollout shards "
            "(config.algo.tasks_per_iter must divide by the shard count)"
        )
    k = len(tasks) // shards
    return [tasks[i * k : (i + 1) * k] for i in range(shards)]


def process_shards(shards: int, process_index: int, process_count: int) -> range:
    """The shards process `process_index` collects: a contiguous block of shards / processes."""
    if shards % process_count:
        raise ValueError(
            f"{shards} rollout shards do not split over {process_count} processes "
            "(config.mesh.rollout_shards must be a multiple of the process count)"
        )
    k = shards // process_count
    return range(process_index * k, (process_index + 1) * k)


def to_host(res: RolloutResult) -> RolloutResult:
    """Numpy copies of the batch arrays (picklable without a device, for the process gather)."""
    traj = TrajectoryBatch(
        **{f.name: np.asarray(getattr(res.traj, f.name)) for f in dataclasses.fields(TrajectoryBatch)}
    )
    tokens = TokenBatch(**{f.name: np.asarray(getattr(res.tokens, f.name)) for f in dataclasses.fields(TokenBatch)})
    return RolloutResult(traj=traj, tokens=tokens, stats=dict(res.stats), texts=res.texts)


def merge_results(parts: Sequence[RolloutResult], cfg: RolloutConfig) -> RolloutResult:
    """One RolloutResult of all shards, in shard order (see the module docstring)."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [int(np.shape(r.traj.step_mask)[0]) for r in parts])
    traj = _merge_traj([r.traj for r in parts])
    tokens = _merge_tokens([r.tokens for r in parts], offsets, cfg)
    return RolloutResult(
        traj=traj,
        tokens=tokens,
        stats=_merge_stats([r.stats for r in parts], traj, tokens),
        texts=_merge_texts([r.texts for r in parts], offsets),
    )


def _merge_traj(parts: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
    arrays = {}
    for f in dataclasses.fields(TrajectoryBatch):
        xs = [np.asarray(getattr(t, f.name)) for t in parts]
        if f.name in ("anchor_id", "action_id"):
            # Each shard's ids are dense relabels of its own text hashes; shift them apart so equal
            # ids never mean different texts across shards (within a task, where the advantages
            # group, the order and the grouping are unchanged).
            shifted, base = [], 0
            for x in xs:
                shifted.append(np.where(x >= 0, x + base, -1))
                base += int(x.max(initial=-1)) + 1
            xs = shifted
        arrays[f.name] = np.concatenate(xs, axis=0)
    return TrajectoryBatch.from_numpy(**arrays)


def _merge_tokens(parts: Sequence[TokenBatch], offsets: np.ndarray, cfg: RolloutConfig) -> TokenBatch:
    width = max(int(np.asarray(t.tokens).shape[1]) for t in parts)
    cols: dict[str, list[np.ndarray]] = {f.name: [] for f in dataclasses.fields(TokenBatch)}
    longest = 1
    for t, off in zip(parts, offsets):
        valid = np.asarray(t.row_valid)
        mask = np.asarray(t.attention_mask)[valid]
        longest = max(longest, int(mask.sum(axis=1).max(initial=1)))
        for f in dataclasses.fields(TokenBatch):
            x = np.asarray(getattr(t, f.name))[valid]
            if f.name == "row_index":
                x = x.copy()
                x[:, 0] += off
            elif x.ndim == 2 and f.name != "row_index":
                # rows end at the last column (left padding): widen on the left
                fill = cfg.pad_id if f.name == "tokens" else 0
                x = np.concatenate([np.full((x.shape[0], width - x.shape[1]), fill, x.dtype), x], axis=1)
            cols[f.name].append(x)
    rows = {k: np.concatenate(v, axis=0) for k, v in cols.items()}
    ri = rows["row_index"]
    # collect's order: strategy rows (t = -1) by (p, n), then step rows by (p, n, m, t)
    order = np.lexsort((ri[:, 3], ri[:, 2], ri[:, 1], ri[:, 0], ri[:, 3] >= 0))
    n = len(order)
    length = bucket(longest, cfg.length_buckets)
    if length > width:
        raise ValueError(f"merged rows need length {length} > the shards' widest {width}")
    num_rows = max(-(-n // cfg.row_multiple), 1) * cfg.row_multiple
    out = {}
    for name, x in rows.items():
        x = x[order]
        if x.ndim == 2 and name != "row_index":
            x = x[:, width - length :]
        pad_shape = (num_rows - n,) + x.shape[1:]
        fill = cfg.pad_id if name == "tokens" else 0
        out[name] = np.concatenate([x, np.full(pad_shape, fill, x.dtype)], axis=0)
    return TokenBatch(**out)


def _merge_stats(parts: Sequence[dict], traj: TrajectoryBatch, tokens: TokenBatch) -> dict[str, float]:
    keys = list(parts[0])
    for s in parts[1:]:
        if list(s) != keys:
            raise ValueError(f"rollout shards report different stats: {sorted(set(s) ^ set(keys))}")
    out = {k: float(sum(s[k] for s in parts)) for k in keys if k not in _RATES + _SHAPE}
    step_mask = np.asarray(traj.step_mask).reshape(-1, np.shape(traj.step_mask)[-1])
    in_batch = step_mask.any(axis=1)
    won = np.asarray(traj.won).reshape(-1)
    if "invalid_rate" in keys:
        out["invalid_rate"] = out["invalid"] / max(out["steps"], 1.0)
    if "success_rate" in keys:
        out["success_rate"] = float(won[in_batch].mean()) if in_batch.any() else 0.0
    if "mean_episode_len" in keys:
        # an in-batch trajectory's steps are 0 .. length-1 (a crash masks the whole trajectory)
        length = step_mask.sum(axis=1).astype(np.int64)
        out["mean_episode_len"] = float(length[in_batch].mean()) if in_batch.any() else 0.0
    if "judge_parse_fail_rate" in keys:
        out["judge_parse_fail_rate"] = out["judge_parse_fail"] / max(out["judge_calls"], 1.0)
    if "non_policy_share" in keys:
        out["non_policy_share"] = 1.0 - out["policy_time_s"] / max(out["time_s"], 1e-9)
    if "rows_padded" in keys:
        out["rows_padded"] = float(tokens.tokens.shape[0])
    if "row_length" in keys:
        out["row_length"] = float(tokens.tokens.shape[1])
    return {k: out[k] for k in keys}


def _merge_texts(parts: Sequence[dict], offsets: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {"candidates": [], "strategies": [], "trajectories": []}
    for t, off in zip(parts, offsets):
        out["candidates"] += list(t["candidates"])
        out["strategies"] += list(t["strategies"])
        for tr in t["trajectories"]:
            p, n, m = tr["key"]
            out["trajectories"].append({**tr, "key": (int(p) + int(off), n, m)})
    return out
