"""Hugging Face checkpoints in and out: config.json + (sharded) safetensors <-> Decoder params.

Loading never builds the model on the host: `nnx.eval_shape` gives the abstract parameter tree,
then one tensor at a time is read from a memory-mapped safetensors file, converted to our layout,
and placed straight into its target sharding with `jax.make_array_from_callback` (each device
receives only its slice; on multi-host each process fills only its addressable shards). Peak host
memory is one converted tensor (one stacked [L, ...] tensor with scan_layers).

safetensors is read and written by a small numpy reader/writer here instead of the `safetensors`
package's numpy backend, because that backend cannot represent bfloat16 (numpy has no bf16; we
use ml_dtypes' bfloat16, which jax ships with).

Layout differences (HF torch Linear weight is [out, in]):
    embed_tokens.weight [V, D]        -> embed_tokens.embedding [V, D]
    q_proj.weight [H*Dh, D]           -> q_proj.kernel [D, H, Dh]      (bias [H*Dh] -> [H, Dh])
    o_proj.weight [D, H*Dh]           -> o_proj.kernel [H, Dh, D]
    gate/up_proj.weight [F, D]        -> kernel [D, F];  down_proj.weight [D, F] -> kernel [F, D]
    lm_head.weight [V, D]             -> lm_head [D, V]
With scan_layers the per-layer tensors are stacked on a leading [L] axis.
"""

from __future__ import annotations

import json
import math
import pathlib
import struct as _struct
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from strata_jax.models.config import ModelConfig, UnsupportedArchitectureError
from strata_jax.models.qwen2 import Decoder

__all__ = [
    "CheckpointMismatchError",
    "NotAModelDirectoryError",
    "UnsupportedArchitectureError",
    "load_hf_model",
    "load_hf_config",
    "load_tokenizer",
    "export_hf",
    "hf_param_names",
    "read_safetensors",
    "write_safetensors",
]


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: a missing, extra or mis-shaped tensor."""


class NotAModelDirectoryError(FileNotFoundError):
    """The path is not a directory holding config.json and safetensors weights."""


# ----------------------------------------------------------------------------------------------
# safetensors (numpy, memory-mapped)

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path) -> dict[str, np.ndarray]:
    """name -> read-only memory-mapped array (nothing is read until a tensor is used)."""
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = _struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (_struct.error, ValueError, MemoryError, OverflowError) as e:
        raise CheckpointMismatchError(
            f"{path}: not a safetensors file, its header is unreadable ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointMismatchError(f"{path}: not a safetensors file, its header is not a JSON object")
    header.pop("__metadata__", None)
    if not header:
        return {}
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    have = len(raw) - 8 - n  # data bytes on disk
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointMismatchError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        want = math.prod(info["shape"]) * _ST_DTYPES[info["dtype"]].itemsize
        if end - start != want or end > have:
            raise CheckpointMismatchError(
                f"{path}: tensor {name!r} needs data bytes [{start}, {end}) of {want} but the file holds {have} "
                "(the file is truncated or corrupt)"
            )
        buf = raw[8 + n + start : 8 + n + end]
        out[name] = buf.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write numpy arrays (bfloat16 included) in the safetensors format."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_NAMES:
            raise ValueError(f"write_safetensors: tensor {name!r} has unsupported dtype {a.dtype}")
        header[name] = {
            "dtype": _ST_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(_struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())


# ----------------------------------------------------------------------------------------------
# Name and layout mapping


def _dense_spec(hf: str, n_in: int, bias: bool):
    """Entries for one Dense: kernel (in..., out...) <- HF weight [out, in] and optional bias."""
    out = [("kernel", f"{hf}.weight", ("dense", n_in))]
    if bias:
        out.append(("bias", f"{hf}.bias", ("reshape",)))
    return out


def _layer_spec(cfg: ModelConfig) -> list[tuple[tuple, str, tuple]]:
    """(path inside a Block, HF name suffix, conversion) for every tensor of one layer."""
    spec = [
        (("input_layernorm", "scale"), "input_layernorm.weight", ("reshape",)),
        (("post_attention_layernorm", "scale"), "post_attention_layernorm.weight", ("reshape",)),
    ]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        bias = cfg.o_bias if name == "o_proj" else cfg.qkv_bias
        n_in = 2 if name == "o_proj" else 1
        for leaf, hf, conv in _dense_spec(f"self_attn.{name}", n_in, bias):
            spec.append((("self_attn", name, leaf), hf, conv))
    for name in ("gate_proj", "up_proj", "down_proj"):
        for leaf, hf, conv in _dense_spec(f"mlp.{name}", 1, cfg.mlp_bias):
            spec.append((("mlp", name, leaf), hf, conv))
    return spec


def hf_param_names(cfg: ModelConfig) -> list[tuple[tuple, list[str], tuple]]:
    """(our state path, HF tensor names (one, or one per layer when stacked), conversion)."""
    out = [
        (("embed_tokens", "embedding"), ["model.embed_tokens.weight"], ("reshape",)),
        (("norm", "scale"), ["model.norm.weight"], ("reshape",)),
    ]
    if not cfg.tie_word_embeddings:
        out.append((("lm_head",), ["lm_head.weight"], ("transpose",)))
    for path, hf, conv in _layer_spec(cfg):
        names = [f"model.layers.{i}.{hf}" for i in range(cfg.num_layers)]
        if cfg.scan_layers:
            out.append((("layers", *path), names, ("stacked", conv)))
        else:
            out.extend((("layers", i, *path), [n], conv) for i, n in enumerate(names))
    return out


def _to_ours(hf: np.ndarray, conv: tuple, shape: tuple) -> np.ndarray:
    kind = conv[0]
    if kind == "reshape":
        return hf.reshape(shape)
    if kind == "transpose":
        return hf.T
    if kind == "dense":  # [out, in] -> [*in, *out]
        return hf.T.reshape(shape)
    raise AssertionError(conv)


def _to_hf(ours: np.ndarray, conv: tuple, hf_shape_hint=None) -> np.ndarray:
    kind = conv[0]
    if kind == "reshape":
        return ours.reshape(-1) if ours.ndim > 1 and hf_shape_hint == "flat" else ours
    if kind == "transpose":
        return ours.T
    if kind == "dense":
        n_in = conv[1]
        fan_in = math.prod(ours.shape[:n_in])
        return ours.reshape(fan_in, -1).T
    raise AssertionError(conv)


def _hf_shape(name: str, conv: tuple, shape: tuple) -> tuple:
    """The HF shape that maps onto our `shape` (for the mismatch message)."""
    kind = conv[0]
    if kind == "transpose":
        return tuple(reversed(shape))
    if kind == "dense":
        n_in = conv[1]
        return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    # reshape: norms and embeddings keep their shape; biases are flat.
    return (math.prod(shape),) if name.endswith(".bias") else tuple(shape)


# ----------------------------------------------------------------------------------------------
# Loading


def load_hf_config(path) -> dict:
    """config.json of a model directory, with a clear error when it is not one."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise NotAModelDirectoryError(f"{path}: not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise NotAModelDirectoryError(f"{path}: no config.json, not a Hugging Face model directory")
    with open(cfg_file) as f:
        return json.load(f)


