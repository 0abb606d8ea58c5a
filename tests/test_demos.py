"""Expert demonstrations (rollout/demos.py) and the household options configs/tiny_household.py uses."""

import re

import pytest

from configs.base import ConfigError, base_config, validate, with_algo_env
from rollout.demos import household_kwargs, sft_rows
from rollout.envs.household import HouseholdEnv, solve

REVEALED = re.compile(r"The (\w+ \d+) is (in|on) the (\w+ \d+)\.")


def _kw(**over):
    kw = {"max_steps": 12, "horizon": (2, 12), "n_extra_receptacles": 1, "n_distractors": 3}
    kw.update(over)
    return kw


def test_revealed_locations_are_where_the_expert_finds_the_objects():
    """The first observation's 'The pen 1 is on the desk 1.' must name the receptacle the exact
    solver (which reads the world state, not the text) takes the object from, and the lamp's host."""
    env = HouseholdEnv(**_kw(reveal_objects=True))
    checked = 0
    for seed in range(200):
        obs, info = env.reset(seed=seed)
        said = {o: r for o, _, r in REVEALED.findall(obs)}
        assert said, f"seed {seed}: nothing revealed in {obs!r}"
        for o, r in said.items():
            if o == "desklamp 1":
                assert r == env.world.lamp_host, (seed, obs)
            else:
                # the preposition follows the receptacle: in a closed/openable one, on a surface
                assert (f"The {o} is in the {r}." in obs) == (r in env.world.openable), (seed, obs)
        takes = [re.fullmatch(r"take (\w+ \d+) from (\w+ \d+)", c) for c in solve(seed, **_kw(reveal_objects=True))]
        for m in filter(None, takes):
            o, r = m.groups()
            if o.split()[0] == env.task.obj_type and o in said:
                assert said[o] == r, (seed, o, said[o], r)
                checked += 1
        assert ("desklamp 1" in said) == (info["task_type"] == "look_at_obj_in_light")
    assert checked >= 200


def test_reveal_is_off_by_default_and_changes_only_the_first_observation():
    hidden, shown = HouseholdEnv(**_kw()), HouseholdEnv(**_kw(reveal_objects=True))
    for seed in range(20):
        a, ia = hidden.reset(seed=seed)
        b, ib = shown.reset(seed=seed)
        assert not REVEALED.search(a)
        assert re.sub(" " + REVEALED.pattern, "", b) == a
        assert ia == ib
        for cmd in solve(seed, **_kw()):  # same world, same dynamics
            assert hidden.step(cmd)[:3] == shown.step(cmd)[:3]


def test_reveal_is_refused_outside_the_household_world():
    c = with_algo_env(base_config(), "strata", "alfworld")
    c.env.reveal_objects = True
    with pytest.raises(ConfigError, match="reveal_objects"):
        validate(c)
    c = base_config()
    c.sft.styles = "all"
    with pytest.raises(ConfigError, match="sft.styles"):
        validate(c)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from rollout.demos import corpus
    from strata_jax.models.hf import load_tokenizer
    from strata_jax.models.tiny import make_tiny_model

    c = with_algo_env(base_config(), "strata", "household")
    c.env.max_steps, c.env.horizon_max = 12, 6
    out = tmp_path_factory.mktemp("tok")
    make_tiny_model(out, texts=corpus(c, num_tasks=24), vocab_size=512)
    return load_tokenizer(out)


def test_sft_rows_in_both_styles_are_the_strategy_rows_plus_the_flat_rows(tokenizer):
    c = with_algo_env(base_config(), "strata", "household")
    c.env.max_steps, c.env.horizon_max = 12, 6
    tasks = range(6)
    strata = sft_rows(c, tokenizer, tasks, judge_share=0.0)
    flat_c = with_algo_env(base_config(), "grpo", "household")
    flat_c.env.max_steps, flat_c.env.horizon_max = 12, 6
    flat = sft_rows(flat_c, tokenizer, tasks, judge_share=0.0)
    c.sft.styles = "both"
    both = sft_rows(c, tokenizer, tasks, judge_share=0.0)
    assert len(both) == len(strata) + len(flat)
    for (p, r), (q, s) in zip(both, strata + flat):
        assert (p == q).all() and (r == s).all()
    text = [tokenizer.decode(p) for p, _ in flat]
    assert not any("strategy" in t.lower() for t in text)  # flat prompts carry no strategy
    assert sum("<strategy>" in tokenizer.decode(r) for _, r in strata) == len(tasks)
    # every flat action row answers with the expert's next command
    plans = {t: solve(t, **household_kwargs(flat_c)) for t in tasks}
    n_actions = sum(len(p) for p in plans.values())
    assert len(flat) == n_actions
    c.sft.styles = "nope"
    with pytest.raises(ValueError, match="sft.styles"):
        sft_rows(c, tokenizer, tasks)


def test_epsilon_soft_expert_detours_recovers_and_judges_its_detours():
    """Every action is admissible, every episode is still won (the detours cost steps only), the
    detours are the steps its judgment lists, and epsilon 0 is the plain expert plan."""
    from rollout.collect import RolloutConfig, collect
    from rollout.demos import expert_script
    from rollout.policy import ScriptedPolicy

    kw = _kw(reveal_objects=True, max_steps=60)
    tasks = list(range(60))
    cfg = RolloutConfig(mode="flat", group_size=1, judgment=True, max_steps=60, progress=False)
    plain = collect([HouseholdEnv(**kw) for _ in tasks], ScriptedPolicy(expert_script(tasks, kw)), tasks, cfg)
    soft = collect(
        [HouseholdEnv(**kw) for _ in tasks], ScriptedPolicy(expert_script(tasks, kw, epsilon=0.3, seed=1)), tasks, cfg
    )
    for res in (plain, soft):
        assert res.stats["success_rate"] == 1.0 and res.stats["invalid_rate"] == 0.0
    detours = 0
    for p, (a, b) in enumerate(zip(plain.texts["trajectories"], soft.texts["trajectories"])):
        assert [s["action"] for s in a["steps"]] == solve(tasks[p], **kw)
        assert a["judge"] == "<bad_steps>none</bad_steps>"
        acts = [s["action"] for s in b["steps"]]
        listed = re.findall(r"\d+", b["judge"])
        bad = {int(k) for k in listed}
        detours += len(bad)
        # replay: a detour is followed by a walk back unless the plan's next command is a go-to;
        # everything else is the plan, in order
        plan, j, walk_back = solve(tasks[p], **kw), 0, False
        for i, x in enumerate(acts, 1):
            if walk_back:
                assert x.startswith("go to "), (p, acts)
                walk_back = False
            elif i in bad:
                assert x in ("look", "inventory") or x.startswith("go to "), (p, acts)
                walk_back = x.startswith("go to ") and not plan[j].startswith("go to ")
            else:
                assert x == plan[j], (p, i, acts, plan)
                j += 1
        assert j == len(plan)
    assert 0.2 < detours / sum(len(solve(t, **kw)) for t in tasks) < 0.7  # about eps / (1 - eps)
