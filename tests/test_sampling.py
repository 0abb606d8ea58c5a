"""Sampler and score: token selection statistics, stop handling, HF parity, sharding, compile count."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.sampling import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    SamplerConfig,
    argmax_last,
    draw,
    draw_chunk,
    draw_with_uniforms,
    pick_bucket,
    power_of_two_buckets,
    sample_tokens,
    stop_sequence_hit,
)

# ------------------------------------------------------------------------------ pure pieces


def test_buckets():
    assert power_of_two_buckets(16, 100) == (16, 32, 64, 100)
    assert power_of_two_buckets(1, 8) == (1, 2, 4, 8)
    assert pick_bucket(17, (16, 32), "prompt length") == 32
    assert pick_bucket(16, (16, 32), "prompt length") == 16
    with pytest.raises(ValueError, match="prompt length 33 exceeds the largest bucket 32"):
        pick_bucket(33, (16, 32), "prompt length")
    cfg = SamplerConfig(max_prompt_len=64, max_batch=6)
    assert cfg.prompt_bucket_list() == (16, 32, 64)
    assert cfg.batch_bucket_list() == (1, 2, 4, 6)
    assert cfg.batch_bucket_list(4) == (4, 8)  # rounded up to the data-parallel size
    with pytest.raises(ValueError, match="prompt_buckets"):
        SamplerConfig(prompt_buckets=(32, 16))


def _chi2_crit(dof: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 is the 1e-4 tail."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _reference_probs(logits, temperature, top_k, top_p):
    """Independent numpy version of temperature -> top-k -> top-p (transformers' order)."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    k = len(z) if top_k == 0 else top_k
    keep[order[:k]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    cum = np.cumsum(p[order])
    n_keep = int(np.searchsorted(cum, top_p) + 1)  # smallest prefix with mass >= top_p
    keep_p = np.zeros_like(keep)
    keep_p[order[:n_keep]] = True
    p = np.where(keep_p, p, 0.0)
    return p / p.sum()


_sample_jit = jax.jit(sample_tokens)


def _draw(logits, n, temperature, top_k, top_p, seed=0):
    b = np.broadcast_to(np.asarray(logits, np.float32), (n, len(logits)))
    toks = _sample_jit(
        jnp.asarray(b),
        jax.random.key(seed),
        jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
    )
    return np.bincount(np.asarray(toks), minlength=len(logits))


LOGITS = np.array([1.2, -0.3, 0.5, 2.0, -1.0, 0.1, 0.9], np.float32)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.75), (0.8, 4, 0.8)]
)
def test_sample_frequencies_match_truncated_softmax(temperature, top_k, top_p):
    n = 40_000
    counts = _draw(LOGITS, n, temperature, top_k, top_p)
    p = _reference_probs(LOGITS, temperature, top_k, top_p)
    assert np.all(counts[p == 0] == 0), (counts, p)  # truncated tokens are never drawn
    kept = p > 0
    chi2 = float((((counts - n * p) ** 2)[kept] / (n * p[kept])).sum())
    dof = int(kept.sum()) - 1
    if dof > 0:
        assert chi2 < _chi2_crit(dof), (chi2, counts, n * p)
    # Power check: the same counts clearly reject the untruncated, untempered softmax.
    q = np.exp(LOGITS - LOGITS.max()) / np.exp(LOGITS - LOGITS.max()).sum()
    if not np.allclose(p, q, atol=1e-3):
        chi2_wrong = float(((counts - n * q) ** 2 / (n * q)).sum())
        assert chi2_wrong > _chi2_crit(len(q) - 1)


def test_top_k_and_top_p_support():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 50)).astype(np.float32) * 2
    top_k = rng.integers(0, 6, size=64).astype(np.int32)
    top_p = rng.uniform(0.2, 1.0, size=64).astype(np.float32)
    for seed in range(5):
        toks = np.asarray(
            _sample_jit(jnp.asarray(logits), jax.random.key(seed), jnp.ones(64), jnp.asarray(top_k), jnp.asarray(top_p))
        )
        for b in range(64):
            assert _reference_probs(logits[b], 1.0, top_k[b], top_p[b])[toks[b]] > 0


