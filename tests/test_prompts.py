"""Prompt builders: what each prompt must and must not contain, and chat-template rendering."""

import pytest

from rollout.parsing import parse_action, parse_bad_steps, parse_strategy
from rollout.policy import render
from rollout.prompts import judge_prompt, step_prompt, strategy_prompt

HIST = [
    ("obs one", "go to desk 1"),
    ("obs two", "open drawer 1"),
    ("obs three", ""),
    ("obs four", "take pen 1 from drawer 1"),
]


def _content(msgs):
    assert isinstance(msgs, list) and all(set(m) == {"role", "content"} for m in msgs)
    assert msgs[-1]["role"] == "user"
    return "\n".join(m["content"] for m in msgs)


def test_step_prompt_is_non_cumulative_and_complete():
    text = _content(
        step_prompt(
            "put a pen in drawer",
            "You see a pen 1.",
            ["look", "go to desk 1"],
            history=HIST,
            strategy="search desks first",
            step=4,
            history_length=2,
        )
    )
    assert "Your task is to: put a pen in drawer" in text
    assert "Your strategy for this episode: search desks first" in text
    # only the last two steps, numbered by their position in the episode
    assert "obs one" not in text and "obs two" not in text
    assert "[Step 3] Observation: obs three Action: (no valid action)" in text
    assert "[Step 4] Observation: obs four Action: take pen 1 from drawer 1" in text
    assert "Current observation (step 5): You see a pen 1." in text
    assert "Admissible actions: 'look', 'go to desk 1'" in text
    assert "<think>...</think>" in text and "<action>...</action>" in text


def test_step_prompt_without_strategy_or_history():
    text = _content(step_prompt("t", "o", ["look"], history=HIST, strategy=None, history_length=0))
    assert "strategy" not in text.lower()
    assert "obs four" not in text and "Your last" not in text


def test_strategy_prompt():
    text = _content(strategy_prompt("cool an apple", "You are in a kitchen.", max_words=30))
    assert "cool an apple" in text and "You are in a kitchen." in text
    assert "<strategy>...</strategy>" in text and "30 words" in text


def test_judge_prompt_numbers_steps_with_excerpts():
    long_obs = "word " * 100
    text = _content(judge_prompt("find pen", "search desks", [(long_obs, "look"), ("b", "")], excerpt_chars=20))
    assert "find pen" in text and "search desks" in text
    assert "1. Observation: " + ("word " * 3) in text and "| Action: look" in text
    assert "word " * 10 not in text  # the observation is cut to an excerpt
    assert "2. Observation: b | Action: (no valid action)" in text
    assert "<bad_steps>2, 5</bad_steps>" in text and "<bad_steps>none</bad_steps>" in text


def test_prompt_examples_parse_with_the_parsers():
    # the formats the prompts ask for are exactly what the parsers accept
    assert parse_action("<think>x</think><action>look</action>", ["look"]).valid
    assert parse_strategy("<strategy>search desks</strategy>") == ("search desks", False)
    assert parse_bad_steps("<bad_steps>2, 5</bad_steps>", 5) == ({2, 5}, True)


def _chat_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, unk_token="[UNK]")


def test_render_applies_chat_template_with_generation_prompt():
    msgs = step_prompt("t", "o", ["look"])
    out = render(msgs, _chat_tokenizer())
    assert out == f"<|im_start|>user\n{msgs[0]['content']}<|im_end|>\n<|im_start|>assistant\n"


