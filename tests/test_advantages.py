"""Advantage estimators: hand-computed cases, a slow numpy reference, invariances, vmap, tracing."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from strata_jax.advantages import ALGOS, AdvantageParams, compute_advantages, stack_params
from strata_jax.advantages.gigpo import discounted_returns, step_rewards
from strata_jax.batch import TrajectoryBatch
from tests.advantage_reference import reference_advantages

R2 = 1 / math.sqrt(2)
R3 = 1 / math.sqrt(3)


# ---------------------------------------------------------------- batch helpers


def blank(P, N, M, H):
    """All-padding numpy batch dict; tests fill in what they need."""
    z = lambda *s, dt=bool: np.zeros(s, dt)  # noqa: E731
    return dict(
        step_mask=z(P, N, M, H),
        won=z(P, N, M),
        episode_return=z(P, N, M, dt=np.float32),
        env_reward=z(P, N, M, H, dt=np.float32),
        invalid=z(P, N, M, H),
        milestone=z(P, N, M, H),
        judged_bad=z(P, N, M, H),
        anchor_id=np.full((P, N, M, H), -1, np.int64),
        action_id=np.full((P, N, M, H), -1, np.int64),
        strategy_mask=np.ones((P, N), bool),
        strategy_len=z(P, N, dt=np.int32),
        strategy_malformed=z(P, N),
        horizon=np.full(P, 3, np.int32),
    )


def set_lengths(d, lengths):
    """Prefix step masks from a [P, N, M] array of lengths."""
    lengths = np.asarray(lengths).reshape(d["step_mask"].shape[:3])
    H = d["step_mask"].shape[3]
    d["step_mask"] = np.arange(H) < lengths[..., None]
    return d


def run(d, algo, **hp):
    out = compute_advantages(TrajectoryBatch.from_numpy(**d), AdvantageParams().replace(**hp), algo)
    return np.asarray(out.step), np.asarray(out.strategy)


def hp_dict(params):
    return {k: (v if isinstance(v, (str, bool)) else float(v)) for k, v in vars(params).items()}


def random_batch(rng, P, N, M, H, p_empty=0.15):
    """Random batch with prefix masks; rewards are multiples of 0.5 (exact in f32)."""
    d = blank(P, N, M, H)
    lengths = rng.integers(1, H + 1, (P, N, M))
    lengths[rng.random((P, N, M)) < p_empty] = 0
    set_lengths(d, lengths)
    d["won"] = rng.random((P, N, M)) < 0.4
    sparse = rng.random((P, N, M, H)) < 0.3
    d["env_reward"] = (rng.integers(0, 3, (P, N, M, H)) * 0.5 * sparse * d["step_mask"]).astype(np.float32)
    extra = 0.5 * rng.integers(0, 3, (P, N, M))  # return not fully explained by env rewards
    d["episode_return"] = (10.0 * d["won"] + d["env_reward"].sum(-1) + extra).astype(np.float32)
    d["invalid"] = rng.random((P, N, M, H)) < 0.15
    d["milestone"] = rng.random((P, N, M, H)) < 0.3
    d["judged_bad"] = rng.random((P, N, M, H)) < 0.2
    d["anchor_id"] = rng.integers(-1, 4, (P, N, M, H)).astype(np.int64) * 7919  # sparse "hashes"
    d["action_id"] = rng.integers(-1, 3, (P, N, M, H)).astype(np.int64)
    d["strategy_mask"] = rng.random((P, N)) < 0.85
    d["strategy_len"] = rng.integers(20, 100, (P, N)).astype(np.int32)
    d["strategy_malformed"] = rng.random((P, N)) < 0.2
    d["horizon"] = rng.integers(1, 12, P).astype(np.int32)
    return d


# ---------------------------------------------------------------- hand-computed cases


def test_grpo_hand_padding_singleton_invalid():
    d = blank(2, 1, 3, 4)
    set_lengths(d, [[[2, 4, 1]], [[3, 0, 0]]])  # task 1: a single trajectory
    d["episode_return"][0, 0] = [10, 0, 0]
    d["episode_return"][1, 0, 0] = 10
    d["invalid"][0, 0, 1, 3] = True
    d["invalid"][0, 0, 2, 3] = True  # padded step: must stay 0
    d["invalid"][1, 0, 0, 0] = True
    step, strat = run(d, "grpo")
    # returns [10, 0, 0]: mean 10/3, unbiased std 10/sqrt(3) -> 2/sqrt(3), -1/sqrt(3), -1/sqrt(3)
    want = np.zeros((2, 1, 3, 4))
    want[0, 0, 0, :2] = 2 * R3
    want[0, 0, 1, :] = -R3
    want[0, 0, 1, 3] -= 0.1
    want[0, 0, 2, :1] = -R3
    want[1, 0, 0, 0] = -0.1  # singleton group -> 0, then the invalid penalty
    np.testing.assert_allclose(step, want, atol=1e-5)
    assert (strat == 0).all()


def test_grpo_all_fail_group_is_exactly_zero():
    d = set_lengths(blank(1, 1, 4, 5), [[[3, 2, 5, 1]]])
    d["episode_return"][:] = 0.3  # constant, not representable exactly: still exactly 0
    for algo in ALGOS:
        step, strat = run(d, algo)
        assert (step == 0).all(), algo
        assert (strat == 0).all(), algo


def test_grpo_stats_over_steps_weights_by_length():
    d = set_lengths(blank(1, 1, 2, 3), [[[3, 1]]])
    d["episode_return"][0, 0] = [10, 0]
    step, _ = run(d, "grpo", stats_over_steps=True)
    # samples 10, 10, 10, 0: mean 7.5, unbiased var (3 * 6.25 + 56.25) / 3 = 25 -> std 5
    np.testing.assert_allclose(step[0, 0, 0], [0.5, 0.5, 0.5], atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 1], [-1.5, 0, 0], atol=1e-5)


def _gigpo_case():
    d = set_lengths(blank(1, 1, 2, 3), [[[3, 2]]])
    d["env_reward"][0, 0, 0] = [0, 2, 0]
    d["episode_return"][0, 0] = [12, 1]
    d["env_reward"][0, 0, 1] = [1, 0, 0]
    d["anchor_id"][0, 0, 0] = [111, 222, 333]
    d["anchor_id"][0, 0, 1] = [111, 222, -1]
    return d


def test_gigpo_step_rewards_and_returns():
    b = TrajectoryBatch.from_numpy(**_gigpo_case())
    r = np.asarray(step_rewards(b))
    np.testing.assert_allclose(r[0, 0], [[0, 2, 10], [1, 0, 0]])  # rest of R(tau) on the last step
    ret = np.asarray(discounted_returns(step_rewards(b), jnp.float32(0.5)))[..., 0]  # grid-last, G = 1
    np.testing.assert_allclose(ret[0, 0], [[3.5, 7, 10], [1, 0, 0]])


def test_gigpo_hand_mean_and_std():
    d = _gigpo_case()
    step, _ = run(d, "gigpo", gamma=0.5, gigpo_norm="mean")
    # A^E: returns 12, 1 centred -> +-5.5; anchor 111: R 3.5 vs 1 -> +-1.25; 222: 7 vs 0 -> +-3.5;
    # 333: singleton -> 0
    np.testing.assert_allclose(step[0, 0, 0], [6.75, 9.0, 5.5], atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 1], [-6.75, -9.0, 0], atol=1e-5)
    step, _ = run(d, "gigpo", gamma=0.5, omega=2.0)
    # std mode: every two-member group gives +-1/sqrt(2)
    np.testing.assert_allclose(step[0, 0, 0], [3 * R2, 3 * R2, R2], atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 1], [-3 * R2, -3 * R2, 0], atol=1e-5)


def test_gigpo_anchor_groups_are_per_task():
    d = set_lengths(blank(2, 1, 1, 1), [[[1]], [[1]]])
    d["episode_return"][:, 0, 0] = [10, 0]
    d["anchor_id"][:] = 5  # same observation text in two different tasks: no shared group
    step, _ = run(d, "gigpo")
    assert (step == 0).all()


def _beacon_traj(d, p, n, m, length, milestones, ret):
    d["step_mask"][p, n, m, :length] = True
    d["milestone"][p, n, m, milestones] = True
    d["episode_return"][p, n, m] = ret


def test_beacon_hand_unfinished_and_singleton_segments():
    d = blank(1, 1, 2, 5)
    _beacon_traj(d, 0, 0, 0, 5, [1, 3], 10)
    _beacon_traj(d, 0, 0, 1, 4, [2], 0)
    step, strat = run(d, "beacon", beacon_gamma=0.5, r_ms=8.0)
    # r: traj0 [4, 8 | 4, 8 | 0(unfinished)], traj1 [2, 4, 8 | 0(unfinished)]; A^traj = +-5.
    # seg0 mean 26/5; seg1 samples [4, 8, 0] mean 4; seg2 has one member -> 0.
    np.testing.assert_allclose(step[0, 0, 0], [3.8, 7.8, 5.0, 9.0, 5.0], atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 1], [-8.2, -6.2, -2.2, -9.0, 0.0], atol=1e-5)
    assert (strat == 0).all()
    step, _ = run(d, "beacon", beacon_gamma=0.5, r_ms=8.0, lam_seg=2.0, seg_norm="std")
    s0 = np.std([4, 8, 2, 4, 8], ddof=1)
    np.testing.assert_allclose(step[0, 0, 1, 0], -5 + 2 * (2 - 5.2) / (s0 + 1e-6), atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 0, 3], 5 + 2 * (8 - 4) / (4 + 1e-6), atol=1e-5)


def test_beacon_trajectory_ending_on_milestone_does_not_enter_next_segment():
    d = blank(1, 1, 2, 3)
    _beacon_traj(d, 0, 0, 0, 2, [1], 10)  # ends on its milestone: no step in segment 1
    _beacon_traj(d, 0, 0, 1, 3, [0], 10)  # segment 1 = steps 1, 2 (unfinished, r = 0)
    step, _ = run(d, "beacon", beacon_gamma=0.5, r_ms=8.0)
    # seg0: [4, 8] and [8]: mean 20/3; seg1: one member -> 0; A^traj = 0
    np.testing.assert_allclose(step[0, 0, 0, :2], [4 - 20 / 3, 8 - 20 / 3], atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 1], [8 - 20 / 3, 0, 0], atol=1e-5)


def _strata_case():
    d = blank(1, 4, 3, 2)
    set_lengths(d, [[[2, 1, 2], [1, 2, 0], [2, 2, 2], [1, 1, 1]]])
    d["episode_return"][0] = [[10, 0, 0], [10, 10, 0], [10, 10, 10], [0, 0, 0]]
    d["strategy_len"][0] = [80, 10, 10, 10]  # budget 64: strategy 0 is 16 tokens over
    d["strategy_malformed"][0] = [False, True, False, False]
    d["strategy_mask"][0] = [True, True, False, True]
    d["judged_bad"][0, 0, 1, 0] = True
    d["judged_bad"][0, 0, 1, 1] = True  # padded step: stays 0
    return d


def test_strata_hand_action_and_strategy_levels():
    step, strat = run(_strata_case(), "strata")
    np.testing.assert_allclose(step[0, 0, 0], [2 * R3, 2 * R3], atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 1], [-R3 - 0.1, 0], atol=1e-5)  # judged bad
    np.testing.assert_allclose(step[0, 1], 0, atol=1e-6)  # constant group
    # R(z): s0 top ceil(1.5)=2 of [10,0,0] -> 5/10 - 0.1*16/64 = 0.475; s1 top 1 of [10,10] -> 1 - 0.1;
    # s2 masked; s3 top 2 of [0,0,0] -> 0.
    r = np.array([0.475, 0.9, 0.0])
    a = (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # no lambda: it weights the loss (test_loss.py)
    np.testing.assert_allclose(strat[0], [a[0], a[1], 0.0, a[2]], atol=1e-5)


def test_strata_strategy_reward_clipped_and_delta():
    d = _strata_case()
    d["strategy_len"][0, 1] = 2000  # huge over-length penalty: R(z) clipped at -1
    d["episode_return"][0, 3] = [30, 0, 0]  # 30/10 = 3 -> clipped at 1 (delta=0.25: top 1 of 3)
    _, strat = run(d, "strata", delta=0.25)
    # s0: top ceil(0.75)=1 -> 1 - 0.025 = 0.975; s1: clip(1 - 0.1 * 1936/64 - 0.1) = -1; s3: 1
    r = np.array([0.975, -1.0, 1.0])
    a = (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # no lambda: it weights the loss (test_loss.py)
    np.testing.assert_allclose(strat[0], [a[0], a[1], 0.0, a[2]], atol=1e-5)


def test_strata_beacon_groups_per_strategy():
    d = blank(1, 2, 2, 5)
    _beacon_traj(d, 0, 0, 0, 5, [1, 3], 10)
    _beacon_traj(d, 0, 0, 1, 4, [2], 0)
    _beacon_traj(d, 0, 1, 0, 3, [0], 10)  # alone in its (task, z) group: all 0
    d["judged_bad"][0, 0, 0, 4] = True
    step, strat = run(d, "strata+beacon", beacon_gamma=0.5, r_ms=8.0)
    np.testing.assert_allclose(step[0, 0, 0], [3.8, 7.8, 5.0, 9.0, 4.9], atol=1e-5)
    np.testing.assert_allclose(step[0, 0, 1], [-8.2, -6.2, -2.2, -9.0, 0.0], atol=1e-5)
    np.testing.assert_allclose(step[0, 1], 0, atol=1e-6)
    # R(z): s0 top 1 of [10, 0] -> 1; s1 -> 1: a constant strategy group
    np.testing.assert_allclose(strat, 0, atol=1e-6)


@pytest.mark.parametrize("algo", ALGOS)
def test_invalid_penalty_on_invalid_steps_only(algo):
    d = random_batch(np.random.default_rng(3), 2, 2, 4, 4)
    d["invalid"][:] = False
    base, _ = run(d, algo)
    d["invalid"] = np.random.default_rng(4).random(d["invalid"].shape) < 0.3
    pen, _ = run(d, algo, invalid_penalty=0.25)
    want = base - 0.25 * (d["invalid"] & d["step_mask"])
    np.testing.assert_allclose(pen, want, atol=1e-6)
    assert (pen[~d["step_mask"]] == 0).all()


# ---------------------------------------------------------------- errors


def test_unknown_algo_and_bad_switches_raise():
    b = TrajectoryBatch.from_numpy(**set_lengths(blank(1, 1, 2, 2), [[[1, 2]]]))
    with pytest.raises(ValueError, match="allowed.*grpo"):
        compute_advantages(b, AdvantageParams(), "ppo")
    with pytest.raises(ValueError, match="gigpo_norm"):
        AdvantageParams(gigpo_norm="l2")
    with pytest.raises(ValueError, match="seg_norm"):
        AdvantageParams().replace(seg_norm="median")
    with pytest.raises(ValueError, match="delta"):
        AdvantageParams(delta=0.0)
    with pytest.raises(ValueError, match="stats_over_steps"):
        compute_advantages(b, AdvantageParams(stats_over_steps=True), "strata")
    with pytest.raises(ValueError, match="static switches differ"):
        stack_params([AdvantageParams(), AdvantageParams(seg_norm="std")])


def test_defaults_match_algorithms_md():
    p = AdvantageParams()
    want = dict(
        delta=0.5,
        kappa=0.1,
        gamma=0.95,
        beacon_gamma=0.9,
        lam_strategy=0.5,
        lam_seg=1.0,
        omega=1.0,
        invalid_penalty=0.1,
        r_succ=10.0,
        r_ms=10.0,
        c_len=0.1,
        c_fmt=0.1,
    )
    for k, v in want.items():
        assert np.float32(getattr(p, k)) == np.float32(v), k
    assert (p.stats_over_steps, p.gigpo_norm, p.seg_norm) == (False, "std", "mean")


# ---------------------------------------------------------------- reference on random batches

# Few shapes, shared with the other tests below: each new shape is a new compilation per algo.
SHAPES = [(1, 1, 4, 5), (2, 2, 4, 4), (3, 2, 3, 6)]


def _hp(delta, gamma, kappa, lam):
    # Dyadic r_succ / c_len / c_fmt keep R(z) exact in f32, so mathematically tied strategies stay
    # tied (a 1-ulp f32 gap over the 1e-6 epsilon would otherwise differ from float64). Dyadic
    # gamma does the same for GiGPO's returns: with gamma = 0.95, 0.5 + 0.95 * 10 is exactly 10 in
    # f32 but 10 - 1.2e-7 in float64 from f32(0.95), a tie to one side and +-0.055 to the other.
    return AdvantageParams(
        delta=delta,
        gamma=gamma,
        beacon_gamma=gamma * 0.9,
        kappa=kappa,
        lam_seg=lam,
        omega=lam,
        lam_strategy=lam,
        r_succ=8.0,
        r_ms=8.0,
        c_len=0.125,
        c_fmt=0.125,
    )


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from(SHAPES),
    algo=st.sampled_from(ALGOS),
    delta=st.sampled_from([0.25, 0.5, 0.75, 1.0]),
    gamma=st.sampled_from([0.5, 0.75, 0.875]),
    kappa=st.sampled_from([0.0, 0.1, 0.3]),
    lam=st.sampled_from([0.5, 1.0, 2.0]),
)
# Two strategies whose rewards tie in exact arithmetic, 11/3/8 and 14/3/8 - 1/8, one float32 ulp
# apart: they got +-0.0146 before groups.TIE (CI found it).
@example(seed=206443, shape=(3, 2, 3, 6), algo="strata", delta=0.75, gamma=0.5, kappa=0.0, lam=0.5)
def test_matches_reference(seed, shape, algo, delta, gamma, kappa, lam):
    d = random_batch(np.random.default_rng(seed), *shape)
    params = _hp(delta, gamma, kappa, lam)
    out = compute_advantages(TrajectoryBatch.from_numpy(**d), params, algo)
    ref_step, ref_strat = reference_advantages(d, hp_dict(params), algo)
    np.testing.assert_allclose(np.asarray(out.step), ref_step, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.strategy), ref_strat, rtol=1e-5, atol=1e-5)


@settings(deadline=None, max_examples=25)
@given(
    seed=st.integers(0, 2**31 - 1),
    switch=st.sampled_from(
        [
            ("grpo", dict(stats_over_steps=True)),
            ("gigpo", dict(stats_over_steps=True)),
            ("gigpo", dict(gigpo_norm="mean")),
            ("beacon", dict(seg_norm="std")),
            ("strata+beacon", dict(seg_norm="std")),
        ]
    ),
)
def test_switches_match_reference(seed, switch):
    algo, kw = switch
    d = random_batch(np.random.default_rng(seed), 2, 2, 4, 4)
    params = _hp(0.5, 0.875, 0.1, 1.0).replace(**kw)
    out = compute_advantages(TrajectoryBatch.from_numpy(**d), params, algo)
    ref_step, ref_strat = reference_advantages(d, hp_dict(params), algo)
    np.testing.assert_allclose(np.asarray(out.step), ref_step, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.strategy), ref_strat, rtol=1e-5, atol=1e-5)


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), algo=st.sampled_from(ALGOS))
def test_invariant_to_extra_padding_and_permutation(seed, algo):
    rng = np.random.default_rng(seed)
    P, N, M, H = 2, 2, 4, 4
    extra = 3
    d = random_batch(rng, P, N, M, H)
    step, strat = run(d, algo)
    # Extra padding steps in H (with junk in the padded fields) change nothing.
    padded = {}
    for k, v in d.items():
        if v.ndim == 4:
            junk = rng.integers(0, 2, v.shape[:3] + (extra,)).astype(v.dtype)
            padded[k] = np.concatenate([v, np.zeros_like(junk) if k == "step_mask" else junk], -1)
        else:
            padded[k] = v
    pstep, pstrat = run(padded, algo)
    np.testing.assert_allclose(pstep[..., :H], step, atol=1e-5)
    assert (pstep[..., H:] == 0).all()
    np.testing.assert_allclose(pstrat, strat, atol=1e-5)
    # Permuting the trajectories inside each (task, strategy) group permutes the advantages.
    perm = np.stack([[rng.permutation(M) for _ in range(N)] for _ in range(P)])  # [P, N, M]
    pi, ni = np.ix_(range(P), range(N))[0][..., None], np.arange(N)[None, :, None]
    permuted = {k: (v[pi, ni, perm] if v.ndim >= 3 else v) for k, v in d.items()}
    qstep, qstrat = run(permuted, algo)
    np.testing.assert_allclose(qstep, step[pi, ni, perm], atol=1e-5)
    np.testing.assert_allclose(qstrat, strat, atol=1e-5)


# ---------------------------------------------------------------- vmap and tracing


def _grid(n):
    vals = np.linspace(0.1, 0.9, n)
    return [
        AdvantageParams(
            delta=float(v),
            kappa=float(v) / 2,
            gamma=float(v),
            beacon_gamma=1 - float(v),
            omega=2 * float(v),
            lam_seg=3 * float(v),
            lam_strategy=float(v),
            invalid_penalty=float(v) / 3,
        )
        for v in vals
    ]


@pytest.mark.parametrize("algo", ALGOS)
def test_vmap_grid_equals_loop(algo):
    b = TrajectoryBatch.from_numpy(**random_batch(np.random.default_rng(11), 2, 2, 4, 5))
    grid = _grid(5)
    out = jax.vmap(compute_advantages, in_axes=(None, 0, None))(b, stack_params(grid), algo)
    for i, p in enumerate(grid):
        one = compute_advantages(b, p, algo)
        # Same math; a batched matmul may sum in another order (f32 rounding only).
        np.testing.assert_allclose(np.asarray(out.step[i]), np.asarray(one.step), rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out.strategy[i]), np.asarray(one.strategy), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("algo", ["gigpo", "strata+beacon"])
def test_vmap_over_batches_and_params_equals_loop(algo):
    """A vmap over (batch, params) together (rollout/population.py) takes the grid-last kernels'
    plain-vmap fallback: each copy equals its own call."""
    rng = np.random.default_rng(13)
    batches = [TrajectoryBatch.from_numpy(**random_batch(rng, 2, 2, 3, 5)) for _ in range(3)]
    grid = _grid(3)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
    out = jax.vmap(compute_advantages, in_axes=(0, 0, None))(stacked, stack_params(grid), algo)
    for i, (b, p) in enumerate(zip(batches, grid)):
        one = compute_advantages(b, p, algo)
        np.testing.assert_allclose(np.asarray(out.step[i]), np.asarray(one.step), rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out.strategy[i]), np.asarray(one.strategy), rtol=2e-6, atol=1e-6)


def test_no_retrace_per_value():
    b = TrajectoryBatch.from_numpy(**random_batch(np.random.default_rng(12), 2, 2, 3, 4))
    traces = {"one": 0, "grid": 0}

    def one(batch, params):
        traces["one"] += 1
        return compute_advantages(batch, params, "strata+beacon")

    def grid(batch, params):
        traces["grid"] += 1
        return jax.vmap(compute_advantages, in_axes=(None, 0, None))(batch, params, "strata+beacon")

    one_j, grid_j = jax.jit(one), jax.jit(grid)
    for p in _grid(3) + [AdvantageParams(), AdvantageParams().replace(delta=0.25)]:
        one_j(b, p).step.block_until_ready()
    for g in (_grid(4), _grid(4)[::-1]):
        grid_j(b, stack_params(g)).step.block_until_ready()
    assert traces == {"one": 1, "grid": 1}


# ---------------------------------------------------------------- group helpers


def _same_partition(ids, keys, valid):
    """ids induce exactly the partition of valid elements by key tuple (numpy check)."""
    tuples = list(zip(*[k[valid] for k in keys]))
    got = ids[valid]
    for i in range(len(got)):
        for j in range(i + 1, len(got)):
            assert (got[i] == got[j]) == (tuples[i] == tuples[j])


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([3, 2**30]))
def test_dense_ids_partition(seed, spread):
    """Small ids take the no-sort digit path, huge (not from_numpy) ids the ranking path."""
    from strata_jax.advantages.groups import dense_ids

    rng = np.random.default_rng(seed)
    keys = [rng.integers(0, 3, 40), rng.integers(-spread, spread, 40), rng.integers(0, spread, 40)]
    valid = rng.random(40) < 0.8
    ids_fn = jax.jit(dense_ids, static_argnums=2)
    ids = np.asarray(ids_fn(tuple(jnp.asarray(k, jnp.int32) for k in keys), jnp.asarray(valid), (3, None, None)))
    assert ids.min() >= 0 and ids.max() < 40
    _same_partition(ids, keys, valid)


def test_dense_ids_large_uses_lexsort_correctly():
    from strata_jax.advantages.groups import dense_ids

    rng = np.random.default_rng(0)
    t = 46341  # t * t overflows int32: the lexsort path
    a, b = rng.integers(0, 50, t), rng.integers(0, 7, t)
    ids = np.asarray(jax.jit(dense_ids)((jnp.asarray(a), jnp.asarray(b)), jnp.ones(t, bool)))
    code = a * 7 + b
    # same partition: ids and codes are in bijection
    assert len(np.unique(ids)) == len(np.unique(code)) == np.unique(np.stack([ids, code]), axis=1).shape[1]


def test_normalize_rows_matches_loops():
    """Each of the G columns is normalised on its own within the groups (the grid-last layout)."""
    from strata_jax.advantages.groups import group_by, normalize_rows

    rng = np.random.default_rng(5)
    g = rng.integers(0, 6, 60)
    x = rng.integers(0, 5, (60, 3)).astype(np.float32) * np.array([1.5, -0.25, 4.0], np.float32)
    valid = rng.random(60) < 0.8
    g[:7] = 9  # one long group
    groups = jax.jit(group_by)((jnp.asarray(g),), jnp.asarray(valid))
    for mode in ("std", "mean"):
        got = np.asarray(jax.jit(normalize_rows, static_argnums=2)(jnp.asarray(x), groups, mode))
        for k in np.unique(g):
            m = valid & (g == k)
            xs = x[m].astype(np.float64)
            if m.sum() < 2:
                want = np.zeros_like(xs)
            elif mode == "mean":
                want = xs - xs.mean(0)
            else:
                want = (xs - xs.mean(0)) / (xs.std(0, ddof=1) + 1e-6)
            np.testing.assert_allclose(got[m], want, atol=1e-5)
        assert (got[~valid] == 0).all()


def test_rounding_ties_normalise_to_zero_and_real_spreads_do_not():
    """Values equal in exact arithmetic but one float32 ulp apart (11/3/8 and 14/3/8 - 1/8) are a
    tie: 0, as a constant group, in both normalisations. A spread of 1e-5 relative, well above
    rounding, is normalised as usual (+-0.707 for two members)."""
    from strata_jax.advantages.groups import axis_normalize, group_by, normalize_rows

    a = np.float32(11.0) / np.float32(3.0) / np.float32(8.0)
    b = np.float32(14.0) / np.float32(3.0) / np.float32(8.0) - np.float32(0.125)
    assert a != b  # the premise: one ulp apart
    near = np.float32(a) * np.float32(1.0 + 1e-5)
    x = jnp.asarray([[a, b], [a, near]], jnp.float32)  # [groups, members]
    valid = jnp.ones((2, 2), bool)
    got = np.asarray(axis_normalize(x, valid, (1,)))
    np.testing.assert_array_equal(got[0], [0.0, 0.0])
    want = (np.float64(near) - a) / 2 / (abs(np.float64(near) - a) / np.sqrt(2) + 1e-6)
    np.testing.assert_allclose(got[1], [-want, want], rtol=1e-3)
    groups = group_by((jnp.asarray([0, 0, 1, 1]),), jnp.ones(4, bool))
    rows = np.asarray(normalize_rows(x.reshape(4, 1), groups))[:, 0]
    np.testing.assert_array_equal(rows[:2], [0.0, 0.0])
    np.testing.assert_allclose(rows[2:], [-want, want], rtol=1e-3)


@pytest.mark.parametrize("algo", ["gigpo", "beacon"])
def test_ids_need_not_come_from_from_numpy(algo):
    """A batch built directly with arbitrary (large, sparse) ids gives the same advantages."""
    d = random_batch(np.random.default_rng(8), 2, 2, 4, 4)
    b = TrajectoryBatch.from_numpy(**d)
    sparse = b.replace(anchor_id=jnp.where(b.anchor_id >= 0, b.anchor_id * 99991 + 12345, -1))
    np.testing.assert_allclose(
        np.asarray(compute_advantages(sparse, AdvantageParams(), algo).step),
        np.asarray(compute_advantages(b, AdvantageParams(), algo).step),
        atol=1e-6,
    )


def test_beacon_shaping_rewards_hand():
    from strata_jax.advantages.beacon import segments, shaping_rewards

    d = blank(1, 1, 1, 6)
    _beacon_traj(d, 0, 0, 0, 5, [1, 3], 0)
    d["milestone"][0, 0, 0, 5] = True  # padded step: ignored
    b = TrajectoryBatch.from_numpy(**d)
    seg, dist = segments(b.step_mask, b.milestone)
    assert np.asarray(seg)[0, 0, 0, :5].tolist() == [0, 0, 1, 1, 2]
    assert np.asarray(dist)[0, 0, 0, :5].tolist() == [1, 0, 1, 0, -1]
    r = np.asarray(shaping_rewards(b, AdvantageParams(beacon_gamma=0.5, r_ms=8.0)))  # grid-last, G = 1
    np.testing.assert_allclose(r[0, 0, 0, :, 0], [4, 8, 4, 8, 0, 0])
