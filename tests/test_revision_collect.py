"""Strategy revision and trained self-judgment in the rollout loop: revisions change the later step
prompts and get their own token rows; k judgments give a majority set, environment labels and
(judge_train) judgment rows; each row gets its advantage; sharded collection merges to the same
batch."""

import numpy as np
import pytest

from rollout.collect import RolloutConfig, collect
from rollout.policy import fake_token_ids, messages_text
from rollout.shards import merge_results
from strata_jax.advantages import AdvantageParams, compute_advantages
from strata_jax.batch import gather_advantages, row_kinds
from tests.revision_reference import judge_reference, revision_reference
from tests.test_collect import FWD, WAIT, Corridor, Recorder

H, K = 6, 2  # revisions before steps 2 and 4: R = 2
JUDGE = ["<bad_steps>2</bad_steps>", "<bad_steps>2, 3</bad_steps>", "I cannot say"]


def script(msgs, kind, key):
    if kind == "strategy" and len(key) == 2:  # reset candidates (p, k)
        return f"<strategy>plan A{key[1]}</strategy>"
    if kind == "strategy":  # revision (p, n, m, r)
        p, n, m, r = key
        return "no tags here" if m == 1 else f"<strategy>plan B{n}{m}{r}</strategy>"
    if kind == "judge":
        return JUDGE[key[3]]
    p, n, m, t = key
    # m = 0 waits out the episode (6 steps, 2 revisions); m = 1 waits twice, then walks to room 2
    return WAIT if m == 0 or t < 2 else FWD


def cfg(**kw):
    base = dict(
        mode="strata",
        num_strategies=2,
        traj_per_strategy=2,
        oversample=1,
        diverse=False,
        max_steps=H,
        revise_every=K,
        judge_samples=3,
        judge_train=True,
        progress=False,
        row_multiple=4,
    )
    return RolloutConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run():
    policy = Recorder(script)
    return collect([Corridor(H) for _ in range(4)], policy, [0], cfg()), policy


def test_revision_changes_later_step_prompts(run):
    res, policy = run
    assert [k for k, _ in policy.calls] == [
        "strategy",
        "action",
        "action",
        "strategy",
        "action",
        "action",
        "strategy",
        "action",
        "action",
        "judge",
    ]
    assert [b for k, b in policy.calls if k == "strategy"] == [2, 4, 2]  # then only the m = 0 are running
    say = lambda n, m, t: policy.prompts[("action", (0, n, m, t))]  # noqa: E731
    for n in range(2):
        for t in range(H):
            want = f"plan A{n}" if t < 2 else f"plan B{n}0{(t - 2) // 2}"
            assert f"Your strategy for this episode: {want}" in say(n, 0, t), (n, t)
        for t in range(4):  # m = 1's revision is malformed: the reset strategy stays in force
            assert f"Your strategy for this episode: plan A{n}" in say(n, 1, t)
        rp = policy.prompts[("strategy", (0, n, 0, 1))]
        assert f"Your strategy so far: plan B{n}00" in rp and "You have taken 4 step(s)" in rp
    b = res.traj
    np.testing.assert_array_equal(np.asarray(b.step_slot)[0, :, 0], [[0, 0, 1, 1, 2, 2]] * 2)
    np.testing.assert_array_equal(np.asarray(b.step_slot)[0, :, 1], [[0, 0, 0, 0, 0, 0]] * 2)
    np.testing.assert_array_equal(np.asarray(b.revision_mask)[0], [[[1, 1], [1, 0]]] * 2)
    np.testing.assert_array_equal(np.asarray(b.revision_malformed)[0], [[[0, 0], [1, 0]]] * 2)
    assert res.stats["revisions"] == 6 and res.stats["revision_malformed"] == 2


def test_environment_labels_and_majority_judgment(run):
    res, _ = run
    b = res.traj
    # waits: the first one is unknown, every repeat changed nothing; a forward that reached room 1
    # is a milestone; the second forward repeats an action but changed the state
    np.testing.assert_array_equal(np.asarray(b.step_label)[0, :, 0], [[0, -1, -1, -1, -1, -1]] * 2)
    np.testing.assert_array_equal(np.asarray(b.step_label)[0, :, 1], [[0, -1, 1, 0, 0, 0]] * 2)
    np.testing.assert_array_equal(np.asarray(b.judge_ok)[0], np.tile([True, True, False], (2, 2, 1)))
    # step 2 is in 2 of 3 sets (a majority), step 3 in one only
    np.testing.assert_array_equal(np.asarray(b.judged_bad)[0, 0, 0], [0, 1, 0, 0, 0, 0])
    assert res.texts["trajectories"][0]["judge"] == JUDGE
    assert [r["strategy"] for r in res.texts["trajectories"][0]["revisions"]] == ["plan B000", "plan B001"]


