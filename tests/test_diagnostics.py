"""Diagnostics: hand-built cases and the slow loop reference of tests/advantage_reference.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.advantages import Advantages
from strata_jax.batch import TrajectoryBatch
from strata_jax.diagnostics import compute_diagnostics, strategy_diversity
from tests.advantage_reference import reference_diagnostics
from tests.test_advantages import blank, random_batch, set_lengths


def diag(d, step, strategy=None, **kw):
    b = TrajectoryBatch.from_numpy(**d)
    strategy = np.zeros(d["strategy_mask"].shape, np.float32) if strategy is None else strategy
    out = compute_diagnostics(b, Advantages(step=np.asarray(step, np.float32), strategy=strategy), **kw)
    return {k: np.asarray(v) for k, v in out.items()}


def hand_case():
    d = set_lengths(blank(2, 1, 3, 4), [[[4, 2, 2]], [[3, 1, 0]]])
    a = np.zeros((2, 1, 3, 4), np.float32)
    a[0, 0, 0] = [1.0, 1.0, 1.0, -1.0]
    a[0, 0, 1] = [-1.0, 0.0, 9.0, 9.0]  # t >= 2 padded: ignored everywhere
    a[0, 0, 2] = [0.0, 0.5, 0, 0]
    a[1, 0, 0] = [2.0, -2.0, 0.0, 0]
    a[1, 0, 1] = [1e-7, 0, 0, 0]  # below the tolerance: a zero advantage
    # CAR keys (task, anchor, action):
    #   (0, 1, 1): traj 0 (+1) and traj 1 (-1)        -> shared, both signs
    #   (0, 2, 2): traj 0 (+1) and traj 2 (+0.5)      -> shared, one sign
    #   (0, 3, 3): traj 0 twice (+1, -1)              -> one trajectory only
    #   (1, 1, 1): task 1, traj 0 (+2) and traj 1 (~0) -> shared, one sign
    d["anchor_id"][0, 0, 0] = [1, 2, 3, 3]
    d["action_id"][0, 0, 0] = [1, 2, 3, 3]
    d["anchor_id"][0, 0, 1, :2] = [1, 5]
    d["action_id"][0, 0, 1, :2] = [1, 5]
    d["anchor_id"][0, 0, 2, :2] = [6, 2]
    d["action_id"][0, 0, 2, :2] = [6, 2]
    d["anchor_id"][1, 0, 0, :3] = [1, 7, 8]
    d["action_id"][1, 0, 0, :3] = [1, 7, -1]
    d["anchor_id"][1, 0, 1, 0] = 1
    d["action_id"][1, 0, 1, 0] = 1
    d["milestone"][0, 0, 0, 1] = True  # |A| = 1
    d["milestone"][1, 0, 0, 0] = True  # |A| = 2
    d["milestone"][0, 0, 1, 3] = True  # padded: ignored
    d["won"][0, 0, 0] = True
    d["won"][
        0,
        0,
        1,
    ] = True
    d["invalid"][0, 0, 2, 1] = True
    d["invalid"][1, 0, 2, 0] = True  # padded
    d["judged_bad"][1, 0, 0, 2] = True
    d["horizon"][:] = [3, 9]
    return d, a


def test_hand_case():
    d, a = hand_case()
    out = diag(d, a)
    # 12 valid steps; non-zero: task0 traj0 4, traj1 1, traj2 1; task1 traj0 2 -> 8
    assert out["num_steps"] == 12 and out["num_trajectories"] == 5
    np.testing.assert_allclose(out["esu"], 8 / 12, rtol=1e-6)
    np.testing.assert_allclose(out["zero_adv_ratio"], 4 / 12, rtol=1e-6)
    assert out["car_keys"] == 3
    np.testing.assert_allclose(out["car"], 1 / 3, rtol=1e-6)
    # milestone |A| mean (1 + 2) / 2; others: |A| sum of the other 10 valid steps / 10
    others = (1 + 1 + 1) + (1 + 0) + (0 + 0.5) + (2 + 0) + 1e-7
    np.testing.assert_allclose(out["ccr"], 1.5 / (others / 10), rtol=1e-5)
    assert out["milestone_steps"] == 2
    # outcomes: won {t0 traj0, t0 traj1}; partial {t1 traj0}; none {t0 traj2, t1 traj1}
    np.testing.assert_allclose(
        [out["outcome_full"], out["outcome_partial"], out["outcome_none"]], [2 / 5, 1 / 5, 2 / 5], rtol=1e-6
    )
    np.testing.assert_allclose(out["success"], 2 / 5, rtol=1e-6)
    # task 0 won 2 of 3 (mixed), task 1 won 0 of 2 (not): one of two groups carries an outcome signal
    np.testing.assert_allclose(out["mixed_groups"], 1 / 2, rtol=1e-6)
    np.testing.assert_allclose(out["success_short"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(out["success_long"], 0.0)
    assert (out["tasks_short"], out["tasks_medium"], out["tasks_long"]) == (1, 0, 1)
    assert out["success_medium"] == 0  # empty bucket
    np.testing.assert_allclose(out["invalid_rate"], 1 / 12, rtol=1e-6)
    np.testing.assert_allclose(out["judged_bad_rate"], 1 / 12, rtol=1e-6)
    np.testing.assert_allclose(out["mean_episode_length"], 12 / 5, rtol=1e-6)


def test_success_by_type():
    d, a = hand_case()
    out = diag(d, a, task_type=np.array([2, 0]), num_task_types=3)
    np.testing.assert_allclose(out["success_by_type"], [0.0, 0.0, 2 / 3], rtol=1e-6)
    with pytest.raises(ValueError, match="task_type"):
        diag(d, a, num_task_types=3)


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**31 - 1))
def test_matches_slow_reference(seed):
    rng = np.random.default_rng(seed)
    d = random_batch(rng, 2, 2, 4, 4)
    a = (rng.integers(-1, 2, d["step_mask"].shape) * rng.random(d["step_mask"].shape)).astype(np.float32)
    out = diag(d, a)
    esu, n_keys, car, ccr = reference_diagnostics(d, a)
    np.testing.assert_allclose(out["esu"], esu, rtol=1e-6)
    assert out["car_keys"] == n_keys
    np.testing.assert_allclose(out["car"], car, rtol=1e-6)
    np.testing.assert_allclose(out["ccr"], ccr, rtol=1e-5)
    # mixed_groups by a loop over tasks: their valid trajectories' wins, neither all nor none
    won = d["won"].reshape(d["won"].shape[0], -1)
    valid = d["step_mask"].any(-1).reshape(won.shape)  # a trajectory exists when it has a step
    groups = [w[v] for w, v in zip(won, valid) if v.sum() >= 2]
    mixed = sum(0 < g.sum() < len(g) for g in groups) / len(groups) if groups else 0.0
    np.testing.assert_allclose(out["mixed_groups"], mixed, rtol=1e-6)


def test_strategy_diversity():
    e1, e2, e3 = [1, 0, 0], [0, 2, 0], [0, 0, -3]
    emb = np.array([[e1, e2, e1], [e1, e2, e3], [e1, e2, e3]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 1]], bool)
    got = np.asarray(strategy_diversity(emb, mask))
    # task 0: pairs (e1,e2)=1, (e1,e1)=0, (e2,e1)=1 -> 2/3; task 1: one pair, 1; task 2: alone -> 0
    np.testing.assert_allclose(got, [2 / 3, 1.0, 0.0], atol=1e-6)
    opp = np.array([[[1, 1], [-1, -1]]], np.float32)
    np.testing.assert_allclose(np.asarray(strategy_diversity(opp, np.ones((1, 2), bool))), [2.0], atol=1e-6)


def test_vmap_grid_equals_loop():
    """Under a vmap over advantages (a hyper-parameter grid) the advantage diagnostics run as one
    grid-last kernel; each grid point equals its own call."""
    rng = np.random.default_rng(3)
    d = random_batch(rng, 2, 2, 4, 5)
    b = TrajectoryBatch.from_numpy(**d)
    steps = rng.integers(-1, 2, (4,) + d["step_mask"].shape) * rng.random((4,) + d["step_mask"].shape)
    advs = Advantages(step=jnp.asarray(steps, jnp.float32), strategy=jnp.zeros((4,) + d["strategy_mask"].shape))
    out = jax.vmap(compute_diagnostics, in_axes=(None, 0))(b, advs)
    for i in range(4):
        one = diag(d, steps[i])
        for k, v in one.items():
            np.testing.assert_allclose(np.asarray(out[k][i]), v, rtol=1e-6, err_msg=k)


def test_vmap_over_batches_and_advantages_equals_loop():
    """A vmap over (batch, advantages) together takes the kernel's plain-vmap fallback."""
    rng = np.random.default_rng(4)
    ds = [random_batch(rng, 2, 2, 4, 5) for _ in range(3)]
    steps = [rng.integers(-1, 2, d["step_mask"].shape) * rng.random(d["step_mask"].shape) for d in ds]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[TrajectoryBatch.from_numpy(**d) for d in ds])
    advs = Advantages(step=jnp.asarray(np.stack(steps), jnp.float32), strategy=jnp.zeros((3, 2, 2)))
    out = jax.vmap(compute_diagnostics)(stacked, advs)
    for i, (d, a) in enumerate(zip(ds, steps)):
        for k, v in diag(d, a).items():
            np.testing.assert_allclose(np.asarray(out[k][i]), v, rtol=1e-6, err_msg=k)
