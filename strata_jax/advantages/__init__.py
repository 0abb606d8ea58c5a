"""Jitted advantage estimators: GRPO, GiGPO, StraTA, BEACON and StraTA+BEACON.

    adv = compute_advantages(batch, AdvantageParams(), "strata")   # Advantages(step, strategy, revision, judge)
    grid = jax.vmap(compute_advantages, in_axes=(None, 0, None))(batch, stacked_params, "gigpo")

Rules shared by every algorithm (ALGORITHMS.md section 0): padded steps get 0; the invalid-action
penalty is subtracted after normalisation, on the invalid step only; the strategy advantage is 0
for flat algorithms and for masked strategies.

Grids: the estimators are written grid-last: every traced AdvantageParams field is a [G] vector and
every result carries a trailing [G] axis (one point: G = 1). `compute_advantages` is one
grid-last kernel (advantages/grid.py), so a vmap over params runs the estimator ONCE for the whole
grid, building the groups (anchor states, segments, ranks) once, and only the outputs (step,
strategy, revision) are transposed to the grid-first layout vmap returns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.advantages.beacon import beacon_step_advantage
from strata_jax.advantages.gigpo import gigpo_step_advantage
from strata_jax.advantages.grid import grid_last
from strata_jax.advantages.grpo import grpo_step_advantage
from strata_jax.advantages.judge import judge_advantage
from strata_jax.advantages.params import AdvantageParams, stack_params
from strata_jax.advantages.revision import revision_advantage
from strata_jax.advantages.strata import judge_reward, strata_step_advantage, strategy_advantage
from strata_jax.advantages.weighting import step_weights
from strata_jax.batch import TokenBatch, TrajectoryBatch, gather_advantages
from strata_jax.names import ALGOS

# Algorithms where stats_over_steps is wired (trajectory-level statistics of GRPO / GiGPO A^E).
_STEP_WEIGHTED = ("grpo", "gigpo")

__all__ = [
    "ALGOS",
    "AdvantageParams",
    "Advantages",
    "compute_advantages",
    "invalid_penalty",
    "stack_params",
    "token_advantages",
]


@struct.dataclass
class Advantages:
    step: jax.Array  # [P, N, M, H] f32
    strategy: jax.Array  # [P, N] f32
    # Revision and judgment (docs/CONTRACTS.md); compute_advantages always fills them (R = 0 / J = 0: empty).
    revision: jax.Array | None = None  # [P, N, M, R] f32: strategy revisions (strata modes)
    judge: jax.Array | None = None  # [P, N, M, J] f32: GRPO over a trajectory's J judgments


def check_algo(algo: str, params: AdvantageParams) -> None:
    """Raise ValueError for an unknown algo or a switch the algo does not implement."""
    if algo not in ALGOS:
        raise ValueError(f"compute_advantages: unknown algo {algo!r}; allowed: {ALGOS}")
    if params.stats_over_steps and algo not in _STEP_WEIGHTED:
        raise ValueError(
            f"AdvantageParams.stats_over_steps=True is only wired for {_STEP_WEIGHTED}, not for algo {algo!r}"
        )


@functools.partial(jax.jit, static_argnames=("algo",))
def compute_advantages(batch: TrajectoryBatch, params: AdvantageParams, algo: str) -> Advantages:
    """Per-step [P, N, M, H] and per-strategy [P, N] advantages of `algo` (static), and those of
    the strategy revisions [P, N, M, R] (strata modes; 0 for flat ones) and judgments [P, N, M, J]."""
    check_algo(algo, params)
    step, strategy, revision = _KERNELS[algo](params, batch)
    # The judgments' GRPO reads no AdvantageParams field: outside the grid kernel (one copy per grid).
    return Advantages(step=step, strategy=strategy, revision=revision, judge=judge_advantage(batch))


def grid_advantages(
    batch: TrajectoryBatch, params: AdvantageParams, algo: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grid-last form: params fields [G] -> (step [P, N, M, H, G], strategy [P, N, G],
    revision [P, N, M, R, G])."""
    strategy = jnp.zeros(batch.strategy_mask.shape + (1,), jnp.float32)
    revision = jnp.zeros(batch.revision_mask.shape + (1,), jnp.float32)
    if algo == "grpo":
        step = grpo_step_advantage(batch, params)
    elif algo == "gigpo":
        step = gigpo_step_advantage(batch, params)
    elif algo == "beacon":
        step = beacon_step_advantage(batch, params, per_strategy=False)
    elif algo == "strata":
        step = strata_step_advantage(batch, params)
        strategy = strategy_advantage(batch, params)
        revision = revision_advantage(batch, params)
    else:  # strata+beacon: BEACON inside each (task, z_i) group, judgment and strategy level of 3.
        step = beacon_step_advantage(batch, params, per_strategy=True) + judge_reward(batch, params)
        strategy = strategy_advantage(batch, params)
        revision = revision_advantage(batch, params)
    return _finalize(step, batch, params), strategy, revision


def invalid_penalty(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """[P, N, M, H] f32: the invalid-action penalty each step's advantage carries (0 elsewhere).
    `gather_advantages` uses it to put the penalty on the wrong tokens only (TokenBatch.penalty_mask)."""
    pen = params.invalid_penalty * batch.invalid.astype(jnp.float32)
    return jnp.where(batch.step_mask, pen, 0.0).astype(jnp.float32)


_gather = jax.jit(gather_advantages)


def token_advantages(
    traj: TrajectoryBatch, adv: Advantages, tb: TokenBatch, params: AdvantageParams, step_weighting: str = "step"
) -> TokenBatch:
    """The rollout's TokenBatch with each token's advantage filled in: the invalid penalty on the
    tokens collect marked (TokenBatch.penalty_mask), the step / strategy / revision / judgment
    advantage on the rest, step rows scaled by their weight (`train.step_weighting`,
    advantages/weighting.py). The mask is dropped afterwards: the update reads only `advantage`."""
    tb = jax.tree.map(jnp.asarray, tb)
    w = step_weights(traj, step_weighting)  # [P, N, M, H]
    tb = _gather(adv.step * w, adv.strategy, tb, invalid_penalty(traj, params) * w, adv.revision, adv.judge)
    return tb.replace(penalty_mask=None)


def _finalize(step: jax.Array, batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """Invalid penalty on invalid steps (after normalisation; `invalid_penalty` grid-last), 0 on
    padded steps. [P, N, M, H, G]."""
    step = step - params.invalid_penalty * batch.invalid[..., None].astype(jnp.float32)
    return jnp.where(batch.step_mask[..., None], step, 0.0).astype(jnp.float32)


# Without a valid step every advantage is 0 (finalize masks the steps; a strategy or a revision
# needs a valid trajectory, and traj_mask is "has a valid step"), so a grid call may skip the kernel.
_KERNELS = {
    algo: grid_last(
        lambda params, batch, algo=algo: grid_advantages(batch, params, algo), lambda batch: batch.step_mask.any()
    )
    for algo in ALGOS
}
