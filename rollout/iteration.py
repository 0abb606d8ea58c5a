"""One training iteration: collect the rollouts of its P tasks, score them, compute the advantages,
update the train state on its mini-batches, and return the iteration's metrics row.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from rollout.collect import collect
from rollout.judge import judge_quality_row
from rollout.scoring import score_batch, to_mesh, update_batch
from rollout.setup import rollout_config, train_tasks
from rollout.shards import merge_results, shard_tasks, to_host
from strata_jax import cost, sharding
from strata_jax.advantages import compute_advantages, token_advantages
from strata_jax.batch import check_window, has_signal, trim_rows
from strata_jax.diagnostics import compute_diagnostics
from strata_jax.packing import SharedBatch
from strata_jax.train import minibatches
from strata_jax.tree import TreeRows

if TYPE_CHECKING:
    from rollout.run import Run


def collect_iteration(run: Run, envs, iteration: int, n_train: int | None):
    """This iteration's rollouts over all P tasks, the same on every process.

    Each process collects its own shards (one after the other, each with its own sampling keys;
    see rollout/shards.py), then the shards are gathered to every process and merged. One shard
    (the default on one process) is exactly the plain `collect` over all tasks.
    """
    config = run.config
    cfg = rollout_config(config)
    if run.nproc > 1:
        cfg = dataclasses.replace(cfg, progress=cfg.progress and run.lead)
    per_shard = shard_tasks(train_tasks(config, iteration, n_train), run.shards)
    mine = []
    for shard in run.my_shards:
        run.policy.reseed(int(config.seed), iteration, shard=None if run.shards == 1 else shard)
        mine.append(collect(envs, run.policy, per_shard[shard], cfg))
    if run.nproc > 1:
        mine = [r for part in sharding.allgather_objects([to_host(r) for r in mine]) for r in part]
    return merge_results(mine, cfg)


def iteration_step(run: Run, envs, iteration: int, n_train: int | None) -> tuple[dict, Any]:
    config = run.config
    times = {}
    t0 = time.perf_counter()
    run.sync_policy()
    run.set_temperature(config.sampling.temperature, config.sampling.strategy_temperature)
    tok0, s0 = run.policy.tokens_generated, run.policy.sample_seconds
    kind0 = dict(run.policy.seconds_by_kind)
    res = collect_iteration(run, envs, iteration, n_train)
    times["rollout"] = time.perf_counter() - t0
    kind_s = {k: run.policy.seconds_by_kind[k] - kind0.get(k, 0.0) for k in run.policy.seconds_by_kind}

    t1 = time.perf_counter()
    tb = score_batch(run, res.tokens, run.state.model_params)
    times["score"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    adv = _compute_advantages(res.traj, run.adv_params, algo=config.algo.name)
    tb = token_advantages(res.traj, adv, tb, run.adv_params, str(config.train.step_weighting))
    diag = jax.device_get(compute_diagnostics(res.traj, adv))
    times["advantages"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    rows = int(config.train.mini_batch_rows)
    sums: dict[str, float] = {}
    n_steps = no_signal = model_tokens = 0
    ptx_nll: list[float] = []
    # the ptx rows of an iteration depend on (seed, iteration) only: a resumed run draws the same
    ptx_rng = np.random.default_rng([int(config.seed), iteration, 0x9F7])
    for mb in minibatches(jax.tree.map(np.asarray, tb), rows, seed=int(config.seed) * 100003 + iteration):
        if run.ptx_step is not None:  # PPO-ptx: one demonstration step per mini-batch, signal or not
            host = run.ptx.batch(ptx_rng)
            run.work["update"].add(
                **cost.dense(*host["tokens"].shape, host["tokens"].shape[1]),
                **cost.real(np.asarray(host["attention_mask"]).sum(axis=1)),
            )
            pk = to_mesh(run, host)
            run.state, nll = run.ptx_step(
                run.state, pk["tokens"], pk["attention_mask"], pk["loss_mask"], float(config.train.ptx_coef)
            )
            ptx_nll.append(float(jax.device_get(nll)))
        if config.train.skip_no_signal and not has_signal(mb):
            no_signal += 1
            continue
        if config.train.rl_update:
            mb = trim_rows(mb, config.train.length_buckets)
            check_window(np.asarray(mb.loss_mask), run.window)
            lengths = np.asarray(mb.attention_mask).sum(axis=1)
            mb = update_batch(run, mb)  # shared prefixes once (train.shared_prefix, train.prefix_tree_update)
            packed = isinstance(mb, (SharedBatch, TreeRows))
            model_tokens += mb.model_tokens if packed else int(np.prod(mb.tokens.shape))
            run.work["update"].add(**cost.batch_work(mb, run.window), **cost.real(lengths))
            # Every process cut the same mini-batches from the same gathered batch (same seed).
            run.state, m = run.train_step(run.state, to_mesh(run, mb), float(config.algo.lam_strategy))
            m = jax.device_get(m)
            n_steps += 1
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(np.asarray(v))
    times["update"] = time.perf_counter() - t3
    # Gather the new params for the samplers now, on every process together, so that process 0
    # can evaluate alone after this step without waiting in a collective (docs/TPU.md).
    run.sync_policy()

    row = {"iteration": iteration}
    row.update(
        metrics_row(
            res,
            diag,
            sums,
            n_steps,
            no_signal,
            float(np.asarray(run.state.skipped)),
            judgment=bool(config.algo.judgment),
        )
    )
    gen_tok = run.policy.tokens_generated - tok0
    row["time/sample_tok_s"] = gen_tok / max(run.policy.sample_seconds - s0, 1e-9)
    row["time/train_tok_s"] = float(np.asarray(tb.attention_mask).sum()) / max(times["update"], 1e-9)
    if ptx_nll:
        row["update/ptx_nll"] = float(np.mean(ptx_nll))  # the demonstrations' NLL before each ptx step
        row["update/ptx_steps"] = len(ptx_nll)
    row["time/update_model_tokens"] = model_tokens  # padded token slots the update ran (shared prefixes once)
    for k, v in times.items():
        row[f"time/{k}_s"] = v
    # The rollout's policy time by call kind: StraTA's strategy and self-judgment calls vs the
    # action calls every algorithm makes (bench/iteration.py reads these).
    row["time/judge_s"] = kind_s.get("judge", 0.0)
    row["time/strategy_s"] = kind_s.get("strategy", 0.0)
    row["time/action_s"] = kind_s.get("action", 0.0)
    row["time/iteration_s"] = time.perf_counter() - t0
    return row, res


def metrics_row(
    res, diag: dict, sums: dict, n_steps: int, no_signal: int, skipped: float, judgment: bool = False
) -> dict:
    """The train/* and update/* columns of an iteration's metrics row: the rollout `res`, its
    diagnostics, and the update's summed metrics over `n_steps` steps (`no_signal` mini-batches
    skipped, `skipped` the state's running count of skipped non-finite steps); with `judgment`,
    the self-judgment's precision and recall against the environment's labels."""
    row = _diag_row("train", diag)
    row["train/success"] = float(res.stats["success_rate"])
    row.update(judge_quality_row(res.traj) if judgment else {})
    row["train/episode_return"] = (
        float(np.asarray(res.traj.episode_return)[np.asarray(res.traj.traj_mask)].mean())
        if np.asarray(res.traj.traj_mask).any()
        else 0.0
    )
    for k in (
        "invalid_rate",
        "crashed",
        "unrun",
        "judge_parse_fail_rate",
        "judged_bad_steps",
        "strategy_malformed",
        "milestones",
        "mean_episode_len",
        "revisions",
        "revision_malformed",
    ):
        if k in res.stats:
            row[f"train/{k}"] = float(res.stats[k])
    for k in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm"):
        if k in sums:
            row[f"update/{k}"] = sums[k] / max(n_steps, 1)
    row["update/skipped_total"] = skipped
    row["update/steps"] = n_steps
    row["update/no_signal_skipped"] = no_signal
    return row


def _diag_row(prefix: str, diag: dict) -> dict:
    out = {}
    for k, v in diag.items():
        a = np.asarray(v)
        if a.ndim == 0:
            out[f"{prefix}/{k}"] = float(a)
    return out


_compute_advantages = jax.jit(compute_advantages, static_argnames=("algo",))
