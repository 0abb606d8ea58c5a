"""HF checkpoints in and out, tokenizers, and the tiny model maker, checked against transformers."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from strata_jax.models import hf  # noqa: E402
from strata_jax.models.tiny import CHATML_TEMPLATE, make_tiny_model  # noqa: E402

SMALL = dict(vocab_size=384, hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate_size=64)
TEXTS = [
    "go to countertop 1",
    "take apple 1 from countertop 1",
    "You open the fridge 1.",
    "Your task is to: put a clean mug in the coffeemachine.",
    "Nothing happens.",
] * 4
SAMPLES = [
    "go to countertop 1",
    "two  spaces\nand a newline\n\n",
    "unicode: ü, 中文, emoji 🙂",
    "take apple 1 from countertop 1<|im_end|>",
]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", TEXTS, tie=True, rope_theta=1e6, **SMALL),
        "llama": make_tiny_model(
            root / "llama",
            "llama",
            TEXTS,
            tie=False,
            rope_theta=1e4,
            seed=1,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            **SMALL,
        ),
    }


def _batch(vocab, b=2, t=12):
    rng = np.random.default_rng(0)
    mask = np.ones((b, t), bool)
    mask[1, :4] = False
    tokens = np.where(mask, rng.integers(1, vocab, size=(b, t)), 0).astype(np.int32)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    return tokens, pos, mask


def _our_logits(model, tokens, pos, mask):
    hidden, _ = model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    return np.asarray(model.logits(hidden))


def _torch_logits(path, tokens, pos, mask):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(pos, dtype=torch.long),
        ).logits.numpy()


def _flat_params(model_or_params):
    params = model_or_params if not isinstance(model_or_params, nnx.Module) else nnx.state(model_or_params, nnx.Param)
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


# ----------------------------------------------------------------------------------------------
# Tokenizers


def test_bpe_tokenizer_round_trips(tiny):
    from tokenizers import Tokenizer

    tok = hf.load_tokenizer(tiny["qwen2"])
    assert type(tok).__name__.startswith("Qwen2Tokenizer")
    raw = Tokenizer.from_file(str(tiny["qwen2"] / "tokenizer.json"))
    for s in SAMPLES + ["  leading spaces"]:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
        assert ids == raw.encode(s, add_special_tokens=False).ids  # the file's own pipeline agrees
    assert len(tok.encode("go to countertop 1", add_special_tokens=False)) < len("go to countertop 1")  # merges learnt
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    config = json.loads((tiny["qwen2"] / "config.json").read_text())
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert config["pad_token_id"] == tok.pad_token_id != tok.eos_token_id


def test_chat_template_renders_chatml(tiny):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go to x"}]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ngo to x<|im_end|>\n<|im_start|>assistant\n"
    for arch in ("qwen2", "llama"):
        tok = hf.load_tokenizer(tiny[arch])
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tok.decode(ids) == want


def test_sentencepiece_tokenizer_matches_sentencepiece(tiny):
    import sentencepiece as spm

    path = tiny["llama"]
    assert not (path / "tokenizer.json").exists()  # loading goes through the sentencepiece conversion
    tok = hf.load_tokenizer(path)
    assert type(tok).__name__.startswith("LlamaTokenizer")
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    # Not text that starts with a space: transformers' Metaspace(prepend_scheme="first") and
    # sentencepiece's dummy prefix disagree there (a known legacy difference, not ours).
    for s in SAMPLES[:3]:
        ids = tok.encode(s, add_special_tokens=False)
        assert ids == sp.encode(s)
        assert tok.decode(ids) == s
    assert len(tok.encode("<|im_start|>", add_special_tokens=False)) == 1


def test_default_tiny_model_size(tmp_path):
    path = make_tiny_model(tmp_path / "default")  # the embedded CPU default
    model, cfg = hf.load_hf_model(path)
    n = sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert 1e6 <= n <= 5e6, n
    assert cfg.arch == "qwen2" and cfg.tie_word_embeddings


# ----------------------------------------------------------------------------------------------
# The tiny model maker's weights (made in JAX) against transformers


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_loads_in_transformers_with_equal_logits(tiny, arch):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny[arch]))
    assert type(config).__name__ == {"qwen2": "Qwen2Config", "llama": "LlamaConfig"}[arch]
    model, info = AutoModelForCausalLM.from_pretrained(str(tiny[arch]), dtype=torch.float32, output_loading_info=True)
    # Nothing left to transformers' random init: every tensor came from the file.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    if arch == "llama":
        assert model.config.rope_parameters["rope_type"] == "llama3"
        assert model.config.rope_parameters["rope_theta"] == 1e4
    ours, cfg = hf.load_hf_model(tiny[arch])
    tokens, pos, mask = _batch(cfg.vocab_size)
    theirs = _torch_logits(tiny[arch], tokens, pos, mask)
    assert np.abs(_our_logits(ours, tokens, pos, mask) - theirs)[mask].max() <= 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_init_follows_transformers_scheme(tmp_path, arch):
    """Tensor by tensor, our init has the statistics of transformers' own init of the same config."""
    from transformers import AutoConfig

    kw = dict(SMALL, hidden_size=64, intermediate_size=128)
    extra = {"attention_bias": True} if arch == "llama" else {}  # biases on every projection
    path = make_tiny_model(tmp_path / arch, arch, TEXTS, tie=False, **kw, **extra)
    ours = hf.read_safetensors(path / "model.safetensors")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path))).state_dict()
    ref = {k: v.numpy() for k, v in ref.items() if not k.endswith("rotary_emb.inv_freq")}
    assert set(ours) == set(ref)
    std = json.loads((path / "config.json").read_text())["initializer_range"]
    assert std == 0.02
    pad = json.loads((path / "config.json").read_text())["pad_token_id"]
    kernels = 0
    for name, theirs in ref.items():
        mine = np.asarray(ours[name], np.float32)
        assert mine.shape == theirs.shape, name
        if name.endswith("norm.weight"):
            assert np.all(mine == 1) and np.all(theirs == 1), name
        elif name.endswith(".bias"):
            assert np.all(mine == 0) and np.all(theirs == 0), name
        else:  # Linear weights and the embedding: normal(0, initializer_range)
            if name == "model.embed_tokens.weight":  # nn.Embedding(padding_idx=pad_token_id) zeroes that row
                assert np.all(mine[pad] == 0) and np.all(theirs[pad] == 0)
                mine, theirs = np.delete(mine, pad, 0), np.delete(theirs, pad, 0)
            n = mine.size
            assert abs(mine.std() - std) < 5 * std / np.sqrt(2 * n), (name, mine.std())
            assert abs(theirs.std() - std) < 5 * std / np.sqrt(2 * n), (name, theirs.std())
            assert abs(mine.mean()) < 5 * std / np.sqrt(n), (name, mine.mean())
            kernels += 1
    assert kernels == 2 + 7 * kw["layers"]  # embedding, lm_head, q/k/v/o/gate/up/down per layer
    # Deterministic from the seed; another seed gives other weights.
    again = hf.read_safetensors(
        make_tiny_model(tmp_path / "again", arch, TEXTS, tie=False, **kw, **extra) / "model.safetensors"
    )
    other = hf.read_safetensors(
        make_tiny_model(tmp_path / "other", arch, TEXTS, tie=False, seed=7, **kw, **extra) / "model.safetensors"
    )
    assert all(np.array_equal(ours[k], again[k]) for k in ours)
    assert not np.array_equal(ours["lm_head.weight"], other["lm_head.weight"])