def test_step_prompt_repeats_the_first_observation_from_the_second_step():
    first = (
        "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
        "around you, you see a cabinet 1, and a desk 1. The pen 1 is in the cabinet 1.\n\n"
        "Your task is to: put a pen in desk."
    )
    at0 = _content(step_prompt("put a pen in desk.", first, ["go to cabinet 1"], step=0, first_observation=first))
    assert "At the start you saw" not in at0  # step 0: it is the current observation
    later = _content(
        step_prompt(
            "put a pen in desk.",
            "You arrive at desk 1.",
            ["look"],
            history=HIST[:1],
            step=1,
            history_length=1,
            first_observation=first,
        )
    )
    line = next(ln for ln in later.splitlines() if ln.startswith("At the start you saw: "))
    assert line == (
        "At the start you saw: You are in the middle of a room. Looking quickly around you, "
        "you see a cabinet 1, and a desk 1. The pen 1 is in the cabinet 1."
    )
    assert "Welcome" not in later and later.count("Your task is to:") == 1
    off = _content(step_prompt("t", "o", ["look"], step=3, first_observation=None))
    assert "At the start" not in off


def test_household_prompts_keep_revealed_locations_every_step():
    """With history 1 the revealed locations stay in every step's prompt, not only while the step
    that revealed them is in the history window."""
    from rollout.collect import RolloutConfig, collect
    from rollout.demos import expert_script
    from rollout.envs.household import HouseholdEnv
    from rollout.policy import ScriptedPolicy

    kw = dict(max_steps=12, horizon=(8, 8), reveal_objects=True)
    seen = []
    base = expert_script([5], kw)

    def script(msgs, kind, key):
        seen.append(msgs[-1]["content"])
        return base(msgs, kind, key)

    cfg = RolloutConfig(mode="flat", group_size=1, judgment=False, max_steps=12, history_length=1, progress=False)
    collect([HouseholdEnv(**kw)], ScriptedPolicy(script), [5], cfg)
    import re

    reveal = re.findall(r"The \w+ \d+ is (?:in|on) the \w+ \d+\.", seen[0])
    assert reveal and len(seen) == 8
    for text in seen[1:]:
        assert all(r in text for r in reveal)


@pytest.mark.parametrize("name", ["tiny_household", "tiny_shop"])
def test_the_longest_self_judgment_prompt_fits_the_prompt_buckets(name, tmp_path):
    """A judgment lists every step (a 150-character observation excerpt and the action), so with
    max_steps steps it is the longest prompt of a run. tiny_shop once sampled a 1,110-token one
    against a largest bucket of 1,024, after 23 minutes of SFT. Worst case here: a real
    observation, an action and a strategy each as long as their token budgets allow, measured
    with the tokenizer the run trains (rollout/warmstart.py, on the same corpus)."""
    import importlib

    from rollout.demos import corpus, expert_env_kwargs
    from rollout.envs import make_env
    from strata_jax.models.hf import load_tokenizer
    from strata_jax.models.tiny import make_tiny_model

    c = importlib.import_module(f"configs.{name}").get_config()
    c.log.progress = False
    path = make_tiny_model(
        tmp_path / "m",
        texts=corpus(c),
        vocab_size=int(c.model.tiny_vocab),
        hidden_size=16,
        layers=1,
        heads=2,
        kv_heads=1,
        intermediate_size=32,
    )
    tok = load_tokenizer(path)
    env = make_env(c.env.name, **expert_env_kwargs(c))
    obs, _ = env.reset(seed=3)
    task = obs[-300:]
    first = importlib.import_module(f"rollout.envs.{c.env.name}").expert_plan(env)[0]
    obs, *_ = env.step(first)  # household: arrive somewhere; shop: a results page
    obs = max(obs, task, key=len)
    assert len(obs) > 150

    def budget_long(text: str, budget: int) -> str:
        return tok.decode(tok.encode((text + " ") * 64, add_special_tokens=False)[:budget])

    action = "<action>" + budget_long(
        "search[womens waterproof hiking boots] put mug 1 in/on coffeemachine 1", c.sampling.max_action_tokens
    )
    strategy = budget_long(
        "go to countertop 1, take mug 1, heat it with microwave 1, then buy", c.sampling.max_strategy_tokens
    )
    n = len(
        tok.encode(
            render(judge_prompt(task, strategy, [(obs, action)] * c.env.max_steps), tok), add_special_tokens=False
        )
    )
    assert n <= max(c.sampling.prompt_buckets), (n, c.sampling.prompt_buckets)
