"""Group statistics for the advantage estimators (ALGORITHMS.md section 0).

`norm(x; g) = (x - mean_g) / (std_g + 1e-6)`, `center(x; g) = x - mean_g`, masked-in members only,
unbiased std (ddof = 1), a one-member group gives 0.

Two shapes of group:
- `axis_normalize`: the group is a set of array axes (a task's trajectories, a task's strategies):
  plain masked reductions.
- `sorted_normalize`: arbitrary key tuples (GiGPO's anchor states). A `SortedGroups` layout, built
  once from the keys, orders the elements so that each group is one contiguous run; group sums are
  then a segmented Hillis-Steele scan (ceil(log2(largest group)) shifted adds) and a gather.

Why not `jax.ops.segment_sum`: hyper-parameter grids run under `jax.vmap`, and XLA:CPU executes a
batched scatter ~500x slower than the unbatched one; the layout depends only on ids (never on
the vmapped hyper-parameters), so under vmap only shifts, adds and gathers are batched.

Both normalisations shift each group by one of its own members before summing, so a constant group
(an all-fail group) gives exactly 0, not f32 rounding residue divided by the 1e-6 epsilon.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

EPS = 1e-6
NORM_MODES = ("std", "mean")
_I32_MAX = 2**31 - 1


def check_mode(mode: str) -> None:
    if mode not in NORM_MODES:
        raise ValueError(f"normalisation mode must be one of {NORM_MODES}, got {mode!r}")


def finish(c: jax.Array, n: jax.Array, sq_sum: jax.Array, keep: jax.Array, mode: str) -> jax.Array:
    """Centred values c -> c / (unbiased std + EPS) in 'std' mode, c in 'mean' mode; 0 where not keep.

    n: (weighted) member count of each element's group; sq_sum: its sum of (weighted) c**2.
    """
    if mode == "std":
        c = c / (jnp.sqrt(sq_sum / jnp.maximum(n - 1.0, 1.0)) + EPS)
    return jnp.where(keep, c, 0.0)


def axis_normalize(
    x: jax.Array,  # [...] f32
    valid: jax.Array,  # [...] bool, member takes part
    axes: tuple[int, ...],  # the group = these axes (the other indices name the group)
    mode: str = "std",
    weight: jax.Array | None = None,  # [...] frequency weight (>= 1) per member
) -> jax.Array:
    """norm / center of x over `axes`; 0 for invalid members and groups with < 2 members.

    With `weight`, a member counts as `weight` identical samples (mean and unbiased variance of
    the expanded multiset), as verl-agent's step-weighted statistics do.
    """
    check_mode(mode)
    x = x.astype(jnp.float32)
    w = jnp.where(valid, 1.0 if weight is None else weight.astype(jnp.float32), 0.0)
    members = valid.sum(axes, keepdims=True)
    shift = jnp.max(jnp.where(valid, x, -jnp.inf), axes, keepdims=True)
    d = jnp.where(valid, x - jnp.where(members > 0, shift, 0.0), 0.0)
    wsum = w.sum(axes, keepdims=True)
    c = jnp.where(valid, d - (w * d).sum(axes, keepdims=True) / jnp.maximum(wsum, 1.0), 0.0)
    return finish(c, wsum, (w * c * c).sum(axes, keepdims=True), valid & (members >= 2), mode)


# ----------------------------------------------------------------------------- key tuples -> ids

def _rank(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[T] int32 -> (dense rank of each value in [0, U), U): one single-array sort + binary search.

    XLA:CPU sorts a lone key array ~10x faster than a multi-operand sort (argsort, lexsort).
    """
    s = jnp.sort(x)
    new = jnp.concatenate([jnp.ones(1, jnp.int32), (s[1:] != s[:-1]).astype(jnp.int32)])
    rank_sorted = jnp.cumsum(new) - 1
    return rank_sorted[jnp.searchsorted(s, x)], rank_sorted[-1] + 1


