"""GiGPO: episode advantage plus anchor-state step advantage (ALGORITHMS.md section 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import check_mode, group_by, index_grid, normalize_rows
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
    """R_t = sum_{k >= t} gamma^{k-t} r_k along the time axis -> [..., H, G] f32.

    r: [..., H] with 0 on padded steps (so they add nothing); gamma: traced [G] (grid-last; a
    scalar is a grid of one). A loop back over t, R_t = r_t + gamma R_{t+1}, writing each [.., G]
    slice in place: H multiply-adds per element, where the [H, H] discount matmul it replaces cost
    H per element and, batched over a grid, ran at a fraction of the matmul rate.
    """
    r = r.astype(jnp.float32)
    gamma = jnp.atleast_1d(jnp.asarray(gamma, jnp.float32))
    h = r.shape[-1]

    def back(i, carry):
        out, later = carry
        t = h - 1 - i
        now = jax.lax.dynamic_index_in_dim(r, t, axis=-1, keepdims=False)[..., None] + gamma * later
        return jax.lax.dynamic_update_index_in_dim(out, now, t, axis=r.ndim - 1), now

    later = jnp.zeros(r.shape[:-1] + gamma.shape, jnp.float32)
    out = jnp.zeros(r.shape + gamma.shape, jnp.float32)
    return jax.lax.fori_loop(0, h, back, (out, later))[0]


def anchor_step_advantage(batch: TrajectoryBatch, gamma: jax.Array, mode: str) -> jax.Array:
    """A^S = norm(R_t) within (task, anchor observation) groups: gamma [G] -> [P, N, M, H, G].

    Steps with a negative anchor id ("no id") form no group and get 0, like singletons. The
    groups come from ids only (built once for a whole grid); each group sum is a scatter of
    contiguous [G] rows.
    """
    check_mode(mode)
    valid = batch.step_mask & (batch.anchor_id >= 0)
    groups = group_by((index_grid(batch.shape, 0), batch.anchor_id), valid, (batch.shape[0], None))
    returns = discounted_returns(step_rewards(batch), gamma)  # [P, N, M, H, G]
    return normalize_rows(returns.reshape(groups.num, -1), groups, mode).reshape(returns.shape)


def gigpo_step_advantage(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """A_{i,t} = A^E_i + omega * A^S_{i,t} -> [P, N, M, H, G] (grid-last: params fields are [G]).

    (choice) `gigpo_norm` ('std' | 'mean') applies to both the episode and the anchor-state
    statistics, as verl-agent's single `mode` switch does.
    """
    mode = params.gigpo_norm
    a_e = episode_advantage(batch, params, mode)  # [P, N, M]
    a_s = anchor_step_advantage(batch, params.gamma, mode)  # [P, N, M, H, G]
    return a_e[..., None, None] + params.omega * a_s
