"""Teacher-forced log-probs of a rollout's token rows (the reference policy's, and the old policy's
when they are re-scored), and the row shapes they share with the update: the log-prob window at the
end of each row, trimming to a length bucket, shared prompt prefixes split off (`train.shared_prefix`,
strata_jax/packing.py), and host rows placed on the mesh.

The run is passed in; this module never imports rollout/run.py (which imports it): `ScoringRun`
names what the scoring reads of a run. The pure row operations it shares with the update
(trim_width / trim_rows, check_window, token_order) live in strata_jax/batch.py.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import numpy as np

from strata_jax import cost, sharding
from strata_jax.batch import TokenBatch, check_window, token_order, trim_width
from strata_jax.packing import SharedBatch, length_buckets, pack_shared, pair_cost
from strata_jax.train import sequence_logprobs, shared_batch_logprobs, tree_logprobs
from strata_jax.tree import TreeBatch, TreeRows, plan_tree, plan_tree_rows


class ScoringRun(Protocol):
    """What the scoring reads of a run (rollout.run.Run; the tests pass stand-ins)."""

    config: Any  # the ml_collections run config (train.* settings)
    mesh: Any  # jax.sharding.Mesh with data / fsdp axes
    graphdef: Any  # the model's nnx graphdef
    plan_model: Any  # the ModelConfig the packing plans weigh (packing.pair_cost)
    window: int  # logprob_window(config)
    pad_id: int
    work: dict  # {"score": cost.Work, ...}: model work counted from padded shapes

    def reference_params(self) -> Any: ...


def logprob_window(config) -> int:
    """Columns at the end of a token row that can hold a trained response: the longest budget of
    a trained call kind (strategies, revisions and actions; judgments with algo.judge_train). The update
    and the scoring run the vocabulary head on these columns only (see train.sequence_logprobs)."""
    s = config.sampling
    return int(max(s.max_action_tokens, s.max_strategy_tokens, s.max_judge_tokens if config.algo.judge_train else 0))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _score_window(graphdef, chunk: int, window: int, params, tokens, mask):
    """Teacher-forced log-probs [S, L] on the last `window` columns: the update's own forward."""
    return sequence_logprobs(graphdef, params, tokens, mask, chunk, False, window)[0]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _score_shared(graphdef, chunk: int, window: int, params, sb: SharedBatch):
    """`_score_window` of rows packed with shared prefixes: [S, Ls] over the rows' suffixes."""
    return shared_batch_logprobs(graphdef, params, sb, chunk, False, window)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _score_tree(graphdef, chunk: int, params, tb: TreeBatch):
    """`_score_window` of rows packed as prefix trees (strata_jax/tree.py): [S, W + 1]."""
    return tree_logprobs(
        graphdef, params, tb.tokens, tb.positions, tb.end, tb.slots, tb.targets, tb.blocks, chunk, False
    )[0]


def data_parallel(run: ScoringRun) -> int:
    """Devices the batch rows are split over (the mesh's data and fsdp axes)."""
    return int(run.mesh.shape["data"] * run.mesh.shape["fsdp"])


def update_batch(run: ScoringRun, mb: TokenBatch) -> TokenBatch | SharedBatch | TreeRows:
    """The update's input for a trimmed mini-batch: with `train.shared_prefix` its rows packed with
    their shared prompt prefixes (strata_jax/packing.py) when that saves at least a fifth of the
    tokens through the model, and with `train.prefix_tree_update` its rows as prefix trees
    (strata_jax/tree.py) when those cost the model less still; else the mini-batch itself. All
    give the same update up to float rounding (tests/test_train_shared_prefix.py, tests/test_tree.py)."""
    t = run.config.train
    packed = pack(run, mb, int(t.micro_batches), t.length_buckets) if t.shared_prefix else None
    plan = mb if packed is None else packed[0]
    if not t.prefix_tree_update:
        return plan
    mask = np.asarray(mb.attention_mask)
    # Packed rows at most twice the mini-batch's width: the backward keeps dense attention's
    # [rows, heads, width, width] scores, so wider rows would trade tokens for memory.
    widths = tree_widths(run, mask, 2 * mask.shape[1])
    tree, _ = plan_tree_rows(
        mb, widths, run.window, int(t.micro_batches), data_parallel(run), pair_cost(run.plan_model)
    )
    return min((plan, tree), key=lambda x: model_cost(run, x))


