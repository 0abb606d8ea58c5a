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

The update and the scoring share prefixes too (strata_jax/packing.py): they use `group_rows` and
`fit_groups` with a suffix bucket of their own and each row's response as its `tail`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

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


def fit_groups(prompts: Sequence[Sequence[int]], groups: list[tuple[list[int], int]], prefix_bucket: int,
               suffix_bucket: int, min_prefix: int, tails: Sequence[int] | None = None) -> np.ndarray | None:
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


def plan_prefixes(prompts: Sequence[Sequence[int]], prompt_bucket: int, batch_bucket: int,
                  prefix_buckets: Sequence[int], unique_buckets: Sequence[int], min_prefix: int = 16,
                  min_saving: float = 0.2) -> PrefixPlan | None:
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
            best = PrefixPlan(prefixes=prefixes, row_prefix=np.asarray([index[k] for k in keys], np.int32),
                              split=splits.astype(np.int32), prefix_bucket=int(tpre), suffix_bucket=ts,
                              unique_bucket=ub, cost=cost, unshared_cost=unshared)
    if best is None or best.cost >= unshared or best.cost > (1.0 - min_saving) * unshared:
        return None
    return best
