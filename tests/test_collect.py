"""The rollout loop against scripted trajectories: every batch field is checked against
hand-written expectations (a tiny corridor env defined here, and the household world's expert)."""

import numpy as np
import pytest

from rollout.collect import RolloutConfig, collect, text_id
from rollout.envs.base import TextEnv
from rollout.parsing import EMPTY, INADMISSIBLE, MISSING_TAG, MULTIPLE, TOO_LONG
from rollout.policy import Reply, ScriptedPolicy, fake_logprob, fake_token_ids

# --- a corridor env: walk `forward` to room L (L = 2 for even seeds, 3 for odd) -----------------


class Corridor(TextEnv):
    """obs "room k"; 'forward' advances (milestone on first reaching room 1), 'wait' does nothing.
    `crash_on` = (phase, step): raise in reset ("reset", 0) or in step number k ("step", k)."""

    def __init__(self, max_steps=4, crash_on=None):
        super().__init__(max_steps)
        self.crash_on = crash_on

    def reset(self, *, seed=None, options=None):
        if self.crash_on == ("reset", 0):
            raise RuntimeError("engine died on reset")
        self.goal, self.pos, self.t = 2 + seed % 2, 0, 0
        return "room 0", self._info(task=f"reach room {self.goal}", horizon=self.goal)

    def step(self, action):
        if self.crash_on == ("step", self.t):
            raise RuntimeError("engine died")
        self.t += 1
        milestone = False
        if action == "forward":
            self.pos += 1
            milestone = self.pos == 1
            obs = f"room {self.pos}"
        else:
            obs = "Nothing happens."
        won = self.pos >= self.goal
        info = {"won": won, "milestone": milestone, "milestone_name": None, "admissible_commands": ["forward", "wait"]}
        return obs, 0.0, won, not won and self.t >= self.max_steps, info

    def _info(self, **kw):
        return {
            "admissible_commands": ["forward", "wait"],
            "task_type": "corridor",
            "task_id": "c",
            "won": False,
            "milestones_total": 1,
            **kw,
        }


def act(a):
    return f"<think>go</think><action>{a}</action>"


FWD, WAIT = act("forward"), act("wait")
# (p, n, m) -> outputs per step; what each trajectory does and why is spelled out in EXPECTED.
FLAT_SCRIPT = {
    (0, 0, 0): [FWD, FWD],
    (0, 0, 1): ["forward please", FWD, FWD],
    (0, 0, 2): [WAIT, WAIT, WAIT, WAIT],
    (1, 0, 0): [FWD, act("forward") + act("wait"), FWD, FWD],
    (1, 0, 1): [FWD, FWD, FWD],  # its env crashes at its 3rd step
    (1, 0, 2): [act("fly"), act(""), act("forward " * 60), FWD],
}
JUDGE = {
    (0, 0, 0): "<bad_steps>none</bad_steps>",
    (0, 0, 1): "<bad_steps>1</bad_steps>",
    (0, 0, 2): "I cannot tell",
    (1, 0, 0): "<bad_steps>2, 4</bad_steps>",
    (1, 0, 2): "<bad_steps>1, 2, 3</bad_steps>",
}
# step_mask lengths, won, invalid steps, milestone steps (0-based) per trajectory
EXPECTED = {
    (0, 0, 0): dict(length=2, won=True, invalid=[], milestone=[0], bad=[], obs=["room 0", "room 1"]),
    (0, 0, 1): dict(
        length=3, won=True, invalid=[0], milestone=[1], bad=[0], obs=["room 0", "Nothing happens.", "room 1"]
    ),
    (0, 0, 2): dict(length=4, won=False, invalid=[], milestone=[], bad=[], obs=["room 0"] + ["Nothing happens."] * 3),
    (1, 0, 0): dict(
        length=4,
        won=True,
        invalid=[1],
        milestone=[0],
        bad=[1, 3],
        obs=["room 0", "room 1", "Nothing happens.", "room 2"],
    ),
    (1, 0, 1): dict(length=0, won=False, invalid=[], milestone=[], bad=[], obs=[]),  # crashed
    (1, 0, 2): dict(
        length=4, won=False, invalid=[0, 1, 2], milestone=[3], bad=[0, 1, 2], obs=["room 0"] + ["Nothing happens."] * 3
    ),
}
REASONS = {MISSING_TAG: 1, MULTIPLE: 1, INADMISSIBLE: 1, EMPTY: 1, TOO_LONG: 1}


