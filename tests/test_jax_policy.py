"""JaxPolicy's per-kind sampling: `sampling.strategy_temperature` draws strategy calls at their own
temperature, and every other call kind keeps the policy's temperature."""

import pytest

from configs.base import ConfigError, base_config, validate, with_algo_env
from rollout.jax_policy import JaxPolicy
from strata_jax.models.hf import load_hf_model, load_tokenizer
from strata_jax.models.tiny import make_tiny_model
from strata_jax.sampling import SamplingParams

TEXTS = [
    "go to countertop 1",
    "take apple 1 from countertop 1",
    "You open the fridge 1.",
    "Your task is to: put a clean mug in the coffeemachine.",
    "Nothing happens.",
] * 4
PROMPTS = [[{"role": "user", "content": f"Your task is to: put apple {i} in the fridge 1."}] for i in range(8)]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny"),
        "qwen2",
        TEXTS,
        vocab_size=384,
        hidden_size=32,
        layers=1,
        heads=2,
        kv_heads=1,
        intermediate_size=64,
    )
    (graphdef, params), _ = load_hf_model(path, split=True)
    return JaxPolicy(
        graphdef,
        params,
        load_tokenizer(path),
        {"strategy": 12, "action": 12},
        prompt_buckets=(64,),
        batch_buckets=(8,),
        temperature=1.0,
        seed=0,
    )


def _texts(policy, kind, seed):
    policy.reseed(seed)
    return [g.text for g in policy.generate(PROMPTS, kind)]


def test_strategy_calls_use_their_own_temperature(policy):
    policy.kind_sampling = {}
    greedy_policy_sampling = policy.sampling
    policy.sampling = SamplingParams(temperature=0.0)
    greedy = {k: _texts(policy, k, 0) for k in ("strategy", "action")}
    policy.sampling = greedy_policy_sampling
    # a random model at T = 1 spreads its mass over the vocabulary: samples are not the greedy text
    assert _texts(policy, "strategy", 1) != greedy["strategy"]
    policy.kind_sampling = {"strategy": SamplingParams(temperature=0.0)}
    assert _texts(policy, "strategy", 1) == greedy["strategy"]
    assert _texts(policy, "strategy", 2) == greedy["strategy"]
    assert _texts(policy, "action", 1) != greedy["action"]  # other kinds keep T = 1
    policy.kind_sampling = {}


def test_unfused_decode_writes_the_same_greedy_text(policy):
    """`sampling.fuse_decode=False` reaches every call kind's sampler, and its greedy text is the
    fused decode's (the default)."""
    graphdef = policy.samplers["action"].graphdef
    plain = JaxPolicy(
        graphdef,
        policy.params,
        policy.tokenizer,
        {"strategy": 12, "action": 12},
        prompt_buckets=(64,),
        batch_buckets=(8,),
        temperature=0.0,
        seed=0,
        fuse_decode=False,
    )
    assert all(s.config.fuse_decode for s in policy.samplers.values())
    assert not any(s.config.fuse_decode for s in plain.samplers.values())
    policy.kind_sampling, sampling = {}, policy.sampling
    policy.sampling = SamplingParams(temperature=0.0)
    try:
        for kind in ("strategy", "action"):
            assert _texts(plain, kind, 0) == _texts(policy, kind, 0)
    finally:
        policy.sampling = sampling


def test_strategy_temperature_is_refused_without_strategies():
    c = with_algo_env(base_config(), "grpo", "household")
    c.sampling.strategy_temperature = 0.5
    with pytest.raises(ConfigError, match="strategy_temperature"):
        validate(c)
    for algo in ("strata", "strata+beacon", "beacon"):
        c = with_algo_env(base_config(), algo, "household")
        c.sampling.strategy_temperature = 0.5
        if algo.startswith("strata"):
            validate(c)  # both strategy-sampling algorithms accept it (strata+beacon was refused: a typo)
        else:
            with pytest.raises(ConfigError, match="strategy_temperature"):
                validate(c)


def test_stop_sequences_catch_a_tag_merged_with_the_text_before_it(tmp_path):
    """The shop tokenizer writes `search[a b]</action>` as ... "]</" "action" ">": the plain
    "</" "action" ">" never appears, so a stop on it alone lets every such answer run on to the
    action budget. Every answer that ends with the tag must end with one of the stop sequences."""
    from configs.tiny_shop import get_config
    from rollout.demos import corpus
    from rollout.jax_policy import stop_sequences

    c = get_config()
    c.log.progress = False
    tok = load_tokenizer(
        make_tiny_model(
            tmp_path / "m",
            texts=corpus(c, num_tasks=32),
            vocab_size=int(c.model.tiny_vocab),
            hidden_size=16,
            layers=1,
            heads=2,
            kv_heads=1,
            intermediate_size=32,
        )
    )
    answers = ["search[vegan organic licorice]", "click[next >]", "click[buy now]", "go to desk 1", "look.", "x"]
    merged = 0
    for tag in ("</action>", "</strategy>", "</bad_steps>"):
        stops = stop_sequences(tok, tag)
        plain = tok.encode(tag, add_special_tokens=False)
        for text in answers:
            ids = tok.encode(f"<think>ok</think>{text}{tag}", add_special_tokens=False)
            assert any(ids[-len(s) :] == s for s in stops), (tag, text, [tok.decode([i]) for i in ids[-4:]])
            merged += ids[-len(plain) :] != plain
        assert all(tok.decode(s).endswith(tag) for s in stops)
    assert merged > 0  # the case this guards against occurs with this tokenizer