def test_tiny_model_refuses_overrides_the_decoder_ignores(tmp_path):
    from strata_jax.models.tiny import TinyModelError

    with pytest.raises(TinyModelError, match="sliding_window_size"):
        make_tiny_model(tmp_path / "m", "qwen2", TEXTS, sliding_window_size=4, **SMALL)


# ----------------------------------------------------------------------------------------------
# Export round trip


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_export_round_trip(tiny, tmp_path, arch):
    model, cfg = hf.load_hf_model(tiny[arch])
    tok = hf.load_tokenizer(tiny[arch])
    # Make the params differ from the checkpoint so the export is not a copy of the input.
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x + 0.01, params))
    out = hf.export_hf(model, cfg, tok, tmp_path / "export")

    tokens, pos, mask = _batch(cfg.vocab_size)
    theirs = _torch_logits(out, tokens, pos, mask)
    assert np.abs(_our_logits(model, tokens, pos, mask) - theirs)[mask].max() <= 1e-4

    again, cfg2 = hf.load_hf_model(out)
    assert cfg2 == cfg
    a, b = _flat_params(model), _flat_params(again)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    tok2 = hf.load_tokenizer(out)
    assert tok2.encode(SAMPLES[2], add_special_tokens=False) == tok.encode(SAMPLES[2], add_special_tokens=False)
    assert tok2.chat_template == CHATML_TEMPLATE