def _open_checkpoint(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors (lazily memory-mapped) of a single-file or sharded checkpoint."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif single.exists():
        files = [single.name]
    else:
        raise NotAModelDirectoryError(
            f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors are read)"
        )
    tensors = {}
    for fname in files:
        if not (path / fname).exists():
            raise NotAModelDirectoryError(f"{path}: shard {fname} named in the index is missing")
        tensors.update(read_safetensors(path / fname))
    return tensors


def _resolve_shardings(abstract_state, mesh, rules, shardings):
    if shardings is not None:
        return shardings(abstract_state) if callable(shardings) else shardings
    if mesh is not None:
        # Lazy import: the sharding module owns the logical -> mesh mapping (divisibility rules).
        from strata_jax.sharding import param_shardings

        return param_shardings(abstract_state, mesh, rules)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: dev, abstract_state)


def _flat(state) -> dict[tuple, Any]:
    return {tuple(k): v for k, v in nnx.to_flat_state(state)}


def _leaf(x):
    """A Variable's value or a plain leaf."""
    return x.get_value() if isinstance(x, nnx.Variable) else x


def load_hf_model(
    path,
    dtype: str = "float32",
    param_dtype: str = "float32",
    mesh=None,
    rules=None,
    scan_layers: bool = False,
    remat: bool = False,
    attention: str = "einsum",
    shardings: Any | Callable | None = None,
    split: bool = False,
    lora_rank: int = 0,
    lora_alpha: float = 16.0,
    lora_targets=None,
    lora_seed: int = 0,
):
    """Read config.json + safetensors into a Decoder, placed in its target sharding.

    shardings: a pytree of `jax.sharding.Sharding` matching nnx.state(model, nnx.Param), or a
      callable(abstract_state) -> that pytree (how strata_jax.sharding supplies it); else
      `mesh` + `rules` (logical name -> mesh axis; default strata_jax.sharding.DEFAULT_RULES) go
      through strata_jax.sharding.param_shardings; else everything on one device.
    lora_rank > 0: the decoder carries LoRA adapters (strata_jax/lora.py) on `lora_targets`, which
      no checkpoint holds: A is drawn from `lora_seed`, B is zero (the model is the checkpoint's).
    Returns (model, cfg), or ((graphdef, params), cfg) when split=True.
    """
    from strata_jax.models.config import LORA_TARGETS

    path = pathlib.Path(path)
    cfg = ModelConfig.from_hf(
        load_hf_config(path),
        dtype=dtype,
        param_dtype=param_dtype,
        scan_layers=scan_layers,
        remat=remat,
        attention=attention,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_targets=tuple(lora_targets or LORA_TARGETS),
    )
    tensors = _open_checkpoint(path)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract, nnx.Param)
    shard_tree = _flat(_resolve_shardings(abs_state, mesh, rules, shardings))
    abs_flat = _flat(abs_state)
    values = {}
    used = set()
    for our_path, names, conv in hf_param_names(cfg):
        var = abs_flat[our_path]
        shape, sharding = tuple(_leaf(var).shape), _leaf(shard_tree[our_path])
        host = _read_converted(tensors, names, conv, shape, cfg.params_dtype)
        used.update(names)
        values[our_path] = jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx])
    _check_extra(tensors, used, cfg)
    if cfg.lora_rank:
        from strata_jax.lora import init_adapters

        adapters = init_adapters(nnx.split_state(abs_state, nnx.LoRAParam, ...)[0], int(lora_seed))
        for p, var in nnx.to_flat_state(adapters):
            values[tuple(p)] = jax.device_put(_leaf(var), _leaf(shard_tree[tuple(p)]))
    # New Variables (same metadata): the abstract state handed to `shardings` stays abstract.
    params = nnx.from_flat_state([(p, var.replace(values[p])) for p, var in abs_flat.items()])
    if split:
        return (graphdef, params), cfg
    return nnx.merge(graphdef, params), cfg