def _radix(k: jax.Array, t: int) -> tuple[jax.Array, jax.Array]:
    """A key as a digit: itself when all of it lies in [0, t) (TrajectoryBatch.from_numpy ids do),
    else its dense rank (one sort). -> (digit [T], radix) with digit < radix <= t."""
    inside = (k.min() >= 0) & (k.max() < t)
    return jax.lax.cond(inside, lambda k: (k, jnp.int32(t)), _rank, k)


def dense_ids(keys: tuple[jax.Array, ...], valid: jax.Array,
              bounds: tuple[int | None, ...] | None = None) -> jax.Array:
    """int32 ids [same shape] in [0, size), equal iff the key tuples are (valid elements only).

    keys: same-shape int arrays; bounds: per key, a static bound (values in [0, bound), e.g. the
    task index) or None (arbitrary int32). Invalid elements share one id of their own (callers
    mask them). Keys are folded into one mixed-radix int32 code, re-ranked by sorting whenever the
    next digit could overflow int32; beyond size 46340 a (slower) lexsort is used instead.
    """
    shape = valid.shape
    v = valid.reshape(-1)
    t = v.shape[0]
    bounds = (None,) * len(keys) if bounds is None else tuple(bounds)
    flat = [jnp.where(v, k.reshape(-1).astype(jnp.int32), 0) for k in keys]
    if t * t > _I32_MAX:
        return _dense_ids_lexsort([(~v).astype(jnp.int32)] + flat).reshape(shape)
    code, u = (~v).astype(jnp.int32), 2  # u: static upper bound of code
    for k, b in zip(flat, bounds):
        digit, radix = (jnp.clip(k, 0, b - 1), b) if b is not None else _radix(k, t)
        radix_max = b if b is not None else t
        if u * radix_max > _I32_MAX:
            code, u = _rank(code)[0], t
        code, u = code * radix + digit, u * radix_max
    if u > t:
        code = _rank(code)[0]
    return code.reshape(shape)


def _dense_ids_lexsort(flat: list[jax.Array]) -> jax.Array:
    """Ids by a multi-key lexsort (only where int32 codes could overflow)."""
    order = jnp.lexsort(tuple(reversed(flat)))  # lexsort: last key is primary
    changed = jnp.zeros(flat[0].shape[0] - 1, bool)
    for k in flat:
        sk = k[order]
        changed = changed | (sk[1:] != sk[:-1])
    rank = jnp.cumsum(jnp.concatenate([jnp.zeros(1, jnp.int32), changed.astype(jnp.int32)]))
    return jnp.zeros(flat[0].shape[0], jnp.int32).at[order].set(rank)


# ----------------------------------------------------------------------------- sorted layout

@struct.dataclass
class SortedGroups:
    """Elements ordered so that each group is one contiguous run, with index maps to gather from.

    Built from ids only, so under vmap over hyper-parameters none of it is batched: only gathers
    through these maps and the scans are. All arrays are [T] (flat element count).
    """

    order: jax.Array  # int32: flat element at each sorted position
    first: jax.Array  # int32: per sorted position, sorted position of its run's first element
    last: jax.Array  # int32: per sorted position, sorted position of its run's last element
    head: jax.Array  # int32: per sorted position, flat index of its run's first element
    valid: jax.Array  # bool: per sorted position, the element takes part
    size: jax.Array  # f32: per sorted position, valid members of its run (0 for the invalid run)
    nat_last: jax.Array  # int32: per flat element, sorted position of its run's last element
    nat_head: jax.Array  # int32: per flat element, flat index of its run's first element
    nat_size: jax.Array  # f32: per flat element, valid members of its run
    n_pass: jax.Array  # int32 scalar: ceil(log2(longest valid run))