def test_greedy_rows_and_mixed_rows():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(8, 30)), jnp.float32)
    temp = jnp.asarray([0.0, 1.0] * 4, jnp.float32)
    toks = np.asarray(_sample_jit(logits, jax.random.key(3), temp, jnp.full((8,), 2, jnp.int32), jnp.ones(8)))
    np.testing.assert_array_equal(toks[::2], np.argmax(np.asarray(logits), -1)[::2])
    top2 = np.argsort(-np.asarray(logits), -1)[:, :2]
    assert all(toks[b] in top2[b] for b in range(1, 8, 2))


def test_same_key_same_tokens():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(16, 100)), jnp.float32)
    args = (jnp.ones(16), jnp.zeros(16, jnp.int32), jnp.full((16,), 0.9))
    a = _sample_jit(logits, jax.random.key(5), *args)
    b = _sample_jit(logits, jax.random.key(5), *args)
    c = _sample_jit(logits, jax.random.key(6), *args)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_argmax_last_equals_jnp_argmax():
    """The two-reduction argmax: the first maximum on ties, and -inf rows, as jnp.argmax."""
    x = np.random.default_rng(3).normal(size=(64, 300)).astype(np.float32)
    x[1, [5, 9]] = 10.0  # a tie: the first index wins
    x[2] = -np.inf
    x[3, :7] = -np.inf
    np.testing.assert_array_equal(np.asarray(argmax_last(jnp.asarray(x))), np.argmax(x, -1))


def test_draw_inverts_the_cdf_by_hand():
    """Two levels by hand: V = 10 -> chunks of 4 (draw_chunk), [4, 4, 2 + 2 padding]."""
    assert [draw_chunk(v) for v in (1, 2, 10, 16, 17, 151_936)] == [1, 2, 4, 4, 8, 512]
    p = np.array([0.1, 0.0, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3])  # chunk sums 0.4, 0.0, 0.6
    logits = jnp.asarray(np.log(np.where(p > 0, p, 1e-45))[None].repeat(6, 0), jnp.float32)
    logits = logits.at[:, [1, 4, 5, 6, 7]].set(-jnp.inf)
    # u[0] picks the chunk by its share of the mass, u[1] the token by its share of the chunk's.
    u = jnp.asarray([[0.2, 0.39, 0.41, 0.99, 1.0, 0.3], [0.2, 1.0, 0.5, 0.5, 1.0, 0.75]], jnp.float32)
    # row 0: chunk 0 (0.2 <= 0.4), 0.2 of [0.1, 0, 0.2, 0.1] -> cum [.1 .1 .3 .4] >= .08 -> token 0
    # row 1: chunk 0 (0.39), u 1.0 -> the chunk's last positive token, 3
    # row 2: chunk 2 (0.41 > 0.4; chunk 1 has no mass), 0.5 of [0.3, 0.3] -> token 8
    # row 3: chunk 2, token 8; row 4: u = 1 twice -> the last token, 9
    # row 5: chunk 0, 0.75 of 0.4 = 0.3 -> cum [.1 .1 .3 .4] first >= .3 -> token 2
    np.testing.assert_array_equal(np.asarray(draw_with_uniforms(logits, u)), [0, 3, 8, 8, 9, 2])