def test_revision_and_judgment_rows_get_their_tokens_and_advantages(run):
    res, policy = run
    tb, b = res.tokens, res.traj
    valid = np.asarray(tb.row_valid)
    idx = np.asarray(tb.row_index)[valid]
    _, is_strat, is_rev, is_judge = (np.asarray(x) for x in row_kinds(idx[:, 3], H))
    assert is_strat.sum() == 2 and is_rev.sum() == 6 and is_judge.sum() == 4 * 3
    assert (idx[:, 3] >= 0).argmax() == 8  # strategies and revisions first (the shard-merge order)
    for s in np.flatnonzero(valid):
        p, n, m, t = (int(x) for x in np.asarray(tb.row_index)[s])
        if t <= -2:  # revision r: its prompt and its answer
            r = -2 - t
            text = script(None, "strategy", (p, n, m, r))
            resp = fake_token_ids(text)
            want_prompt = fake_token_ids(
                messages_text([{"role": "user", "content": policy.prompts[("strategy", (p, n, m, r))]}])
            )
            row = np.asarray(tb.tokens[s])[np.asarray(tb.attention_mask[s])]
            np.testing.assert_array_equal(row, np.concatenate([want_prompt, resp]))
        elif t >= H:
            resp = fake_token_ids(JUDGE[t - H])
            np.testing.assert_array_equal(np.asarray(tb.tokens[s])[np.asarray(tb.loss_mask[s])], resp)
    d = {
        f: np.asarray(getattr(b, f))
        for f in (
            "step_mask",
            "episode_return",
            "revision_mask",
            "revision_len",
            "revision_malformed",
            "judge_valid",
            "judge_ok",
            "judge_sets",
            "step_label",
        )
    }
    adv = compute_advantages(b, AdvantageParams(), "strata")
    np.testing.assert_allclose(np.asarray(adv.revision), revision_reference(d), atol=1e-5)
    np.testing.assert_allclose(np.asarray(adv.judge), judge_reference(d), atol=1e-5)
    assert np.abs(np.asarray(adv.revision)[0, :, :, 0]).min() > 0.5  # winners' malformed revisions vs losers'
    out = gather_advantages(adv.step, adv.strategy, tb, revision_adv=adv.revision, judge_adv=adv.judge)
    a, lm = np.asarray(out.advantage), np.asarray(tb.loss_mask)
    for s in np.flatnonzero(valid):
        p, n, m, t = (int(x) for x in np.asarray(tb.row_index)[s])
        want = (
            np.asarray(adv.revision)[p, n, m, -2 - t]
            if t <= -2
            else np.asarray(adv.strategy)[p, n]
            if t == -1
            else np.asarray(adv.judge)[p, n, m, t - H]
            if t >= H
            else np.asarray(adv.step)[p, n, m, t]
        )
        np.testing.assert_allclose(a[s][lm[s]], want, atol=1e-6)


def test_judgments_are_not_rows_unless_trained_and_defaults_record_one_judgment():
    res = collect([Corridor(H) for _ in range(4)], Recorder(script), [0], cfg(judge_train=False))
    t = np.asarray(res.tokens.row_index)[np.asarray(res.tokens.row_valid), 3]
    assert (t < H).all() and (t <= -2).sum() == 6
    res = collect(
        [Corridor(H) for _ in range(4)],
        Recorder(lambda m, k, key: script(m, k, (*key, 0)) if k == "judge" else script(m, k, key)),
        [0],
        cfg(judge_train=False, judge_samples=1, revise_every=0),
    )
    assert res.traj.num_revisions == 0 and res.traj.num_judgments == 1
    assert not np.asarray(res.traj.step_slot).any()


def test_shards_merge_to_the_single_collect():
    envs = lambda: [Corridor(H) for _ in range(8)]  # noqa: E731
    one = collect(envs(), Recorder(script), [0, 1], cfg())
    parts = [collect(envs(), Recorder(script), [s], cfg()) for s in (0, 1)]
    # shard 1's keys say p = 0; the single collect's say p = 1: the script ignores p
    merged = merge_results(parts, cfg())
    for f in ("tokens", "loss_mask", "row_index", "row_valid", "old_logp"):
        np.testing.assert_array_equal(np.asarray(getattr(merged.tokens, f)), np.asarray(getattr(one.tokens, f)), f)
    for f in ("revision_mask", "step_slot", "step_label", "judge_sets", "judged_bad"):
        np.testing.assert_array_equal(np.asarray(getattr(merged.traj, f)), np.asarray(getattr(one.traj, f)), f)
