"""How much each step row of a trajectory weighs in the update (`train.step_weighting`).

"step": every step row weighs the same (the loss is a token mean over the mini-batch). Then a
trajectory's weight grows with its length. In an agent task the losers usually run to max_steps
while the winners stop early. For example, in the household config the winners took 3.7-4.6 steps and
the losers 12. The zero-mean group advantages then sum to a clearly negative total over step rows
(-57 of |223| in one iteration), so every token that winners and losers share is pushed down: the
format tags and the common commands. The policy drifts into junk that no single
advantage asked for.

"trajectory": each trajectory's steps share one unit of weight, w = L_mean / L(p, n, m). Within
a group the weighted advantages then sum to the sum of the trajectory advantages, which is 0 for
GRPO-style outcome normalisation. L_mean, the mean length of the valid trajectories in the batch,
keeps the average step weight at 1, so lr means what it meant. Our choice; docs/CONTRACTS.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.batch import TrajectoryBatch
from strata_jax.names import STEP_WEIGHTINGS


def step_weights(batch: TrajectoryBatch, mode: str) -> jax.Array:
    """[P, N, M, H] f32 weight of each step row (0 on padded steps)."""
    if mode not in STEP_WEIGHTINGS:
        raise ValueError(f"step weighting {mode!r}: choose from {STEP_WEIGHTINGS}")
    mask = batch.step_mask
    if mode == "step":
        return mask.astype(jnp.float32)
    length = mask.sum(-1).astype(jnp.float32)  # [P, N, M]
    has = length > 0
    mean_len = jnp.sum(jnp.where(has, length, 0.0)) / jnp.maximum(jnp.sum(has), 1)
    w = jnp.where(has, mean_len / jnp.maximum(length, 1.0), 0.0)  # [P, N, M]
    return jnp.where(mask, w[..., None], 0.0).astype(jnp.float32)