class Recorder(ScriptedPolicy):
    """A ScriptedPolicy that also keeps every prompt by key."""

    def __init__(self, script, **kw):
        super().__init__(script, **kw)
        self.prompts = {}

    def generate(self, prompts, kind, keys=None):
        for msgs, key in zip(prompts, keys):
            self.prompts[(kind, key)] = msgs[-1]["content"]
        return super().generate(prompts, kind, keys)


def flat_script(msgs, kind, key):
    if kind == "judge":
        return JUDGE[key]
    p, n, m, t = key
    return FLAT_SCRIPT[(p, n, m)][t]


def flat_envs():
    envs = [Corridor(max_steps=4) for _ in range(6)]
    envs[4] = Corridor(max_steps=4, crash_on=("step", 2))  # trajectory (1, 0, 1)
    return envs


def flat_cfg(**kw):
    base = dict(mode="flat", group_size=3, max_steps=4, judgment=True, progress=False, row_multiple=8)
    return RolloutConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def flat():
    policy = Recorder(flat_script)
    return collect(flat_envs(), policy, [0, 1], flat_cfg()), policy


def test_flat_trajectory_fields(flat):
    res, _ = flat
    b = res.traj
    assert b.shape == (2, 1, 3, 4)
    for (p, n, m), ex in EXPECTED.items():
        L = ex["length"]
        assert np.asarray(b.step_mask[p, n, m]).tolist() == [t < L for t in range(4)], (p, n, m)
        assert bool(b.won[p, n, m]) == ex["won"]
        assert float(b.episode_return[p, n, m]) == (10.0 if ex["won"] else 0.0)
        for name in ("invalid", "milestone"):
            assert np.flatnonzero(np.asarray(getattr(b, name)[p, n, m])).tolist() == ex[name], (name, p, m)
        assert np.flatnonzero(np.asarray(b.judged_bad[p, n, m])).tolist() == ex["bad"], (p, m)
    assert np.asarray(b.horizon).tolist() == [2, 3]
    assert not np.asarray(b.strategy_mask).any()
    assert np.asarray(b.env_reward).sum() == 0


def test_anchor_and_action_ids_follow_the_texts(flat):
    res, _ = flat
    b = res.traj
    # gather (observation text -> dense anchor id) over all real steps: one id per distinct text
    seen = {}
    for key, ex in EXPECTED.items():
        for t, obs in enumerate(ex["obs"]):
            seen.setdefault(obs, set()).add(int(b.anchor_id[key][t]))
    assert all(len(ids) == 1 for ids in seen.values())
    assert len({next(iter(v)) for v in seen.values()}) == len(seen)  # distinct texts, distinct ids
    # action ids: all "forward" steps share one id, invalid steps and padding have none
    fwd = {int(b.action_id[0, 0, 0, 0]), int(b.action_id[0, 0, 1, 1]), int(b.action_id[1, 0, 2, 3])}
    assert len(fwd) == 1 and fwd != {int(b.action_id[0, 0, 2, 0])}
    assert int(b.action_id[1, 0, 2, 0]) == -1 and int(b.action_id[0, 0, 0, 3]) == -1
    assert int(b.anchor_id[1, 0, 1, 0]) == -1  # crashed trajectory: no ids
    assert text_id("room 0") == text_id("room 0") > 0


def test_invalid_outputs_are_counted_by_reason_and_crash_masked(flat):
    res, _ = flat
    s = res.stats
    for reason, count in REASONS.items():
        assert s[f"invalid/{reason}"] == count, reason
    assert s["invalid"] == 5 and s["steps"] == 2 + 3 + 4 + 4 + 4
    assert s["crashed"] == 1 and s["unrun"] == 0 and s["in_batch"] == 5
    assert s["judge_calls"] == 5 and s["judge_parse_fail"] == 1  # "I cannot tell"
    keys = [t["key"] for t in res.texts["trajectories"]]
    assert sorted(keys) == sorted(EXPECTED) and len(keys) == len(set(keys))  # none lost / duplicated
    crashed = [t for t in res.texts["trajectories"] if t["crashed"]]
    assert [c["key"] for c in crashed] == [(1, 0, 1)] and "engine died" in crashed[0]["error"]


def test_step_prompts_carry_history_and_observation(flat):
    _, policy = flat
    text = policy.prompts[("action", (0, 0, 1, 2))]
    assert "[Step 1] Observation: room 0 Action: (no valid action)" in text
    assert "[Step 2] Observation: Nothing happens. Action: forward" in text
    assert "Current observation (step 3): room 1" in text
    assert "reach room 2" in text and "strategy" not in text.lower()
    judge = policy.prompts[("judge", (1, 0, 0))]
    assert "2. Observation: room 1 | Action: (no valid action)" in judge
    assert ("judge", (1, 0, 1)) not in policy.prompts  # crashed trajectories are not judged


