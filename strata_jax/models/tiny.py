"""Tiny random Qwen2 / Llama checkpoints with a tokenizer trained on the spot.

Used by the tests and as the embedded CPU default model. The output directory is a normal
Hugging Face model directory (config.json, model.safetensors, tokenizer files, ChatML template) that
`transformers` and `strata_jax.models.hf.load_hf_model` both load.

Tokenizers:
- "bpe" (default for qwen2): byte-level BPE trained with `tokenizers` using exactly the pipeline
  that transformers' Qwen2Tokenizer rebuilds on load (NFC, Qwen split regex, ByteLevel without
  regex), so ids round-trip through AutoTokenizer. Every byte is in the alphabet: any text encodes.
- "sentencepiece" (default for llama): a sentencepiece BPE model with byte fallback, saved as
  tokenizer.model only, so loading exercises transformers' sentencepiece conversion.

Weights: our own NNX decoder, initialised with jax.random in transformers' scheme (`init_params`)
and written by `strata_jax.models.hf.export_hf`. No torch: it is a test-only dependency, and this
module runs on a user's first `python launch.py`.
"""

from __future__ import annotations

import io
import json
import pathlib

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_TEXTS = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, "
    "a drawer 2, a fridge 1, a microwave 1, a shelf 3, a sinkbasin 1, and a toaster 1.",
    "Your task is to: put a clean apple in the fridge.",
    "go to countertop 1",
    "take apple 1 from countertop 1",
    "clean apple 1 with sinkbasin 1",
    "open fridge 1",
    "put apple 1 in/on fridge 1",
    "Nothing happens.",
    "You arrive at countertop 1. On the countertop 1, you see a apple 1, a knife 2, and a mug 3.",
    "Strategy: first find the object, then clean it, then place it. Think step by step.",
    "<think>I should look for the apple on the countertop.</think> <action>go to countertop 1</action>",
)

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}

# Config keys `ModelConfig.from_hf` reads: an override outside these would reach transformers'
# config.json but not our decoder, so the two would disagree; it is refused instead.
_READ_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "use_sliding_window",
        "max_position_embeddings",
        "initializer_range",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
)


class TinyModelError(ValueError):
    """Invalid arguments to make_tiny_model; the message names the argument."""


def make_tiny_model(
    out_dir,
    arch: str = "qwen2",
    texts: list[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 512,
    tie: bool = True,
    rope_theta: float = 1e6,
    seed: int = 0,
    tokenizer: str | None = None,
    **overrides,
) -> pathlib.Path:
    """Write a random-weight HF model + trained tokenizer to out_dir and return it.

    `overrides` go straight into the config.json dict (e.g. head_dim, rope_parameters,
    rope_scaling, max_position_embeddings, initializer_range). `tokenizer`: "bpe" | "sentencepiece"
    (default by arch). The weights follow transformers' init scheme, drawn with jax.random from `seed`
    (`init_params`); no torch is needed.
    """
    if arch not in _ARCHITECTURES:
        raise TinyModelError(f"arch {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    kind = tokenizer or ("bpe" if arch == "qwen2" else "sentencepiece")
    if kind not in ("bpe", "sentencepiece"):
        raise TinyModelError(f"tokenizer {kind!r}: expected 'bpe' or 'sentencepiece'")
    unknown = sorted(set(overrides) - _READ_KEYS)
    if unknown:
        raise TinyModelError(
            f"config overrides {unknown} are not read by strata_jax's decoder "
            f"(ModelConfig.from_hf); allowed: {sorted(_READ_KEYS)}"
        )
    texts = list(texts) if texts else list(DEFAULT_TEXTS)
    if not all(isinstance(t, str) for t in texts):
        raise TinyModelError("texts must be a list of str")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _bpe_tokenizer(out, texts, vocab_size) if kind == "bpe" else _sp_tokenizer(out, texts, vocab_size)
    if len(tok) > vocab_size:
        raise TinyModelError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tok)} tokens)")
    ids = {
        k: tok.convert_tokens_to_ids(getattr(tok, k.replace("_id", "")))
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(tok, k.replace("_id", ""), None)
    }
    config = dict(
        model_type=arch,
        architectures=[_ARCHITECTURES[arch]],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=tie,
        rope_theta=rope_theta,
        max_position_embeddings=4096,
        **ids,
    )
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    config.update(overrides)
    _save_jax_model(out, config, seed)
    return out


def _save_jax_model(out: pathlib.Path, config: dict, seed: int) -> None:
    """Initialise our decoder from the config dict and write it with our own HF export."""
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.hf import export_hf

    cfg = ModelConfig.from_hf(config)
    # The tokenizer files are already in `out` (written above); export_hf adds config.json (which
    # replaces the sentencepiece path's placeholder) and model.safetensors.
    export_hf(init_params(cfg, seed), cfg, None, out)


def init_params(cfg, seed: int):
    """(graphdef, params) of a Decoder initialised as transformers initialises Qwen2 / Llama.

    transformers' `_init_weights`: every Linear weight and the embedding ~ normal(0, initializer_range),
    biases 0, RMSNorm weights 1, and the embedding row of pad_token_id 0 (nn.Embedding's
    padding_idx). Each tensor gets its own key, folded from `seed` and the tensor's path, so a
    tensor's values do not depend on which other tensors the model has.
    """
    import zlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.models.qwen2 import Decoder

    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    root = jax.random.key(seed)
    leaves = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        name = ".".join(map(str, path))
        if path[-1] in ("kernel", "embedding", "lm_head"):
            key = jax.random.fold_in(root, zlib.crc32(name.encode()))
            value = cfg.initializer_range * jax.random.normal(key, shape, jnp.float32)
            if path[-1] == "embedding" and isinstance(cfg.pad_token_id, int) and 0 <= cfg.pad_token_id < shape[0]:
                value = value.at[cfg.pad_token_id].set(0.0)
        elif path[-1] == "bias":
            value = jnp.zeros(shape, jnp.float32)
        elif path[-1] == "scale":
            value = jnp.ones(shape, jnp.float32)
        else:
            raise AssertionError(f"init_params: no init rule for parameter {name}")
        leaves.append((path, var.replace(value.astype(dtype))))
    return graphdef, nnx.from_flat_state(leaves)


# ----------------------------------------------------------------------------------------------
# Tokenizers


def _bpe_tokenizer(out: pathlib.Path, texts: list[str], vocab_size: int):
    """Byte-level BPE with the Qwen2 pre-tokenizer, saved through Qwen2Tokenizer itself."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise TinyModelError(
            f"vocab_size={vocab_size}: byte-level BPE needs at least "
            f"{len(alphabet) + len(SPECIAL_TOKENS)} (256 bytes + special tokens)"
        )
    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet, show_progress=False
    )
    raw.train_from_iterator(texts, trainer=trainer)
    model = json.loads(raw.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(out))
    return tok


def _sp_tokenizer(out: pathlib.Path, texts: list[str], vocab_size: int):
    """sentencepiece BPE with byte fallback; only tokenizer.model + tokenizer_config.json are written."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        character_coverage=1.0,
        user_defined_symbols=[t for t in SPECIAL_TOKENS if t != "<|pad|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        pad_piece="<|pad|>",
        # identity: keep newlines and repeated spaces, so sentencepiece and transformers agree.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        num_threads=1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "</s>"],
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 4096,
        "legacy": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))  # replaced by export_hf
    return AutoTokenizer.from_pretrained(str(out))
