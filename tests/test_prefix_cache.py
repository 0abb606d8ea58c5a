"""The prefix cache across sampler calls (strata_jax/prefix.py PrefixCache, SamplerConfig.
prefix_cache_tokens): its bookkeeping by hand, and sampling with it against the sampler without it
(the independent reference) over several calls, on one device, under scan_layers, on 8 devices,
across a change of params, and through a whole StraTA rollout with revisions and judgments."""

import dataclasses

import jax
import numpy as np
import pytest

from rollout.collect import RolloutConfig, collect
from rollout.envs.household import HouseholdEnv
from rollout.jax_policy import JaxPolicy
from strata_jax import sharding
from strata_jax.batch import row_kinds
from strata_jax.models.hf import load_hf_model, load_tokenizer
from strata_jax.models.tiny import make_tiny_model
from strata_jax.prefix import PrefixCache
from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_shared_prefix import VOCAB, _model


def test_match_takes_the_longest_common_prefix_and_leaves_one_token():
    cache = PrefixCache(rows=4, width=8, min_prefix=3)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 9, 9, 9]
    stores = cache.assign([a, b], [(None, 0), (None, 0)])
    # heads: a's first 8 tokens, b's first 5 (len - 1): one row each
    assert sorted((i, h) for i, _, h in stores) == [(0, 8), (1, 5)]
    e, n = cache.match([1, 2, 3, 4, 5, 0, 0])
    assert e.tokens == tuple(a[:8]) and n == 5
    e, n = cache.match([1, 2, 3, 4])  # every token matches a: at most len - 1 usable
    assert e.tokens == tuple(a[:8]) and n == 3
    assert cache.match([1, 2, 7, 7, 7]) == (None, 0)  # 2 < min_prefix tokens in common
    assert cache.match([1, 2, 3]) == (None, 0)  # len - 1 < min_prefix


def test_assign_keeps_what_the_call_used_and_wrote_and_evicts_the_rest():
    cache = PrefixCache(rows=3, width=4, min_prefix=2)
    p, q, r = [5, 6, 7, 8, 9], [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]
    cache.assign([p, q, r], [(None, 0)] * 3)
    assert len(cache) == 3
    # next call: only p's episode is still running, its prompt repeats p's first 2 tokens
    nxt = [5, 6, 0, 0, 0]
    hit = cache.match(nxt)
    assert hit[0].tokens == (5, 6, 7, 8) and hit[1] == 2
    stores = cache.assign([nxt], [hit])
    # q's and r's entries are gone (their episodes ended); nxt's head is new: it takes a free row
    assert len(stores) == 1 and stores[0][2] == 4
    assert sorted(e.tokens for e in cache.entries) == [(5, 6, 0, 0), (5, 6, 7, 8)]
    assert cache.match([5, 6, 0, 0, 3])[0].tokens == (5, 6, 0, 0)  # the longer match wins
    # identical prompts store one head; a prompt whose head is all matched stores nothing
    same = [[3, 3, 3, 3, 3]] * 2
    assert len(cache.assign(same, [(None, 0)] * 2)) == 1
    assert cache.assign([[3, 3, 3, 3, 3]], [cache.match([3, 3, 3, 3, 3])]) == []


def test_assign_reuses_the_rows_of_its_hits_when_the_pool_is_full():
    cache = PrefixCache(rows=2, width=4, min_prefix=2)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 9, 9]
    cache.assign([a, b], [(None, 0)] * 2)
    a2, b2 = [1, 2, 0, 0, 0], [7, 8, 0, 0, 0]
    hits = [cache.match(a2), cache.match(b2)]
    stores = cache.assign([a2, b2], hits)
    assert sorted(row for _, row, _ in stores) == [0, 1]  # both rows rewritten with the new heads
    assert sorted(e.tokens for e in cache.entries) == [(1, 2, 0, 0), (7, 8, 0, 0)]


