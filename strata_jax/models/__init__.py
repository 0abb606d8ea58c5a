"""Decoders (Qwen2 / Llama) in Flax NNX, HF checkpoints in and out, tiny test models.

from strata_jax.models import Decoder, ModelConfig, load_hf_model, export_hf, make_tiny_model
"""

from strata_jax.models.config import ConfigError, ModelConfig, UnsupportedArchitectureError
from strata_jax.models.hf import (
    CheckpointMismatchError,
    NotAModelDirectoryError,
    export_hf,
    load_hf_config,
    load_hf_model,
    load_tokenizer,
)
from strata_jax.models.qwen2 import Decoder, KVCache, param_logical_axes
from strata_jax.models.tiny import make_tiny_model

__all__ = [
    "CheckpointMismatchError",
    "ConfigError",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "NotAModelDirectoryError",
    "UnsupportedArchitectureError",
    "export_hf",
    "load_hf_config",
    "load_hf_model",
    "load_tokenizer",
    "make_tiny_model",
    "param_logical_axes",
]
