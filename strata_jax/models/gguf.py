"""GGUF files (llama.cpp's format) in: a quantized model becomes an ordinary Hugging Face directory.

`gguf_to_hf(path, out_dir)` reads the file with the `gguf` package (its numpy reader and
dequantizer, every tensor type that package dequantizes), and writes what `load_hf_model` and
transformers read: config.json, model.safetensors (float32, dequantized) and a tokenizer built
from the file's metadata with `tokenizers` (BPE vocabulary and merges, the pre-tokenizer that
`tokenizer.ggml.pre` names, special tokens, chat template). Every later load (the RL run, SFT,
export, transformers itself) then reads one format.

Layout differences undone here:
- GGUF names tensors llama.cpp's way (`blk.3.attn_q.weight`); HF's names are restored.
- GGML shapes list the fastest axis first; numpy's order is their reverse, which is HF's
  [out, in] for every Linear weight.
- llama.cpp's converter permutes the rows of Llama's q and k projections (it pairs rotary
  dimensions (i, i + Dh/2) as adjacent rows for its interleaved RoPE); HF keeps the half-split
  layout. Qwen2 files are not permuted (llama.cpp runs Qwen2 with NEOX RoPE).
"""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np

from strata_jax.models.config import UnsupportedArchitectureError

__all__ = [
    "GGUFError",
    "gguf_config",
    "gguf_to_hf",
    "gguf_tokenizer",
    "read_gguf",
    "permute_qk",
    "unpermute_qk",
    "PRE_TOKENIZERS",
]

ARCHITECTURES = ("llama", "qwen2")


class GGUFError(ValueError):
    """The file is not a complete GGUF model: the message names the file and, where one is at
    fault, the tensor or metadata key."""


# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp splits text.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (split every digit first, the regex the byte-level split uses; None = GPT-2's own)
PRE_TOKENIZERS = {
    "default": (False, None),
    "gpt2": (False, None),
    "gpt-2": (False, None),
    "smollm": (True, None),  # HF SmolLM: Digits(individual) then GPT-2's byte-level regex
    "qwen2": (False, _QWEN2),
    "llama3": (False, _LLAMA3),
    "llama-bpe": (False, _LLAMA3),
}

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"^(\w+)\.(weight|bias)$")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a q / k weight [n_head * Dh, ...] (or bias)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_qk`: llama.cpp's row order back to HF's half-split rotary layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reader(path: pathlib.Path):
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
    except ImportError as e:  # a runtime dependency; only a broken install lacks it
        raise GGUFError(f"{path}: reading GGUF files needs the `gguf` package: pip install gguf") from e

    class CheckedReader(GGUFReader):
        """GGUFReader maps every tensor while it opens the file, and on a truncated file fails in a
        numpy view that names no tensor: each tensor's byte range is checked first. (An override of
        the reader's own tensor pass; if a gguf release changes it, the check steps aside and the
        generic message below still names the file.)"""

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                try:
                    _, name, _, dims, raw_dtype, offset = field.parts
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                    end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block
                    name = bytes(name).decode()
                except Exception:  # noqa: BLE001 (an unknown layout: leave the check to the reader)
                    continue
                if end > size:
                    raise GGUFError(
                        f"{path}: tensor {name!r} ends at byte {end}, but the file has {size} bytes "
                        "(the file is truncated or corrupt)"
                    )
            return super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except GGUFError:
        raise
    except Exception as e:  # noqa: BLE001 (numpy / struct errors of a damaged header, in one line)
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, path, default=None, required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFError(f"{path}: metadata key {key!r} is missing")
        return default
    return f.contents()


def _hf_config(reader, path, arch: str, tensor_names: set[str]) -> dict:
    """config.json of the model, from the `<arch>.*` metadata."""

    def get(key, default=None, required=False):
        return _field(reader, f"{arch}.{key}", path, default, required)

    heads = int(get("attention.head_count", required=True))
    hidden = int(get("embedding_length", required=True))
    head_dim = int(get("attention.key_length", hidden // heads))
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise UnsupportedArchitectureError(
            f"{path}: partial rotary embeddings ({arch}.rope.dimension_count={rot}, head dim {head_dim}) "
            "are not supported"
        )
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise UnsupportedArchitectureError(
            f"{path}: rope scaling ({scaling or 'rope_freqs tensor'}) in a GGUF file is not supported; "
            "convert the Hugging Face checkpoint instead"
        )
    vocab = _field(reader, "tokenizer.ggml.tokens", path, required=True)
    cfg = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": int(get("vocab_size", len(vocab))),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", path),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", path),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", path),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    else:
        cfg["use_sliding_window"] = False
    return cfg


def _hf_name(name: str, path) -> str:
    m = _BLOCK.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = _TOP.match(name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise UnsupportedArchitectureError(f"{path}: tensor {name!r} has no place in a llama / qwen2 decoder")


def _dequantized(t, path) -> np.ndarray:
    """A tensor as float32 in numpy (HF) axis order, with its byte count checked first: a truncated
    file maps fewer bytes than the header promises."""
    from gguf import GGMLQuantizationType, quants

    data = t.data
    if int(data.nbytes) != int(t.n_bytes):
        raise GGUFError(
            f"{path}: tensor {t.name!r} holds {data.nbytes} of its {int(t.n_bytes)} bytes "
            "(the file is truncated or corrupt)"
        )
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    qtype = GGMLQuantizationType(int(t.tensor_type))
    try:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64):
            out = np.asarray(data, np.float32)
        else:
            out = quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError as e:
        raise GGUFError(
            f"{path}: tensor {t.name!r} has type {qtype.name}, which the gguf package cannot dequantize"
        ) from e
    except Exception as e:  # noqa: BLE001
        raise GGUFError(
            f"{path}: tensor {t.name!r} ({qtype.name}) could not be dequantized: {type(e).__name__}: {e}"
        ) from e
    out = np.asarray(out, np.float32)
    if out.size != int(np.prod(shape)):
        raise GGUFError(
            f"{path}: tensor {t.name!r} dequantizes to {out.size} values, its shape {shape} needs {int(np.prod(shape))}"
        )
    if not np.isfinite(out).all():
        raise GGUFError(f"{path}: tensor {t.name!r} holds non-finite values (the file is corrupt)")
    return out.reshape(shape)


def read_gguf(path) -> tuple[dict, dict[str, np.ndarray], object]:
    """(HF config dict, HF-named float32 tensors in HF layout, transformers fast tokenizer) of a
    GGUF file.

    Tensors are dequantized one at a time; the whole float32 model is held at the end (a 135M
    model: 0.54 GB), which is what writing one safetensors file needs anyway.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    reader = _reader(path)
    cfg = _config_of(reader, path)
    arch = cfg["model_type"]
    tensors = {}
    for t in reader.tensors:
        hf = _hf_name(t.name, path)
        w = _dequantized(t, path)
        if arch == "llama" and re.search(r"\.(q_proj|k_proj)\.", hf):
            n = cfg["num_attention_heads"] if ".q_proj." in hf else cfg["num_key_value_heads"]
            w = unpermute_qk(w, n)
        tensors[hf] = w
    return cfg, tensors, _hf_tokenizer(build_tokenizer(reader, path), reader, path)


def gguf_config(path) -> dict:
    """The HF config dict of a GGUF file alone (no tensor is read)."""
    path = pathlib.Path(path)
    return _config_of(_reader(path), path)


def _config_of(reader, path) -> dict:
    arch = _field(reader, "general.architecture", path, required=True)
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {list(ARCHITECTURES)}"
        )
    return _hf_config(reader, path, arch, {t.name for t in reader.tensors})


def gguf_tokenizer(path):
    """The transformers fast tokenizer of a GGUF file alone (no tensor is read)."""
    path = pathlib.Path(path)
    reader = _reader(path)
    return _hf_tokenizer(build_tokenizer(reader, path), reader, path)


def build_tokenizer(reader, path):
    """A `tokenizers.Tokenizer` from the file's BPE metadata (tokenizer.ggml.model = "gpt2")."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model", path, required=True)
    if kind != "gpt2":
        raise UnsupportedArchitectureError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported; only byte-level BPE ('gpt2': "
            "SmolLM, Llama 3, Qwen2) is"
        )
    pre = _field(reader, "tokenizer.ggml.pre", path, "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedArchitectureError(
            f"{path}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens", path, required=True))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", path, required=True)]
    types = list(_field(reader, "tokenizer.ggml.token_type", path, [1] * len(tokens)))
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    digits, regex = PRE_TOKENIZERS[pre]
    if regex is None:
        split = [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    else:
        split = [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    if digits:
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.ByteLevel()
    # token types: 3 = control (chat markers, eos), 4 = user-defined; both match before the BPE
    added = [
        AddedToken(tokens[i], special=types[i] == 3, normalized=False) for i in range(len(tokens)) if types[i] in (3, 4)
    ]
    tok.add_tokens(added)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", path)
    if _field(reader, "tokenizer.ggml.add_bos_token", path, False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    return tok


def _hf_tokenizer(reader_tok, reader, path):
    from transformers import PreTrainedTokenizerFast

    tokens = list(_field(reader, "tokenizer.ggml.tokens", path, required=True))

    def tok_of(key):
        i = _field(reader, f"tokenizer.ggml.{key}", path)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    kw = {
        k: v
        for k, v in {
            "bos_token": tok_of("bos_token_id"),
            "eos_token": tok_of("eos_token_id"),
            "unk_token": tok_of("unknown_token_id"),
            "pad_token": tok_of("padding_token_id"),
        }.items()
        if v is not None
    }
    template = _field(reader, "tokenizer.chat_template", path)
    if template:
        kw["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=reader_tok, clean_up_tokenization_spaces=False, **kw)


def gguf_to_hf(path, out_dir) -> pathlib.Path:
    """Write the GGUF model at `path` to `out_dir` as a Hugging Face directory (transformers loads
    it as it is). The directory is written under a temporary name and renamed when complete, so a
    run killed while converting never leaves a half directory that looks finished."""
    import shutil

    from strata_jax.models.hf import write_safetensors

    path, out_dir = pathlib.Path(path), pathlib.Path(out_dir)
    cfg, tensors, tok = read_gguf(path)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_safetensors(tmp / "model.safetensors", tensors)
    tok.save_pretrained(str(tmp))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "source.json").write_text(json.dumps({"gguf": str(path.resolve()), "bytes": path.stat().st_size}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
