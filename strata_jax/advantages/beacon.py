"""BEACON: milestone-anchored trajectory + segment advantages (ALGORITHMS.md section 4).

Grid-last (see advantages/__init__.py): traced params are [G] vectors, results end in [G].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import axis_normalize, finish, index_grid
from strata_jax.advantages.params import AdvantageParams
from strata_jax.batch import TrajectoryBatch


def segments(step_mask: jax.Array, milestone: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Segment id and distance to the segment's milestone, per step, in time order.

    step_mask, milestone: [P, N, M, H] bool. Returns
      seg  [P, N, M, H] int32: number of milestone steps strictly before t (a milestone step ends
           its own segment; the unfinished tail gets id K);
      dist [P, N, M, H] int32: t_k - t for a step of a completed segment, -1 in the unfinished one.
    """
    ms = step_mask & milestone
    msi = ms.astype(jnp.int32)
    seg = jnp.cumsum(msi, axis=-1) - msi
    h = ms.shape[-1]
    t = index_grid(ms.shape, 3)
    # Next milestone step at or after t (h = none): a reverse running minimum.
    nxt = jax.lax.cummin(jnp.where(ms, t, h), axis=3, reverse=True)
    dist = jnp.where(nxt < h, nxt - t, -1)
    return seg, dist


def bin_values(params: AdvantageParams, h: int) -> jax.Array:
    """Shaping reward of each distance bin -> [H + 1, G]: R_ms * gamma^d for d < H, 0 for bin H.

    Bin H stands for "in the unfinished segment", whose reward is 0.
    """
    d = jnp.arange(h + 1, dtype=jnp.float32)[:, None]
    return jnp.where(d < h, params.r_ms * jnp.power(params.beacon_gamma, d), 0.0)


def shaping_rewards(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """r_t = R_ms * beacon_gamma^{t_k - t} in completed segments, 0 elsewhere -> [P, N, M, H, G]."""
    _, dist = segments(batch.step_mask, batch.milestone)
    h = batch.shape[-1]
    r = bin_values(params, h)[jnp.where(dist >= 0, dist, h)]
    return jnp.where(batch.step_mask[..., None], r, 0.0)


def segment_advantage(batch: TrajectoryBatch, params: AdvantageParams, per_strategy: bool) -> jax.Array:
    """A^seg = center (or norm, seg_norm='std') of r_t within (task[, z], k) -> [P, N, M, H, G].

    Statistics are over step samples; the group's members are the trajectories that entered
    segment k. (choice) "Entered" = has at least one step in it, so a trajectory that ended on
    its K-th milestone is not a member of group K; a group with one member gives 0.

    A step's reward depends only on its distance bin (t_k - t, or "unfinished"), so each group is
    summarised by a histogram over bins, cnt [NG, H+1], built from the batch alone (once for a
    whole grid). Group sums are then cnt @ bin values [H+1, G], and per grid point only these
    products and row gathers from small [., G] tables remain (no scatter). Sums are taken
    relative to the value of a bin present in the group, so a constant group gives exactly 0.
    """
    h = batch.shape[-1]
    seg, dist = segments(batch.step_mask, batch.milestone)
    g, num_groups = _segment_groups(batch.shape, seg, per_strategy)  # [P, N, M, H]
    bins = jnp.where(dist >= 0, dist, h)  # [P, N, M, H] in [0, H]
    sm = batch.step_mask
    cnt = jax.ops.segment_sum(
        sm.reshape(-1).astype(jnp.float32), (g * (h + 1) + bins).reshape(-1), num_segments=num_groups * (h + 1)
    ).reshape(num_groups, h + 1)
    n = cnt.sum(-1, keepdims=True)  # [NG, 1] step samples
    b0 = jnp.argmax(cnt > 0, axis=-1)  # [NG] a bin present in the group: its value is the shift
    members = _members(batch, seg, per_strategy)  # [NG] trajectories that entered
    vals = bin_values(params, h)  # [H+1, G]
    shift = vals[b0]  # [NG, G]
    s1 = cnt @ vals  # [NG, G] sum of r
    dsum = s1 - n * shift  # sum of (r - shift): exactly 0 when the group has one bin
    mean = dsum / jnp.maximum(n, 1.0)  # [NG, G] mean of (r - shift)
    # sum of (r - shift - mean)^2 = sum (r - shift)^2 - n mean^2, expanded so that only
    # [NG, H+1] x [H+1, G] products are needed.
    sq_dev = cnt @ (vals * vals) - 2.0 * shift * s1 + n * shift * shift
    sq = jnp.maximum(sq_dev - n * mean * mean, 0.0)  # [NG, G]
    c = vals[bins] - (shift + mean)[g]  # [P, N, M, H, G]
    return finish(c, n[g], sq[g], (sm & (members[g] >= 2))[..., None], params.seg_norm, mean=(shift + mean)[g])


def _segment_groups(shape, seg, per_strategy):
    """Group id (task[, z], k) of each step -> ([P, N, M, H] int32, number of groups)."""
    p_, n_, _, h = shape
    owner = _owner(shape, per_strategy)
    return owner * (h + 1) + seg, (p_ * n_ if per_strategy else p_) * (h + 1)


def _members(batch: TrajectoryBatch, seg: jax.Array, per_strategy: bool) -> jax.Array:
    """[G] number of trajectories with at least one step in each (task[, z], k) group."""
    p_, n_, m_, h = batch.shape
    traj = (index_grid(batch.shape, 0) * n_ + index_grid(batch.shape, 1)) * m_ + index_grid(batch.shape, 2)
    entered = jax.ops.segment_max(
        batch.step_mask.reshape(-1).astype(jnp.int32),
        (traj * (h + 1) + seg).reshape(-1),
        num_segments=p_ * n_ * m_ * (h + 1),
    )
    entered = jnp.maximum(entered, 0).reshape(p_, n_, m_, h + 1)
    members = entered.sum(axis=2) if per_strategy else entered.sum(axis=(1, 2))  # [O, H+1]
    return members.reshape(-1).astype(jnp.float32)


def trajectory_advantage(batch: TrajectoryBatch, per_strategy: bool) -> jax.Array:
    """A^traj = center(R(tau)) over the task group (or the (task, z) group) -> [P, N, M]."""
    axes = (2,) if per_strategy else (1, 2)
    return axis_normalize(batch.episode_return, batch.traj_mask, axes, "mean")


def beacon_step_advantage(batch: TrajectoryBatch, params: AdvantageParams, per_strategy: bool) -> jax.Array:
    """A_{i,t} = A^traj_i + lam_seg * A^seg_{i,t} -> [P, N, M, H, G].

    per_strategy=True restricts both groups to one (task, z_i), for algo 'strata+beacon'.
    """
    a_traj = trajectory_advantage(batch, per_strategy)
    return a_traj[..., None, None] + params.lam_seg * segment_advantage(batch, params, per_strategy)


def _owner(shape: tuple[int, ...], per_strategy: bool) -> jax.Array:
    """Group owner index of each element: task p, or (task, z) = p * N + n."""
    p_idx = index_grid(shape, 0)
    return p_idx * shape[1] + index_grid(shape, 1) if per_strategy else p_idx
