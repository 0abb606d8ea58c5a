"""Token rows with their shared prompt prefixes split off: the update's and the scoring's input.

In a StraTA iteration the step prompts of the M trajectories of one (task, strategy) begin with the
same intro, task, strategy and start memory (~150-200 of ~250 tokens in the household config).
Teacher-forcing every row in full pays for those tokens once per row; `SharedBatch` runs each
common prefix once ([U, Tpre]) and every row's remainder ([S, Ls], its suffix) against the
prefix's keys and values (`strata_jax.train.shared_sequence_logprobs`).

`pack_shared` builds it on the host (numpy) from a TokenBatch mini-batch:
  - a row's *prompt* is its real tokens before its first loss token; only that part is ever
    shared, and every row keeps at least its last prompt token in the suffix (the hidden state
    there predicts the first response token), so every loss token lies in the suffix;
  - rows are sorted by prompt (sharing rows become neighbours) and dealt to the micro-batches in
    blocks; each micro-batch is planned with strata_jax/prefix.py (`group_rows`, `fit_groups`);
  - one (Tpre, Ts, UB) for all micro-batches, chosen from the buckets to minimise the padded
    tokens through the model, k x UB x Tpre + S x Ts; a row whose suffix would not fit gets a
    private prefix, a row that shares nothing an empty one (all padding);
  - None when no plan saves `min_saving` of the unshared S x L tokens: the caller runs the plain
    TokenBatch then.

Plans are compared by model cost: padded tokens plus `pair_cost` x the (query, key) pairs that the
dense attention computes (`pair_cost`: one pair's FLOPs over one token's layer FLOPs, from
`pair_cost(model_config)`; about 0.002 for the 64-wide tiny model, where attention is most of a
token's cost, and 3e-5 for Qwen2.5-7B, where it is negligible). Without it, a plan would pick the
longest rows it can, cheapest in tokens and dearest in attention.

Layout of a SharedBatch packed for k micro-batches (`train._split_micro` takes rows j, j + k, ...
into micro-batch j, and the same stride over the prefixes): row p = i·k + j is row i of micro-batch
j, prefix q = u·k + j is prefix u of micro-batch j, and `row_prefix[p]` = u indexes the prefixes of
the row's own micro-batch. The rows' order differs from the input's (`pack_shared` returns it):
the loss is a sum over rows, so an update does not depend on it beyond float rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from flax import struct

from strata_jax.batch import TokenBatch
from strata_jax.cost import layer_flops, pair_flops, plan_cost, prefixed
from strata_jax.prefix import common_prefix_len, fit_groups, group_rows

# The TokenBatch fields laid out [S, L] along the row's tokens (the suffix keeps their tail).
TOKEN_FIELDS = ("tokens", "attention_mask", "loss_mask", "old_logp", "ref_logp", "advantage", "penalty_mask")


@struct.dataclass
class SharedBatch:
    """A TokenBatch whose rows' shared prompt prefixes are split off (module docstring).

    `rows`: the rows' suffixes, a TokenBatch [S, Ls] (every [S, L] field cut to the row's last
    Ls columns, the split-off prefix masked out); `prefix_tokens` / `prefix_mask` [k·UB, Tpre]
    left-padded (unused slots all False); `row_prefix` [S] i32, the row's prefix among its
    micro-batch's UB; `micro_batches` = k (static).
    """

    rows: TokenBatch
    prefix_tokens: np.ndarray
    prefix_mask: np.ndarray
    row_prefix: np.ndarray
    micro_batches: int = struct.field(pytree_node=False, default=1)

    @property
    def model_tokens(self) -> int:
        """Padded token slots one pass runs through the model: prefixes plus suffixes."""
        return int(np.prod(self.prefix_tokens.shape) + np.prod(self.rows.tokens.shape))


def length_buckets(longest: int, extra: Sequence[int] = (), smallest: int = 16, steps: int = 2) -> tuple[int, ...]:
    """Prefix / suffix lengths: `steps` evenly spaced sizes per octave, 2^i x (1, 1 + 1/steps, ...),
    from `smallest` up to the first >= `longest`, with the `extra` buckets below it. steps = 2
    (2^i and 3 x 2^(i-1)) keeps padding under a third (a 180-token prefix pads to 192, not 256)
    for about twice the programs of powers of two; steps = 8 keeps it under 1/8 (rows of 520 to
    570 tokens pad to 576, not 768) for about four times the programs of steps = 2."""
    if steps < 1 or steps & (steps - 1):
        raise ValueError(f"length_buckets: steps={steps} must be a power of two (1, 2, 4, 8, ...)")
    out, b = set(int(x) for x in extra if int(x) < longest), smallest
    while True:
        for j in range(steps):
            size = b + j * b // steps
            out.add(size)
            if size >= longest:
                return tuple(sorted(out))
        b *= 2


def row_prompts(batch: TokenBatch) -> tuple[list[list[int]], np.ndarray]:
    """Each row's prompt (its real tokens before the first loss token; all of them for a row without
    loss tokens) and its tail length (the real tokens from the first loss token on), [S].

    Raises on a row that is not left-padded or whose first real token is a loss token (it has no
    context to be predicted from)."""
    tokens, mask, loss = (np.asarray(x) for x in (batch.tokens, batch.attention_mask, batch.loss_mask))
    s, length = tokens.shape
    n = mask.sum(axis=1)  # [S] real tokens
    col = np.arange(length)[None]
    start = length - n  # [S] first real column
    bad = np.flatnonzero((mask != (col >= start[:, None])).any(axis=1))
    if bad.size:
        raise ValueError(
            f"pack_shared: rows {bad[:8].tolist()} are not left-padded (attention_mask must be False then True)"
        )
    if (loss & ~mask).any():
        raise ValueError("pack_shared: a loss_mask token lies on padding (attention_mask False)")
    has_loss = loss.any(axis=1)
    first = np.where(has_loss, np.argmax(loss, axis=1), length)  # [S] first loss column
    orphan = np.flatnonzero(has_loss & (first <= start))
    if orphan.size:
        raise ValueError(
            f"pack_shared: rows {orphan[:8].tolist()} have a loss token at their first real token "
            "(nothing to predict it from)"
        )
    prompts = [tokens[r, start[r] : first[r]].tolist() for r in range(s)]
    return prompts, (length - first).astype(np.int64)


def pair_cost(model_cfg) -> float:
    """FLOPs of one attention (query, key) pair over one token's FLOPs in a layer's projections
    and MLP (the vocabulary head runs on the loss window either way): the weight of attention in
    `pack_shared`'s plan cost. `model_cfg`: a strata_jax.models.config.ModelConfig."""
    return pair_flops(model_cfg) / layer_flops(model_cfg)


