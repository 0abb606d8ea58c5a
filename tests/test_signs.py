"""The signpost corridor (rollout/envs/doors.py `sign_at`, the strategy-revision study) and its
demonstrator (rollout/demos.py `doors_script`): hand-played episodes and hand-built prompts."""

import collections

import pytest

from rollout.demos import DOORS_STRATEGY, corpus, doors_script, sft_rows
from rollout.envs.doors import COLORS, DoorsEnv
from rollout.judge import state_changed
from rollout.prompts import judge_prompt, revision_prompt, step_prompt


def _play(env, seed, choose):
    """Play one episode with choose(env) -> colour; returns (observations, infos)."""
    obs, info = env.reset(seed=seed)
    seen, infos = [obs], [info]
    done = False
    while not done:
        obs, _, won, trunc, info = env.step(f"open the {choose(env)} door")
        seen.append(obs)
        infos.append(info)
        done = won or trunc
    return seen, infos


def test_the_sign_names_the_colour_that_opens_from_its_door_on():
    env = DoorsEnv(doors=(5, 5), options=3, sign_at=2)
    after = collections.Counter()
    for seed in range(40):
        seen, infos = _play(env, seed, lambda e: e.opens[e.at])
        assert infos[-1]["won"] and len(seen) == 6
        colour = env.opens[2]
        after[colour] += 1
        assert env.opens == ["red", "red", colour, colour, colour] and colour in COLORS[1:3]
        # the sign is in the observation at door 3 only (after two doors), and names that colour
        signed = [i for i, o in enumerate(seen) if "sign" in o]
        assert signed == [2] and f"reads: {colour}." in seen[2] and "door 3 of 5" in seen[2]
        assert all(i["state_changed"] for i in infos[1:])
    assert set(after) == {"blue", "green"}  # the colour is the task's, not a constant


def test_red_after_the_sign_is_locked_and_changes_nothing():
    env = DoorsEnv(doors=(4, 4), max_steps=8, options=3, sign_at=1)
    env.reset(seed=3)
    obs, _, _, _, info = env.step("open the red door")
    assert info["milestone"] and "sign" in obs
    obs, _, _, _, info = env.step("open the red door")  # the sign's colour opens now, not red
    assert not info["milestone"] and not info["state_changed"] and not state_changed(info, obs)
    assert "locked" in obs and "sign" in obs  # still at the sign's door: it is still in view


def test_no_sign_keeps_the_corridor_and_its_tasks():
    """sign_at = 0 is the learnability world unchanged: same door lists per seed, red always."""
    a, b = DoorsEnv(doors=(3, 3), options=3), DoorsEnv(doors=(3, 3), options=3, sign_at=2)
    for seed in range(10):
        a.reset(seed=seed)
        b.reset(seed=seed)
        assert a.lists == b.lists and a.opens == ["red"] * 3
    with pytest.raises(ValueError, match="options >= 3"):
        DoorsEnv(options=2, sign_at=1)
    with pytest.raises(ValueError, match="sign_at"):
        DoorsEnv(options=3, sign_at=-1)


def test_the_demonstrators_judgment_lists_the_doors_that_stayed_shut():
    """The verdict is read from the judge prompt alone; the environment's own record of which steps
    changed nothing is the reference (the last step's outcome is not in the prompt)."""
    import random

    env = DoorsEnv(doors=(5, 5), max_steps=9, options=3, sign_at=2)
    script = doors_script([0], seed=0, sign_at=2)
    listed = 0
    for seed in range(12):
        pick = random.Random(seed)
        seen, infos = _play(env, seed, lambda e, pick=pick: pick.choice(["red", *COLORS[1:3]]))
        actions = [f"step {i}" for i in range(len(seen) - 1)]  # the verdict must not depend on them
        prompt = judge_prompt("go through every door.", DOORS_STRATEGY, list(zip(seen[:-1], actions)))
        answer = script(prompt, "judge", (0, 0, 0))
        # step i (1-based) acted on seen[i - 1]; infos[i] is its outcome, seen[i] the next prompt line
        shut = [i for i in range(1, len(seen) - 1) if not infos[i]["state_changed"]]
        assert answer == f"<bad_steps>{', '.join(map(str, shut)) if shut else 'none'}</bad_steps>"
        listed += len(shut)
    assert listed > 10  # random doors: most episodes have shut doors to list


def _action(script, messages, key=(0, 0, 0, 0)):
    return script(messages, "action", key).split("<action>")[1].split("</action>")[0]


def test_the_signs_demonstrator_reads_what_it_is_shown():
    script = doors_script([0], seed=0, sign_at=2)
    doors = ["open the blue door", "open the red door", "open the green door"]
    before = step_prompt(
        "go through every door.", "You are at door 2 of 5.", doors, strategy=DOORS_STRATEGY, step=1, history_length=0
    )
    assert _action(script, before) == "open the red door"  # before the sign: the corridor's red
    sign = (
        "The door opens. You are at door 3 of 5. A sign here reads: green. From this door on, only that colour opens."
    )
    at_sign = step_prompt("go through every door.", sign, doors, strategy=DOORS_STRATEGY, step=2, history_length=0)
    assert _action(script, at_sign) == "open the green door"
    carried = step_prompt(
        "go through every door.",
        "The door opens. You are at door 4 of 5.",
        doors,
        strategy="blue doors from here on.",
        step=3,
        history_length=0,
    )
    assert _action(script, carried) == "open the blue door"
    blind = step_prompt(
        "go through every door.",
        "The door opens. You are at door 4 of 5.",
        doors,
        strategy=DOORS_STRATEGY,
        step=3,
        history_length=0,
    )
    picks = {_action(script, blind, key=(0, 0, m, 3)) for m in range(30)}
    assert picks == set(doors)  # no colour named: a random listed door


