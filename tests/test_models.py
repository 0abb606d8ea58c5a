"""Decoder parity against transformers' PyTorch Qwen2 / Llama on tiny random configs.

The reference is transformers' own model (torch, CPU, 1 thread) run on the same left-padded batch
with the same position ids; logits are compared on valid (non-padding) positions only.
"""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from strata_jax import sharding  # noqa: E402
from strata_jax.models.config import ConfigError, ModelConfig, UnsupportedArchitectureError  # noqa: E402
from strata_jax.models.hf import load_hf_model  # noqa: E402
from strata_jax.models.qwen2 import Decoder, param_logical_axes, prepare_decode, rope_inv_freq  # noqa: E402

VOCAB = 97
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    tie_word_embeddings=False,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 5e5,
}

# name -> (arch, overrides): tied/untied, GQA ratio 1/2/3/4, odd hidden size, theta 1e4/1e6, llama3.
CONFIGS = {
    "qwen2_tied_gqa2_theta1e6": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2_untied_gqa1_theta1e4": ("qwen2", dict(num_key_value_heads=4, rope_theta=1e4)),
    "qwen2_gqa4": ("qwen2", dict(hidden_size=48, num_attention_heads=8, num_key_value_heads=2)),
    # hidden 45 (odd); head_dim 8 set explicitly, since 45 / 3 heads = 15 is odd and rope needs even.
    "llama_odd_hidden_gqa3": (
        "llama",
        dict(hidden_size=45, num_attention_heads=3, num_key_value_heads=1, head_dim=8, rope_theta=1e4),
    ),
    "llama3_rope_scaling": ("llama", dict(tie_word_embeddings=True, rope_scaling=dict(LLAMA3_ROPE))),
}


def _build(root, name):
    arch, kw = CONFIGS[name]
    torch.manual_seed(0)
    conf = {**BASE, **kw}
    model = (Qwen2ForCausalLM(Qwen2Config(**conf)) if arch == "qwen2" else LlamaForCausalLM(LlamaConfig(**conf))).eval()
    # HF init leaves norms at 1 and biases at 0; perturb everything so a mis-mapped tensor shows.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(root / name)
    return root / name, model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    return {name: _build(root, name) for name in CONFIGS}


def _batch(seed=0, b=3, t=20):
    """Left-padded batch: row r has 3*r padding tokens; positions restart at each row's start."""
    rng = np.random.default_rng(seed)
    mask = np.ones((b, t), bool)
    for r in range(b):
        mask[r, : 3 * r] = False
    tokens = np.where(mask, rng.integers(1, VOCAB, size=(b, t)), 0).astype(np.int32)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    return tokens, pos, mask


def _ref_logits(model, tokens, pos, mask):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()


@nnx.jit
def _forward(model, tokens, pos, mask):
    hidden, cache = model(tokens, pos, mask)
    return model.logits(hidden), hidden.dtype == jnp.bfloat16, cache is None