def _cost(prefix_rows: int, tpre: int, rows: int, ts: int, pair: float) -> float:
    """Plan cost: padded tokens plus `pair` x the dense attention's (query, key) pairs."""
    return plan_cost(prefixed(prefix_rows, tpre, rows, ts, 0), pair)


@dataclasses.dataclass(frozen=True)
class _Plan:
    prefix_bucket: int
    suffix_bucket: int
    unique_bucket: int
    cost: float
    splits: list  # per micro-batch [S / k] splits


def prefix_tree_tokens(batch: TokenBatch) -> int:
    """Tokens a perfect prefix tree would run for these rows: every distinct prompt prefix once
    (the nodes of a trie over the rows' prompts), each row's tail, no padding. The lower bound of
    any prefix-sharing layout (bench/iteration.py prints it against pack_shared's plans)."""
    prompts, tails = row_prompts(batch)
    live = np.flatnonzero(np.asarray(batch.attention_mask).any(axis=1))
    ps = sorted(prompts[r] for r in live)
    shared = sum(common_prefix_len(a, b) for a, b in zip(ps, ps[1:]))  # sorted: trie nodes = sum - lcps
    return int(sum(map(len, ps)) - shared + tails[live].sum())


def _common_prefixes(sorted_prompts) -> np.ndarray:
    """[m, m]: the common prefix length of prompts a < b (sorted), the minimum of the neighbours'
    common prefixes between them (sorted order)."""
    m = len(sorted_prompts)
    lcp = np.array([common_prefix_len(a, b) for a, b in zip(sorted_prompts, sorted_prompts[1:])] + [0], np.int64)
    out = np.zeros((m, m), np.int64)
    for a in range(m - 1):
        out[a, a + 1 :] = np.minimum.accumulate(lcp[a : m - 1])
    return out