def test_token_rows_align_with_trajectories(flat):
    res, policy = flat
    tb = res.tokens
    rows = np.asarray(tb.row_valid)
    idx = np.asarray(tb.row_index)[rows]
    expected_rows = sorted((p, n, m, t) for (p, n, m), ex in EXPECTED.items() for t in range(ex["length"]))
    assert sorted(map(tuple, idx.tolist())) == expected_rows  # one row per step, invalid ones too
    L = tb.tokens.shape[1]
    assert tb.tokens.shape[0] == 24 and L & (L - 1) == 0  # 17 rows -> 3 x row_multiple; L a power of 2
    assert not np.asarray(tb.loss_mask)[~rows].any()
    for s in np.flatnonzero(rows):
        p, n, m, t = idx[s]
        response = fake_token_ids(FLAT_SCRIPT[(p, n, m)][t])
        prompt = fake_token_ids(f"<user> {policy.prompts[('action', (p, n, m, t))]}")
        tok, lm = np.asarray(tb.tokens[s]), np.asarray(tb.loss_mask[s])
        L = tok.shape[0]
        np.testing.assert_array_equal(tok[L - len(response) :], response)
        np.testing.assert_array_equal(tok[L - len(response) - len(prompt) : L - len(response)], prompt)
        assert np.flatnonzero(lm).tolist() == list(range(L - len(response), L))
        assert np.asarray(tb.attention_mask[s]).sum() == len(prompt) + len(response)
        lp = np.asarray(tb.old_logp[s])
        np.testing.assert_allclose(lp[lm], fake_logprob(tok[lm]))  # old_logp[s, i] scores tokens[s, i]
        assert not lp[~lm].any()
    assert not np.asarray(tb.ref_logp).any() and not np.asarray(tb.advantage).any()


def test_judgment_off_and_inconsistent_options_raise():
    res = collect(flat_envs(), ScriptedPolicy(flat_script), [0, 1], flat_cfg(judgment=False))
    assert not np.asarray(res.traj.judged_bad).any() and "judge_calls" not in res.stats
    # judge_train needs k >= 2 samples; revision needs a strategy (strata mode)
    with pytest.raises(ValueError, match="judge_samples >= 2"):
        collect(flat_envs(), ScriptedPolicy(flat_script), [0, 1], flat_cfg(judge_train=True))
    with pytest.raises(ValueError, match="revise_every"):
        collect(flat_envs(), ScriptedPolicy(flat_script), [0, 1], flat_cfg(revise_every=3))


def test_rows_are_padded_to_the_configured_length_bucket():
    res = collect(flat_envs(), ScriptedPolicy(flat_script), [0, 1], flat_cfg(judgment=False, length_buckets=(8, 1000)))
    assert res.tokens.tokens.shape == (24, 1000)
    with pytest.raises(ValueError, match="largest length bucket 8"):
        collect(flat_envs(), ScriptedPolicy(flat_script), [0, 1], flat_cfg(judgment=False, length_buckets=(8,)))


def test_episodes_longer_than_h_are_cut_and_counted():
    envs = [Corridor(max_steps=10) for _ in range(6)]
    res = collect(envs, ScriptedPolicy(lambda msgs, kind, key: WAIT), [0, 1], flat_cfg(judgment=False))
    assert np.asarray(res.traj.step_mask).all() and res.stats["cut_at_horizon"] == 6
    assert not np.asarray(res.traj.won).any()


def test_crash_on_reset_is_masked_and_counted():
    envs = flat_envs()
    envs[0] = Corridor(max_steps=4, crash_on=("reset", 0))
    res = collect(envs, ScriptedPolicy(flat_script), [0, 1], flat_cfg())
    mask = np.asarray(res.traj.traj_mask)
    assert mask[:, 0].tolist() == [[False, True, True], [True, False, True]]
    assert res.stats["crashed"] == 2 and res.stats["in_batch"] == 4
    idx = np.asarray(res.tokens.row_index)[np.asarray(res.tokens.row_valid)]
    assert not any((r[0], r[2]) in {(0, 0), (1, 1)} for r in idx.tolist())


# --- StraTA mode: candidates, farthest-point selection, strategy rows ---------------------------

