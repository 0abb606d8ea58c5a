"""Strategy revision and self-judgment, pure side: revision and judgment advantages (hand cases and
a slow reference), the majority set, precision / recall, token-row gathering, loss weights, vmap
over traced params."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.advantages import AdvantageParams, compute_advantages, stack_params
from strata_jax.advantages.judge import judge_quality, majority_sets
from strata_jax.batch import BatchError, TokenBatch, TrajectoryBatch, gather_advantages
from strata_jax.loss import row_weights
from strata_jax.names import STRATA_ALGOS
from tests.revision_reference import judge_reference, revision_reference
from tests.test_advantages import blank, random_batch, set_lengths

R2 = 1 / math.sqrt(2)


def with_revisions(d, R):
    P, N, M, _ = d["step_mask"].shape
    d["revision_mask"] = np.zeros((P, N, M, R), bool)
    d["revision_len"] = np.zeros((P, N, M, R), np.int32)
    d["revision_malformed"] = np.zeros((P, N, M, R), bool)
    return d


def with_judgments(d, J):
    P, N, M, H = d["step_mask"].shape
    d["judge_valid"] = np.zeros((P, N, M, J), bool)
    d["judge_ok"] = np.zeros((P, N, M, J), bool)
    d["judge_sets"] = np.zeros((P, N, M, J, H), bool)
    d["step_label"] = np.zeros((P, N, M, H), np.int32)
    return d


def adv(d, algo="strata", **hp):
    return compute_advantages(TrajectoryBatch.from_numpy(**d), AdvantageParams().replace(**hp), algo)


# ---------------------------------------------------------------- batch contract


def test_optional_fields_default_to_no_revisions_and_no_judgments():
    d = set_lengths(blank(2, 2, 3, 4), np.full((2, 2, 3), 2))
    b = TrajectoryBatch.from_numpy(**d)
    assert b.revision_mask.shape == (2, 2, 3, 0) and b.num_revisions == 0
    assert b.judge_sets.shape == (2, 2, 3, 0, 4) and b.num_judgments == 0
    assert b.step_slot.shape == (2, 2, 3, 4) and not np.asarray(b.step_slot).any()
    a = compute_advantages(b, AdvantageParams(), "strata")
    assert a.revision.shape == (2, 2, 3, 0) and a.judge.shape == (2, 2, 3, 0)


def test_optional_groups_come_together_and_are_shape_checked():
    d = set_lengths(blank(1, 1, 2, 3), [[[1, 2]]])
    with pytest.raises(BatchError, match="come together"):
        TrajectoryBatch.from_numpy(**d, revision_mask=np.zeros((1, 1, 2, 1), bool))
    e = with_revisions(dict(d), 2)
    e["revision_len"] = np.zeros((1, 1, 2, 3), np.int32)
    with pytest.raises(BatchError, match="revision_len"):
        TrajectoryBatch.from_numpy(**e)


# ---------------------------------------------------------------- revision: hand case


def test_revision_hand_case_groups_by_task_and_revision_index():
    # task 0: 2 strategies x 2 trajectories, 2 revision slots; task 1: one revision only.
    d = with_revisions(set_lengths(blank(2, 2, 2, 6), np.full((2, 2, 2), 5)), 2)
    d["episode_return"][0] = [[10, 0], [0, 10]]
    d["revision_mask"][0, :, :, 0] = True  # every trajectory revised at index 0
    d["revision_mask"][0, 0, 0, 1] = d["revision_mask"][0, 1, 1, 1] = True  # two at index 1
    d["revision_malformed"][0, 1, 1, 1] = True
    d["revision_len"][0, 0, 0, 1] = 96  # 32 over a budget of 64: c_len * 0.5
    d["revision_mask"][1, 0, 0, 0] = True  # a singleton group -> 0
    d["episode_return"][1, 0, 0] = 10
    a = np.asarray(adv(d).revision)
    # index 0: rewards 1, 0, 0, 1 -> mean 0.5, std sqrt(1/3) -> +-sqrt(3)/2
    s = math.sqrt(3) / 2
    np.testing.assert_allclose(a[0, :, :, 0], [[s, -s], [-s, s]], atol=1e-5)
    # index 1: 1 - 0.05 = 0.95 vs 1 - 0.1 = 0.9: centred +-0.025, std 0.05 / sqrt(2) (+ 1e-6)
    x = 0.025 / (0.05 * R2 + 1e-6)
    np.testing.assert_allclose(a[0, :, :, 1], [[x, 0], [0, -x]], atol=1e-5)
    assert (a[1] == 0).all()


def test_revision_advantage_matches_the_slow_reference():
    rng = np.random.default_rng(3)
    for _ in range(4):
        d = random_batch(rng, 3, 2, 3, 6)
        d["episode_return"] = rng.choice([0.0, 5.0, 10.0, 12.0], d["won"].shape).astype(np.float32)
        with_revisions(d, 2)
        d["revision_mask"] = rng.random((3, 2, 3, 2)) < 0.7
        d["revision_len"] = rng.integers(10, 120, (3, 2, 3, 2)).astype(np.int32)
        d["revision_malformed"] = rng.random((3, 2, 3, 2)) < 0.3
        for algo in STRATA_ALGOS:
            got = np.asarray(adv(d, algo, c_len=0.2).revision)
            np.testing.assert_allclose(got, revision_reference(d, c_len=0.2), atol=2e-5)
        assert (np.asarray(adv(d, "grpo").revision) == 0).all()  # flat algorithms have no strategies


def test_revisions_leave_every_other_advantage_unchanged():
    rng = np.random.default_rng(5)
    d = random_batch(rng, 2, 2, 3, 5)
    base = adv(d)
    e = with_judgments(with_revisions(dict(d), 2), 3)
    e["revision_mask"][:] = True
    e["judge_valid"][:] = True
    out = adv(e)
    np.testing.assert_array_equal(np.asarray(out.step), np.asarray(base.step))
    np.testing.assert_array_equal(np.asarray(out.strategy), np.asarray(base.strategy))


# ---------------------------------------------------------------- judgment


def test_judge_hand_case():
    # one trajectory of 4 steps: t0 milestone (+1), t1 invalid (-1), t2 unknown, t3 repeat (-1)
    d = with_judgments(set_lengths(blank(1, 1, 1, 5), [[[4]]]), 4)
    d["step_label"][0, 0, 0, :4] = [1, -1, 0, -1]
    d["judge_valid"][:] = True
    d["judge_ok"][0, 0, 0] = [True, True, True, False]
    d["judge_sets"][0, 0, 0, 0, []] = True  # flags nothing: right on t0 only -> 1/3
    d["judge_sets"][0, 0, 0, 1, [1, 2, 3]] = True  # right on t0, t1, t3 -> 1 (t2 has no label)
    d["judge_sets"][0, 0, 0, 2, [0, 1]] = True  # right on t1 -> 1/3
    d["judge_sets"][0, 0, 0, 3, [1, 3]] = True  # unparsed -> -1 whatever it says
    r = np.array([1 / 3, 1.0, 1 / 3, -1.0])
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(np.asarray(adv(d).judge)[0, 0, 0], want, atol=1e-5)


def test_judge_advantage_matches_the_slow_reference_and_needs_two_samples():
    rng = np.random.default_rng(11)
    for J in (1, 2, 3):
        d = with_judgments(random_batch(rng, 2, 2, 3, 6), J)
        d["step_label"] = rng.integers(-1, 2, d["step_mask"].shape).astype(np.int32)
        d["judge_valid"] = rng.random(d["judge_valid"].shape) < 0.9
        d["judge_ok"] = rng.random(d["judge_ok"].shape) < 0.8
        d["judge_sets"] = rng.random(d["judge_sets"].shape) < 0.4
        got = np.asarray(adv(d).judge)
        np.testing.assert_allclose(got, judge_reference(d), atol=2e-5)
        if J == 1:
            assert (got == 0).all()


def test_majority_set_and_precision_recall_by_hand():
    sets = np.zeros((1, 1, 1, 3, 4), bool)
    sets[0, 0, 0, 0, [0, 1]] = True
    sets[0, 0, 0, 1, [1, 2]] = True
    sets[0, 0, 0, 2, [1, 2, 3]] = True
    ok = np.array([[[[True, True, False]]]])  # the third is unparsed: its votes do not count
    maj = np.asarray(majority_sets(jnp.asarray(sets), jnp.asarray(ok)))
    np.testing.assert_array_equal(maj[0, 0, 0], [False, True, False, False])  # 2 of 3 only on t1
    one = np.asarray(majority_sets(jnp.asarray(sets[:, :, :, :1]), jnp.asarray(ok[..., :1])))
    np.testing.assert_array_equal(one[0, 0, 0], sets[0, 0, 0, 0])  # k = 1: the judgment itself

    d = with_judgments(set_lengths(blank(1, 1, 2, 4), [[[4, 3]]]), 1)
    d["step_label"][0, 0] = [[1, -1, 0, -1], [-1, 0, 1, 0]]
    d["judged_bad"][0, 0] = [[True, True, True, False], [False, False, True, True]]  # [1, 3] padded
    q = jax.device_get(judge_quality(TrajectoryBatch.from_numpy(**d)))
    # judged & labelled: (0,0) good, (0,1) bad, (1,2) good -> precision 1/3; bad: (0,1), (0,3), (1,0)
    assert q["judge_flagged_labelled"] == 3 and q["label_bad_steps"] == 3
    np.testing.assert_allclose([q["judge_precision"], q["judge_recall"]], [1 / 3, 1 / 3], atol=1e-6)


# ---------------------------------------------------------------- token rows and loss weights


def test_gather_puts_each_row_kind_on_its_tokens():
    H = 3
    step = jnp.arange(2 * 1 * 2 * H, dtype=jnp.float32).reshape(2, 1, 2, H) + 1.0
    strategy = jnp.array([[100.0], [200.0]])
    revision = jnp.array([[[[10.0, 11.0], [12.0, 13.0]]], [[[14.0, 15.0], [16.0, 17.0]]]])  # [2,1,2,2]
    judge = -jnp.arange(2 * 1 * 2 * 3, dtype=jnp.float32).reshape(2, 1, 2, 3) - 1.0
    rows = np.array(
        [[1, 0, 0, -1], [0, 0, 1, 2], [1, 0, 1, -2], [1, 0, 0, -3], [0, 0, 1, H + 2], [1, 0, 0, H], [0, 0, 0, 0]],
        np.int32,
    )
    S, L = len(rows), 3
    valid = np.ones(S, bool)
    valid[-1] = False
    zeros = jnp.zeros((S, L))
    tb = TokenBatch(
        tokens=jnp.zeros((S, L), jnp.int32),
        attention_mask=jnp.ones((S, L), bool),
        loss_mask=jnp.ones((S, L), bool).at[:, 0].set(False),
        old_logp=zeros,
        ref_logp=zeros,
        advantage=zeros,
        row_index=jnp.asarray(rows),
        row_valid=jnp.asarray(valid),
    )
    out = np.asarray(gather_advantages(step, strategy, tb, revision_adv=revision, judge_adv=judge).advantage)
    want = [200.0, float(step[0, 0, 1, 2]), 16.0, 15.0, float(judge[0, 0, 1, 2]), float(judge[1, 0, 0, 0]), 0.0]
    np.testing.assert_allclose(out[:, 1], want)
    assert (out[:, 0] == 0).all()
    # loss weights: lambda for the strategy and the revisions, 1 for steps and judgments, 0 padding
    w = np.asarray(row_weights(jnp.asarray(rows), jnp.asarray(valid), 0.5))
    np.testing.assert_allclose(w, [0.5, 1, 0.5, 0.5, 1, 1, 0])


# ---------------------------------------------------------------- vmap over traced parameters


def test_vmap_over_traced_params_with_revisions_and_judgments():
    rng = np.random.default_rng(2)
    d = with_judgments(with_revisions(random_batch(rng, 2, 2, 3, 6), 2), 3)
    d["revision_mask"][:] = True
    d["revision_len"] = rng.integers(30, 120, (2, 2, 3, 2)).astype(np.int32)
    d["revision_malformed"] = rng.random((2, 2, 3, 2)) < 0.5
    d["judge_valid"][:] = True
    d["judge_ok"] = rng.random(d["judge_ok"].shape) < 0.8
    d["judge_sets"] = rng.random(d["judge_sets"].shape) < 0.4
    d["step_label"] = rng.integers(-1, 2, d["step_mask"].shape).astype(np.int32)
    b = TrajectoryBatch.from_numpy(**d)
    grid = [
        AdvantageParams(c_fmt=c, c_len=cl, kappa=k) for c, cl, k in ((0.0, 0.0, 0.1), (0.3, 0.2, 0.0), (0.1, 0.5, 0.2))
    ]
    vmapped = jax.jit(jax.vmap(compute_advantages, in_axes=(None, 0, None)), static_argnums=2)
    out = vmapped(b, stack_params(grid), "strata")
    for i, p in enumerate(grid):
        one = compute_advantages(b, p, "strata")
        for f in ("step", "strategy", "revision", "judge"):
            np.testing.assert_allclose(np.asarray(getattr(out, f))[i], np.asarray(getattr(one, f)), atol=1e-5)