def _distinct_prefixes(common: np.ndarray, splits: np.ndarray) -> int:
    """How many distinct prefixes prompt[:split] the sorted rows have (the empty one included):
    `len({tuple(prompts[r][:sp]) ...})` without building them. Rows with one key are contiguous
    among the rows of their split length (sorted order), and two of them share the key when their
    common prefix reaches the split."""
    splits = np.asarray(splits, np.int64)
    order = np.lexsort((np.arange(len(splits)), splits))  # by split, then sorted position
    sp = splits[order]
    a, b = order[:-1], order[1:]
    same = (sp[1:] == sp[:-1]) & (common[a, b] >= sp[1:])
    return int(len(splits) - same.sum())


def pack_shared(
    batch: TokenBatch,
    micro_batches: int = 1,
    data_parallel: int = 1,
    buckets: Sequence[int] = (),
    min_prefix: int = 16,
    min_saving: float = 0.2,
    pair: float = 0.0,
    steps: int = 2,
) -> tuple[SharedBatch, np.ndarray] | None:
    """(SharedBatch, order [S]) for a host TokenBatch [S, L], or None when sharing saves too little.

    `order[p]` is the input row that became row p. `micro_batches` / `data_parallel`: the train
    step's k and data-parallel device count (S must divide by their product; UB is a multiple of
    `data_parallel` so the prefixes split over the same devices). Tpre and Ts come from
    `length_buckets(L, buckets, steps=steps)`; UB from half steps (1, 2, 3, 4, 6, 8, ...) times
    `data_parallel`. `pair`: attention's weight in the plan cost (`pair_cost`).
    """
    host = TokenBatch(
        **{
            f.name: (None if getattr(batch, f.name) is None else np.asarray(getattr(batch, f.name)))
            for f in dataclasses.fields(TokenBatch)
        }
    )
    s, length = host.tokens.shape
    k = int(micro_batches)
    if k < 1 or data_parallel < 1:
        raise ValueError(f"pack_shared: micro_batches={k} and data_parallel={data_parallel} must be >= 1")
    if s % (k * data_parallel):
        raise ValueError(
            f"pack_shared: rows S={s} must be divisible by micro_batches={k} x data-parallel devices={data_parallel}"
        )
    prompts, tails = row_prompts(host)
    m = s // k
    # Sorted rows dealt to micro-batches in blocks: rows sharing a prefix share a micro-batch.
    by_prompt = sorted(range(s), key=lambda r: prompts[r])
    order = np.empty(s, np.int64)
    for q, r in enumerate(by_prompt):
        order[(q % m) * k + q // m] = r
    micro = [order[j::k] for j in range(k)]  # input rows of micro-batch j, in its row order
    groups = [group_rows([prompts[r] for r in rows], min_prefix) for rows in micro]
    common = [_common_prefixes([prompts[r] for r in rows]) for rows in micro]

    sizes = length_buckets(length, buckets, steps=steps)
    n_prompt = np.array([len(p) for p in prompts], np.int64)  # [S]
    best = None
    for tpre in sizes:
        # A row fits only if its prompt's last token and its tail fit in Ts after a prefix of at
        # most Tpre (fit_groups): smaller Ts need not be tried.
        need = int(np.max(n_prompt + tails - np.minimum(tpre, n_prompt - 1)))
        for ts in sizes:
            if ts < need:
                continue
            if best is not None and _cost(0, tpre, s, ts, pair) >= best.cost:
                break  # costs only grow with Ts
            splits = [
                fit_groups([prompts[r] for r in rows], g, tpre, ts, min_prefix, tails[rows])
                for rows, g in zip(micro, groups)
            ]
            if any(x is None for x in splits):
                continue
            if best is not None and _cost(k * data_parallel, tpre, s, ts, pair) >= best.cost:
                continue  # not cheaper even with the fewest prefix rows: skip counting them
            u = max(_distinct_prefixes(c, x) for c, x in zip(common, splits))
            # UB: data_parallel x the first half-step size (1, 2, 3, 4, 6, 8, 12, ...) that holds U,
            # as for the lengths: 9 prefixes pad to 12 slots, not 16.
            ub = data_parallel * max(length_buckets(-(-u // data_parallel), smallest=1))
            cost = _cost(k * ub, tpre, s, ts, pair)
            if best is None or cost < best.cost:
                best = _Plan(tpre, ts, ub, cost, splits)
        if tpre >= n_prompt.max():
            break  # a longer prefix bucket cannot split any row later: it only pads
    unshared = _cost(0, 0, s, length, pair)
    if best is None or best.cost >= unshared or best.cost > (1.0 - min_saving) * unshared:
        return None
    return _build(host, prompts, order, micro, best, k), order


def _build(host: TokenBatch, prompts, order: np.ndarray, micro, plan: _Plan, k: int) -> SharedBatch:
    s, length = host.tokens.shape
    tpre, ts, ub = plan.prefix_bucket, plan.suffix_bucket, plan.unique_bucket
    pre_tokens = np.zeros((k * ub, tpre), np.int32)
    pre_mask = np.zeros((k * ub, tpre), bool)
    row_prefix = np.zeros(s, np.int32)
    split = np.zeros(s, np.int64)  # [S] in the packed order
    for j, (rows, splits) in enumerate(zip(micro, plan.splits)):
        index: dict[tuple, int] = {}  # prefix key -> its index among the micro-batch's UB
        for i, (r, sp) in enumerate(zip(rows, splits)):
            key = tuple(prompts[r][:sp])
            if key not in index:
                u = index[key] = len(index)
                if sp:
                    pre_tokens[u * k + j, tpre - sp :] = key
                    pre_mask[u * k + j, tpre - sp :] = True
            row_prefix[i * k + j] = index[key]
            split[i * k + j] = sp
    # A row's suffix is its last n - split real tokens: the tail of every [S, L] field, cut (or
    # left-padded) to Ts columns, with the columns before the suffix cleared.
    n = host.attention_mask[order].sum(axis=1) - split  # [S] suffix tokens
    keep = np.arange(ts)[None] >= (ts - n)[:, None]  # [S, Ts]

    def cut(x):
        x = x[order]
        x = x[:, -ts:] if ts <= length else np.pad(x, ((0, 0), (ts - length, 0)))
        return np.where(keep, x, np.zeros((), x.dtype))

    fields = {f: (None if getattr(host, f) is None else cut(getattr(host, f))) for f in TOKEN_FIELDS}
    lost = host.loss_mask[order].sum() - fields["loss_mask"].sum()
    if lost:  # cannot happen: splits stop before every row's first loss token
        raise AssertionError(f"pack_shared: {lost} loss tokens fell into a prefix")
    rows = TokenBatch(**fields, row_index=host.row_index[order], row_valid=host.row_valid[order])
    return SharedBatch(
        rows=rows, prefix_tokens=pre_tokens, prefix_mask=pre_mask, row_prefix=row_prefix, micro_batches=k
    )