@pytest.mark.parametrize("v", [7, 300, 5000])
def test_draw_frequencies_match_softmax(v):
    """draw against numpy's softmax over one or many chunks, -inf entries never drawn."""
    rng = np.random.default_rng(v)
    logits = rng.normal(size=v).astype(np.float32) * 1.5
    logits[rng.choice(v, size=v // 3, replace=False)] = -np.inf
    logits[np.argsort(-logits)[:6]] += 4.0  # a few likely tokens: the chi-square gets counts to test
    n = 40_000
    toks = np.asarray(jax.jit(draw)(jax.random.key(1), jnp.broadcast_to(jnp.asarray(logits), (n, v))))
    counts = np.bincount(toks, minlength=v)
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    assert np.all(counts[p == 0] == 0)
    # Chi-square over the tokens expected at least 5 times, the rest pooled into one cell.
    big = n * p >= 5
    obs = np.append(counts[big], counts[~big & (p > 0)].sum())
    exp = np.append(n * p[big], n * p[~big & (p > 0)].sum())
    chi2 = float(((obs - exp) ** 2 / np.maximum(exp, 1e-12)).sum())
    assert chi2 < _chi2_crit(len(obs) - 1), (chi2, len(obs))


def test_stop_sequence_hit():
    w = 4
    stops = np.full((3, w), -1, np.int32)
    stops[0, 2:] = [7, 8]  # right-aligned [7, 8]
    stops[1, 3:] = [9]
    lens = np.array([2, 1, 0], np.int32)  # third row is padding
    window = np.array(
        [
            [-1, -1, 7, 8],  # ends with [7, 8]
            [1, 7, 8, 2],  # contains it, but not at the end
            [-1, -1, -1, 9],  # ends with [9]
            [-1, -1, -1, 8],  # only the tail of [7, 8]: the 7 was in the prompt
            [-1, -1, -1, -1],
        ],
        np.int32,
    )
    hit = np.asarray(stop_sequence_hit(jnp.asarray(window), jnp.asarray(stops), jnp.asarray(lens)))
    np.testing.assert_array_equal(hit, [True, False, True, False, False])


# ------------------------------------------------------------------------ with the decoder

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from flax import nnx  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from strata_jax import sharding  # noqa: E402
from strata_jax.models.hf import load_hf_model  # noqa: E402
from strata_jax.sampling import Sampler, SamplingParams, score  # noqa: E402

N_NEW = 12
PROMPT_LENS = (5, 9, 3)


def _tiny_hf(path, vocab=97, seed=0, logit_scale=None):
    """Random tiny Qwen2 (2 layers, 4 heads, 2 kv heads), perturbed so the logits are not flat."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            rope_theta=1e6,
            tie_word_embeddings=False,
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        if logit_scale:
            model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * logit_scale)
    model.save_pretrained(path)
    (graphdef, params), _ = load_hf_model(path, split=True)
    return model, graphdef, params


def _left_pad_np(prompts):
    t = max(map(len, prompts))
    ids = np.zeros((len(prompts), t), np.int64)
    mask = np.zeros((len(prompts), t), np.int64)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :], mask[i, t - len(p) :] = p, 1
    return ids, mask


def _hf_greedy(model, prompts, eos=None):
    ids, mask = _left_pad_np(prompts)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=N_NEW,
            pad_token_id=0,
            eos_token_id=eos,
        )
    gen = out[:, ids.shape[1] :].numpy()
    return np.pad(gen, ((0, 0), (0, N_NEW - gen.shape[1])))  # HF stops early when all rows hit EOS


def _expected_end(gen, eos, stops):
    """(length, finish_reason) of a row by scanning for the first EOS / stop-sequence end."""
    for j, tok in enumerate(gen):
        if tok in eos:
            return j + 1, FINISH_EOS
        if any(j + 1 >= len(s) and list(gen[j + 1 - len(s) : j + 1]) == list(s) for s in stops):
            return j + 1, FINISH_STOP
    return len(gen), FINISH_LENGTH


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model, prompts, HF greedy references, and one sampler whose EOS id is taken from them."""
    path = tmp_path_factory.mktemp("tiny") / "m"
    hf, graphdef, params = _tiny_hf(path)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(1, 97, size=n)] for n in PROMPT_LENS]
    free = _hf_greedy(hf, prompts)
    eos = int(free[1, 3])  # a token row 1 emits early: row 1 ends on EOS, the others (checked) do not
    cfg = SamplerConfig(
        max_new_tokens=N_NEW,
        prompt_buckets=(16, 32),
        batch_buckets=(4,),
        eos_ids=(eos,),
        pad_id=0,
        return_embedding=True,
        max_stop_sequences=3,
        max_stop_len=4,
    )
    return dict(
        hf=hf,
        path=path,
        graphdef=graphdef,
        params=params,
        prompts=prompts,
        free=free,
        eos=eos,
        ref=_hf_greedy(hf, prompts, eos=eos),
        sampler=Sampler(graphdef, cfg),
    )


