"""GRPO, agentic trajectory level (ALGORITHMS.md section 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import axis_normalize, traj_lengths
from strata_jax.advantages.params import AdvantageParams
from strata_jax.batch import TrajectoryBatch


def episode_advantage(batch: TrajectoryBatch, params: AdvantageParams, mode: str) -> jax.Array:
    """norm (mode 'std') or center (mode 'mean') of R(tau) over the task group -> [P, N, M].

    The task group is every trajectory of task p (all N x M of them). With `stats_over_steps`,
    each trajectory weighs its step count in the mean / std (verl-agent's cross-step statistics).
    """
    weight = traj_lengths(batch.step_mask) if params.stats_over_steps else None
    return axis_normalize(batch.episode_return, batch.traj_mask, (1, 2), mode, weight=weight)


def grpo_step_advantage(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """A_i = norm(R(tau_i)) over the task group, broadcast to every step -> [P, N, M, H, 1].

    No traced parameter enters: the grid axis (last) has size 1 and broadcasts.
    """
    a = episode_advantage(batch, params, "std")  # [P, N, M]
    return jnp.broadcast_to(a[..., None, None], batch.shape + (1,))