CFG = SamplerConfig(
    max_new_tokens=10,
    prompt_buckets=(16, 32, 48, 64),
    batch_buckets=(4, 8, 16),
    pad_id=0,
    eos_ids=(7,),
    return_embedding=True,
    min_shared_prefix=8,
    min_prefix_saving=0.0,
)


def _steps(n_steps=4):
    """Prompts of several calls: 3 episodes whose step prompts repeat a head of 22-30 tokens (the
    third one ends after step 1), their later parts new each step, and a row that shares nothing."""
    rng = np.random.default_rng(0)

    def tok(n):
        return [int(x) for x in rng.integers(1, VOCAB, size=n)]

    heads = [tok(30), tok(22), tok(26)]
    calls = []
    for t in range(n_steps):
        running = heads if t < 2 else heads[:2]
        calls.append([h + tok(4 + 3 * t + i) for i, h in enumerate(running)] + [tok(12 + t)])
    return calls


def test_assign_never_gives_two_new_heads_one_row():
    """More new heads than rows: the longest get a row each and the rest none (two heads written to
    one row would leave the bookkeeping naming keys and values that the row does not hold)."""
    cache = PrefixCache(rows=2, width=8, min_prefix=2)
    prompts = [[1] * 9, [2] * 6, [3] * 4, [4] * 7]  # heads of 8, 5, 3 and 6 tokens
    stores = cache.assign(prompts, [(None, 0)] * 4)
    assert sorted((i, h) for i, _, h in stores) == [(0, 8), (3, 6)]
    assert sorted(row for _, row, _ in stores) == [0, 1]
    assert sorted((e.row, e.tokens[0]) for e in cache.entries) == sorted((row, prompts[i][0]) for i, row, _ in stores)
    # next call: one head hit, two new ones; the hit's row goes to the longer new head only
    nxt = [[1] * 3 + [9] * 6, [5] * 9, [6] * 5]
    hits = [cache.match(p) for p in nxt]
    assert hits[0][1] == 3 and hits[1] == (None, 0)
    stores = cache.assign(nxt, hits)
    assert sorted((i, h) for i, _, h in stores) == [(0, 8), (1, 8)]
    assert len({row for _, row, _ in stores}) == 2 and len(cache) == 2


def _compare(cached_sampler, plain_sampler, params_per_call, calls, temperature):
    for i, (params, prompts) in enumerate(zip(params_per_call, calls)):
        sp = SamplingParams(temperature=temperature)
        ref = plain_sampler.generate(params, prompts, sp, jax.random.key(i))
        out = cached_sampler.generate(params, prompts, sp, jax.random.key(i))
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.lengths, ref.lengths)
        np.testing.assert_array_equal(out.finish_reason, ref.finish_reason)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=3e-5)
        np.testing.assert_allclose(out.embedding, ref.embedding, atol=3e-5)


@pytest.mark.parametrize(
    "scan_layers,temperature,shared", [(False, 0.0, False), (False, 1.0, True), (True, 1.0, False)]
)
def test_cached_prefill_samples_what_the_uncached_one_does(scan_layers, temperature, shared):
    graphdef, params = _model(scan_layers)
    calls = _steps()
    plain = Sampler(graphdef, dataclasses.replace(CFG, shared_prefix=shared))
    cached = Sampler(graphdef, dataclasses.replace(CFG, shared_prefix=shared, prefix_cache_tokens=24))
    _compare(cached, plain, [params] * len(calls), calls, temperature)
    stats = cached.cache_stats
    # calls 1-3 find the episodes' heads (3 + 2 + 2 rows); the unrelated row never hits
    assert stats["hit_rows"] == 7 and cached.traces["prefill_cached"] >= 1
    assert stats["reused_tokens"] >= 7 * 22
    assert cached.prefill_tokens < plain.prefill_tokens
    # the third episode ended after call 1: its entries are gone; the others' latest heads remain
    assert len(cached.prefix_cache) <= 2 * 3


