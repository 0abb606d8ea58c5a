"""Decoders (Qwen2 / Llama) in Flax NNX, HF checkpoints in and out, tiny test models."""

from strata_jax.models.qwen2 import Decoder, KVCache, ModelConfig, param_logical_axes

__all__ = ["Decoder", "KVCache", "ModelConfig", "param_logical_axes"]