# 4 candidates per task (sigma=2, N=2); embeddings and mean log-probs chosen so the picks are known:
# start = the highest mean log-prob (c1); farthest from c1 is c3 (orthogonal); c0 duplicates c1.
CANDS = [
    Reply("<strategy>alpha plan</strategy>", mean_logprob=-0.5, embedding=[1.0, 0.0]),
    Reply("<strategy>beta plan</strategy>", mean_logprob=-0.1, embedding=[1.0, 0.0]),
    Reply("<strategy>gamma plan</strategy>", mean_logprob=-0.3, embedding=[0.9, 0.1]),
    Reply("delta plan without tags", mean_logprob=-0.9, embedding=[0.0, 1.0]),
]


def strata_script(msgs, kind, key):
    if kind == "strategy":
        return CANDS[key[1]]
    if kind == "judge":
        return "<bad_steps>none</bad_steps>"
    p, n, m, t = key
    return FWD if m == 0 else WAIT  # m = 0 wins in 2 steps, m = 1 waits until truncation


def strata_cfg(**kw):
    base = dict(
        mode="strata", num_strategies=2, traj_per_strategy=2, oversample=2, max_steps=4, progress=False, row_multiple=4
    )
    return RolloutConfig(**{**base, **kw})


@pytest.mark.parametrize("diverse, picks", [(True, [1, 3]), (False, [0, 1])])
def test_strata_selects_strategies_and_builds_strategy_rows(diverse, picks):
    policy = Recorder(strata_script)
    res = collect([Corridor(4) for _ in range(4)], policy, [0], strata_cfg(diverse=diverse))
    assert [k for k, b in policy.calls] == ["strategy", "action", "action", "action", "action", "judge"]
    assert policy.calls[0][1] == 4  # sigma * N candidates in one call
    texts = ["alpha plan", "beta plan", "gamma plan", "delta plan without tags"]
    assert res.texts["strategies"] == [[texts[k] for k in picks]]
    b = res.traj
    assert np.asarray(b.strategy_mask).tolist() == [[True, True]]
    assert np.asarray(b.strategy_malformed).tolist() == [[k == 3 for k in picks]]
    assert np.asarray(b.strategy_len).tolist() == [[len(CANDS[k].text.split()) for k in picks]]
    for n, k in enumerate(picks):  # every step prompt of strategy n carries its z
        assert f"Your strategy for this episode: {texts[k]}" in policy.prompts[("action", (0, n, 1, 3))]
    assert np.asarray(b.won)[0].tolist() == [[True, False], [True, False]]
    tb = res.tokens
    idx = np.asarray(tb.row_index)[np.asarray(tb.row_valid)].tolist()
    assert idx[:2] == [[0, 0, 0, -1], [0, 1, 0, -1]]
    assert len(idx) == 2 + 2 * (2 + 4)
    for s, k in enumerate(picks):  # strategy rows: the candidate's tokens and its log-probs
        resp = fake_token_ids(CANDS[k].text)
        np.testing.assert_array_equal(np.asarray(tb.tokens[s, -len(resp) :]), resp)
        np.testing.assert_allclose(np.asarray(tb.old_logp[s])[np.asarray(tb.loss_mask[s])], CANDS[k].mean_logprob)


def test_strata_crashed_strategy_group_is_masked():
    envs = [Corridor(4), Corridor(4), Corridor(4, crash_on=("step", 0)), Corridor(4, crash_on=("reset", 0))]
    res = collect(envs, ScriptedPolicy(strata_script), [0], strata_cfg())
    assert np.asarray(res.traj.strategy_mask).tolist() == [[True, False]]  # z_2 has no trajectory
    assert res.stats["crashed"] == 2
    idx = np.asarray(res.tokens.row_index)[np.asarray(res.tokens.row_valid)].tolist()
    assert [0, 1, 0, -1] not in idx and all(r[1] == 0 for r in idx)


# --- the household world with its expert ---------------------------------------------------------


def test_household_expert_and_invalid_agent():
    from rollout.envs.household import HouseholdEnv, solve

    seeds = [3, 5]
    plans = {p: solve(s, max_steps=12) for p, s in enumerate(seeds)}

    def script(msgs, kind, key):
        if kind == "judge":
            return "<bad_steps>1</bad_steps>"
        p, n, m, t = key
        return act(plans[p][t]) if m == 0 else "<action>dance</action>"

    envs = [HouseholdEnv(max_steps=12) for _ in range(4)]
    res = collect(envs, ScriptedPolicy(script), seeds, flat_cfg(group_size=2, max_steps=12))
    b = res.traj
    for p in range(2):
        L = len(plans[p])
        assert np.asarray(b.step_mask[p, 0, 0]).sum() == L and bool(b.won[p, 0, 0])
        assert int(b.horizon[p]) == L
        ms_total = HouseholdEnv(max_steps=12).reset(seed=seeds[p])[1]["milestones_total"]
        assert np.asarray(b.milestone[p, 0, 0]).sum() == ms_total
        assert np.asarray(b.step_mask[p, 0, 1]).all() and np.asarray(b.invalid[p, 0, 1]).all()
        assert not np.asarray(b.milestone[p, 0, 1]).any() and not bool(b.won[p, 0, 1])
        # the invalid agent never moves: every pre-action observation after the first is identical
        anchors = np.asarray(b.anchor_id[p, 0, 1])
        assert len(set(anchors[1:].tolist())) == 1 and anchors[0] == int(b.anchor_id[p, 0, 0, 0])
    assert res.stats["invalid/inadmissible"] == 24
    assert np.asarray(b.judged_bad)[..., 0].all() and np.asarray(b.judged_bad).sum() == 4


