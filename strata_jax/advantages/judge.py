"""Checked, trainable self-judgment (beyond StraTA).

The environment proves some steps good (a milestone) or bad (an invalid step, or a repeat that
changed nothing): `TrajectoryBatch.step_label` in {+1, -1, 0 = unknown}, filled by the rollout.
Each of the J judgments of a trajectory is rewarded by its agreement with those labels, and GRPO
runs over the J judgments of the trajectory. The exact formulas are in docs/CONTRACTS.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.advantages.groups import axis_normalize
from strata_jax.batch import TrajectoryBatch

UNPARSED_REWARD = -1.0  # below every parsed answer (those score in [0, 1])


def majority_sets(judge_sets: jax.Array, judge_ok: jax.Array) -> jax.Array:
    """[P, N, M, J, H], [P, N, M, J] -> [P, N, M, H] bool: steps in a strict majority of the J sets.

    An unparseable judgment's set is empty (it votes "not bad"); J = 1 gives that judgment's set.
    """
    votes = (judge_sets & judge_ok[..., None]).sum(axis=3)  # [P, N, M, H]
    return 2 * votes > judge_sets.shape[3]


def judgment_reward(batch: TrajectoryBatch) -> tuple[jax.Array, jax.Array]:
    """R_j -> ([P, N, M, J] f32, [P, N, M, J] bool: the judgment takes part)."""
    label = jnp.where(batch.step_mask, batch.step_label, 0)[:, :, :, None, :]  # [P, N, M, 1, H]
    labelled = label != 0
    says_bad = batch.judge_sets  # [P, N, M, J, H]
    agree = (labelled & (says_bad == (label < 0))).sum(-1).astype(jnp.float32)  # [P, N, M, J]
    n_lab = labelled.sum(-1).astype(jnp.float32)  # [P, N, M, 1]
    acc = jnp.where(n_lab > 0, agree / jnp.maximum(n_lab, 1.0), 0.0)
    r = jnp.where(batch.judge_ok, acc, UNPARSED_REWARD)
    valid = batch.judge_valid & batch.traj_mask[..., None]
    return jnp.where(valid, r, 0.0), valid


def judge_advantage(batch: TrajectoryBatch) -> jax.Array:
    """GRPO over the J judgments of each trajectory -> [P, N, M, J] f32 (0 for J < 2)."""
    r, valid = judgment_reward(batch)
    if r.shape[3] == 0:  # no judgments recorded: nothing to normalise (and no max over 0 members)
        return r
    return axis_normalize(r, valid, (3,), "std")


def judge_quality(batch: TrajectoryBatch) -> dict[str, jax.Array]:
    """Precision and recall of the penalised set (judged_bad) against the environment's labels.

    precision = |I & bad| / |I & labelled| (a judged step without a label is neither right nor
    wrong), recall = |I & bad| / |bad|; 0 with an empty denominator, reported next to its count.
    """
    sm = batch.step_mask
    bad = sm & (batch.step_label < 0)
    labelled = sm & (batch.step_label != 0)
    judged = sm & batch.judged_bad
    hit = (judged & bad).sum()
    flagged = (judged & labelled).sum()
    n_bad = bad.sum()
    ratio = lambda a, b: jnp.where(b > 0, a / jnp.maximum(b, 1), 0.0).astype(jnp.float32)  # noqa: E731
    return {
        "judge_precision": ratio(hit, flagged),
        "judge_recall": ratio(hit, n_bad),
        "judge_flagged_labelled": flagged.astype(jnp.int32),
        "label_bad_steps": n_bad.astype(jnp.int32),
        "label_good_steps": (sm & (batch.step_label > 0)).sum().astype(jnp.int32),
    }
