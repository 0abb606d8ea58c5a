"""`env.action_format = "index"`: the step prompt numbers the admissible commands and the agent
answers with a number. Checked against the plain-text format on the same tasks: the expert that
answers by number takes exactly the expert plan's commands, and the parser maps numbers (and only
numbers in range) to the commands the prompt listed."""

import re

import pytest

from configs.base import ConfigError, base_config, validate, with_algo_env
from configs.tiny_household import get_config
from rollout import prompts
from rollout.collect import RolloutConfig, collect
from rollout.demos import expert_script
from rollout.envs.household import HouseholdEnv, solve
from rollout.parsing import INADMISSIBLE, parse_action
from rollout.policy import ScriptedPolicy

ADM = ["examine desk 1", "go to cabinet 1", "go to sofa 1", "take pen 1 from desk 1", "inventory", "look"]


def test_numbered_prompt_lists_every_command_once_and_reads_back():
    text = prompts.step_prompt("put a pen in sofa.", "You arrive at desk 1.", ADM, numbered=True)[0]["content"]
    assert "Admissible actions: [1] examine desk 1 [2] go to cabinet 1 [3] go to sofa 1 " in text
    assert "give the number of exactly one admissible action" in text
    assert prompts.numbered_commands(text) == {a: k for k, a in enumerate(ADM, 1)}
    plain = prompts.step_prompt("put a pen in sofa.", "You arrive at desk 1.", ADM)[0]["content"]
    assert prompts.numbered_commands(plain) == {} and "'take pen 1 from desk 1'" in plain
    with pytest.raises(ValueError, match="needs the admissible commands"):
        prompts.step_prompt("t", "o", None, numbered=True)


@pytest.mark.parametrize(
    "answer,want",
    [
        ("<think>x</think><action>4</action>", "take pen 1 from desk 1"),
        ("<action> 1 </action>", "examine desk 1"),
        ("<action>6</action>", "look"),
    ],
)
def test_a_number_in_range_is_its_command(answer, want):
    pa = parse_action(answer, ADM, by_index=True)
    assert pa.valid and pa.action == want and pa.reason is None


@pytest.mark.parametrize(
    "answer",
    [
        "<action>0</action>",
        "<action>7</action>",
        "<action>-1</action>",
        "<action>go to sofa 1</action>",
        "<action>3a</action>",
        "<action>" + "9" * 50 + "</action>",
    ],
)
def test_anything_else_is_inadmissible(answer):
    pa = parse_action(answer, ADM, by_index=True)
    assert not pa.valid and pa.action == "" and pa.reason == INADMISSIBLE
    assert parse_action("<action>go to sofa 1</action>", ADM).valid  # the text format still takes text


def test_index_expert_takes_the_plan_and_wins_as_the_text_expert_does():
    kw = {"max_steps": 14, "horizon": (2, 8), "n_extra_receptacles": 1, "n_distractors": 3, "reveal_objects": True}
    tasks = list(range(24))
    runs = {}
    for fmt in ("text", "index"):
        cfg = RolloutConfig(
            mode="strata",
            num_strategies=1,
            traj_per_strategy=1,
            oversample=1,
            judgment=False,
            max_steps=14,
            action_format=fmt,
            progress=False,
        )
        runs[fmt] = collect([HouseholdEnv(**kw) for _ in tasks], ScriptedPolicy(expert_script(tasks, kw)), tasks, cfg)
        assert runs[fmt].stats["success_rate"] == 1.0 and runs[fmt].stats["invalid_rate"] == 0.0
    for p, (a, b) in enumerate(zip(runs["text"].texts["trajectories"], runs["index"].texts["trajectories"])):
        plan = solve(tasks[p], **kw)
        assert [s["action"] for s in a["steps"]] == [s["action"] for s in b["steps"]] == plan
        # the index expert's outputs are numbers, each the plan command's number in its prompt
        for s, _cmd in zip(b["steps"], plan):
            assert re.fullmatch(r"<think>.*</think><action>\d+</action>", s["output"]), s["output"]


def test_index_format_is_refused_where_not_wired():
    c = with_algo_env(base_config(), "grpo", "alfworld")
    c.env.action_format = "index"
    with pytest.raises(ConfigError, match="action_format='index' is only wired for env.name='household'"):
        validate(c)
    c = get_config()
    c.env.action_format = "index"
    validate(c)
    c.algo.invalid_penalty_tokens = "divergence"
    with pytest.raises(ConfigError, match="divergence' compares command text"):
        validate(c)