def test_export_bf16_sharded_index(tiny, tmp_path):
    (graphdef, params), cfg = hf.load_hf_model(tiny["llama"], param_dtype="bfloat16", scan_layers=True, split=True)
    out = hf.export_hf((graphdef, params), cfg, None, tmp_path / "export", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # Back into our loader (unrolled this time): identical bf16 values.
    again, _ = hf.load_hf_model(out, param_dtype="bfloat16")
    ref, _ = hf.load_hf_model(tiny["llama"], param_dtype="bfloat16")
    a, b = _flat_params(ref), _flat_params(again)
    assert all(v.dtype == ml_dtypes.bfloat16 for v in b.values())
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # transformers reads the sharded bf16 checkpoint to the same tensors.
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).state_dict()
    ours = hf.hf_tensors((graphdef, params), cfg)
    for name, arr in ours.items():
        assert np.array_equal(theirs[name].float().numpy(), arr.astype(np.float32)), name


def test_safetensors_io_matches_the_safetensors_package(tmp_path):
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, -2], np.int64)}
    hf.write_safetensors(tmp_path / "ours.safetensors", arrays)
    theirs = load_file(str(tmp_path / "ours.safetensors"))
    assert all(np.array_equal(theirs[k], arrays[k]) for k in arrays)
    t = torch.randn(5, 3).to(torch.bfloat16)
    save_file({"w": t}, str(tmp_path / "torch.safetensors"))
    ours = hf.read_safetensors(tmp_path / "torch.safetensors")["w"]
    assert ours.dtype == ml_dtypes.bfloat16
    assert np.array_equal(ours.astype(np.float32), t.float().numpy())


# ----------------------------------------------------------------------------------------------
# Loading into a sharding


def test_load_with_shardings_callable(tiny):
    from strata_jax.sharding import param_shardings

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    rules = {
        "embed": "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
        "head_dim": None,
        "layers": None,
    }
    seen = []

    def shardings(abstract):
        seen.append(abstract)
        return param_shardings(abstract, mesh, rules)

    (graphdef, params), cfg = hf.load_hf_model(tiny["qwen2"], shardings=shardings, split=True)
    assert len(seen) == 1 and isinstance(jax.tree.leaves(seen[0])[0], jax.ShapeDtypeStruct)  # abstract
    mlp = params["layers"][1]["mlp"]["gate_proj"]["kernel"][...]
    assert mlp.sharding == NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    assert mlp.addressable_shards[0].data.shape == (16, 16)  # [32, 64] over 2 x 4
    single, _ = hf.load_hf_model(tiny["qwen2"])
    tokens, pos, mask = _batch(cfg.vocab_size)
    sharded = _our_logits(nnx.merge(graphdef, params), tokens, pos, mask)
    assert np.abs(sharded - _our_logits(single, tokens, pos, mask))[mask].max() <= 1e-5


# ----------------------------------------------------------------------------------------------
# Errors


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, fn):
    tensors = {k: np.array(v) for k, v in hf.read_safetensors(path / "model.safetensors").items()}
    fn(tensors)
    hf.write_safetensors(path / "model.safetensors", tensors)


def test_missing_tensor_is_named(tiny, tmp_path):
    path = _copy(tiny["qwen2"], tmp_path / "m")
    _edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(hf.CheckpointMismatchError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        hf.load_hf_model(path)


def test_extra_tensor_is_named(tiny, tmp_path):
    path = _copy(tiny["qwen2"], tmp_path / "m")
    _edit_weights(path, lambda t: t.update({"model.layers.9.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(hf.CheckpointMismatchError, match=r"model\.layers\.9\.extra\.weight"):
        hf.load_hf_model(path)


def test_shape_mismatch_names_tensor_and_shapes(tiny, tmp_path):
    path = _copy(tiny["llama"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        hf.CheckpointMismatchError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(64, 32\).*\(80, 32\)"
    ):
        hf.load_hf_model(path)


def test_unsupported_architecture_is_named(tiny, tmp_path):
    path = _copy(tiny["qwen2"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.UnsupportedArchitectureError, match=r"gpt2.*supported.*qwen2.*llama"):
        hf.load_hf_model(path)


def test_not_a_model_directory(tiny, tmp_path):
    with pytest.raises(hf.NotAModelDirectoryError, match="not a directory"):
        hf.load_hf_model(tmp_path / "does_not_exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(hf.NotAModelDirectoryError, match="config.json"):
        hf.load_hf_model(tmp_path / "empty")
    path = _copy(tiny["qwen2"], tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(hf.NotAModelDirectoryError, match="safetensors"):
        hf.load_hf_model(path)
