"""Token rows packed as prefix trees: every distinct prefix of a chunk's rows runs through the model once.

`strata_jax/packing.py` splits one level of shared prefix off a mini-batch. The rows of a rollout
share more than that: the M trajectories of a strategy share their intro, task and strategy, the
rows of one trajectory share its steps' common history, and a looping policy repeats whole
prompts. A trie over the rows holds each of those shared prefixes once
(`packing.prefix_tree_tokens` counts it: about half a scoring pass's token slots on ALFWorld rows).

`pack_tree` lays the trie out for the model. The rows, sorted by their tokens, are written one
after the other into packed rows of `width` slots, each row writing only what its predecessor in
the packed row has not written already (in sorted order a row's longest common prefix with any
earlier row is the one with its predecessor). That is the trie in preorder, and a token's subtree
is the run of slots after it that lie deeper (`end`: the first later slot of depth <= its own).
The model runs each packed row with `Decoder(tree_end=end)`: query i sees key j iff
j <= i < end[j], exactly the tokens on its path from the root, at the position (its depth) the
token has in its own row. Every row's hidden states are then gathered back from its path
(`slots`) and the head runs on the rows' log-prob windows as in `train.sequence_logprobs`, so the
log-probs are the unpacked rows' up to float rounding (tests/test_tree.py).

A row that does not fit in what is left of a packed row starts the next one, written in full.
Rows of a chunk are split into `blocks` contiguous blocks packed separately, one per data-parallel
device, so the gather stays on a device. Dense attention runs every (query, key) pair of a packed
row, most of them masked: the width trades shared tokens against pairs (`plan_tree` picks it by
model cost).

The scoring runs TreeBatches (rollout/scoring.score_rows). With `train.prefix_tree_update` the
update runs `TreeRows`: a mini-batch's rows dealt to (micro-batch, device) blocks and laid out
for the train step's strided micro-batch split (`plan_tree_rows`), with the loss's fields cut to
the log-prob window.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import struct

from strata_jax.batch import TokenBatch, smallest_bucket
from strata_jax.cost import dense, plan_cost
from strata_jax.packing import TOKEN_FIELDS, length_buckets
from strata_jax.prefix import common_prefix_len


@struct.dataclass
class TreeBatch:
    """Rows packed as prefix trees (module docstring).

    tokens / positions / end [R, T] int32: the packed rows (positions = depth; end = the
    exclusive end of the slot's subtree, 0 on padding slots); slots [S, W + 1] int32: where row s's
    last W + 1 columns lie among the (R / blocks) x T slots of its block, flattened (0 where the row
    has no token); targets [S, W + 1]: the rows' last W + 1 tokens. `blocks` (static): the rows and
    the packed rows split into that many contiguous blocks.
    """

    tokens: np.ndarray
    positions: np.ndarray
    end: np.ndarray
    slots: np.ndarray
    targets: np.ndarray
    blocks: int = struct.field(pytree_node=False, default=1)

    @property
    def model_tokens(self) -> int:
        return int(np.prod(self.tokens.shape))


def subtree_ends(depth: np.ndarray, used: int) -> np.ndarray:
    """[used] the exclusive end of each slot's subtree in a preorder layout: the first later slot
    whose depth is <= the slot's own, else `used` (a monotone stack, one pass)."""
    end = np.full(used, used, np.int32)
    stack: list[int] = []
    for i in range(used):
        d = depth[i]
        while stack and depth[stack[-1]] >= d:
            end[stack.pop()] = i
        stack.append(i)
    return end


def _blocks(tokens: np.ndarray, mask: np.ndarray, blocks: int):
    """Each block's rows as token arrays, and each row's common prefix with the block's previous
    non-empty row (0 for its first)."""
    s = tokens.shape[0]
    if s % blocks:
        raise ValueError(f"pack_tree: {s} rows do not split into {blocks} blocks")
    per, out = s // blocks, []
    for b in range(blocks):
        seqs = [tokens[r][mask[r]] for r in range(b * per, (b + 1) * per)]
        lcps, prev = [], None
        for seq in seqs:
            lcps.append(common_prefix_len(prev, seq) if prev is not None and len(seq) else 0)
            prev = seq if len(seq) else prev
        out.append((seqs, lcps))
    return out


def _placements(seqs, lcps, width: int):
    """The greedy layout rule, once: for each non-empty row k (in order), (k, packed row, first
    slot, kept prefix). A row continues its predecessor's packed row past their common prefix when
    its new tokens fit, else opens the next packed row and is written in full."""
    rows, used = -1, width + 1  # used > width: the first row opens a packed row
    for k, (seq, keep) in enumerate(zip(seqs, lcps)):
        n = len(seq)
        if n == 0:
            continue
        if n > width:
            raise ValueError(f"pack_tree: a row of {n} tokens does not fit a packed row of width {width}")
        if used + n - keep > width:
            rows, used, keep = rows + 1, 0, 0
        yield k, rows, used, keep
        used += n - keep


def _pack_block(seqs: Sequence[np.ndarray], lcps: Sequence[int], width: int, window: int):
    """One block's rows (token arrays in sorted order, with `_blocks`' common prefixes) packed into
    rows of `width` slots by `_placements`.

    Returns (packed rows as (tokens, depth) pairs, [n, window + 1] flat slots of each row's last
    window + 1 tokens, -1 where the row has no token)."""
    packed: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
    slots = np.full((len(seqs), window + 1), -1, np.int64)
    prev_path = None
    for k, row, used, keep in _placements(seqs, lcps, width):
        seq, n = seqs[k], len(seqs[k])
        if row == len(packed):
            packed.append(([], []))
        new = np.arange(used, used + n - keep)
        path = new if keep == 0 else np.concatenate([prev_path[:keep], new])
        packed[-1][0].append(seq[keep:])
        packed[-1][1].append(np.arange(keep, n))
        take = min(n, window + 1)
        slots[k, -take:] = row * width + path[n - take :]
        prev_path = path
    return packed, slots


def pack_tree(
    tokens: np.ndarray, mask: np.ndarray, width: int, window: int, blocks: int = 1, bucket=None, parts=None
) -> TreeBatch:
    """The rows tokens / mask [S, L] (left-padded, in the order to pack: sorted by tokens for the
    most sharing) as prefix trees in packed rows of `width` slots, the log-prob window's last
    `window` columns gathered back. `blocks` must divide S. `bucket(n)`: the packed rows per
    block to pad n to (default n), so that few shapes compile. `parts`: `_blocks`' result, if
    already computed."""
    tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
    s, length = tokens.shape
    window = min(window, length - 1)
    per = s // blocks
    parts = [_pack_block(seqs, lcps, width, window) for seqs, lcps in (parts or _blocks(tokens, mask, blocks))]
    rb = max(1, max(len(p) for p, _ in parts))
    rb = int(bucket(rb)) if bucket is not None else rb
    out_tok = np.zeros((blocks * rb, width), np.int32)
    out_pos = np.zeros((blocks * rb, width), np.int32)
    out_end = np.zeros((blocks * rb, width), np.int32)
    slots = np.zeros((s, window + 1), np.int32)
    for b, (packed, sl) in enumerate(parts):
        for j, (toks, depths) in enumerate(packed):
            r = b * rb + j
            t, d = np.concatenate(toks), np.concatenate(depths)
            out_tok[r, : len(t)] = t
            out_pos[r, : len(t)] = d
            out_end[r, : len(t)] = subtree_ends(d, len(t))
        slots[b * per : (b + 1) * per] = np.maximum(sl, 0)
    return TreeBatch(
        tokens=out_tok,
        positions=out_pos,
        end=out_end,
        slots=slots,
        targets=tokens[:, length - window - 1 :].astype(np.int32),
        blocks=blocks,
    )


def row_bucket(n: int) -> int:
    """Packed rows per block: the next of 1, 2, 3, 4, 6, 8, 12, ... (`length_buckets`' two sizes
    per octave: at most a third padding, about twice the programs of powers of two)."""
    return smallest_bucket(n, length_buckets(n, smallest=1))


def plan_tree(
    tokens: np.ndarray, mask: np.ndarray, widths: Sequence[int], window: int, blocks: int, pair: float
) -> TreeBatch:
    """`pack_tree` at the cheapest of `widths` that holds the longest row (packed rows per block
    padded by `row_bucket`): the fewest slots plus `pair` x dense attention pairs (`pair`:
    packing.pair_cost of the model the plan is for)."""
    tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
    longest = int(mask.sum(axis=1).max(initial=1))
    fits = sorted(set(int(x) for x in widths if int(x) >= longest))
    if not fits:
        raise ValueError(f"plan_tree: no width in {sorted(widths)} holds the longest row ({longest} tokens)")
    parts = _blocks(tokens, mask, blocks)

    def cost(width: int) -> float:
        used = max(1 + max((row for _, row, _, _ in _placements(seqs, lcps, width)), default=0) for seqs, lcps in parts)
        return plan_cost(dense(blocks * row_bucket(used), width, 0), pair)

    best = min(fits, key=cost)
    return pack_tree(tokens, mask, best, window, blocks, bucket=row_bucket, parts=parts)


@struct.dataclass
class TreeRows:
    """A mini-batch for the update with its rows packed as prefix trees: `tree` (a TreeBatch whose
    blocks are the data-parallel devices, laid out for `micro_batches` like a SharedBatch: row
    p = i·k + j and packed row q = u·k + j belong to micro-batch j) and `rows`, the TokenBatch's
    rows in the same order cut to their last W + 1 columns (the loss's fields; every loss token
    lies in the log-prob window)."""

    tree: TreeBatch
    rows: TokenBatch
    micro_batches: int = struct.field(pytree_node=False, default=1)

    @property
    def model_tokens(self) -> int:
        return self.tree.model_tokens


def plan_tree_rows(
    batch: TokenBatch, widths: Sequence[int], window: int, micro_batches: int, data_parallel: int, pair: float
) -> tuple[TreeRows, np.ndarray]:
    """(TreeRows, order [S]) for a host TokenBatch [S, L]: `order[p]` is the input row that became
    row p. The rows, sorted by their tokens, are dealt to the k micro-batches and, within each, to
    the data-parallel devices in contiguous runs (neighbours share a tree); each (micro-batch,
    device) block is packed by `plan_tree` at one common width."""
    host = jax.tree.map(np.asarray, batch)
    tokens, mask = host.tokens, host.attention_mask.astype(bool)
    s, length = tokens.shape
    k, dp = int(micro_batches), int(data_parallel)
    if s % (k * dp):
        raise ValueError(
            f"plan_tree_rows: rows S={s} must be divisible by micro_batches={k} x data-parallel devices={dp}"
        )
    per = s // (k * dp)
    by_tokens = np.asarray(sorted(range(s), key=lambda r: tokens[r][mask[r]].tolist()), np.int64)
    tree = plan_tree(tokens[by_tokens], mask[by_tokens], widths, window, k * dp, pair)
    rb = tree.tokens.shape[0] // (k * dp)
    # block c = j·dp + d of the plan (micro-batch j, device d) -> the step's strided layout
    p = np.arange(s)
    j, i = p % k, p // k
    q = (j * dp + i // per) * per + i % per  # the sorted row that becomes row p
    big_p = np.arange(k * dp * rb)
    jj, u = big_p % k, big_p // k
    big_q = (jj * dp + u // rb) * rb + u % rb
    tree = TreeBatch(
        tokens=tree.tokens[big_q],
        positions=tree.positions[big_q],
        end=tree.end[big_q],
        slots=tree.slots[q],
        targets=tree.targets[q],
        blocks=dp,
    )
    order = by_tokens[q]
    w1 = tree.slots.shape[1]
    rows = host.replace(
        **{f: getattr(host, f)[order][:, length - w1 :] for f in TOKEN_FIELDS if getattr(host, f, None) is not None},
        row_index=host.row_index[order],
        row_valid=host.row_valid[order],
    )
    return TreeRows(tree=tree, rows=rows, micro_batches=k), order