def sort_groups(keys: tuple[jax.Array, ...], valid: jax.Array,
                bounds: tuple[int | None, ...] | None = None) -> SortedGroups:
    """Layout of the groups of equal key tuples among valid elements (invalid ones apart)."""
    v = valid.reshape(-1)
    t = v.shape[0]
    ids = dense_ids(keys, valid, bounds).reshape(-1)  # [T] in [0, T)
    pos = jnp.arange(t, dtype=jnp.int32)
    if t * t <= _I32_MAX:  # argsort by packing (id, index) into one int32 key: a lone-array sort
        order = (jnp.sort(ids * t + pos) % t).astype(jnp.int32)
    else:
        order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    sid, vs = ids[order], v[order]
    start = jnp.concatenate([jnp.ones(1, bool), sid[1:] != sid[:-1]])
    end = jnp.concatenate([sid[1:] != sid[:-1], jnp.ones(1, bool)])
    first = jax.lax.cummax(jnp.where(start, pos, 0), axis=0)
    last = jax.lax.cummin(jnp.where(end, pos, t - 1), axis=0, reverse=True)
    size = jnp.where(vs, last - first + 1, 0).astype(jnp.float32)
    inv = jnp.zeros(t, jnp.int32).at[order].set(pos)  # sorted position of each flat element
    n_pass = jnp.ceil(jnp.log2(jnp.maximum(size.max(), 1.0))).astype(jnp.int32)
    head = order[first]
    return SortedGroups(order=order, first=first, last=last, head=head, valid=vs, size=size,
                        nat_last=last[inv], nat_head=head[inv], nat_size=size[inv], n_pass=n_pass)


def run_scan(x: jax.Array, layout: SortedGroups, op: Callable) -> jax.Array:
    """Inclusive segmented scan of `op` along each run: x [..., T] in sorted order -> [..., T].

    Hillis-Steele: pass k combines each element with the one 2**k back when it is in the same run,
    for k < n_pass. A `fori_loop` over the passes picks the pass's static shift by `lax.switch`
    (a static slice + pad is cheaper than a dynamic roll; unrolling all passes makes XLA fuse the
    chain into one kernel that recomputes it exponentially). The loop bound comes from ids only,
    so under vmap it stays a loop. The value at a run's last position is the run's total.
    """
    t = x.shape[-1]
    pos = jnp.arange(t, dtype=jnp.int32)

    def shifted(s):
        def step(x):
            pad = jnp.zeros(x.shape[:-1] + (s,), x.dtype)
            prev = jnp.concatenate([pad, x[..., :-s]], axis=-1)  # prev[i] = x[i - s]
            return jnp.where(pos - s >= layout.first, op(x, prev), x)
        return step

    passes = [shifted(1 << k) for k in range(max(1, (t - 1).bit_length()))]
    return jax.lax.fori_loop(0, layout.n_pass, lambda k, x: jax.lax.switch(k, passes, x), x)


def sorted_normalize(x: jax.Array, layout: SortedGroups, mode: str = "std") -> jax.Array:
    """norm / center of x [...] within the layout's groups -> [...]; 0 for invalid and singletons.

    Values are shifted by one member of their group (a constant group then gives exactly 0); the
    sums of the deviations and then of the squared centred values (two-pass, for accuracy) come
    from segmented scans in sorted order, and the result is assembled in natural order through
    the layout's index maps (no permutation back).
    """
    check_mode(mode)
    shape = x.shape
    x = x.reshape(-1).astype(jnp.float32)
    vs, n = layout.valid, layout.size
    d = jnp.where(vs, x[layout.order] - x[layout.head], 0.0)  # [T] sorted
    scan_d = run_scan(d, layout, jnp.add)
    c = jnp.where(vs, d - scan_d[layout.last] / jnp.maximum(n, 1.0), 0.0)
    scan_sq = run_scan(c * c, layout, jnp.add)
    # Natural order: each element minus its run's shift and mean deviation.
    nn = layout.nat_size
    v = nn > 0  # valid elements sit in runs of size >= 1; the invalid run has size 0
    mean = scan_d[layout.nat_last] / jnp.maximum(nn, 1.0)
    cn = jnp.where(v, x - x[layout.nat_head] - mean, 0.0)
    out = finish(cn, nn, scan_sq[layout.nat_last], v & (nn >= 2), mode)
    return out.reshape(shape)


def index_grid(shape: tuple[int, ...], axis: int) -> jax.Array:
    """int32 array of `shape` holding each element's index along `axis`."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def traj_lengths(step_mask: jax.Array) -> jax.Array:
    """[P, N, M, H] bool -> [P, N, M] f32 number of valid steps."""
    return step_mask.sum(-1).astype(jnp.float32)