def test_greedy_matches_transformers_left_padded(tiny):
    out = tiny["sampler"].generate(tiny["params"], tiny["prompts"], SamplingParams(temperature=0.0), jax.random.key(0))
    ref = tiny["ref"]  # HF pads rows after EOS with pad_token_id = 0, as we do
    np.testing.assert_array_equal(out.tokens, ref)
    ends = [_expected_end(r, [tiny["eos"]], []) for r in ref]
    np.testing.assert_array_equal(out.lengths, [e[0] for e in ends])
    np.testing.assert_array_equal(out.finish_reason, [e[1] for e in ends])
    assert FINISH_EOS in out.finish_reason and FINISH_LENGTH in out.finish_reason  # both paths exercised
    assert np.all(out.logprobs[out.tokens == 0] == 0) and np.all(out.logprobs[:, 0] < 0)
    # The decode loop's fused kernels (the default) against the model's own: the same tokens.
    plain = Sampler(tiny["graphdef"], dataclasses.replace(tiny["sampler"].config, fuse_decode=False))
    unfused = plain.generate(tiny["params"], tiny["prompts"], SamplingParams(temperature=0.0), jax.random.key(0))
    np.testing.assert_array_equal(unfused.tokens, ref)
    np.testing.assert_allclose(unfused.logprobs, out.logprobs, atol=1e-5)


def test_stop_sequences_end_exactly_after_the_sequence(tiny):
    free = tiny["free"]
    stops = [[int(free[0, 6]), int(free[0, 7])], [int(free[2, 2]), int(free[2, 3]), int(free[2, 4])]]
    out = tiny["sampler"].generate(
        tiny["params"], tiny["prompts"], SamplingParams(temperature=0.0), jax.random.key(0), stop_sequences=stops
    )
    for b in range(len(tiny["prompts"])):
        n, reason = _expected_end(tiny["ref"][b], [tiny["eos"]], stops)
        assert (out.lengths[b], out.finish_reason[b]) == (n, reason), (b, out.tokens[b], stops)
        np.testing.assert_array_equal(out.tokens[b, :n], tiny["ref"][b, :n])
        assert np.all(out.tokens[b, n:] == 0) and np.all(out.logprobs[b, n:] == 0)
    assert FINISH_STOP in out.finish_reason


def _full_rows(prompts, out):
    """Left-padded prompt + generated tokens (right-padded) as one [B, Tp + N] row per prompt."""
    tp = max(map(len, prompts))
    toks = np.zeros((len(prompts), tp + N_NEW), np.int32)
    mask = np.zeros_like(toks, bool)
    for b, p in enumerate(prompts):
        toks[b, tp - len(p) : tp], mask[b, tp - len(p) : tp] = p, True
        n = out.lengths[b]
        toks[b, tp : tp + n], mask[b, tp : tp + n] = out.tokens[b, :n], True
    return toks, mask, tp


def test_sampled_logprobs_equal_score_and_rng_reproducible(tiny):
    s, params, prompts = tiny["sampler"], tiny["params"], tiny["prompts"]
    sp = SamplingParams(temperature=[1.0, 0.8, 1.3], top_k=[0, 5, 0], top_p=[1.0, 1.0, 0.9])
    out = s.generate(params, prompts, sp, jax.random.key(7))
    again = s.generate(params, prompts, sp, jax.random.key(7))
    other = s.generate(params, prompts, sp, jax.random.key(8))
    np.testing.assert_array_equal(out.tokens, again.tokens)
    np.testing.assert_array_equal(out.logprobs, again.logprobs)
    assert not np.array_equal(out.tokens, other.tokens)
    toks, mask, tp = _full_rows(prompts, out)
    ref = score(tiny["graphdef"], params, toks, mask)
    gen = np.arange(N_NEW)[None, :] < out.lengths[:, None]
    np.testing.assert_allclose(out.logprobs[gen], ref[:, tp:][gen], atol=1e-5)
    # The mean final hidden state over the generated tokens, from one full forward without a cache.
    model = nnx.merge(tiny["graphdef"], params)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    hidden = np.asarray(model(jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask))[0])[:, tp:]
    emb = (hidden * gen[..., None]).sum(1) / out.lengths[:, None]
    np.testing.assert_allclose(out.embedding, emb, atol=1e-5)


