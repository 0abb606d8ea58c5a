"""GRPO, agentic trajectory level (ALGORITHMS.md section 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import group_normalize, index_grid, traj_lengths
from strata_jax.advantages.params import AdvantageParams
from strata_jax.batch import TrajectoryBatch


def episode_advantage(batch: TrajectoryBatch, params: AdvantageParams, mode: str) -> jax.Array:
    """norm (mode 'std') or center (mode 'mean') of R(tau) over the task group -> [P, N, M].

    The task group is every trajectory of task p (all N x M of them). With `stats_over_steps`,
    each trajectory weighs its step count in the mean / std (verl-agent's cross-step statistics).
    """
    p_, n_, m_, _ = batch.shape
    gid = index_grid((p_, n_, m_), 0)  # [P, N, M] task index
    weight = traj_lengths(batch.step_mask) if params.stats_over_steps else None
    return group_normalize(batch.episode_return, gid, batch.traj_mask, p_, mode, weight=weight)


def grpo_step_advantage(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """A_i = norm(R(tau_i)) over the task group, broadcast to every step -> [P, N, M, H]."""
    a = episode_advantage(batch, params, "std")  # [P, N, M]
    return jnp.broadcast_to(a[..., None], batch.shape)