def model_cost(run: ScoringRun, batch) -> float:
    """`cost.plan_cost` of running `batch` (plain, shared or as trees), for `run.plan_model`."""
    return cost.plan_cost(cost.batch_work(batch, 0), pair_cost(run.plan_model))


def tree_widths(run: ScoringRun, mask: np.ndarray, most: int) -> list[int]:
    """The packed-row widths a prefix-tree plan may pick for rows `mask` [S, L]: the length
    buckets (`train.bucket_steps` per octave) from the longest row up to `most`, and no wider than
    the widest configured length bucket; the rows' own width L when none fits."""
    longest = int(mask.sum(axis=1).max(initial=1))
    top = max(longest, min(most, max(run.config.train.length_buckets)))
    return [
        x
        for x in length_buckets(top, run.config.train.length_buckets, steps=int(run.config.train.bucket_steps))
        if longest <= x <= top
    ] or [mask.shape[1]]


def pack(run: ScoringRun, tb: TokenBatch, micro_batches: int, buckets):
    """`pack_shared` with the run's settings: data-parallel blocks, `train.bucket_steps`, and
    attention's weight in the plan cost from `run.plan_model`."""
    return pack_shared(
        tb,
        micro_batches,
        data_parallel(run),
        buckets,
        pair=pair_cost(run.plan_model),
        steps=int(run.config.train.bucket_steps),
    )


def score_batch(run: ScoringRun, tb: TokenBatch, params) -> TokenBatch:
    """The rollout's TokenBatch with ref_logp (the reference params'; 0 when the run keeps none,
    train.kl_coef = 0) and old_logp (`params'` re-scored with train.recompute_old_logp, else the
    sampler's own) filled in, 0 off the loss."""
    tokens_np, mask_np = np.asarray(tb.tokens), np.asarray(tb.attention_mask)
    loss_mask = np.asarray(tb.loss_mask)
    ref_params = run.reference_params()
    ref = (
        np.zeros(loss_mask.shape, np.float32)
        if ref_params is None
        else score_rows(run, ref_params, tokens_np, mask_np, loss_mask)
    )
    old = (
        score_rows(run, params, tokens_np, mask_np, loss_mask)
        if run.config.train.recompute_old_logp
        else np.where(loss_mask, np.asarray(tb.old_logp), 0.0).astype(np.float32)
    )
    return tb.replace(ref_logp=ref, old_logp=old)


