"""`ModelConfig`: the static description of a Qwen2 / Llama decoder, read from a Hugging Face
config.json dict (transformers 4 or 5 layout) and written back for export. Unsupported model types
and features, and inconsistent fields, are refused here with their name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from strata_jax.names import ATTENTION_IMPLS, LORA_TARGETS  # noqa: F401 (this module's names too)

SUPPORTED_ARCHITECTURES = ("qwen2", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedArchitectureError(ValueError):
    """The HF config names a model type or feature this decoder does not implement."""


class ConfigError(ValueError):
    """The HF config dict is missing a field or has an inconsistent value; the message names it."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder; hashable so it can sit in a graphdef / static arg."""

    arch: str  # "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # ((key, value), ...) of the extra rope parameters (llama3: factor, low_freq_factor, ...).
    rope_scaling: tuple = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    bos_token_id: Any = None
    eos_token_id: Any = None
    pad_token_id: Any = None
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat: bool = False
    # Attention over fresh tokens (training, scoring, prefill): "einsum" materialises the [B, K, T,
    # G, S] scores; "cudnn" is jax.nn.dot_product_attention's fused flash kernel (GPU, bf16/fp16),
    # "xla" the same function's reference path. Every call with more than one query uses it, with
    # or without a cache; decode steps (one query on a cache) use the einsum.
    attention: str = "einsum"
    # LoRA adapters (strata_jax/lora.py): rank 0 = none. Each targeted projection W gets
    # W x + (alpha / rank) * B A x, A [in, rank] random, B [rank, out] zero at the start.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = tuple(LORA_TARGETS)

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ConfigError(f"model lora_rank={self.lora_rank} must be >= 0")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or (self.lora_rank and not self.lora_targets):
            raise ConfigError(f"model lora_targets={self.lora_targets!r}: choose from {list(LORA_TARGETS)}")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"model attention {self.attention!r} is not one of {list(ATTENTION_IMPLS)}")
        if self.attention == "cudnn" and self.dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"model attention 'cudnn' needs a bfloat16 or float16 compute dtype, got {self.dtype!r}")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    @classmethod
    def from_hf(
        cls,
        config: dict,
        dtype: str = "float32",
        param_dtype: str = "float32",
        scan_layers: bool = False,
        remat: bool = False,
        attention: str = "einsum",
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets=tuple(LORA_TARGETS),
    ) -> ModelConfig:
        """Build from a transformers config.json dict (transformers 4 or 5 layout)."""
        if not isinstance(config, dict):
            raise ConfigError(f"ModelConfig.from_hf: expected a config.json dict, got {type(config).__name__}")
        arch = config.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"model_type {arch!r} (architectures={config.get('architectures')}) is not supported; "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "qwen2" and config.get("use_sliding_window", False):
            raise UnsupportedArchitectureError("qwen2 with use_sliding_window=True is not supported")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in config:
                raise ConfigError(f"config.json: missing required field {key!r}")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported; supported: ['silu']")
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if head_dim % 2:
            raise ConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
        theta, rope_type, scaling = _rope_from_hf(config)
        attn_bias = bool(config.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rope_theta=theta,
            rope_type=rope_type,
            rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o bias; Llama follows attention_bias for all four.
            qkv_bias=True if arch == "qwen2" else attn_bias,
            o_bias=False if arch == "qwen2" else attn_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if arch == "llama" else False,
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            initializer_range=float(config.get("initializer_range", 0.02)),
            bos_token_id=_hashable(config.get("bos_token_id")),
            eos_token_id=_hashable(config.get("eos_token_id")),
            pad_token_id=_hashable(config.get("pad_token_id")),
            dtype=jnp.dtype(dtype).name,
            param_dtype=jnp.dtype(param_dtype).name,
            scan_layers=bool(scan_layers),
            remat=bool(remat),
            attention=str(attention),
            lora_rank=int(lora_rank),
            lora_alpha=float(lora_alpha),
            lora_targets=tuple(str(t) for t in lora_targets),
        )

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def to_hf(self) -> dict:
        """The transformers 5 config.json dict for this model (used by export)."""
        # Stored as floats (hashable, uniform); transformers wants the context length an int.
        extra = {k: int(v) if k == "original_max_position_embeddings" else v for k, v in self.rope_scaling}
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **extra}
        out = {
            "model_type": self.arch,
            "architectures": ["Qwen2ForCausalLM" if self.arch == "qwen2" else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rope_parameters": rope,
            # transformers 4 readers look at these two keys.
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_type == "default" else rope,
            "bos_token_id": _listify(self.bos_token_id),
            "eos_token_id": _listify(self.eos_token_id),
            "pad_token_id": _listify(self.pad_token_id),
            "dtype": self.param_dtype,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.arch == "llama":
            out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        else:
            out.update(use_sliding_window=False, sliding_window=None)
        return out


def _hashable(x):
    return tuple(x) if isinstance(x, list) else x


def _listify(x):
    return list(x) if isinstance(x, tuple) else x


def _rope_from_hf(config: dict) -> tuple[float, str, tuple]:
    """(theta, rope_type, extra params) from `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = dict(params)
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    need = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    }
    for key in need.get(rope_type, ()):
        if key not in params:
            raise ConfigError(f"rope_type {rope_type!r} needs rope parameter {key!r}")
    keep = need.get(rope_type, ())
    return theta, rope_type, tuple(sorted((k, float(params[k])) for k in keep))
