"""StraTA: strategy-level and action-level advantages (ALGORITHMS.md sections 3.3 - 3.5).

Grid-last (see advantages/__init__.py): traced params are [G] vectors, results end in [G].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import axis_normalize, index_grid
from strata_jax.advantages.params import AdvantageParams
from strata_jax.batch import TrajectoryBatch

# (choice) ceil(delta * M_i) is taken with this slack so f32 rounding of delta (0.3 -> 0.30000001)
# cannot add a member: ceil(0.3 * 10) must be 3, not 4.
_CEIL_SLACK = 1e-4


def top_k_count(delta: jax.Array, m_valid: jax.Array) -> jax.Array:
    """ceil(delta * M_i), clamped to [1, M_i] (0 when M_i = 0) -> same shape as m_valid, f32."""
    m = m_valid.astype(jnp.float32)
    k = jnp.ceil(delta * m - _CEIL_SLACK)
    return jnp.clip(k, jnp.minimum(m, 1.0), m)


def strategy_reward(batch: TrajectoryBatch, params: AdvantageParams) -> tuple[jax.Array, jax.Array]:
    """R(z_i) of section 3.3 -> ([P, N, G] f32, [P, N, 1] bool: the strategy takes part).

    (choice) A strategy with no valid trajectory (M_i = 0) has no returns to score it: it is left
    out of the strategy group and gets advantage 0.
    """
    tm = batch.traj_mask  # [P, N, M]
    m_valid = tm.sum(-1)  # [P, N]
    k = top_k_count(params.delta, m_valid[..., None])  # [P, N, G]
    desc = -jnp.sort(jnp.where(tm, -batch.episode_return, jnp.inf), axis=-1)  # [P, N, M]
    rank = index_grid(desc.shape, 2).astype(jnp.float32)
    top_sum = jnp.where(rank[..., None] < k[:, :, None, :], desc[..., None], 0.0).sum(2)  # [P, N, G]
    top_mean = top_sum / jnp.maximum(k, 1.0)
    budget = params.strategy_budget
    over = jnp.maximum(0.0, batch.strategy_len[..., None].astype(jnp.float32) - budget) / budget
    r = (
        top_mean / params.r_succ
        - params.c_len * over
        - params.c_fmt * batch.strategy_malformed[..., None].astype(jnp.float32)
    )
    return jnp.clip(r, -1.0, 1.0), (batch.strategy_mask & (m_valid > 0))[..., None]


def strategy_advantage(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """A^str = norm_i(R(z_i)) over the N strategies of each task -> [P, N, G].

    lambda (lam_strategy) is NOT folded in here (ALGORITHMS.md 3.5): the loss weights the strategy
    rows by it once (strata_jax/loss.py row_weights). Folding it here as well gave lambda^2.
    """
    r, valid = strategy_reward(batch, params)  # [P, N, G], [P, N, 1]
    return axis_normalize(r, valid, (1,), "std")


def judge_reward(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """R_judge(t) = -kappa * 1[t in I] -> [P, N, M, H, G] (section 3.4)."""
    return -params.kappa * batch.judged_bad[..., None].astype(jnp.float32)


def strata_step_advantage(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """A^act = norm_j(R(tau_ij)) over the M trajectories of (task, z_i) + R_judge(t) -> [P,N,M,H,G]."""
    a = axis_normalize(batch.episode_return, batch.traj_mask, (2,), "std")  # [P, N, M]
    return a[..., None, None] + judge_reward(batch, params)
