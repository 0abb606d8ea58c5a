"""Group statistics on integer group ids with segment ops (no Python loops over groups).

ALGORITHMS.md section 0: `norm(x; g) = (x - mean_g) / (std_g + 1e-6)`, `center(x; g) = x - mean_g`,
masked-in members only, unbiased std (ddof = 1), a one-member group gives 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-6
NORM_MODES = ("std", "mean")


def group_normalize(
    x: jax.Array,  # [...] f32 values
    gid: jax.Array,  # [...] int, group of each element, in [0, num_groups)
    valid: jax.Array,  # [...] bool, element takes part (others get 0 and do not count)
    num_groups: int,  # static
    mode: str = "std",  # 'std' = norm, 'mean' = center
    weight: jax.Array | None = None,  # [...] frequency weight (>= 1) of each valid element
    members: jax.Array | None = None,  # [num_groups] member count; default: valid elements
) -> jax.Array:
    """norm / center of x within its group; 0 for invalid elements and one-member groups.

    With `weight`, an element counts as `weight` identical samples (mean and unbiased variance
    over the expanded multiset), which is how verl-agent's step-weighted statistics behave.
    """
    if mode not in NORM_MODES:
        raise ValueError(f"group_normalize: mode must be one of {NORM_MODES}, got {mode!r}")
    shape = x.shape
    x, g, v = x.reshape(-1).astype(jnp.float32), gid.reshape(-1), valid.reshape(-1)
    w = jnp.where(v, 1.0 if weight is None else weight.reshape(-1).astype(jnp.float32), 0.0)
    ssum = lambda a: jax.ops.segment_sum(a, g, num_segments=num_groups)  # noqa: E731
    if members is None:
        members = ssum(v.astype(jnp.float32))
    # Shift by a member of the group first: a constant group then yields exactly 0 (no f32
    # residue of x - mean being blown up by the 1e-6 epsilon), e.g. an all-fail group.
    shift = jax.ops.segment_max(jnp.where(v, x, -jnp.inf), g, num_segments=num_groups)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    d = jnp.where(v, x - shift[g], 0.0)
    wsum = ssum(w)
    mean = ssum(w * d) / jnp.maximum(wsum, 1.0)
    c = jnp.where(v, d - mean[g], 0.0)
    if mode == "std":
        var = ssum(w * c * c) / jnp.maximum(wsum - 1.0, 1.0)
        c = c / (jnp.sqrt(var)[g] + EPS)
    keep = v & (members[g] >= 2)
    return jnp.where(keep, c, 0.0).reshape(shape)


def dense_ids(keys: tuple[jax.Array, ...], valid: jax.Array) -> jax.Array:
    """Dense int32 ids of the distinct key tuples among valid elements, by sorting.

    keys: same-shape int arrays; returns ids [same shape] in [0, size). Invalid elements all
    share one id of their own (callers mask them out with `valid`).
    """
    shape = valid.shape
    v = valid.reshape(-1)
    flat = [jnp.where(v, k.reshape(-1).astype(jnp.int32), -1) for k in keys]
    flat = [(~v).astype(jnp.int32)] + flat  # invalid elements sort last, apart from the rest
    order = jnp.lexsort(tuple(reversed(flat)))  # lexsort: last key is primary
    sk = [k[order] for k in flat]
    changed = jnp.zeros(v.shape[0] - 1, bool)
    for k in sk:
        changed = changed | (k[1:] != k[:-1])
    rank = jnp.cumsum(jnp.concatenate([jnp.zeros(1, jnp.int32), changed.astype(jnp.int32)]))
    return jnp.zeros(v.shape[0], jnp.int32).at[order].set(rank).reshape(shape)


def index_grid(shape: tuple[int, ...], axis: int) -> jax.Array:
    """int32 array of `shape` holding each element's index along `axis`."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def traj_lengths(step_mask: jax.Array) -> jax.Array:
    """[P, N, M, H] bool -> [P, N, M] f32 number of valid steps."""
    return step_mask.sum(-1).astype(jnp.float32)
