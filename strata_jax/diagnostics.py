"""Per-iteration diagnostics (ALGORITHMS.md section 6), jitted, on a TrajectoryBatch + Advantages.

Ratios whose denominator is empty (no milestone steps, no CAR key, an empty horizon bucket) are
reported as 0 next to their count, so a logger never sees NaN; read them together.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.advantages import Advantages
from strata_jax.advantages.grid import grid_last
from strata_jax.advantages.groups import Groups, group_by, index_grid
from strata_jax.batch import TrajectoryBatch
from strata_jax.diversity import cosine_distances

ADV_TOL = 1e-6  # |A| above this counts as a non-zero advantage (ESU, CAR signs)
# Horizon buckets on the expert plan length L*: short <= 4, medium 5-7, long > 7 (L* < 1: unknown).
BUCKETS = {"short": (1, 4), "medium": (5, 7), "long": (8, 2**30)}


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    num, den = jnp.asarray(num, jnp.float32), jnp.asarray(den, jnp.float32)
    return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)


def car_keys(batch: TrajectoryBatch) -> tuple[Groups, jax.Array]:
    """CAR's keys (task, anchor observation, action) from ids only -> (groups, shared [T] bool).

    shared[k]: key id k has members, two of them in different trajectories. Steps without an
    anchor or action id (negative) or padded share one id of their own, never shared.
    """
    shape = batch.shape
    valid = batch.step_mask & (batch.anchor_id >= 0) & (batch.action_id >= 0)  # [P, N, M, H]
    groups = group_by((index_grid(shape, 0), batch.anchor_id, batch.action_id), valid, (shape[0], None, None))
    traj = ((index_grid(shape, 0) * shape[1] + index_grid(shape, 1)) * shape[2] + index_grid(shape, 2)).reshape(
        -1
    )  # [T]
    members = jax.ops.segment_sum(groups.valid.astype(jnp.int32), groups.ids, num_segments=groups.num)
    shared = (members > 0) & (
        jax.ops.segment_min(traj, groups.ids, num_segments=groups.num)
        != jax.ops.segment_max(traj, groups.ids, num_segments=groups.num)
    )
    return groups, shared


def contradictory_action_ratio(sign: jax.Array, keys: tuple[Groups, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """CAR -> (ratio [G], number of keys), from the advantages' signs [P, N, M, H, G] (int8 in
    {-1, 0, 1}, 0 where |A| <= ADV_TOL; grid-last) and `car_keys`.

    Keys (task, anchor observation, action) taken in >= 2 distinct trajectories of the task group;
    the ratio is the share of those keys whose step advantages take both signs (|A| > ADV_TOL).
    Per grid point only the signs are reduced over each key: a key has both when the max of its
    signs is 1 and the min is -1 (a scatter-max and a scatter-min of contiguous [G] int8 rows).
    Steps without a valid key share one id, never shared: whatever they hold counts for nothing.
    """
    groups, shared = keys
    sign = sign.reshape(groups.num, -1)  # [T, G]
    hi = jax.ops.segment_max(sign, groups.ids, num_segments=groups.num)  # [keys, G]
    lo = jax.ops.segment_min(sign, groups.ids, num_segments=groups.num)
    both = ((hi > 0) & (lo < 0) & shared[:, None]).sum(0)  # [G]
    n_keys = shared.sum()
    return _ratio(both, n_keys), n_keys


def advantage_diagnostics(
    batch: TrajectoryBatch, step_adv: jax.Array, keys: tuple[Groups, jax.Array]
) -> dict[str, jax.Array]:
    """The diagnostics that read advantages, grid-last: step_adv [P, N, M, H, G] -> {name: [G]}.

    keys: `car_keys(batch)`, built outside so that one build serves every call of a program.
    The masked |A| sums are one [2, T] x [T, G] matmul (milestone / other step masks), which
    XLA:CPU runs from one materialised |A| instead of one masked copy per sum.
    """
    sm = batch.step_mask
    t, g = sm.size, step_adv.shape[-1]
    # Padded steps may hold anything, even NaN: masked out of |A| (a 0 weight would not stop a NaN
    # in the matmul) and of the signs.
    absa = jnp.where(sm[..., None], jnp.abs(step_adv), 0.0).reshape(t, g)
    ms = batch.milestone & sm
    other = sm & ~batch.milestone
    abs_sums = jnp.dot(
        jnp.stack([ms, other]).reshape(2, t).astype(jnp.float32), absa, precision=jax.lax.Precision.HIGHEST
    )  # [2, G]
    # int8 signs of the valid steps: CAR's input, and their |.| counts the non-zero advantages.
    sign = jnp.where(sm[..., None], (step_adv > ADV_TOL).astype(jnp.int8) - (step_adv < -ADV_TOL).astype(jnp.int8), 0)
    n_steps = sm.sum()
    esu = _ratio(jnp.abs(sign).reshape(t, g).astype(jnp.int32).sum(0), n_steps)
    car, n_keys = contradictory_action_ratio(sign, keys)
    return {
        "esu": esu,
        "zero_adv_ratio": jnp.where(n_steps > 0, 1.0 - esu, 0.0),
        "car": car,
        "car_keys": jnp.broadcast_to(n_keys.astype(jnp.int32), esu.shape),
        "ccr": _ratio(_ratio(abs_sums[0], ms.sum()), _ratio(abs_sums[1], other.sum())),
    }


# Without a valid step every advantage diagnostic is 0, so a grid call may skip the kernel.
_ADV_DIAGNOSTICS = grid_last(
    lambda step_adv, shared: advantage_diagnostics(shared[0], step_adv, shared[1]),
    lambda shared: shared[0].step_mask.any(),
)


def _horizon_buckets(batch: TrajectoryBatch, won_t: jax.Array, tm: jax.Array) -> dict[str, jax.Array]:
    """Success rate and task count per horizon bucket. won_t, tm: [P, N*M] f32."""
    out = {}
    task_has = tm.sum(-1) > 0  # [P]
    for name, (lo, hi) in BUCKETS.items():
        inb = (batch.horizon >= lo) & (batch.horizon <= hi)  # [P]
        out[f"success_{name}"] = _ratio((won_t * inb[:, None]).sum(), (tm * inb[:, None]).sum())
        out[f"tasks_{name}"] = (inb & task_has).sum().astype(jnp.int32)
    return out


@functools.partial(jax.jit, static_argnames=("num_task_types",))
def compute_diagnostics(
    batch: TrajectoryBatch,
    adv: Advantages,
    task_type: jax.Array | None = None,  # [P] int in [0, num_task_types), for success by type
    num_task_types: int = 0,
) -> dict[str, jax.Array]:
    """Scalars (and `success_by_type` [num_task_types]) describing one iteration.

    Those that read advantages come from one grid-last kernel (advantages/grid.py): under a vmap
    over advantages (a hyper-parameter grid) it runs once for the whole grid.
    """
    sm = batch.step_mask
    n_steps = sm.sum()
    tm = batch.traj_mask.reshape(batch.shape[0], -1).astype(jnp.float32)  # [P, N*M]
    won = (batch.won.reshape(tm.shape) & (tm > 0)).astype(jnp.float32)
    any_ms = (batch.milestone & sm).any(-1).reshape(tm.shape).astype(jnp.float32)
    n_traj = tm.sum()
    out = _ADV_DIAGNOSTICS(adv.step, (batch, car_keys(batch)))
    out.update(
        {
            "milestone_steps": (batch.milestone & sm).sum().astype(jnp.int32),
            "success": _ratio(won.sum(), n_traj),
            "outcome_full": _ratio(won.sum(), n_traj),
            "outcome_partial": _ratio((any_ms * (1.0 - won) * tm).sum(), n_traj),
            "outcome_none": _ratio(((1.0 - any_ms) * (1.0 - won) * tm).sum(), n_traj),
            # Tasks whose trajectories disagree on success, over tasks with two or more: where an
            # outcome-only group advantage (GRPO's) is non-zero; a near-deterministic warm start
            # leaves few.
            "mixed_groups": _ratio(
                ((won.sum(-1) > 0) & (won.sum(-1) < tm.sum(-1)) & (tm.sum(-1) >= 2)).sum(), (tm.sum(-1) >= 2).sum()
            ),
            "invalid_rate": _ratio((batch.invalid & sm).sum(), n_steps),
            "judged_bad_rate": _ratio((batch.judged_bad & sm).sum(), n_steps),
            "mean_episode_length": _ratio(n_steps, n_traj),
            "num_trajectories": n_traj.astype(jnp.int32),
            "num_steps": n_steps.astype(jnp.int32),
        }
    )
    out.update(_horizon_buckets(batch, won, tm))
    if num_task_types:
        if task_type is None:
            raise ValueError("compute_diagnostics: num_task_types > 0 needs task_type [P]")
        tt = jax.nn.one_hot(task_type, num_task_types)  # [P, T]
        out["success_by_type"] = _ratio(won.sum(-1) @ tt, tm.sum(-1) @ tt)
    elif task_type is not None:
        raise ValueError("compute_diagnostics: task_type given but num_task_types = 0")
    return out


@jax.jit
def strategy_diversity(emb: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean pairwise cosine distance of each task's set: emb [P, N, D], mask [P, N] -> [P] f32.

    Over the unordered pairs of valid members; a task with fewer than two valid members gives 0.
    """
    if emb.ndim != 3 or mask.shape != emb.shape[:2]:
        raise ValueError(f"strategy_diversity: need emb [P, N, D] and mask [P, N], got {emb.shape}, {mask.shape}")
    d = cosine_distances(emb)  # [P, N, N]
    pair = mask[:, :, None] & mask[:, None, :] & ~jnp.eye(mask.shape[1], dtype=bool)
    return _ratio(jnp.where(pair, d, 0.0).sum((1, 2)), pair.sum((1, 2)))