def test_revisions_name_the_sign_in_about_half_of_the_answers():
    script = doors_script([0], seed=0, sign_at=2)
    sign = "The door opens. You are at door 3 of 5. A sign here reads: blue. From this door on, only that colour opens."
    msgs = revision_prompt(
        "go through every door.", sign, DOORS_STRATEGY, [("o", "open the red door")] * 2, step=2, recent=2
    )
    answers = collections.Counter(script(msgs, "strategy", (0, 0, m, 0)) for m in range(200))
    assert set(answers) == {"<strategy>blue doors from here on.</strategy>", f"<strategy>{DOORS_STRATEGY}</strategy>"}
    assert 70 <= answers["<strategy>blue doors from here on.</strategy>"] <= 130
    no_sign = revision_prompt(
        "go through every door.", "You are at door 2 of 5.", "green doors from here on.", [], step=2, recent=2
    )
    assert script(no_sign, "strategy", (0, 0, 0, 0)) == "<strategy>green doors from here on.</strategy>"
    # the plain corridor's demonstrator is unchanged: random doors, never told red
    plain = doors_script([0], seed=0)
    blind = step_prompt(
        "go through every door.",
        "You are at door 1 of 2.",
        ["open the blue door", "open the red door"],
        step=0,
        history_length=0,
    )
    assert {_action(plain, blind, key=(0, 0, m, 0)) for m in range(30)} == {"open the blue door", "open the red door"}


def test_warm_start_rows_of_both_styles_hold_revisions(tmp_path):
    """sft.styles = 'both' with algo.revise_every: the strategy copy carries the expert's revision
    rows and the flat copy revises nothing (it used to refuse: a flat prompt has no strategy)."""
    from transformers import AutoTokenizer

    from configs.tiny_doors import doors
    from strata_jax.models.tiny import make_tiny_model

    c = doors("strata")
    c.env.doors_options, c.env.doors_sign_at, c.algo.revise_every = 3, 2, 2
    c.env.horizon_min = c.env.horizon_max = c.env.max_steps = 4
    make_tiny_model(
        tmp_path,
        texts=corpus(c, num_tasks=8),
        vocab_size=int(c.model.tiny_vocab),
        hidden_size=16,
        layers=1,
        heads=2,
        kv_heads=1,
        intermediate_size=32,
    )
    tok = AutoTokenizer.from_pretrained(tmp_path)
    rows = sft_rows(c, tok, list(range(8)))
    texts = [tok.decode(list(p), skip_special_tokens=True) for p, _ in rows]
    answers = [tok.decode(list(r), skip_special_tokens=True) for _, r in rows]
    revisions = [a for t, a in zip(texts, answers) if "Revise your strategy" in t]
    assert len(revisions) == 8  # one a task: the demonstrator reaches door 3 every time
    assert any("doors from here on" in a for a in revisions)


def test_read_probe_matches_transformers_torch_model(tmp_path):
    """bench/read_probe.py scores the sign's colour with our JAX forward; transformers' PyTorch
    model on the same prompts gives the same probabilities."""
    from tests.bench_modules import load_bench

    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from configs.tiny_doors import doors
    from rollout.demos import THINK
    from rollout.envs.doors import DoorsEnv
    from rollout.policy import render
    from strata_jax.models.tiny import make_tiny_model

    c = doors("strata")
    c.env.doors_options, c.env.doors_sign_at = 6, 2
    c.env.horizon_min = c.env.horizon_max = c.env.max_steps = 4
    make_tiny_model(
        tmp_path,
        texts=corpus(c, num_tasks=16),
        vocab_size=640,
        hidden_size=32,
        layers=2,
        heads=2,
        kv_heads=1,
        intermediate_size=64,
        seed=1,
    )
    got = load_bench("read_probe").probe(str(tmp_path), doors=4, options=6, sign_at=2, tasks=3)
    assert got["n"] == 6 and got["chance"] == pytest.approx(0.2)

    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    env, colours, ps = DoorsEnv(doors=(4, 4), options=6, sign_at=2), COLORS[:6], []
    for seed in range(10**6, 10**6 + 3):
        env.reset(seed=seed)
        for _ in range(2):
            obs, _, _, _, info = env.step("open the red door")
        for strategy in (DOORS_STRATEGY, None):
            msgs = step_prompt(
                "go through every door.", obs, info["admissible_commands"], strategy=strategy, step=2, history_length=0
            )
            ids = tok(
                render(msgs, tok) + f"{THINK}<action>open the", return_tensors="pt", add_special_tokens=False
            ).input_ids
            with torch.no_grad():
                logits = model(ids).logits[0, -1]
            sel = logits[[tok.encode(" " + k, add_special_tokens=False)[0] for k in colours]]
            ps.append(float(torch.softmax(sel, -1)[colours.index(env.opens[2])]))
    assert got["p_right"] == pytest.approx(sum(ps) / len(ps), abs=1e-4)