class _Lazy:
    """A converted tensor that reads (and converts) only the slice a device asks for."""

    def __init__(self, arr, dtype):
        self.arr, self.dtype = arr, dtype

    def __getitem__(self, idx):
        return np.asarray(self.arr[idx]).astype(self.dtype)


def _read_converted(tensors, names, conv, shape, dtype):
    for n in names:
        if n not in tensors:
            raise CheckpointMismatchError(f"checkpoint is missing tensor {n!r}")
    if conv[0] == "stacked":
        inner = conv[1]
        layers = [_check_and_convert(n, tensors[n], inner, shape[1:]) for n in names]
        return _Lazy(np.stack(layers), dtype)
    return _Lazy(_check_and_convert(names[0], tensors[names[0]], conv, shape), dtype)


def _check_and_convert(name, hf, conv, shape):
    want = _hf_shape(name, conv, shape)
    if tuple(hf.shape) != want:
        raise CheckpointMismatchError(
            f"tensor {name!r}: checkpoint shape {tuple(hf.shape)} but the config needs {want}"
        )
    return _to_ours(hf, conv, shape)


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _check_extra(tensors, used, cfg):
    extra = [n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    if cfg.tie_word_embeddings:
        extra = [n for n in extra if n != "lm_head.weight"]  # some exporters keep the tied copy
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint has {len(extra)} tensor(s) the model does not use: {sorted(extra)[:10]}"
        )


def load_tokenizer(path):
    """AutoTokenizer from a model directory (Qwen byte-level BPE or sentencepiece Llama)."""
    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    if not path.is_dir():
        raise NotAModelDirectoryError(f"{path}: not a directory")
    return AutoTokenizer.from_pretrained(str(path))


# ----------------------------------------------------------------------------------------------
# Export


def _params_of(model_or_params):
    if isinstance(model_or_params, nnx.Module):
        return nnx.state(model_or_params, nnx.Param)
    if isinstance(model_or_params, tuple) and len(model_or_params) == 2:
        return model_or_params[1]  # (graphdef, params)
    return model_or_params


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def hf_tensors(model_or_params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our params -> HF-named numpy tensors in HF layout (param dtype kept)."""
    flat = {p: _leaf(v) for p, v in _flat(_params_of(model_or_params)).items()}
    out = {}
    for our_path, names, conv in hf_param_names(cfg):
        if our_path not in flat:
            raise CheckpointMismatchError(f"params are missing {'.'.join(map(str, our_path))}")
        arr = _to_host(flat[our_path])
        if conv[0] == "stacked":
            for i, n in enumerate(names):
                out[n] = _to_hf_named(n, arr[i], conv[1])
        else:
            out[names[0]] = _to_hf_named(names[0], arr, conv)
    return out


def _to_hf_named(name, arr, conv):
    return _to_hf(arr, conv, "flat" if name.endswith(".bias") else None)


def export_hf(model_or_params, cfg: ModelConfig, tokenizer, out_dir, max_shard_bytes: int = 2 << 30):
    """Write config.json, safetensors (sharded with an index above max_shard_bytes) and tokenizer."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model_or_params, cfg)
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += nbytes
    shards.append(cur)
    if len(shards) == 1:
        write_safetensors(out_dir / "model.safetensors", shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out_dir / fname, shard)
            weight_map.update({n: fname for n in shard})
        total = sum(a.nbytes for a in tensors.values())
        with open(out_dir / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_cfg = cfg.to_hf()
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if hf_cfg.get(key) is None and getattr(tokenizer, key, None) is not None:
                hf_cfg[key] = getattr(tokenizer, key)
        tokenizer.save_pretrained(str(out_dir))
    with open(out_dir / "config.json", "w") as f:
        json.dump(hf_cfg, f, indent=2)
    return out_dir
