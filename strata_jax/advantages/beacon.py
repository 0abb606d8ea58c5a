"""BEACON: milestone-anchored trajectory + segment advantages (ALGORITHMS.md section 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import group_normalize, index_grid
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


def shaping_rewards(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """r_t = R_ms * beacon_gamma^{t_k - t} in completed segments, 0 elsewhere -> [P, N, M, H]."""
    _, dist = segments(batch.step_mask, batch.milestone)
    done = batch.step_mask & (dist >= 0)
    power = jnp.power(params.beacon_gamma, jnp.maximum(dist, 0).astype(jnp.float32))
    return jnp.where(done, params.r_ms * power, 0.0)


def segment_advantage(batch: TrajectoryBatch, params: AdvantageParams, per_strategy: bool) -> jax.Array:
    """A^seg = center (or norm, seg_norm='std') of r_t within (task[, z], k) -> [P, N, M, H].

    Statistics are over step samples; the group's members are the trajectories that entered
    segment k. (choice) "Entered" = has at least one step in it, so a trajectory that ended on
    its K-th milestone is not a member of group K; a group with one member gives 0.
    """
    p_, n_, m_, h = batch.shape
    seg, _ = segments(batch.step_mask, batch.milestone)
    r = shaping_rewards(batch, params)
    owner = _owner(batch.shape, per_strategy)  # [P, N, M, H] task or (task, z) index
    num_owner = p_ * n_ if per_strategy else p_
    gid = owner * (h + 1) + seg  # [P, N, M, H]
    # entered[p, n, m, k]: trajectory (p, n, m) has a step in segment k.
    traj = (index_grid(batch.shape, 0) * n_ + index_grid(batch.shape, 1)) * m_ + index_grid(batch.shape, 2)
    entered = jax.ops.segment_max(batch.step_mask.reshape(-1).astype(jnp.int32),
                                  (traj * (h + 1) + seg).reshape(-1), num_segments=p_ * n_ * m_ * (h + 1))
    entered = jnp.maximum(entered, 0).reshape(p_, n_, m_, h + 1)
    members = entered.sum(axis=2) if per_strategy else entered.sum(axis=(1, 2))  # [.., H+1]
    return group_normalize(r, gid, batch.step_mask, num_owner * (h + 1), params.seg_norm,
                           members=members.reshape(-1).astype(jnp.float32))


def trajectory_advantage(batch: TrajectoryBatch, per_strategy: bool) -> jax.Array:
    """A^traj = center(R(tau)) over the task group (or the (task, z) group) -> [P, N, M]."""
    p_, n_, m_, _ = batch.shape
    owner = _owner((p_, n_, m_), per_strategy)
    num_owner = p_ * n_ if per_strategy else p_
    return group_normalize(batch.episode_return, owner, batch.traj_mask, num_owner, "mean")


def beacon_step_advantage(batch: TrajectoryBatch, params: AdvantageParams, per_strategy: bool) -> jax.Array:
    """A_{i,t} = A^traj_i + lam_seg * A^seg_{i,t} -> [P, N, M, H].

    per_strategy=True restricts both groups to one (task, z_i), for algo 'strata+beacon'.
    """
    a_traj = trajectory_advantage(batch, per_strategy)
    return a_traj[..., None] + params.lam_seg * segment_advantage(batch, params, per_strategy)


def _owner(shape: tuple[int, ...], per_strategy: bool) -> jax.Array:
    """Group owner index of each element: task p, or (task, z) = p * N + n."""
    p_idx = index_grid(shape, 0)
    return p_idx * shape[1] + index_grid(shape, 1) if per_strategy else p_idx