def score_rows(run: ScoringRun, params, tokens: np.ndarray, mask: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """Teacher-forced log-probs [S, L] (0 off the loss) of the rows that have loss tokens.

    Rows are scored in mini-batch-sized chunks, each cut to its own length bucket: attention costs
    ~ length^2 here, so a chunk of short rows must not pay for the longest row. The chunks take
    the rows in length order, or with `train.shared_prefix` in token order (rows that share a
    prompt prefix become neighbours) and each chunk runs its shared prefixes once when that saves
    at least a fifth of its tokens (`update_batch`). With `train.prefix_tree`, in token order too, a
    chunk holds mini_batch_rows rows per data-parallel device and runs as prefix trees
    (strata_jax/tree.py: every distinct prefix once) when that costs the model less (`_chunk_plan`).
    """
    buckets = run.config.train.length_buckets
    chunk = int(run.config.train.logprob_chunk)
    shared, tree = bool(run.config.train.shared_prefix), bool(run.config.train.prefix_tree)
    # As trees, every device packs mini_batch_rows neighbours (the chunk's rows are split into one
    # contiguous block per device, and a tree shares only within its block).
    rows = int(run.config.train.mini_batch_rows) * (data_parallel(run) if tree else 1)
    check_window(loss_mask, run.window)
    out = np.zeros(tokens.shape, np.float32)
    live = np.flatnonzero(loss_mask.any(axis=1))
    if shared or tree:
        order = token_order(tokens, mask, live)
    else:
        order = live[np.argsort(mask[live].sum(axis=1), kind="stable")]
    for i in range(0, len(order), rows):
        idx = order[i : i + rows]
        n = len(idx)
        tk, mk, lm = tokens[idx], mask[idx], loss_mask[idx]
        if n < rows:  # pad to one shape per bucket
            tk = np.concatenate([tk, np.full((rows - n, tk.shape[1]), run.pad_id, tk.dtype)])
            mk = np.concatenate([mk, np.zeros((rows - n, mk.shape[1]), bool)])
            lm = np.concatenate([lm, np.zeros((rows - n, lm.shape[1]), bool)])
        w = trim_width(mk, buckets)
        tk, mk, lm = tk[:, -w:], mk[:, -w:], lm[:, -w:]
        plan = _chunk_plan(run, tk, mk, lm, n) if shared or tree else None
        if plan is None:
            run.work["score"].add(**cost.dense(rows, w, run.window), **cost.real(mk.sum(axis=1)))
            lp = _score_window(run.graphdef, chunk, run.window, params, *to_mesh(run, (tk, mk)))
            out[idx, -w:] = sharding.fetch_global(lp)[:n]
        elif isinstance(plan, TreeBatch):
            run.work["score"].add(**cost.batch_work(plan, run.window), **cost.real(mk.sum(axis=1)))
            lp = sharding.fetch_global(_score_tree(run.graphdef, chunk, params, to_mesh(run, plan)))  # [rows, W + 1]
            c = min(lp.shape[1] - 1, w)
            out[idx, -c:] = lp[:n, -c:]
        else:
            sb, perm = plan  # packed row p is chunk row perm[p]; its suffix is the row's last Ls columns
            run.work["score"].add(**cost.batch_work(sb, run.window), **cost.real(mk.sum(axis=1)))
            lp = sharding.fetch_global(_score_shared(run.graphdef, chunk, run.window, params, to_mesh(run, sb)))
            c = min(lp.shape[1], w)
            real = perm < n
            out[idx[perm[real]], -c:] = lp[real, -c:]
    return np.where(loss_mask, out, 0.0).astype(np.float32)


def _chunk_plan(run: ScoringRun, tk, mk, lm, n):
    """How a scoring chunk [rows, w] (its first n rows real) shares its prefixes: with
    `train.shared_prefix` the (SharedBatch, row order) of `pack` (one level of shared prefix), and
    with `train.prefix_tree` whichever of that, a TreeBatch (the rows as prefix trees,
    strata_jax/tree.py) and the plain rows costs the model least (tokens plus attention pairs
    weighed for `run.plan_model`, `pair_cost`); None: the plain rows."""
    rows, w = tk.shape
    zeros = np.zeros(tk.shape, np.float32)
    tb = TokenBatch(
        tokens=tk,
        attention_mask=mk,
        loss_mask=lm,
        old_logp=zeros,
        ref_logp=zeros,
        advantage=zeros,
        row_index=np.zeros((rows, 4), np.int32),
        row_valid=np.arange(rows) < n,
    )
    packed = pack(run, tb, 1, run.config.train.length_buckets) if run.config.train.shared_prefix else None
    if not run.config.train.prefix_tree:
        return packed
    # Packed rows up to 4x the longest row (no backward here to keep their attention scores).
    widths = tree_widths(run, mk, 4 * int(mk.sum(axis=1).max(initial=1)))
    tree = plan_tree(tk, mk, widths, run.window, data_parallel(run), pair_cost(run.plan_model))
    costs = [(model_cost(run, tb), None), (model_cost(run, tree), tree)]
    if packed is not None:
        costs.append((model_cost(run, packed[0]), packed))
    return min(costs, key=lambda c: c[0])[1]


def to_mesh(run: ScoringRun, tree):
    """Several processes: the host rows (the same on every process) as global arrays split over
    the data axes, each process supplying its own devices' rows. One process: unchanged (host
    numpy goes to the jitted function as before)."""
    if getattr(run, "nproc", 1) == 1:
        return tree
    return sharding.global_from_host(tree, sharding.data_sharding(run.mesh))
