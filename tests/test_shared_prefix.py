"""Shared prompt prefixes (strata_jax/prefix.py, SamplerConfig.shared_prefix): the plan covers every
row exactly and saves what a hand count says, and sampling with shared prefixes gives the tokens,
log-probs and embeddings of the unshared sampler (the independent reference) on one device, under
scan_layers and on 8 devices."""

import dataclasses

import jax
import numpy as np
import pytest

from strata_jax import sharding
from strata_jax.models.config import ModelConfig
from strata_jax.models.tiny import init_params
from strata_jax.prefix import common_prefix_len, group_rows, plan_prefixes
from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams

VOCAB = 61


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0


def test_groups_and_plan_by_hand():
    a = list(range(1, 21))  # 20 tokens shared by rows 0, 2, 3
    prompts = [a + [30, 31], [9] * 12, a + [40], a + [41, 42, 43], [9] * 5 + [8]]
    groups = sorted((sorted(r), p) for r, p in group_rows(prompts, min_prefix=4))
    # rows 1 and 4 share 5 tokens ([9] * 5): 5 saved; rows 0, 2, 3 share 20: 40 saved
    assert groups == [([0, 2, 3], 20), ([1, 4], 5)]
    plan = plan_prefixes(
        prompts,
        prompt_bucket=32,
        batch_bucket=8,
        prefix_buckets=(8, 16, 24),
        unique_buckets=(2, 4, 8),
        min_prefix=4,
        min_saving=0.0,
    )
    # Tpre 24 (Ts 8): group a keeps its 20-token prefix (suffixes 1-3 tokens fit in 8); rows 1, 4
    # keep [9] * 5 (suffixes 7 and 1): 2 unique prefixes, bucket 2 -> 2 x 24 + 8 x 8 = 112.
    # Tpre 16 (Ts 16): a's prefix cut to 16 (suffixes 5-7), [9] * 5 as well: 2 x 16 + 8 x 16 = 160.
    assert (plan.prefix_bucket, plan.suffix_bucket, plan.unique_bucket) == (24, 8, 2)
    assert plan.cost == 112 and plan.unshared_cost == 256
    for b, p in enumerate(prompts):
        assert tuple(p[: plan.split[b]]) == plan.prefixes[plan.row_prefix[b]]
        assert 1 <= len(p) - plan.split[b] <= plan.suffix_bucket  # a suffix token for the prefill's logits
    assert plan.prefixes == sorted({tuple(a), (9,) * 5})
    # Nothing shared: no plan.
    assert plan_prefixes([[1, 2], [3, 4]], 16, 2, (8,), (2,), min_prefix=1, min_saving=0.0) is None


def test_plan_gives_a_private_prefix_to_a_row_whose_suffix_would_not_fit():
    shared = list(range(1, 41))
    prompts = [shared + [50], shared + [51], list(range(100, 158))]  # the last row: 58 tokens alone
    plan = plan_prefixes(prompts, 64, 4, (32, 48), (2, 4), min_prefix=8, min_saving=0.0)
    # Tpre 48 (Ts 16): 2 x 48 + 4 x 16 = 160; Tpre 32 (Ts 32): 2 x 32 + 4 x 32 = 192; unshared 256
    assert plan is not None and plan.prefix_bucket == 48 and plan.suffix_bucket == 16
    assert plan.split.tolist() == [40, 40, 58 - 16]
    assert len(plan.prefixes) == 2 and plan.cost == 2 * 48 + 4 * 16


def _model(scan_layers=False, seed=3):
    """A random 2-layer decoder (its init range wide enough that rows given another's prefix differ)."""
    hf = dict(
        model_type="qwen2",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=0.4,
        tie_word_embeddings=False,
        rope_theta=1e4,
        max_position_embeddings=512,
    )
    return init_params(ModelConfig.from_hf(hf, scan_layers=scan_layers), seed=seed)


def _prompts():
    rng = np.random.default_rng(0)

    def tok(n):
        return [int(x) for x in rng.integers(1, VOCAB, size=n)]

    strategy_a, strategy_b = tok(27), tok(33)
    return (
        [strategy_a] * 3  # step 0 of M = 3 trajectories: identical prompts
        + [strategy_b + tok(n) for n in (4, 9, 13)]  # later steps: a shared prefix, own suffixes
        + [tok(19)]
    )  # a row that shares nothing


CFG = SamplerConfig(
    max_new_tokens=10,
    prompt_buckets=(16, 32, 48, 64),
    batch_buckets=(4, 8, 16),
    pad_id=0,
    eos_ids=(7,),
    return_embedding=True,
    prefix_buckets=(16, 24, 32, 40),
    min_shared_prefix=8,
    min_prefix_saving=0.0,
)


@pytest.mark.parametrize("scan_layers,temperature", [(False, 0.0), (False, 1.0), (True, 1.0)])
def test_shared_prefill_samples_what_the_unshared_one_does(scan_layers, temperature):
    graphdef, params = _model(scan_layers)
    prompts = _prompts()
    plain = Sampler(graphdef, dataclasses.replace(CFG, shared_prefix=False))
    shared = Sampler(graphdef, dataclasses.replace(CFG, shared_prefix=True))
    sp = SamplingParams(temperature=temperature)
    ref = plain.generate(params, prompts, sp, jax.random.key(5))
    out = shared.generate(params, prompts, sp, jax.random.key(5))
    assert shared.shared_calls == 1 and shared.traces["prefill_shared"] == 1 and "prefill" not in shared.traces
    assert shared.prefill_tokens < plain.prefill_tokens
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.finish_reason, ref.finish_reason)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=2e-5)
    np.testing.assert_allclose(out.embedding, ref.embedding, atol=2e-5)
    assert np.ptp(ref.logprobs[:, 0]) > 0.1  # the rows differ: a row given another's prefix would show


def test_shared_prefill_on_eight_devices():
    assert jax.device_count() == 8
    graphdef, params = _model()
    prompts = _prompts()
    mesh = sharding.make_mesh((2, 2, 2))
    s8 = Sampler(graphdef, dataclasses.replace(CFG, shared_prefix=True), mesh=mesh)
    sp = SamplingParams(temperature=1.0)
    out = s8.generate(s8.shard_params(params), prompts, sp, jax.random.key(2))
    ref = Sampler(graphdef, CFG).generate(params, prompts, sp, jax.random.key(2))
    assert s8.shared_calls == 1
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=2e-5)
