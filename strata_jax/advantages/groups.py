"""Group statistics for the advantage estimators (ALGORITHMS.md section 0).

`norm(x; g) = (x - mean_g) / (std_g + 1e-6)`, `center(x; g) = x - mean_g`, masked-in members only,
unbiased std (ddof = 1), a one-member group gives 0.

Two shapes of group:
- `axis_normalize`: the group is a set of array axes (a task's trajectories, a task's strategies):
  plain masked reductions.
- `normalize_rows`: arbitrary key tuples (GiGPO's anchor states). A `Groups` partition, built once
  from the keys (`group_by`: dense ids, no sort when the keys' ranges are small), gives each
  element its group id; group sums are segment sums (a scatter-add) gathered back.

The partition depends only on ids, never on hyper-parameters: under a vmap over a grid it is built
once, and the kernels that sum over groups take values with the grid axis last ([T, G], see
advantages/grid.py), so each scatter moves contiguous rows.

Both normalisations shift each group by one of its own members before summing, so a constant group
(an all-fail group) gives exactly 0, not f32 rounding residue divided by the 1e-6 epsilon; a group
whose values tie in exact arithmetic but differ by float32 rounding (std <= TIE |mean|) gives 0 too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

EPS = 1e-6
# A group whose unbiased std is at most TIE x |its mean| is a tie: its members differ by float32
# rounding of values that are equal in exact arithmetic (11/3/8 and 14/3/8 - 1/8 as two
# strategies' rewards differ by one ulp), and dividing that residue by std + EPS would turn it into
# advantages of +-0.01 or more. 2^-20 is 8 ulps at any magnitude. Such a group gets 0, as a
# constant one does.
TIE = 2.0**-20
NORM_MODES = ("std", "mean")
_I32_MAX = 2**31 - 1


def check_mode(mode: str) -> None:
    if mode not in NORM_MODES:
        raise ValueError(f"normalisation mode must be one of {NORM_MODES}, got {mode!r}")


def finish(
    c: jax.Array, n: jax.Array, sq_sum: jax.Array | None, keep: jax.Array, mode: str, mean: jax.Array
) -> jax.Array:
    """Centred values c -> c / (unbiased std + EPS) in 'std' mode, c in 'mean' mode; 0 where not keep.

    n: (weighted) member count of each element's group; sq_sum: its sum of (weighted) c**2
    (unused, may be None, in 'mean' mode); mean: the group's mean, whose magnitude tells a tie
    (std <= TIE |mean|: rounding residue, 0) from a spread.
    """
    if mode == "std":
        std = jnp.sqrt(sq_sum / jnp.maximum(n - 1.0, 1.0))
        c = jnp.where(std > TIE * jnp.abs(mean), c / (std + EPS), 0.0)
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
    dmean = (w * d).sum(axes, keepdims=True) / jnp.maximum(wsum, 1.0)
    c = jnp.where(valid, d - dmean, 0.0)
    return finish(
        c,
        wsum,
        (w * c * c).sum(axes, keepdims=True),
        valid & (members >= 2),
        mode,
        mean=jnp.where(members > 0, shift, 0.0) + dmean,
    )


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


def dense_ids(keys: tuple[jax.Array, ...], valid: jax.Array, bounds: tuple[int | None, ...] | None = None) -> jax.Array:
    """int32 ids [same shape] in [0, size), equal iff the key tuples are (valid elements only).

    keys: same-shape int arrays; bounds: per key, a static bound (values in [0, bound), e.g. the
    task index) or None (arbitrary int32). Invalid elements share one id of their own (callers
    mask them). Keys are folded into one mixed-radix int32 code. When the keys' actual ranges
    (max - min + 1 over valid elements) multiply to at most size, that code is the id: no sort.
    Otherwise the code is re-ranked by sorting whenever the next digit could overflow int32;
    beyond size 46340 a (slower) lexsort is used instead.
    """
    shape = valid.shape
    v = valid.reshape(-1)
    t = v.shape[0]
    bounds = (None,) * len(keys) if bounds is None else tuple(bounds)
    flat = [jnp.where(v, k.reshape(-1).astype(jnp.int32), 0) for k in keys]
    if t * t > _I32_MAX:
        return _dense_ids_lexsort([(~v).astype(jnp.int32)] + flat).reshape(shape)
    # Digits and radices from the actual ranges; their product is checked in f32, exact below
    # 2**24 (a larger product is rounded but still larger than t).
    digits, radices, spans = [], [], []
    for k, b in zip(flat, bounds):
        if b is not None:
            digits.append(jnp.clip(k, 0, b - 1))
            radices.append(jnp.int32(b))
            spans.append(jnp.float32(b))
        else:
            lo = jnp.min(jnp.where(v, k, _I32_MAX))
            hi = jnp.max(jnp.where(v, k, -_I32_MAX - 1))
            span = jnp.maximum(hi.astype(jnp.float32) - lo.astype(jnp.float32) + 1.0, 1.0)
            digits.append(jnp.where(v, k - lo, 0))  # wraps only where the span overflows: not used then
            radices.append(jnp.minimum(span, t).astype(jnp.int32))
            spans.append(span)
    small = (2.0 * jnp.prod(jnp.stack(spans)) <= t) if t < 2**24 else jnp.bool_(False)

    def direct(_):
        code = (~v).astype(jnp.int32)
        for d, r in zip(digits, radices):
            code = code * r + d
        return code

    def ranked(_):
        code, u = (~v).astype(jnp.int32), 2  # u: static upper bound of code
        for k, b in zip(flat, bounds):
            digit, radix = (jnp.clip(k, 0, b - 1), b) if b is not None else _radix(k, t)
            radix_max = b if b is not None else t
            if u * radix_max > _I32_MAX:
                code, u = _rank(code)[0], t
            code, u = code * radix + digit, u * radix_max
        return _rank(code)[0] if u > t else code

    return jax.lax.cond(small, direct, ranked, None).reshape(shape)


def _dense_ids_lexsort(flat: list[jax.Array]) -> jax.Array:
    """Ids by a multi-key lexsort (only where int32 codes could overflow)."""
    order = jnp.lexsort(tuple(reversed(flat)))  # lexsort: last key is primary
    changed = jnp.zeros(flat[0].shape[0] - 1, bool)
    for k in flat:
        sk = k[order]
        changed = changed | (sk[1:] != sk[:-1])
    rank = jnp.cumsum(jnp.concatenate([jnp.zeros(1, jnp.int32), changed.astype(jnp.int32)]))
    return jnp.zeros(flat[0].shape[0], jnp.int32).at[order].set(rank)


# ----------------------------------------------------------------------------- keyed groups


@struct.dataclass
class Groups:
    """A partition of the T (flat) elements into groups of equal key tuples, built from ids only.

    Under a vmap over hyper-parameters none of it is batched: it is built once per batch.
    """

    ids: jax.Array  # [T] int32 in [0, T): group of each element (invalid elements: one id apart)
    valid: jax.Array  # [T] bool: the element takes part
    size: jax.Array  # [T] f32: valid members of the element's group (0 for invalid elements)
    head: jax.Array  # [T] int32: flat index of the first member of the element's group

    @property
    def num(self) -> int:
        """Static number of segments (ids lie in [0, num))."""
        return self.ids.shape[0]


def group_by(keys: tuple[jax.Array, ...], valid: jax.Array, bounds: tuple[int | None, ...] | None = None) -> Groups:
    """Groups of equal key tuples among valid elements (invalid ones apart). See `dense_ids`."""
    v = valid.reshape(-1)
    t = v.shape[0]
    ids = dense_ids(keys, valid, bounds).reshape(-1)
    pos = jnp.arange(t, dtype=jnp.int32)
    count = jax.ops.segment_sum(v.astype(jnp.float32), ids, num_segments=t)
    first = jax.ops.segment_min(pos, ids, num_segments=t)
    return Groups(ids=ids, valid=v, size=jnp.where(v, count[ids], 0.0), head=first[ids])


def group_totals(x: jax.Array, groups: Groups) -> jax.Array:
    """x [T, ...] -> [T, ...]: the sum of x over each element's group (a scatter-add, a gather)."""
    return jax.ops.segment_sum(x, groups.ids, num_segments=groups.num)[groups.ids]


def normalize_rows(x: jax.Array, groups: Groups, mode: str = "std") -> jax.Array:
    """norm / center of x [T, G] within groups, for each of the G columns -> [T, G].

    0 for invalid elements and singletons. Values are shifted by their group's first member (a
    constant group then gives exactly 0); two passes (the mean, then the squared deviations from
    it) for accuracy. The grid axis G is last so each group sum scatters contiguous rows.
    """
    check_mode(mode)
    v = groups.valid[:, None]
    n = groups.size[:, None]
    x = x.astype(jnp.float32)
    d = jnp.where(v, x - x[groups.head], 0.0)
    dmean = group_totals(d, groups) / jnp.maximum(n, 1.0)
    c = jnp.where(v, d - dmean, 0.0)
    sq = group_totals(c * c, groups) if mode == "std" else None
    return finish(c, n, sq, v & (n >= 2), mode, mean=x[groups.head] + dmean)


def index_grid(shape: tuple[int, ...], axis: int) -> jax.Array:
    """int32 array of `shape` holding each element's index along `axis`."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def traj_lengths(step_mask: jax.Array) -> jax.Array:
    """[P, N, M, H] bool -> [P, N, M] f32 number of valid steps."""
    return step_mask.sum(-1).astype(jnp.float32)
