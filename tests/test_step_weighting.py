"""Step-row weights (`train.step_weighting`, strata_jax/advantages/weighting.py), by hand.

Three trajectories of one task in the corridor: two wins in 2 and 3 steps, and a loss that runs
to max_steps = 4. With "trajectory", w = L_mean / L = 3/2, 3/3 and 3/4. The GRPO advantages
of the group sum to 0 over trajectories. Summed over step rows they are negative under "step"
(the long loss outweighs the wins) and 0 under "trajectory".
"""

import numpy as np
import pytest

from rollout.collect import RolloutConfig, collect
from rollout.policy import ScriptedPolicy
from strata_jax.advantages import AdvantageParams, compute_advantages, token_advantages
from strata_jax.advantages.weighting import step_weights
from tests.test_collect import Corridor

RIGHT = "<think> go on </think> <action> forward </action>"
WAIT = "<think> wait </think> <action> wait </action>"


@pytest.fixture(scope="module")
def rollout():
    script = {0: [RIGHT, RIGHT], 1: [WAIT, RIGHT, RIGHT], 2: [WAIT] * 4}
    pol = ScriptedPolicy(lambda msgs, kind, key: script[key[2]][key[3]] if kind == "action" else "")
    cfg = RolloutConfig(mode="flat", group_size=3, max_steps=4, judgment=False, progress=False)
    return collect([Corridor(max_steps=4) for _ in range(3)], pol, [0], cfg)


def test_weights_by_hand(rollout):
    traj = rollout.traj
    assert np.asarray(traj.step_mask).sum(-1)[0, 0].tolist() == [2, 3, 4]
    assert np.asarray(traj.won)[0, 0].tolist() == [True, True, False]
    w = np.asarray(step_weights(traj, "trajectory"))[0, 0]  # [M, H]
    np.testing.assert_allclose(w, [[1.5, 1.5, 0, 0], [1, 1, 1, 0], [0.75] * 4], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(step_weights(traj, "step")), np.asarray(traj.step_mask))
    with pytest.raises(ValueError, match="step weighting"):
        step_weights(traj, "token")


def test_weighted_step_advantages_cancel_within_the_group(rollout):
    params = AdvantageParams(invalid_penalty=0.0)
    adv = compute_advantages(rollout.traj, params, "grpo")
    a_traj = np.asarray(adv.step)[0, 0, :, 0]  # GRPO: one advantage per trajectory
    assert abs(a_traj.sum()) < 1e-5 and a_traj[2] < 0
    sums = {}
    for mode in ("step", "trajectory"):
        tb = token_advantages(rollout.traj, adv, rollout.tokens, params, mode)
        a, lm = np.asarray(tb.advantage), np.asarray(tb.loss_mask)
        w = np.asarray(step_weights(rollout.traj, mode))
        per_row = []
        for s, (p, n, m, t) in enumerate(np.asarray(tb.row_index)):
            if tb.row_valid[s]:
                np.testing.assert_allclose(a[s][lm[s]], a_traj[m] * w[p, n, m, t], atol=1e-6)
                per_row.append(a_traj[m] * w[p, n, m, t])
        sums[mode] = float(np.sum(per_row))
    np.testing.assert_allclose(sums["step"], 2 * a_traj[0] + 3 * a_traj[1] + 4 * a_traj[2], atol=1e-5)
    assert sums["step"] < -0.1
    assert abs(sums["trajectory"]) < 1e-5