def test_batches_feed_the_advantage_code(flat):
    from strata_jax.advantages import AdvantageParams, compute_advantages
    from strata_jax.batch import gather_advantages

    res, _ = flat
    adv = compute_advantages(res.traj, AdvantageParams(), "grpo")
    tb = gather_advantages(adv.step, adv.strategy, res.tokens)
    a = np.asarray(tb.advantage)
    idx = np.asarray(tb.row_index)
    for s in np.flatnonzero(np.asarray(tb.row_valid)):
        p, n, m, t = idx[s]
        row = a[s][np.asarray(tb.loss_mask[s])]
        # task 0: returns (10, 10, 0) -> winners above 0, the loser below
        if p == 0:
            sign = -1 if m == 2 else 1
            assert (np.sign(row) == sign).all(), (p, m, t)
        assert np.allclose(row, float(adv.step[p, n, m, t]))
    # the invalid first step of (0, 0, 1) carries the penalty on top of its trajectory's advantage
    assert np.isclose(float(adv.step[0, 0, 1, 0]), float(adv.step[0, 0, 1, 1]) - 0.1)


class InjectFaults:
    """Wraps a pool built with fault_injection=True: env i's k-th step sends `faults[(i, k)]`
    ("__crash__" kills its worker process, "__raise__" makes the env raise) instead of the action."""

    def __init__(self, pool, faults):
        self.pool, self.faults, self.count = pool, faults, {}

    @property
    def num_envs(self):
        return self.pool.num_envs

    def reset(self, env_indices, seeds):
        self.count = {}
        return self.pool.reset(env_indices, seeds)

    def step(self, env_indices, actions):
        out = []
        for i, a in zip(env_indices, actions):
            k = self.count[i] = self.count.get(i, -1) + 1
            out.append(self.faults.get((i, k), a))
        return self.pool.step(env_indices, out)


def test_worker_crash_and_env_exception_in_process_pool():
    import functools

    from rollout.envs.household import HouseholdEnv, solve
    from rollout.envs.vector import EnvPool

    plan = solve(3, max_steps=6)

    def script(msgs, kind, key):
        if kind == "judge":
            return "<bad_steps>none</bad_steps>"
        p, n, m, t = key
        return act(plan[t]) if m in (0, 1, 2) else "<action>dance</action>"

    # env i lives on worker i % 2: env 2's crash kills worker 0, which also runs env 0
    pool = EnvPool(
        [functools.partial(HouseholdEnv, max_steps=6)] * 4, num_workers=2, timeout_s=60, fault_injection=True
    )
    try:
        res = collect(
            InjectFaults(pool, {(1, 1): "__raise__", (2, 2): "__crash__"}),
            ScriptedPolicy(script),
            [3],
            flat_cfg(group_size=4, max_steps=6),
        )
    finally:
        pool.close()
    b = res.traj
    assert np.asarray(b.traj_mask)[0, 0].tolist() == [True, False, False, True]
    assert np.asarray(b.won)[0, 0].tolist() == [True, False, False, False]
    assert np.asarray(b.step_mask[0, 0, 0]).sum() == len(plan)  # replayed after its worker died
    assert np.asarray(b.milestone[0, 0, 0]).sum() == HouseholdEnv(6).reset(seed=3)[1]["milestones_total"]
    assert np.asarray(b.invalid[0, 0, 3]).sum() == 6
    assert res.stats["crashed"] == 2 and res.stats["in_batch"] == 2
    errors = sorted(t["error"] for t in res.texts["trajectories"] if t["crashed"])
    assert "injected" in errors[0] + errors[1]
    idx = np.asarray(res.tokens.row_index)[np.asarray(res.tokens.row_valid)]
    assert sorted(set(idx[:, 2].tolist())) == [0, 3] and len(idx) == len(plan) + 6
