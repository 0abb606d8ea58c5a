"""strata_jax/cost.py: the counted model work of the sampler, the scoring and the update, and the
roofline model over it. The FLOP formulas are checked against XLA's own count of a compiled
forward and against the published non-embedding parameter counts of the Qwen2.5 models; the
counts against the shapes the calls ran and the decode loop's stopping rule; the seconds by hand."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from strata_jax import cost
from strata_jax.batch import TokenBatch
from strata_jax.models.config import ModelConfig
from strata_jax.models.qwen2 import positions_from_mask
from strata_jax.models.tiny import init_params
from strata_jax.packing import pack_shared
from strata_jax.prefix import plan_prefixes
from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams

VOCAB = 61


def _model_config(d=32, f=48, layers=2, heads=4, kv=2, vocab=VOCAB):
    return ModelConfig.from_hf(
        dict(
            model_type="qwen2",
            vocab_size=vocab,
            hidden_size=d,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=f,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            initializer_range=0.4,
            tie_word_embeddings=False,
            rope_theta=1e4,
            max_position_embeddings=512,
        )
    )


@pytest.mark.parametrize(
    "name,non_embedding", [("qwen2.5-7b", 6.53e9), ("qwen2.5-1.5b", 1.31e9), ("qwen2.5-0.5b", 0.36e9)]
)
def test_layer_flops_are_twice_the_published_non_embedding_parameters(name, non_embedding):
    """Qwen2.5's model cards: 6.53B, 1.31B and 0.36B non-embedding parameters (matrices, plus biases
    and norms that are under 0.1%)."""
    assert cost.layer_flops(cost.MODELS[name]) / 2 == pytest.approx(non_embedding, rel=0.01)


def test_flops_match_xla_cost_analysis_of_a_forward():
    """tokens x layer + pairs x pair + head positions x head FLOPs against XLA's count of the
    compiled forward (einsum attention, every query against every key; the head on every
    position). A wide model keeps the norms, rope and softmax, which the formulas leave out,
    under a few percent."""
    m = _model_config(d=256, f=1024, layers=2, heads=8, kv=2, vocab=512)
    graphdef, params = init_params(m, seed=0)
    b, t = 2, 512  # long enough that attention is a quarter of the FLOPs: a factor 2 off there shows

    def forward(params, tokens, mask):
        model = nnx.merge(graphdef, params)
        hidden, _ = model(tokens, positions_from_mask(mask), mask)
        return hidden @ model.unembed_kernel()

    tokens, mask = np.ones((b, t), np.int32), np.ones((b, t), bool)
    analysis = jax.jit(forward).lower(params, tokens, mask).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    w = cost.Work()
    w.add(**cost.dense(b, t, t))
    ours = w.tokens * cost.layer_flops(m) + w.pairs * cost.pair_flops(m) + w.head_tokens * cost.head_flops(m)
    assert ours == pytest.approx(analysis["flops"], rel=0.03)  # 1.4% under: the elementwise ops


def _token_batch(rows):
    tokens, mask = np.array(rows, np.int32), np.ones((len(rows), len(rows[0])), bool)
    z = np.zeros(tokens.shape, np.float32)
    loss = np.zeros_like(mask)
    loss[:, -2:] = True  # the response: the last two tokens
    return TokenBatch(
        tokens=tokens,
        attention_mask=mask,
        loss_mask=loss,
        old_logp=z,
        ref_logp=z,
        advantage=z,
        row_index=np.zeros((len(rows), 4), np.int32),
        row_valid=np.ones((len(rows),), bool),
    )


def test_batch_work_by_hand():
    """Four rows that share a 12-token prefix: dense, then the prefix once and the suffixes
    against it."""
    shared = list(range(5, 17))
    tb = _token_batch([shared + [20 + i, 30 + i, 40 + i, 50 + i] for i in range(4)])
    assert cost.batch_work(tb, window=3) == {"tokens": 4 * 16, "pairs": 4 * 16 * 16, "head_tokens": 4 * 3}
    packed = pack_shared(tb, 1, 1, (4, 8, 12, 16), min_prefix=4, min_saving=0.0)
    assert packed is not None
    sb = packed[0]
    (upre, tpre), (s, ls) = sb.prefix_tokens.shape, sb.rows.tokens.shape
    got = cost.batch_work(sb, window=3)
    assert got["tokens"] == sb.model_tokens == upre * tpre + s * ls
    assert got["pairs"] == upre * tpre**2 + s * ls * (tpre + ls)
    assert got["head_tokens"] == s * min(3, ls)
    assert got["tokens"] < 4 * 16  # the prefix ran once


CFG = SamplerConfig(
    max_new_tokens=10,
    prompt_buckets=(16, 32, 48, 64),
    batch_buckets=(4, 8, 16),
    pad_id=0,
    eos_ids=(7,),
    prefix_buckets=(16, 24, 32, 40),
    min_shared_prefix=8,
    min_prefix_saving=0.0,
)


def _prompts():
    rng = np.random.default_rng(0)

    def tok(n):
        return [int(x) for x in rng.integers(1, VOCAB, size=n)]

    prefix = tok(30)
    return [prefix + tok(n) for n in (4, 9, 13, 2, 6, 11, 3)] + [tok(19)]


@pytest.mark.parametrize("shared,embedding", [(False, False), (False, True), (True, False)])
def test_sampler_counts_its_prefill_and_decode_steps(shared, embedding):
    """The prefill's token slots are the sampler's own prefill counter (rows x bucket, or the
    shared plan's cost); the decode loop runs until the longest row is done: max(length) - 1 steps
    after the prefill's first token, one more when the last token's hidden state is needed for the
    embedding. Each step reads the whole cache (prompt bucket + budget)."""
    graphdef, params = init_params(_model_config(), seed=3)
    sampler = Sampler(graphdef, dataclasses.replace(CFG, shared_prefix=shared, return_embedding=embedding))
    prompts = _prompts()
    calls = []
    for key, temperature in ((1, 1.0), (2, 1.0), (3, 0.0)):
        out = sampler.generate(params, prompts, SamplingParams(temperature=temperature), jax.random.key(key))
        calls.append(int(out.lengths.max()) - (0 if embedding else 1))
    w = sampler.work
    assert w.tokens == sampler.prefill_tokens
    n = np.array(list(map(len, prompts)))
    assert (w.real_tokens, w.real_pairs) == (3 * n.sum(), 3 * (n * n).sum())  # the prompts alone
    assert sampler.shared_calls == (3 if shared else 0)
    assert w.head_tokens == 3 * 8  # the batch bucket's 8 rows, the last position each
    assert [steps for _, steps, _ in w.decode] == [s for s in calls if s > 0]
    tp = 48  # the prompt bucket of the longest prompt (43 tokens)
    if shared:
        plan = plan_prefixes(prompts, tp, 8, CFG.prefix_bucket_list(), sampler.batch_buckets, 8, 0.0)
        tpre, ts, ub = plan.prefix_bucket, plan.suffix_bucket, plan.unique_bucket
        assert w.pairs == 3 * (ub * tpre * tpre + 8 * ts * (tpre + ts))
        tp = tpre + ts
    else:
        assert w.pairs == 3 * 8 * tp * tp
    assert all((r, cache) == (8, tp + 10) for r, _, cache in w.decode)


def test_since_takes_a_span():
    w = cost.Work()
    w.add(tokens=5, pairs=7, head_tokens=1, **cost.real([2, 3]))
    w.add_decode(4, 3, 20)
    before = w.snapshot()
    w.add(tokens=2, **cost.real([4]))
    w.add_decode(8, 2, 30)
    w.add_decode(8, 0, 30)  # no step ran: nothing to count
    d = w.since(before)
    assert (d.tokens, d.pairs, d.head_tokens, d.real_tokens, d.real_pairs, d.decode) == (2, 0, 0, 4, 16, [(8, 2, 30)])
    assert (before.real_tokens, before.real_pairs) == (5, 13) and len(before.decode) == 1  # a copy
    assert (w + d).decode_steps == 3 + 2 + 2 and (w + d).real_tokens == 9 + 4


def test_seconds_by_hand():
    m = _model_config()
    hw = cost.Hardware(
        "test", peak_flops=1e12, hbm_bytes_per_s=1e11, devices=2, mfu=0.5, hbm_share=0.5, bytes_per_param=2
    )
    lf, pf, hf = cost.layer_flops(m), cost.pair_flops(m), cost.head_flops(m)
    # layer_flops by hand: 2 layers x 2 x (32 x (32 + 2 x 16) + 32 x 32 + 3 x 32 x 48)
    assert lf == 2 * 2 * (32 * 64 + 32 * 32 + 3 * 32 * 48) and pf == 4 * 2 * 32 and hf == 2 * 32 * VOCAB
    w = cost.Work()
    w.add(tokens=100, pairs=1000, head_tokens=10)
    compute = (100 * lf + 1000 * pf + 10 * hf) / (2 * 1e12 * 0.5)
    assert cost.seconds(w, m, hw) == pytest.approx(compute)
    assert cost.seconds(w, m, hw, train=True) == pytest.approx(3 * compute)
    w.add(**cost.real([6, 8]))  # two rows alone: 14 tokens, 100 pairs
    assert cost.seconds(w, m, hw, real=True) == pytest.approx((14 * lf + 100 * pf + 10 * hf) / (2 * 1e12 * 0.5))
    # One decode call of 3 rows (2 per device), 5 steps over a 40-slot cache: memory-bound here.
    w2 = cost.Work()
    w2.add_decode(3, 5, 40)
    weights = (lf / 2 + 32 * VOCAB) * 2
    kv_slot = 2 * 2 * 2 * 8 * 2  # k and v, 2 layers, 2 kv heads, head_dim 8, 2 bytes
    read = (weights + 2 * 40 * kv_slot) / (1e11 * 0.5)
    flops = 2 * (lf + hf + 40 * pf) / (1e12 * 0.5)
    assert read > flops
    assert cost.seconds(w2, m, hw) == pytest.approx(5 * read)
    # With a far slower chip the same steps are compute-bound.
    slow = dataclasses.replace(hw, peak_flops=1e6)
    assert cost.seconds(w2, m, slow) == pytest.approx(5 * 2 * (lf + hf + 40 * pf) / (1e6 * 0.5))
    # k times the tasks: the passes' work times k; a decode of 4 x 3 = 12 rows (6 per device) reads
    # the weights once a step as before, plus six rows' caches, so it costs far less than 4x.
    w3 = (w + w2).times(4)
    assert (w3.tokens, w3.pairs, w3.head_tokens, w3.real_tokens, w3.real_pairs) == (400, 4000, 40, 56, 400)
    assert w3.decode == [(12, 5, 40)]
    read4 = (weights + 6 * 40 * kv_slot) / (1e11 * 0.5)
    assert cost.seconds(w3, m, hw) == pytest.approx(4 * compute + 5 * read4)
    assert cost.seconds(w3, m, hw) < 4 * cost.seconds(w + w2, m, hw)
