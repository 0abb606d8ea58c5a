"""LoRA adapters over a frozen base: the pieces the trainer, the sampler and export need.

The adapters are flax's own `nnx.LoRA` modules inside the decoder's projections
(strata_jax/models/qwen2.py `Dense`, `ModelConfig.lora_rank / lora_alpha / lora_targets`); their
weights are `nnx.LoRAParam`, so one filter splits a model's params into the two parts:

    adapters  nnx.LoRAParam: what the optimiser, the gradients and the checkpoints hold;
    frozen    every other nnx.Param: the base model, never updated, sharded as without LoRA.

What flax does not give is written here (docs/CONTRACTS.md says why):
- `merged_params`: the adapters folded into the base kernels, W + (alpha / r) A B, as the params of
  the same decoder built without adapters. The sampler decodes that merged model, so a decode step
  reads exactly the bytes it reads without LoRA; the merge runs once per policy sync.
- `adapters_off`: B set to zero, which gives the base model's output exactly (x A 0 = 0): the
  reference policy of the KL term, without a second copy of the base.
- `peft_tensors` / `peft_config`: the adapters in PEFT's format and names, which transformers users
  load onto the base model with `peft`.
Shapes: A [(L,) in, r], B [(L,) r, out] (a leading [L] under scan_layers); the base kernel of a
projection is [(L,) *in_shape, *out_shape], flattened to [in, out] for the product.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.models.config import LORA_TARGETS, ModelConfig

__all__ = ["split", "join", "merged_params", "adapters_off", "init_adapters", "count", "peft_tensors", "peft_config"]


def split(params) -> tuple[Any, Any]:
    """(adapters, frozen) of a full params state (nnx.Param, LoRAParam included)."""
    return nnx.split_state(params, nnx.LoRAParam, ...)


def join(frozen, adapters):
    """The full params state the LoRA decoder's graphdef merges with."""
    return nnx.merge_state(frozen, adapters)


def _pairs(adapters) -> dict[tuple, tuple[Any, Any]]:
    """{projection path: (A, B)} from an adapters state ('...', 'q_proj', 'lora', 'lora_a')."""
    flat = {tuple(k): v for k, v in nnx.to_flat_state(adapters)}
    out = {}
    for k, v in flat.items():
        if k[-2:] == ("lora", "lora_a"):
            out[k[:-2]] = (v, flat[k[:-1] + ("lora_b",)])
    return out


def _value(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def merged_params(frozen, adapters, cfg: ModelConfig):
    """The params of the decoder built WITHOUT adapters (`cfg` with lora_rank 0 and the same
    layout), each targeted kernel replaced by W + (alpha / r) A B in W's dtype. Pure; jit it."""
    pairs = _pairs(adapters)
    scale = cfg.lora_scale
    out = []
    for k, var in nnx.to_flat_state(frozen):
        k = tuple(k)
        if k[-1] == "kernel" and k[:-1] in pairs:
            a, b = (_value(x) for x in pairs[k[:-1]])
            w = _value(var)
            delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32)) * scale
            var = var.replace((w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype))
        out.append((k, var))
    return nnx.from_flat_state(out)


def adapters_off(adapters):
    """The adapters with every B zeroed: the LoRA model then computes the base model exactly."""
    return nnx.from_flat_state(
        [(k, v.replace(jnp.zeros_like(_value(v))) if k[-1] == "lora_b" else v) for k, v in nnx.to_flat_state(adapters)]
    )


def init_adapters(abstract_adapters, seed: int):
    """Concrete adapters for an abstract adapters state: A drawn as flax's LoRA draws it (He
    uniform over the input dimension; a stacked [L] axis of scan_layers is a batch axis, not
    fan-in), B zero, so the adapted model starts as the base model."""
    key = jax.random.key(seed)
    out = []
    for i, (k, v) in enumerate(nnx.to_flat_state(abstract_adapters)):
        shape, dtype = v.get_value().shape, v.get_value().dtype
        if k[-1] == "lora_a":
            init = nnx.initializers.variance_scaling(
                2.0, "fan_in", "uniform", in_axis=-2, out_axis=-1, batch_axis=tuple(range(len(shape) - 2))
            )
            value = init(jax.random.fold_in(key, i), shape, dtype)
        else:
            value = jnp.zeros(shape, dtype)
        out.append((k, v.replace(value)))
    return nnx.from_flat_state(out)


def count(adapters) -> int:
    return int(sum(np.prod(_value(v).shape) for _, v in nnx.to_flat_state(adapters)))


def _hf_module(path: tuple, layer: int | None) -> str:
    """('layers', 3, 'self_attn', 'q_proj') -> model.layers.3.self_attn.q_proj."""
    rest = [str(p) for p in path[1:] if not isinstance(p, int)]
    return f"model.layers.{layer}.{'.'.join(rest)}"


def peft_tensors(adapters, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PEFT's adapter_model.safetensors: `base_model.model.<module>.lora_A.weight` [r, in] = A^T and
    `lora_B.weight` [out, r] = B^T per projection and layer (PEFT computes x A^T... as nn.Linear,
    y += (alpha / r) * lora_B(lora_A(x)), the same product)."""
    out = {}
    for path, (a, b) in _pairs(adapters).items():
        a, b = np.asarray(jax.device_get(_value(a))), np.asarray(jax.device_get(_value(b)))
        layers = [(i, a[i], b[i]) for i in range(a.shape[0])] if cfg.scan_layers else [(path[1], a, b)]
        for i, ai, bi in layers:
            name = f"base_model.model.{_hf_module(path, i)}"
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(ai.T)
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(bi.T)
    return out


def peft_config(cfg: ModelConfig, base_model: str = "") -> dict:
    """adapter_config.json for `peft.PeftModel.from_pretrained(base, dir)`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "target_modules": sorted(LORA_TARGETS[t] for t in cfg.lora_targets),
        "init_lora_weights": True,
        "base_model_name_or_path": base_model,
        "inference_mode": True,
    }