def test_new_params_clear_the_cache():
    """Keys and values cached with other weights would give other samples: the sampler notices the
    new arrays and starts again (the reference: the uncached sampler on the new params)."""
    graphdef, params = _model()
    _, other = _model(seed=4)
    calls = _steps(3)
    plain = Sampler(graphdef, CFG)
    cached = Sampler(graphdef, dataclasses.replace(CFG, prefix_cache_tokens=24))
    _compare(cached, plain, [params, other, other], calls, 1.0)
    # call 1 (new params) hits nothing; call 2 finds the heads call 1 stored
    assert cached.cache_stats["hit_rows"] == 2


def test_cached_prefill_on_eight_devices():
    assert jax.device_count() == 8
    graphdef, params = _model()
    mesh = sharding.make_mesh((2, 2, 2))
    s8 = Sampler(graphdef, dataclasses.replace(CFG, prefix_cache_tokens=24), mesh=mesh)
    calls = _steps(3)
    _compare(s8, Sampler(graphdef, CFG), [s8.shard_params(params)] * 3, calls, 1.0)
    assert s8.cache_stats["hit_rows"] == 5 and s8.prefix_cache.rows % 8 == 0


def test_a_pool_too_small_for_one_row_is_refused_with_the_arithmetic():
    graphdef, params = _model()
    s = Sampler(graphdef, dataclasses.replace(CFG, prefix_cache_tokens=24, prefix_cache_bytes=1000))
    # one row: k and v x 2 layers x 2 kv heads x 24 slots x 8 dims x 4 bytes = 6144 bytes
    with pytest.raises(ValueError, match="6144 bytes"):
        s.generate(params, _steps(1)[0], SamplingParams(), jax.random.key(0))


# ------------------------------------------------------------------- a rollout, end to end

TEXTS = [
    "go to countertop 1",
    "take apple 1 from countertop 1",
    "You open the fridge 1.",
    "Your task is to: put a clean mug in the coffeemachine.",
    "Nothing happens.",
    "<action>look</action>",
    "<strategy>search the countertops first</strategy>",
    "<bad_steps>none</bad_steps>",
] * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny"),
        "qwen2",
        TEXTS,
        vocab_size=384,
        hidden_size=32,
        layers=2,
        heads=2,
        kv_heads=1,
        intermediate_size=64,
    )
    (graphdef, params), _ = load_hf_model(path, split=True)
    return graphdef, params, load_tokenizer(path)


def _rollout(tiny, cache_tokens):
    graphdef, params, tokenizer = tiny
    policy = JaxPolicy(
        graphdef,
        params,
        tokenizer,
        {"strategy": 12, "action": 10, "judge": 8},
        prompt_buckets=(256, 512, 1024),
        batch_buckets=(8, 16),
        temperature=1.0,
        seed=3,
        prefix_cache_tokens=cache_tokens,
    )
    cfg = RolloutConfig(
        mode="strata",
        num_strategies=2,
        traj_per_strategy=2,
        oversample=1,
        diverse=False,
        max_steps=5,
        revise_every=2,
        judge_samples=2,
        judge_train=True,
        progress=False,
        history_length=1,
        row_multiple=8,
    )
    envs = [HouseholdEnv(max_steps=5, horizon=(2, 3)) for _ in range(8)]
    res = collect(envs, policy, [11, 12], cfg.validate())
    return res, policy


def test_a_rollout_with_revisions_and_judgments_is_the_same_with_the_cache(tiny):
    plain, _ = _rollout(tiny, 0)
    cached, policy = _rollout(tiny, 256)
    stats = policy.samplers["action"].cache_stats
    assert stats["hit_rows"] > 0 and stats["reused_tokens"] > 50 * stats["hit_rows"]
    a, b = plain.tokens, cached.tokens
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.loss_mask), np.asarray(b.loss_mask))
    np.testing.assert_allclose(np.asarray(a.old_logp), np.asarray(b.old_logp), atol=3e-5)
    t = np.asarray(b.row_index)[:, 3][np.asarray(b.row_valid)]
    # action steps, strategies, revisions and judgments all in the batch
    assert all(np.any(kind) for kind in row_kinds(t, 5))