def test_score_is_exact_teacher_forced_log_softmax(tiny):
    rng = np.random.default_rng(1)
    toks = rng.integers(1, 97, size=(3, 11)).astype(np.int32)
    mask = np.ones_like(toks, bool)
    mask[1, :4] = False  # left padding
    mask[2, 8:] = False  # right padding
    logp = score(tiny["graphdef"], tiny["params"], np.where(mask, toks, 0), mask, chunk_size=16)
    with torch.no_grad():
        pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
        logits = tiny["hf"](
            input_ids=torch.tensor(np.where(mask, toks, 0), dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(pos, dtype=torch.long),
        ).logits.double()
    ref = torch.log_softmax(logits, -1).numpy()[:, :-1]
    ref = np.take_along_axis(ref, toks[:, 1:, None].astype(np.int64), -1)[..., 0]
    has_ctx = mask[:, 1:] & mask[:, :-1]
    np.testing.assert_allclose(logp[:, 1:][has_ctx], ref[has_ctx], atol=1e-5)
    assert np.all(logp[:, 0] == 0) and np.all(logp[:, 1:][~has_ctx] == 0)
    assert logp.shape == (3, 11) and logp.dtype == np.float32


def test_eight_devices_same_greedy_tokens(tiny):
    assert jax.device_count() == 8
    mesh = sharding.make_mesh((2, 2, 2))
    cfg = dataclasses.replace(tiny["sampler"].config, return_embedding=False)
    s8 = Sampler(tiny["graphdef"], cfg, mesh=mesh)
    params = s8.shard_params(tiny["params"])
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
    out = s8.generate(params, tiny["prompts"], SamplingParams(temperature=0.0), jax.random.key(0))
    np.testing.assert_array_equal(out.tokens, tiny["ref"])
    one = tiny["sampler"].generate(tiny["params"], tiny["prompts"], SamplingParams(temperature=0.0), jax.random.key(0))
    np.testing.assert_allclose(out.logprobs, one.logprobs, atol=1e-5)
    toks, mask, _ = _full_rows(tiny["prompts"], out)  # the sharded, bucketed Sampler.score as well
    np.testing.assert_allclose(
        s8.score(params, toks, mask), score(tiny["graphdef"], tiny["params"], toks, mask), atol=1e-5
    )


def test_scan_layers_same_as_unrolled(tiny):
    """scan_layers: a stacked [L, B, K, S, Dh] cache, and a prefill whose last layer runs outside the
    scan (last_only). Same greedy tokens as transformers, same draws and log-probs as unrolled."""
    (graphdef, params), _ = load_hf_model(tiny["path"], split=True, scan_layers=True)
    s = Sampler(graphdef, tiny["sampler"].config)
    greedy = s.generate(params, tiny["prompts"], SamplingParams(temperature=0.0), jax.random.key(0))
    np.testing.assert_array_equal(greedy.tokens, tiny["ref"])
    sp = SamplingParams(temperature=1.0)
    out = s.generate(params, tiny["prompts"], sp, jax.random.key(3))
    ref = tiny["sampler"].generate(tiny["params"], tiny["prompts"], sp, jax.random.key(3))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    np.testing.assert_allclose(out.embedding, ref.embedding, atol=1e-5)


def test_bf16_cache_close_to_f32(tiny):
    cfg = dataclasses.replace(tiny["sampler"].config, cache_dtype="bfloat16", return_embedding=False)
    out = Sampler(tiny["graphdef"], cfg).generate(
        tiny["params"], tiny["prompts"], SamplingParams(temperature=0.0), jax.random.key(0)
    )
    toks, mask, tp = _full_rows(tiny["prompts"], out)
    ref = score(tiny["graphdef"], tiny["params"], toks, mask)[:, tp:]
    gen = np.arange(N_NEW)[None, :] < out.lengths[:, None]
    diff = np.abs(out.logprobs - ref)[gen]
    assert diff.max() < 5e-2 and diff.max() > 0  # bf16 keys/values: close, but not bit-equal


def test_bad_inputs_raise_clear_errors(tiny):
    s, params = tiny["sampler"], tiny["params"]
    greedy = SamplingParams(temperature=0.0)
    key = jax.random.key(0)
    cases = [
        (lambda: s.generate(params, [[1] * 33], greedy, key), "prompt length 33 exceeds the largest bucket 32"),
        (lambda: s.generate(params, [[1]] * 5, greedy, key), "batch size 5 exceeds the largest bucket 4"),
        (lambda: s.generate(params, [[1], []], greedy, key), r"prompts\[1\] is empty"),
        (lambda: s.generate(params, [[1]], SamplingParams(temperature=-1.0), key), "temperature"),
        (lambda: s.generate(params, [[1]], SamplingParams(top_p=0.0), key), "top_p"),
        (lambda: s.generate(params, [[1], [2]], SamplingParams(top_k=[1, 2, 3]), key), "top_k: expected a scalar or 2"),
        (lambda: s.generate(params, [[1]], greedy, key, stop_sequences=[[1]] * 4), "max_stop_sequences is 3"),
        (
            lambda: s.generate(params, [[1]], greedy, key, stop_sequences=[[1] * 5]),
            "stop_sequences\\[0\\] has length 5",
        ),
        (lambda: score(tiny["graphdef"], params, np.zeros((2, 3), np.int32), np.ones((2, 4), bool)), "must both be"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_compiles_bounded_by_buckets(tiny):
    """20 calls with varying batch sizes, prompt lengths, sampling settings and stop sequences on the
    shared sampler (other tests used it too): at most one prefill + one decode per bucket pair."""
    s = tiny["sampler"]
    n_pairs = len(s.prompt_buckets) * len(s.batch_buckets)
    assert n_pairs == 2
    rng = np.random.default_rng(3)
    seen = set()
    for i in range(20):
        b = int(rng.integers(1, 5))
        lens = rng.integers(1, 33, size=b)
        prompts = [[int(x) for x in rng.integers(1, 97, size=n)] for n in lens]
        sp = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.0])),
            top_k=int(rng.integers(0, 10)),
            top_p=float(rng.uniform(0.5, 1.0)),
        )
        stops = [
            [int(x) for x in rng.integers(1, 97, size=int(rng.integers(1, 5)))] for _ in range(int(rng.integers(0, 4)))
        ]
        s.generate(tiny["params"], prompts, sp, jax.random.key(i), stop_sequences=stops)
        seen.add(pick_bucket(int(lens.max()), s.prompt_buckets, "t"))
    assert seen == {16, 32}  # the calls did span every bucket
    assert s.traces["prefill"] == n_pairs and s.traces["decode"] == n_pairs, s.traces