def _logits(model, tokens, pos, mask):
    logits, _, no_cache = _forward(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    assert no_cache
    return np.asarray(logits)


# ----------------------------------------------------------------------------------------------
# Parity


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_logits_match_transformers(hf_models, name):
    path, ref = hf_models[name]
    model, cfg = load_hf_model(path)
    tokens, pos, mask = _batch()
    ours, theirs = _logits(model, tokens, pos, mask), _ref_logits(ref, tokens, pos, mask)
    assert np.abs(theirs).max() > 0.1  # the reference is not degenerate
    diff = np.abs(ours - theirs)[mask]
    assert diff.max() <= 1e-4, f"{name}: max |diff| {diff.max()}"


def test_llama3_scaling_is_active(hf_models):
    """The llama3 case must differ from plain rope, else its parity test proves nothing."""
    path, _ = hf_models["llama3_rope_scaling"]
    _, cfg = load_hf_model(path)
    plain = ModelConfig(**{**cfg.__dict__, "rope_type": "default", "rope_scaling": ()})
    assert cfg.rope_type == "llama3" and cfg.rope_theta == 5e5
    assert not np.allclose(rope_inv_freq(cfg), rope_inv_freq(plain))


# bf16 params + bf16 compute vs the fp32 reference: bf16 has an 8-bit mantissa (rel. step 2^-8),
# and the error grows through 2 layers; we allow 4% of the reference logits' max magnitude.
BF16_REL_BOUND = 0.04


@pytest.mark.parametrize("name", ["qwen2_tied_gqa2_theta1e6", "llama3_rope_scaling"])
def test_bf16_logits_within_bound(hf_models, name):
    path, ref = hf_models[name]
    model, _ = load_hf_model(path, dtype="bfloat16", param_dtype="bfloat16")
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    tokens, pos, mask = _batch()
    logits, is_bf16, _ = _forward(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    assert is_bf16  # hidden states in the compute dtype
    theirs = _ref_logits(ref, tokens, pos, mask)
    diff = np.abs(np.asarray(logits) - theirs)[mask]
    assert diff.max() <= BF16_REL_BOUND * np.abs(theirs).max(), (diff.max(), np.abs(theirs).max())


# ----------------------------------------------------------------------------------------------
# KV cache


def _decode_logits(model, tokens, pos, mask, prefill_len, chunk, capacity, head=None):
    """Prefill `prefill_len` tokens into a cache, then feed the rest `chunk` tokens at a time.
    head(model, hidden) -> logits; default model.logits (f32)."""
    b, t = tokens.shape
    cache = model.init_cache(b, capacity)
    cache_mask = np.zeros((b, capacity), bool)
    out = []
    starts = [0] + list(range(prefill_len, t, chunk))
    ends = starts[1:] + [t]
    step = nnx.jit(lambda m, *a: m(*a))
    for s, e in zip(starts, ends):
        cache_mask[:, s:e] = mask[:, s:e]
        hidden, cache = step(
            model, jnp.asarray(tokens[:, s:e]), jnp.asarray(pos[:, s:e]), jnp.asarray(cache_mask), cache, jnp.int32(s)
        )
        out.append(np.asarray(model.logits(hidden) if head is None else head(model, hidden)))
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize(
    "name,scan,chunk",
    [("qwen2_tied_gqa2_theta1e6", False, 1), ("llama3_rope_scaling", True, 1), ("qwen2_gqa4", False, 3)],
)
def test_cached_decode_equals_full_forward(hf_models, name, scan, chunk):
    path, _ = hf_models[name]
    model, cfg = load_hf_model(path, scan_layers=scan)
    tokens, pos, mask = _batch(seed=1)
    full = _logits(model, tokens, pos, mask)
    dec, cache = _decode_logits(model, tokens, pos, mask, prefill_len=11, chunk=chunk, capacity=24)
    assert cache.shape == (cfg.num_layers, 3, cfg.num_kv_heads, 24, cfg.head_dim)  # [L, B, K, S, Dh]
    assert isinstance(cache.k, tuple) != scan  # one buffer per layer unless scan_layers stacks them
    assert np.abs(dec - full)[mask].max() <= 1e-4
    # Slots past the last written one stay untouched (zero).
    assert not np.asarray(cache.stacked()[0][:, :, :, 20:]).any()


@pytest.mark.parametrize(
    "name,scan",
    [
        ("qwen2_tied_gqa2_theta1e6", False),
        ("qwen2_gqa4", True),
        ("llama_odd_hidden_gqa3", False),
        ("llama3_rope_scaling", True),
    ],
)
def test_prepared_decode_matches_transformers(hf_models, name, scan):
    """prepare_decode's fused q/k/v (GQA 1-4, with and without biases) and gate/up kernels, unrolled
    and stacked: a token-by-token decode gives transformers' logits, as the plain model does."""
    path, ref = hf_models[name]
    tokens, pos, mask = _batch(seed=2)
    theirs = _ref_logits(ref, tokens, pos, mask)
    for fuse in (False, True):
        model, cfg = load_hf_model(path, scan_layers=scan)
        prepare_decode(model, fuse=fuse)
        attn = (model.layers if scan else model.layers[0]).self_attn
        assert (getattr(attn, "qkv", None) is not None) == fuse
        if fuse:  # [(L,) D, K, G + 2, Dh]
            g = cfg.num_heads // cfg.num_kv_heads
            assert attn.qkv[...].shape[-4:] == (cfg.hidden_size, cfg.num_kv_heads, g + 2, cfg.head_dim)
        dec, _ = _decode_logits(model, tokens, pos, mask, prefill_len=9, chunk=1, capacity=24)
        assert np.abs(dec - theirs)[mask].max() <= 1e-4, (fuse, np.abs(dec - theirs)[mask].max())


def test_prepared_decode_casts_master_weights_once(hf_models):
    """f32 master weights, bf16 compute: prepare_decode leaves every Param in bf16 and the decode's
    logits as they were (every use casts to the compute dtype first; the head as the sampler's,
    the bf16 kernel accumulated in f32)."""
    path, _ = hf_models["qwen2_untied_gqa1_theta1e4"]
    tokens, pos, mask = _batch(seed=3)
    plain, _ = load_hf_model(path, dtype="bfloat16", param_dtype="float32")

    def head(model, hidden):
        return jnp.einsum(
            "btd,dv->btv", hidden, model.unembed_kernel().astype(hidden.dtype), preferred_element_type=jnp.float32
        )

    want, _ = _decode_logits(plain, tokens, pos, mask, prefill_len=9, chunk=1, capacity=24, head=head)
    for fuse in (False, True):
        model, _ = load_hf_model(path, dtype="bfloat16", param_dtype="float32")
        prepare_decode(model, fuse=fuse)
        dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
        assert dtypes == {jnp.dtype(jnp.bfloat16)}, dtypes
        got, _ = _decode_logits(model, tokens, pos, mask, prefill_len=9, chunk=1, capacity=24, head=head)
        if not fuse:
            np.testing.assert_array_equal(got[mask], want[mask])
        else:  # the fused matmuls may sum in another order: bf16 rounding apart, no more
            assert np.abs(got - want)[mask].max() <= BF16_REL_BOUND * np.abs(want).max()


@pytest.mark.parametrize("scan", [False, True])
def test_cached_step_updates_the_cache_in_place(scan):
    """Compiled one-token step with a donated cache: the new rows go in by dynamic-update-slice and
    no instruction copies a whole cache buffer (a layer that read its slice of the old cache after
    the write used to cost two full-cache copies per layer per step), nor, with one buffer per
    layer, a layer's K / V (a slice of a stacked buffer or a transposed read cost one copy each).
    Structural check of the HLO only; speed is measured in bench/sampler.py."""
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen2"}, scan_layers=scan)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    b, s = 4, 32
    cache = jax.eval_shape(lambda: model.init_cache(b, s))
    step = jax.jit(lambda p, c, tok, pos, mask, i: nnx.merge(graphdef, p)(tok, pos, mask, c, i)[1], donate_argnums=(1,))
    tok = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    hlo = (
        step.lower(
            params, cache, tok, tok, jax.ShapeDtypeStruct((b, s), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32)
        )
        .compile()
        .as_text()
    )
    layer = (b, cfg.num_kv_heads, s, cfg.head_dim)  # [B, K, S, Dh]
    shape = re.escape("f32[" + ",".join(map(str, (cfg.num_layers,) * scan + layer)) + "]")
    producers = re.findall(r"= " + shape + r"\{[\d,]*\} (\S+)\(", hlo)
    assert any("dynamic-update-slice" in line for line in re.findall(r".*= " + shape + r".*", hlo)), producers
    assert "copy" not in producers, f"full-cache copies in the compiled step: {producers}"
    if not scan:  # one buffer per layer: the attention dots read it as is; its only writes are the DUS
        fusions = re.findall(r"%(\S+) = " + shape + r"\{[\d,]*\} fusion\(", hlo)
        assert fusions and all("dynamic-update-slice" in f for f in fusions), fusions


# ----------------------------------------------------------------------------------------------
# Scan, remat


def test_scan_layers_equals_unrolled(hf_models):
    path, _ = hf_models["qwen2_untied_gqa1_theta1e4"]
    unrolled, _ = load_hf_model(path)
    scanned, _ = load_hf_model(path, scan_layers=True)
    assert scanned.layers.self_attn.q_proj.kernel[...].shape[0] == 2  # stacked [L, ...]
    tokens, pos, mask = _batch()
    a, b = _logits(unrolled, tokens, pos, mask), _logits(scanned, tokens, pos, mask)
    assert np.abs(a - b)[mask].max() <= 1e-5


def _grads(model, tokens, pos, mask):
    graphdef, params = nnx.split(model)
    w = jax.random.normal(jax.random.key(0), (*tokens.shape, VOCAB)) * mask[..., None]

    def loss(p):
        m = nnx.merge(graphdef, p)
        hidden, _ = m(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
        return (m.logits(hidden) * w).sum()

    jaxpr = str(jax.make_jaxpr(loss)(params))  # tracing only: cheap
    return jax.jit(jax.grad(loss))(params), jaxpr


def _has_remat(jaxpr: str) -> bool:
    return "remat" in jaxpr or "checkpoint" in jaxpr


def test_remat_gives_same_gradients(hf_models):
    """Scanned layers (the training setting); the unrolled path uses the same checkpoint wrapper."""
    path, _ = hf_models["llama_odd_hidden_gqa3"]
    plain, _ = load_hf_model(path, scan_layers=True)
    remat, _ = load_hf_model(path, scan_layers=True, remat=True)
    tokens, pos, mask = _batch()
    g1, jaxpr1 = _grads(plain, tokens, pos, mask)
    g2, jaxpr2 = _grads(remat, tokens, pos, mask)
    assert not _has_remat(jaxpr1) and _has_remat(jaxpr2)  # the option is really applied
    leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
    assert len(leaves1) == len(leaves2) > 0
    for a, b in zip(leaves1, leaves2):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(a).max())
    assert max(np.abs(np.asarray(x)).max() for x in leaves1) > 0


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize(
    "name,scan,impl",
    [
        ("qwen2_gqa4", False, "xla"),
        ("llama_odd_hidden_gqa3", True, "xla"),
        pytest.param(
            "qwen2_tied_gqa2_theta1e6", False, "cudnn", marks=pytest.mark.skipif(not ON_GPU, reason="cuDNN: GPU only")
        ),
    ],
)
def test_fused_attention_option_matches_einsum(hf_models, name, scan, impl, monkeypatch):
    """model.attention="xla" (jax.nn.dot_product_attention's reference path) gives the einsum
    path's logits and gradients, and the sampler (fused prefill, einsum decode steps) the same
    greedy tokens and log-probs; the transformers parity above pins the einsum path. "cudnn" (GPU,
    bf16 only) is compared the same way in bf16, at bf16 tolerances. Padding queries (a
    left-padded row's first slots) attend to nothing and are no one's output, so only valid
    positions are compared."""
    from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams

    dtype = "bfloat16" if impl == "cudnn" else "float32"
    tol = 3e-2 if impl == "cudnn" else 1e-5
    path, _ = hf_models[name]
    ref, _ = load_hf_model(path, scan_layers=scan, dtype=dtype)
    fused, cfg = load_hf_model(path, scan_layers=scan, dtype=dtype, attention=impl)
    assert cfg.attention == impl
    tokens, pos, mask = _batch(seed=2)
    a, b = _logits(ref, tokens, pos, mask), _logits(fused, tokens, pos, mask)
    assert np.isfinite(b).all()
    assert np.abs(a - b)[mask].max() <= tol * max(1.0, np.abs(a).max())
    calls = []  # the option is really applied: the fused function is traced, and only with it
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    g1, _ = _grads(ref, tokens, pos, mask)
    assert calls == []
    g2, _ = _grads(fused, tokens, pos, mask)
    assert calls and all(kw["implementation"] == impl for kw in calls)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.isfinite(y).all()
        assert np.abs(x - y).max() <= (0.1 if impl == "cudnn" else tol) * max(1.0, np.abs(x).max())
    # Three queries at a time on a cache (the fused path with a cache, as a shared prefix's
    # suffixes run) against the einsum model's full forward.
    before = len(calls)
    dec, _ = _decode_logits(fused, tokens, pos, mask, prefill_len=11, chunk=3, capacity=24)
    assert len(calls) > before  # traced with the cache too
    assert np.abs(dec - a)[mask].max() <= (10 * tol if impl == "cudnn" else 1e-4) * max(1.0, np.abs(a).max())
    prompts = [list(map(int, row[m])) for row, m in zip(tokens, mask)]
    outs = []
    for model in (ref, fused):
        graphdef, params = nnx.split(model)
        sampler = Sampler(graphdef, SamplerConfig(max_new_tokens=6, prompt_buckets=(32,), batch_buckets=(4,)))
        outs.append(sampler.generate(params, prompts, SamplingParams(temperature=0.0), 0))
    if impl == "cudnn":  # bf16 near-ties may pick another token: compare the first one's log-prob
        np.testing.assert_allclose(outs[0].logprobs[:, 0], outs[1].logprobs[:, 0], atol=0.1)
    else:
        np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
        np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-5)


def test_unknown_attention_is_named():
    with pytest.raises(ConfigError, match="attention 'flash'"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2"}, attention="flash")
    with pytest.raises(ConfigError, match="'cudnn' needs a bfloat16 or float16"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2"}, attention="cudnn")


def test_remat_applied_unrolled(hf_models):
    path, _ = hf_models["llama_odd_hidden_gqa3"]
    tokens, pos, mask = (jnp.asarray(x) for x in _batch())
    for remat in (False, True):
        model, _ = load_hf_model(path, remat=remat)
        graphdef, params = nnx.split(model)
        jaxpr = str(jax.make_jaxpr(lambda p, graphdef=graphdef: nnx.merge(graphdef, p)(tokens, pos, mask)[0])(params))
        assert _has_remat(jaxpr) == remat


# ----------------------------------------------------------------------------------------------
# Sharding and logical axes

RULES = {
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "head_dim": None,
    "layers": None,
}


@pytest.mark.parametrize("scan", [False, True])
def test_sharded_equals_single_device(hf_models, scan):
    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    path, _ = hf_models["qwen2_gqa4"]  # heads 8, kv heads 2, hidden 48, mlp 48, vocab 97
    single, _ = load_hf_model(path, scan_layers=scan)
    (graphdef, params), _ = load_hf_model(path, mesh=mesh, rules=RULES, scan_layers=scan, split=True)
    layer = params["layers"] if scan else params["layers"][0]
    q = layer["self_attn"]["q_proj"]["kernel"]
    want = PartitionSpec(None, "fsdp", "tensor", None) if scan else PartitionSpec("fsdp", "tensor", None)
    assert q[...].sharding.spec == want

    tokens, pos, mask = _batch()

    @jax.jit
    def fwd(p, tokens, pos, mask):
        m = nnx.merge(graphdef, p)
        return m.logits(m(tokens, pos, mask)[0])

    sharded = np.asarray(fwd(params, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask)))
    assert np.abs(sharded - _logits(single, tokens, pos, mask))[mask].max() <= 1e-5


def test_prepared_decode_sharded_equals_single_device(hf_models):
    """The fused kernels on an (fsdp 2, tensor 4) mesh where tensor splits the 8 query heads but not
    the 2 kv heads (replicated): a token-by-token decode's logits as on one device."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    path, _ = hf_models["qwen2_gqa4"]
    tokens, pos, mask = _batch(seed=4)
    single, _ = load_hf_model(path)
    want, _ = _decode_logits(single, tokens, pos, mask, prefill_len=15, chunk=1, capacity=24)
    sharded, _ = load_hf_model(path, mesh=mesh, rules=RULES)
    prepare_decode(sharded)
    assert not sharded.layers[0].self_attn.qkv[...].sharding.is_fully_replicated
    got, _ = _decode_logits(sharded, tokens, pos, mask, prefill_len=15, chunk=1, capacity=24)
    assert np.abs(got - want)[mask].max() <= 1e-5


def _count_constraints(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("sharding_constraint")


@pytest.mark.parametrize(
    "mesh_shape,scan", [((1, 1, 1), False), ((2, 4, 1), False), ((2, 4, 1), True), ((2, 2, 2), False)]
)
def test_mesh_context_constraints(hf_models, mesh_shape, scan):
    """Under jax.set_mesh the decoder gathers the embedding / output kernel over their hidden dim and
    pins the embedded activations to the batch split (see qwen2._constrain_batch); without a mesh
    context nothing is added. Logits and gradients equal the single-device model either way."""
    n = int(np.prod(mesh_shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices (tests/conftest.py simulates 8 CPU devices)")
    mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:n])
    path, _ = hf_models["qwen2_gqa4"]  # untied: embedding and lm_head both constrained
    single, _ = load_hf_model(path, scan_layers=scan)
    (graphdef, params), _ = load_hf_model(path, mesh=mesh, scan_layers=scan, split=True)
    tokens, pos, mask = _batch(b=8, t=24)  # 8 rows: batch divides data x fsdp
    w = jax.random.normal(jax.random.key(0), (*tokens.shape, VOCAB)) * mask[..., None]

    def loss(p, tokens, pos, mask):
        m = nnx.merge(graphdef, p)
        logits = m.logits(m(tokens, pos, mask)[0])
        return (logits * w).sum(), logits

    args = [jax.device_put(x, sharding.data_sharding(mesh)) for x in (tokens, pos, mask)]
    assert _count_constraints(lambda p: loss(p, *args)[0], params) == 0  # no mesh context: no-op
    with jax.set_mesh(mesh):
        # embedding table + output kernel, and the activations when the batch is really split
        want = 2 + (mesh.shape["data"] * mesh.shape["fsdp"] > 1)
        assert _count_constraints(lambda p: loss(p, *args)[0], params) == want
        grads, logits = jax.jit(jax.grad(loss, has_aux=True))(params, *args)

    ref_grads, ref_logits = jax.jit(jax.grad(_plain_loss, has_aux=True), static_argnums=(0,))(
        nnx.graphdef(single), nnx.state(single, nnx.Param), jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask), w
    )
    assert np.abs(np.asarray(logits) - np.asarray(ref_logits))[mask].max() <= 1e-5
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(a).max())


def _plain_loss(graphdef, p, tokens, pos, mask, w):
    m = nnx.merge(graphdef, p)
    logits = m.logits(m(tokens, pos, mask)[0])
    return (logits * w).sum(), logits


ALLOWED_AXES = {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", None}


@pytest.mark.parametrize("scan", [False, True])
def test_every_param_has_logical_axes(scan):
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen2"}, scan_layers=scan)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # abstract: no init compute
    params = nnx.state(model, nnx.Param)
    axes = param_logical_axes(model)
    is_t = lambda x: isinstance(x, tuple)  # noqa: E731
    flat_p = jax.tree.leaves(params)
    flat_a = jax.tree.leaves(axes, is_leaf=is_t)
    assert len(flat_p) == len(flat_a) == len(jax.tree.leaves(nnx.state(model)))  # only Params
    for p, a in zip(flat_p, flat_a):
        assert len(a) == p.ndim and set(a) <= ALLOWED_AXES
    layer = axes["layers"] if scan else axes["layers"][0]
    q_axes = layer["self_attn"]["q_proj"]["kernel"]
    assert q_axes == (("layers",) if scan else ()) + ("embed", "heads", "head_dim")
    assert axes["lm_head"] == ("embed", "vocab") and axes["embed_tokens"]["embedding"] == ("vocab", "embed")


# ----------------------------------------------------------------------------------------------
# Config and input errors


def test_config_reads_transformers4_layout():
    """rope_theta / rope_scaling at the top level (transformers 4) == rope_parameters (5)."""
    v5 = {**BASE, "model_type": "llama", "rope_parameters": dict(LLAMA3_ROPE)}
    v4 = {
        **BASE,
        "model_type": "llama",
        "rope_theta": 5e5,
        "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
    }
    assert ModelConfig.from_hf(v5) == ModelConfig.from_hf(v4)
    assert ModelConfig.from_hf(v5).rope_type == "llama3"


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*qwen2.*llama"):
        ModelConfig.from_hf({**BASE, "model_type": "gpt2"})
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        ModelConfig.from_hf({**BASE, "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(UnsupportedArchitectureError, match="sliding_window"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True})


def test_bad_config_values_are_named():
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf({k: v for k, v in {**BASE, "model_type": "qwen2"}.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2", "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        ModelConfig.from_hf(
            {
                **BASE,
                "model_type": "llama",
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
            }
        )


def test_bad_inputs_raise():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen2"})
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # inputs are checked before any compute
    tokens = jnp.ones((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="positions"):
        model(tokens, jnp.ones((2, 4), jnp.int32), jnp.ones((2, 5), bool))
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens, tokens, jnp.ones((2, 6), bool))
    cache = jax.eval_shape(lambda: model.init_cache(2, 8))
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens, tokens, jnp.ones((2, 5), bool), cache, 0)
    with pytest.raises(ValueError, match="cache_index"):
        model(tokens, tokens, jnp.ones((2, 8), bool), cache, None)
