"""Strategy revision (beyond StraTA): the reward and advantage of a revised strategy.

Every K steps a running trajectory may rewrite its strategy; the exact objective is in
docs/CONTRACTS.md ("Strategy revision and trained self-judgment"). In short: a revision is a
strategy sample that one trajectory continued under, scored like section 3.3 with M_i = 1, and
normalised among the revisions of the same task at the same revision index.

Grid-last (see advantages/__init__.py): traced params are [G] vectors, results end in [G].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import axis_normalize
from strata_jax.advantages.params import AdvantageParams
from strata_jax.batch import TrajectoryBatch


def revision_reward(batch: TrajectoryBatch, params: AdvantageParams) -> tuple[jax.Array, jax.Array]:
    """R(z'_{ijr}) -> ([P, N, M, R, G] f32, [P, N, M, R, 1] bool: the revision takes part).

    The top-ceil(delta * 1) return of the one trajectory that continued under the revision is that
    trajectory's return, so delta plays no part here; length and format penalties as in 3.3.
    """
    valid = (batch.revision_mask & batch.traj_mask[..., None])[..., None]  # [P, N, M, R, 1]
    ret = batch.episode_return[..., None, None]  # [P, N, M, 1, 1]
    budget = params.strategy_budget
    over = jnp.maximum(0.0, batch.revision_len[..., None].astype(jnp.float32) - budget) / budget
    r = (
        ret / params.r_succ
        - params.c_len * over
        - params.c_fmt * batch.revision_malformed[..., None].astype(jnp.float32)
    )
    return jnp.where(valid, jnp.clip(r, -1.0, 1.0), 0.0), valid


def revision_advantage(batch: TrajectoryBatch, params: AdvantageParams) -> jax.Array:
    """A^rev = norm over the revisions of (task p, revision index r) -> [P, N, M, R, G] f32.

    The group runs over the strategy and trajectory axes (1, 2): every trajectory of the task that
    reached the revision point, whichever strategy it started from. lambda is applied by the loss
    (revision rows are strategy rows), not here.
    """
    r, valid = revision_reward(batch, params)
    if r.shape[3] == 0:  # no revision slots (revise_every = 0)
        return r
    return axis_normalize(r, valid, (1, 2), "std")