def test_generate_frequencies_match_softmax(tmp_path):
    """First tokens of many rows from a tiny-vocabulary model vs transformers' softmax(logits / T),
    with per-row settings: 4 groups (plain, temperature, top-k, top-p) in one call."""
    hf, graphdef, params = _tiny_hf(tmp_path / "v8", vocab=8, seed=1, logit_scale=0.4)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt])).logits[0, -1].double().numpy()
    groups = [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 3, 1.0), (1.2, 0, 0.7)]
    per = 1024
    sp = SamplingParams(
        temperature=np.repeat([g[0] for g in groups], per),
        top_k=np.repeat([g[1] for g in groups], per),
        top_p=np.repeat([g[2] for g in groups], per),
    )
    s = Sampler(graphdef, SamplerConfig(max_new_tokens=1, prompt_buckets=(8,), batch_buckets=(per * len(groups),)))
    out = s.generate(params, [prompt] * (per * len(groups)), sp, jax.random.key(0))
    assert np.all(out.finish_reason == FINISH_LENGTH) and np.all(out.lengths == 1)
    assert np.ptp(logits) > 1.0  # the distribution is far from uniform: the test has power
    for g, (t, k, p) in enumerate(groups):
        counts = np.bincount(out.tokens[g * per : (g + 1) * per, 0], minlength=8)
        probs = _reference_probs(logits, t, k, p)
        assert np.all(counts[probs == 0] == 0), (g, counts, probs)
        kept = probs > 0
        chi2 = float((((counts - per * probs) ** 2)[kept] / (per * probs[kept])).sum())
        assert chi2 < _chi2_crit(int(kept.sum()) - 1), (g, chi2, counts, per * probs)
