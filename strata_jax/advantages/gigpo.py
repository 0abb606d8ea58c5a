"""GiGPO: episode advantage plus anchor-state step advantage (ALGORITHMS.md section 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import index_grid, sort_groups, sorted_normalize
from strata_jax.advantages.grpo import episode_advantage
from strata_jax.advantages.params import AdvantageParams
from strata_jax.batch import TrajectoryBatch


def step_rewards(batch: TrajectoryBatch) -> jax.Array:
    """r_k -> [P, N, M, H]: env_reward_k, plus (R(tau) - sum of env_reward) on the last valid step.

    (choice) The spec leaves r_k open; this keeps the environment's shaping where it happened and
    puts the rest of the return (the success reward) where the episode ended, so the undiscounted
    step rewards sum to R(tau). Padded steps get 0.
    """
    mask = batch.step_mask
    env = jnp.where(mask, batch.env_reward, 0.0)  # [P, N, M, H]
    t = index_grid(mask.shape, 3)
    last = jnp.max(jnp.where(mask, t, -1), axis=-1, keepdims=True)  # [P, N, M, 1]
    rest = (batch.episode_return - env.sum(-1))[..., None]  # [P, N, M, 1]
    return env + jnp.where(mask & (t == last), rest, 0.0)


def discounted_returns(r: jax.Array, gamma: jax.Array) -> jax.Array:
    """R_t = sum_{k >= t} gamma^{k-t} r_k along the last axis -> same shape as r.

    r: [..., H] with 0 on padded steps (so they add nothing); gamma: traced scalar. One matmul with
    the [H, H] upper-triangular discount matrix: cheaper than an H-step scan, and under vmap over
    gamma it batches as a matmul.
    """
    h = r.shape[-1]
    lag = jnp.arange(h)[:, None] - jnp.arange(h)[None, :]  # [k, t] = k - t
    disc = jnp.where(lag >= 0, jnp.power(gamma, jnp.maximum(lag, 0).astype(jnp.float32)), 0.0)
    return jnp.einsum("...k,kt->...t", r, disc, precision=jax.lax.Precision.HIGHEST)


def anchor_step_advantage(batch: TrajectoryBatch, returns: jax.Array, mode: str) -> jax.Array:
    """A^S = norm(R_t) within (task, anchor observation) groups -> [P, N, M, H].

    Steps with a negative anchor id ("no id") form no group and get 0, like singletons.
    """
    valid = batch.step_mask & (batch.anchor_id >= 0)
    layout = sort_groups((index_grid(batch.shape, 0), batch.anchor_id), valid, (batch.shape[0], None))
    return sorted_normalize(returns, layout, mode)


def gigpo_step_advantage(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """A_{i,t} = A^E_i + omega * A^S_{i,t} -> [P, N, M, H].

    (choice) `gigpo_norm` ('std' | 'mean') applies to both the episode and the anchor-state
    statistics, as verl-agent's single `mode` switch does.
    """
    mode = params.gigpo_norm
    a_e = episode_advantage(batch, params, mode)  # [P, N, M]
    returns = discounted_returns(step_rewards(batch), params.gamma)  # [P, N, M, H]
    a_s = anchor_step_advantage(batch, returns, mode)
    return a_e[..., None] + params.omega * a_s
