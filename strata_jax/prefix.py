"""Shared prompt prefixes: which rows of a batch can reuse one prefill of a common prefix.

In a StraTA rollout the M trajectories of a (task, strategy) pair ask for actions with prompts that
begin with the same intro, task, strategy and start memory (rollout/prompts.py), and at step 0 (and
in every strategy call) their prompts are identical. Prefilling each such prefix once and copying
its keys and values to every row that starts with it saves (rows - 1) x prefix tokens of prefill.

`plan_prefixes` is pure host code on token ids. It finds the prefixes by sorting the prompts (rows
with a long common prefix become neighbours) and choosing, by dynamic programming over that order,
the groups of consecutive rows that save the most tokens. It then fits the plan to the sampler's
padded shapes: U unique prefixes padded to [UB, Tpre], one suffix per row padded to [BB, Ts] with
Tpre + Ts equal to the prompt bucket Tp that the rows would get without sharing, so the decode
program (and its cache of Tp + max_new slots) is the same one either way. A row whose suffix would
not fit in Ts gets a private prefix. The plan is used only when the padded prefill tokens
UB x Tpre + BB x Ts fall below (1 - min_saving) x BB x Tp.

Every row keeps at least one token in its suffix: the prefill's last position gives the first
sampled token's logits.

`PrefixCache` carries prefixes across calls: the host-side bookkeeping of the sampler's pool of
cached prompt heads (keys and values of each prompt's first W tokens). A step prompt of a StraTA
trajectory repeats the head of its previous step's prompt (intro, task, strategy, start memory),
so the next call finds it there and prefills only the rest. Attention is causal, so the keys and
values of a cached prompt's first c tokens are those of any prompt that starts with the same c
tokens, whatever followed them: a row may use any common prefix of a cached entry.

The update and the scoring share prefixes too (strata_jax/packing.py): they use `group_rows` and
`fit_groups` with a suffix bucket of their own and each row's response as its `tail`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from strata_jax.batch import smallest_bucket


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    prefixes: list[tuple[int, ...]]  # U unique prefixes; () for the rows that share nothing
    row_prefix: np.ndarray  # [B] int32: index into prefixes
    split: np.ndarray  # [B] int32: prompt[b][:split[b]] == prefixes[row_prefix[b]]
    prefix_bucket: int  # Tpre
    suffix_bucket: int  # Ts = Tp - Tpre
    unique_bucket: int  # UB >= U
    cost: int  # padded prefill tokens with sharing: UB * Tpre + BB * Ts
    unshared_cost: int  # BB * Tp


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def group_rows(prompts: Sequence[Sequence[int]], min_prefix: int) -> list[tuple[list[int], int]]:
    """Partition the rows into groups that share a prefix: [(rows, prefix length)], most tokens saved.

    A group is a run of neighbours in sorted order; its prefix is the run's common prefix, cut so
    that every row keeps one suffix token. Groups whose prefix would be shorter than `min_prefix`
    are split into single rows (prefix 0). Maximises sum over groups of (size - 1) x prefix.
    """
    b = len(prompts)
    order = sorted(range(b), key=lambda i: list(prompts[i]))
    lens = [len(prompts[i]) for i in order]
    lcp = [0] + [common_prefix_len(prompts[order[k - 1]], prompts[order[k]]) for k in range(1, b)]
    best = [0] * (b + 1)  # best[j]: most tokens saved over the first j sorted rows
    cut = [(j - 1, 0) for j in range(b + 1)]  # (start of the last group, its prefix)
    for j in range(1, b + 1):
        best[j], cut[j] = best[j - 1], (j - 1, 0)  # row j-1 alone
        shared, shortest = 1 << 30, lens[j - 1]
        for i in range(j - 2, -1, -1):  # group = sorted rows i .. j-1
            shared = min(shared, lcp[i + 1])
            shortest = min(shortest, lens[i])
            p = min(shared, shortest - 1)
            if p < min_prefix:
                break  # the common prefix only shrinks as the group grows
            saved = best[i] + (j - 1 - i) * p
            if saved > best[j]:
                best[j], cut[j] = saved, (i, p)
    groups, j = [], b
    while j > 0:
        i, p = cut[j]
        groups.append(([order[k] for k in range(i, j)], p))
        j = i
    return groups[::-1]


def fit_groups(
    prompts: Sequence[Sequence[int]],
    groups: list[tuple[list[int], int]],
    prefix_bucket: int,
    suffix_bucket: int,
    min_prefix: int,
    tails: Sequence[int] | None = None,
) -> np.ndarray | None:
    """Each row's split [B] for prefix bucket Tpre and suffix bucket Ts, or None when a row cannot fit.

    `groups` come from `group_rows`. The rows of a group whose suffix fits in Ts after the group's
    common prefix (cut to Tpre) share that prefix, when there are several of them and it is at
    least `min_prefix` long; every other row gets a private prefix just long enough for its suffix
    to fit (0 = no prefix). `tails[b]` (default 0): tokens row b carries after its prompt in the
    suffix (the update's response), which the split never reaches into.
    """
    tails = [0] * len(prompts) if tails is None else tails
    splits = np.zeros(len(prompts), np.int64)
    for rows, p in groups:
        use = min(p, int(prefix_bucket))
        fits = [r for r in rows if len(prompts[r]) + int(tails[r]) - use <= suffix_bucket]
        shared = fits if len(fits) > 1 and use >= min_prefix else []
        splits[shared] = use  # one prefix for the group's rows that fit after it
        for r in set(rows) - set(shared):  # a private prefix only where the row's suffix would not fit
            need = len(prompts[r]) + int(tails[r]) - suffix_bucket
            if need > min(int(prefix_bucket), len(prompts[r]) - 1):
                return None
            splits[r] = max(need, 0)
    return splits


def plan_prefixes(
    prompts: Sequence[Sequence[int]],
    prompt_bucket: int,
    batch_bucket: int,
    prefix_buckets: Sequence[int],
    unique_buckets: Sequence[int],
    min_prefix: int = 16,
    min_saving: float = 0.2,
) -> PrefixPlan | None:
    """The cheapest sharing plan for these prompts at the unshared shapes [batch_bucket, prompt_bucket],
    or None when none saves at least `min_saving` of the padded prefill tokens. See the module
    docstring."""
    groups = group_rows(prompts, min_prefix)
    unshared = batch_bucket * prompt_bucket
    best: PrefixPlan | None = None
    for tpre in prefix_buckets:
        ts = prompt_bucket - int(tpre)
        if ts < 1:
            continue
        splits = fit_groups(prompts, groups, int(tpre), ts, min_prefix)
        if splits is None:
            continue
        keys = [tuple(int(t) for t in prompts[r][: splits[r]]) for r in range(len(prompts))]
        prefixes = sorted(set(keys))
        ub = smallest_bucket(len(prefixes), unique_buckets)
        if ub is None:
            continue
        cost = ub * int(tpre) + batch_bucket * ts
        if best is None or cost < best.cost:
            index = {k: i for i, k in enumerate(prefixes)}
            best = PrefixPlan(
                prefixes=prefixes,
                row_prefix=np.asarray([index[k] for k in keys], np.int32),
                split=splits.astype(np.int32),
                prefix_bucket=int(tpre),
                suffix_bucket=ts,
                unique_bucket=ub,
                cost=cost,
                unshared_cost=unshared,
            )
    if best is None or best.cost >= unshared or best.cost > (1.0 - min_saving) * unshared:
        return None
    return best


@dataclasses.dataclass
class CacheEntry:
    tokens: tuple[int, ...]  # the prompt tokens whose keys and values pool row `row` holds (<= width)
    row: int


class PrefixCache:
    """Which row of the sampler's pool [rows, width] holds the keys and values of which prompt head,
    across the calls of a rollout (module docstring). Pure bookkeeping on token ids; the sampler owns
    the device pool and clears this whenever its params change.

    Each call: `match` finds for every prompt the entry with the longest common prefix (at least
    `min_prefix` tokens, and at most len - 1: the prefill's last position gives the first token's
    logits); the sampler prefills only what follows; then `assign` gives pool rows to the call's
    prompts whose first `width` tokens extend past their match, and evicts the entries that the
    call did not use. The action calls of a rollout carry every running trajectory, so an entry
    left out of a call belongs to an episode that ended or to an earlier step's prompt that a newer
    entry repeats.
    """

    def __init__(self, rows: int, width: int, min_prefix: int = 16):
        if rows < 1 or width < 1 or min_prefix < 1:
            raise ValueError(f"PrefixCache(rows={rows}, width={width}, min_prefix={min_prefix}): all must be >= 1")
        self.rows, self.width, self.min_prefix = int(rows), int(width), int(min_prefix)
        self.clear()

    def clear(self) -> None:
        self.entries: list[CacheEntry] = []
        # Entries by their first min_prefix tokens: a hit needs at least those in common.
        self._by_start: dict[tuple[int, ...], list[CacheEntry]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, prompt: Sequence[int]) -> tuple[CacheEntry | None, int]:
        """(entry, usable tokens) for one prompt: the longest common prefix with a cached entry;
        (None, 0) below `min_prefix`."""
        usable_max = len(prompt) - 1
        if usable_max < self.min_prefix:
            return None, 0
        best, best_len = None, 0
        for e in self._by_start.get(tuple(prompt[: self.min_prefix]), ()):
            n = min(common_prefix_len(e.tokens, prompt[: len(e.tokens)]), usable_max)
            if n >= self.min_prefix and n > best_len:
                best, best_len = e, n
        return best, best_len

    def assign(
        self, prompts: Sequence[Sequence[int]], hits: Sequence[tuple[CacheEntry | None, int]]
    ) -> list[tuple[int, int, int]]:
        """End of a call: [(prompt index, pool row, tokens to store)] for the prompts whose first
        `width` tokens (at most len - 1) reach past their match, one per distinct head and each in
        its own row; entries the call did not use are evicted. Rows come from the free ones first,
        then from this call's hits (the new heads repeat them); when more heads are new than that,
        the longest win."""
        used = {id(e) for e, _ in hits if e is not None}
        wanted: dict[tuple[int, ...], int] = {}
        for i, (p, (_, n)) in enumerate(zip(prompts, hits)):
            head = tuple(int(t) for t in p[: min(len(p) - 1, self.width)])
            if len(head) > n and len(head) >= self.min_prefix and head not in wanted:
                wanted[head] = i
        kept = [e for e in self.entries if id(e) in used]
        taken = {e.row for e in kept}
        rows = [r for r in range(self.rows) if r not in taken] + [e.row for e in kept]
        new = sorted(wanted.items(), key=lambda kv: -len(kv[0]))[: len(rows)]
        stores = [(i, row, len(head)) for (head, i), row in zip(new, rows)]
        written = {row for _, row, _ in stores}
        self.entries = [e for e in kept if e.row not in written]
        self.entries += [CacheEntry(tokens=head, row=row) for (head, _), row in zip(new, rows)]
        self._by_start = {}
        for e in self.entries:
            self._by_start.setdefault(e.tokens[: self.min_prefix], []).append(e)
        return stores
