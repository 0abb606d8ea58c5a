"""Qwen2 / Llama decoder in Flax NNX, with a functional KV cache.

One module covers both families: they differ only in biases (Qwen2 has q/k/v biases), in the rope
variant (Llama 3 frequency scaling) and in defaults, all read from the HF config.json dict into a
`ModelConfig` (strata_jax/models/config.py).

Shapes: B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads, G = H / K,
Dh head dim, F mlp width, V vocab, L layers.

Every `nnx.Param` carries logical axis names in its `out_sharding` metadata (the flax 0.12 name of
the `sharding` metadata; see `param_logical_axes`). Variables are created with eager sharding off,
so the model builds without a mesh; `strata_jax/sharding.py` maps the names to mesh axes.
With scan_layers the per-layer params are stacked on a leading axis named "layers".
Under a `jax.set_mesh(mesh)` context the decoder also adds a few sharding constraints (embedding
and output kernel gathered over the hidden dim, embedded activations split over the batch axes;
see `_context_mesh`); without a mesh context it adds none.

KV cache (`KVCache`): one [B, K, S, Dh] buffer per layer (stacked [L, B, K, S, Dh] under scan_layers).
Each layer writes its new slots into its cache first and then reads it back from the updated cache
(`Attention`), so a donated cache is updated in place.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from strata_jax.models.config import ModelConfig
from strata_jax.models.linear import linear

_MASK_VALUE = -1e30  # finite: a fully masked (padding) query row gives a uniform softmax, not NaN


# ----------------------------------------------------------------------------------------------
# Rotary embeddings


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[Dh/2] f32 inverse frequencies, computed as transformers does (float32)."""
    dh = cfg.head_dim
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh)))
    inv = inv.astype(np.float32)
    p = dict(cfg.rope_scaling)
    if cfg.rope_type == "linear":
        inv = inv / np.float32(p["factor"])
    elif cfg.rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, T] i32 RoPE positions of left-padded rows: a row's real tokens sit at 0 .. n - 1, its
    padding at 0 (max(cumsum(mask) - 1, 0)). The sampler, the scoring and the update all use it."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> cos, sin [B, T, Dh] f32 (the two halves repeated, HF convention)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rope_buffers(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """rope_cos_sin, computed once into buffers of their own (on CPU; plain elsewhere).

    Left to itself XLA:CPU recomputes cos and sin inside every fusion that reads them: q and k of
    every layer, forward and backward (16 times in a 4-layer train step). A conditional's results
    are buffers (XLA drops optimization_barrier before fusion, and merges a cond whose branches
    are equal), so they come from a cond whose predicate, (p | 1) != 0, holds for every integer p;
    the zero branch is never taken. Only on CPU: a GPU conditional reads its predicate on the
    host, a sync in every decode step, for a recompute that costs a GPU little.
    """

    def cpu(p):
        pred = jnp.all((p.astype(jnp.int32) | 1) != 0)
        shape = p.shape + (inv_freq.shape[0] * 2,)
        zeros = lambda p: (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))  # noqa: E731
        return jax.lax.cond(pred, lambda p: rope_cos_sin(p, inv_freq), zeros, p)

    return jax.lax.platform_dependent(positions, cpu=cpu, default=lambda p: rope_cos_sin(p, inv_freq))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, Dh] rotated by position (rotate-half layout, as in HF Qwen2/Llama)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    out = xf * cos[:, :, None, :] + rot.astype(jnp.float32) * sin[:, :, None, :]
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Layers


def _param(value: jax.Array, axes: tuple) -> nnx.Param:
    """A Param tagged with logical axis names; no eager sharding (the model builds mesh-free)."""
    assert len(axes) == value.ndim, (axes, value.shape)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class Dense(nnx.Module):
    """x[..., *in_shape] @ kernel[*in_shape, *out_shape] (+ bias[*out_shape])."""

    def __init__(
        self,
        in_shape: tuple,
        out_shape: tuple,
        in_axes: tuple,
        out_axes: tuple,
        use_bias: bool,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        target: str | None = None,
    ):
        init = nnx.initializers.normal(cfg.initializer_range)
        self.n_in = len(in_shape)
        self.dtype = cfg.compute_dtype
        self.kernel = _param(init(rngs.params(), (*in_shape, *out_shape), cfg.params_dtype), (*in_axes, *out_axes))
        self.bias = _param(jnp.zeros(out_shape, cfg.params_dtype), out_axes) if use_bias else None
        self.lora_scale = cfg.lora_scale
        # flax's LoRA module holds the adapter (A [in, r] random, B [r, out] zero) as nnx.LoRAParam,
        # which strata_jax/lora.py filters on; its axes stay unnamed (an adapter is small:
        # replicated on any mesh). Assigned once: an attribute is data or static from then on.
        meta = {"out_sharding": (None, None), "eager_sharding": False}
        self.lora = (
            nnx.LoRA(
                math.prod(in_shape),
                cfg.lora_rank,
                math.prod(out_shape),
                rngs=rngs,
                param_dtype=cfg.params_dtype,
                a_metadata=meta,
                b_metadata=meta,
            )
            if cfg.lora_rank and target in cfg.lora_targets
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _dense(x, self.kernel, self.bias, self.dtype, self.n_in)
        if self.lora is None:
            return y
        lead = x.shape[: x.ndim - self.n_in]
        xf = x.reshape(*lead, -1).astype(self.dtype)
        a, b = self.lora.lora_a[...].astype(self.dtype), self.lora.lora_b[...].astype(self.dtype)
        # through `linear`, whose kernel gradient XLA:CPU runs without transposing dy (linear.py)
        return y + (self.lora_scale * linear(linear(xf, a), b)).reshape(y.shape)


def _dense(x, kernel, bias, dtype, n_in: int = 1) -> jax.Array:
    """x @ kernel (+ bias) in `dtype`, kernel and bias Variables or None. linear: dot_general with
    a kernel gradient XLA:CPU runs without transposing dy."""
    y = linear(x.astype(dtype), kernel[...].astype(dtype), n_in)
    if bias is not None:
        y = y + bias[...].astype(dtype)
    return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig):
        self.eps = cfg.rms_norm_eps
        self.dtype = cfg.compute_dtype
        self.scale = _param(jnp.ones((dim,), cfg.params_dtype), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in f32, cast back, then scale: the HF order (matters in bf16).
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * xf.astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = Dense((d,), (h, dh), ("embed",), ("heads", "head_dim"), cfg.qkv_bias, cfg, rngs, target="q")
        self.k_proj = Dense((d,), (k, dh), ("embed",), ("kv_heads", "head_dim"), cfg.qkv_bias, cfg, rngs, target="k")
        self.v_proj = Dense((d,), (k, dh), ("embed",), ("kv_heads", "head_dim"), cfg.qkv_bias, cfg, rngs, target="v")
        self.o_proj = Dense((h, dh), (d,), ("heads", "head_dim"), ("embed",), cfg.o_bias, cfg, rngs, target="o")

    def __call__(self, x, cos, sin, mask, ks, vs, layer, cache_index, last_only: bool = False):
        """x [B, T, D]; mask [B, T, S'] bool; ks, vs this layer's caches [B, K, S, Dh] (layer None),
        the stacked caches [L, B, K, S, Dh] of scan_layers (layer a traced int32), or None.

        With a cache, this layer's new keys / values are written into slots
        [cache_index, cache_index + T) *before* attention, and attention reads the layer back from
        the updated cache. Nothing then reads the old cache after the write, so XLA updates it in
        place (a T-slot dynamic-update-slice); reading the old cache instead keeps the old buffer
        alive past the write and costs a copy of the whole cache for K and for V on every layer of
        every decode step.

        The layout [B, K, S, Dh] is the one the attention dots consume (batch b, k; the slots next
        to the head dim), and the unrolled model keeps one buffer per layer, so a decode step feeds
        its cache to the dots as is. A [B, S, K, Dh] layout cost XLA-CPU a transposing copy of the
        layer's K and V every step, and a slice of a stacked [L, ...] buffer a plain copy (XLA has
        no views); under scan_layers that slice copy remains.

        cache_index a static 0 (a prefill): every earlier slot is empty, so attention runs over
        the T fresh keys / values (rounded to the cache dtype, exactly what a later step reads)
        instead of all S slots.

        last_only: queries only for the last position (the caller needs nothing else from the
        last layer); keys and values still cover all T tokens. Output [B, 1, D].

        Returns (out [B, T, D], ks, vs): the updated caches, or None without a cache.
        """
        cfg = self.cfg
        dtype = cfg.compute_dtype
        if getattr(self, "qkv", None) is not None:  # prepare_decode's fused kernel: one matmul
            q, k, v = self._fused_qkv(x)  # [B, T, H, Dh], [B, T, K, Dh] x 2
        else:
            q = self.q_proj(x[:, -1:] if last_only else x)  # [B, T or 1, H, Dh]
            k, v = self.k_proj(x), self.v_proj(x)  # [B, T, K, Dh]
        cos_q, sin_q = cos, sin
        if last_only:  # queries for the last position only
            q, cos_q, sin_q, mask = q[:, -1:], cos[:, -1:], sin[:, -1:], mask[:, -1:]
        q = apply_rope(q, cos_q, sin_q)
        k = apply_rope(k, cos, sin).transpose(0, 2, 1, 3)  # [B, K, T, Dh]
        v = v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
        if ks is not None:
            ks = _write_layer(ks, k, layer, cache_index)
            vs = _write_layer(vs, v, layer, cache_index)
            if _is_static_zero(cache_index):
                k = k.astype(ks.dtype).astype(dtype)
                v = v.astype(vs.dtype).astype(dtype)
                mask = mask[..., : k.shape[2]]
            else:
                k = _read_layer(ks, layer).astype(dtype)  # [B, K, S, Dh]
                v = _read_layer(vs, layer).astype(dtype)
        if cfg.attention != "einsum" and q.shape[1] > 1:
            # Several queries: the update, scoring, a prefill, and the suffixes that continue a
            # shared prefix's cache (train.shared_sequence_logprobs, the sampler's shared
            # prefill). A one-query decode step keeps the einsum. The fused kernel takes
            # [B, T, H, Dh] queries and [B, S, K, Dh] keys / values (GQA by head groups, h =
            # kv_head * G + g as below) and a [B, 1, T, S] keep-mask.
            out = jax.nn.dot_product_attention(
                q.astype(dtype),
                k.transpose(0, 2, 1, 3).astype(dtype),
                v.transpose(0, 2, 1, 3).astype(dtype),
                mask=mask[:, None],
                implementation=cfg.attention,
            )
            return self.o_proj(out), ks, vs
        b, t, _, dh = q.shape
        g = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, t, cfg.num_kv_heads, g, dh)  # head h = kv_head * G + g, as HF repeat_kv
        # Output dims in dot_general order (batch b, k; then t, g; then s): no transposes.
        scores = jnp.einsum("btkgd,bksd->bktgs", q, k, preferred_element_type=jnp.float32)
        scores = scores / np.float32(math.sqrt(dh))
        scores = jnp.where(mask[:, None, :, None, :], scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bktgs,bksd->bktgd", probs, v)  # [B, K, T, G, Dh]
        out = out.transpose(0, 2, 1, 3, 4).reshape(b, t, cfg.num_heads, dh)
        return self.o_proj(out), ks, vs

    def _fused_qkv(self, x):
        """q [B, T, H, Dh], k and v [B, T, K, Dh] from prepare_decode's [D, K, G + 2, Dh] kernel."""
        cfg = self.cfg
        b, t = x.shape[:2]
        g = cfg.num_heads // cfg.num_kv_heads
        y = _dense(x, self.qkv, self.qkv_bias, cfg.compute_dtype)  # [B, T, K, G + 2, Dh]
        q = y[:, :, :, :g].reshape(b, t, cfg.num_heads, cfg.head_dim)  # head h = kv_head * G + g
        return q, y[:, :, :, g], y[:, :, :, g + 1]


def _is_static_zero(cache_index) -> bool:
    return isinstance(cache_index, (int, np.integer)) and int(cache_index) == 0


def _write_layer(cache, new, layer, cache_index):
    """new [B, K, T, Dh] written at slots [cache_index, +T) of cache [B, K, S, Dh] (layer None) or of
    layer `layer` of the stacked cache [L, B, K, S, Dh]."""
    if layer is None:
        return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), _cache_start(cache_index))
    start = (jnp.asarray(layer, jnp.int32), *_cache_start(cache_index))
    return jax.lax.dynamic_update_slice(cache, new[None].astype(cache.dtype), start)


def _read_layer(cache, layer):
    """[B, K, S, Dh]: the cache itself (layer None) or layer `layer` of the stacked cache."""
    if layer is None:
        return cache
    return jax.lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)


def _cache_start(cache_index):
    """Start indices (batch, kv head, slot, head dim) of the new slots in one layer's cache."""
    zero = jnp.zeros((), jnp.int32)
    return (zero, zero, jnp.asarray(cache_index, jnp.int32), zero)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Dense((d,), (f,), ("embed",), ("mlp",), cfg.mlp_bias, cfg, rngs, target="gate")
        self.up_proj = Dense((d,), (f,), ("embed",), ("mlp",), cfg.mlp_bias, cfg, rngs, target="up")
        self.down_proj = Dense((f,), (d,), ("mlp",), ("embed",), cfg.mlp_bias, cfg, rngs, target="down")

    def __call__(self, x):  # [B, T, D]
        if getattr(self, "gate_up", None) is not None:  # prepare_decode's fused [D, 2, F] kernel
            y = _dense(x, self.gate_up, self.gate_up_bias, self.gate_proj.dtype)  # [B, T, 2, F]
            return self.down_proj(jax.nn.silu(y[:, :, 0]) * y[:, :, 1])
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, mask, ks, vs, layer, cache_index, last_only: bool = False):
        """x [B, T, D]; this layer's caches ks, vs or None -> (x [B, T, D], ks, vs) (see Attention).

        last_only: the output covers the last position only, [B, 1, D] (see Attention)."""
        a, ks, vs = self.self_attn(self.input_layernorm(x), cos, sin, mask, ks, vs, layer, cache_index, last_only)
        if last_only:
            x = x[:, -1:]
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, ks, vs


# ----------------------------------------------------------------------------------------------
# KV cache and decoder


@struct.dataclass
class KVCache:
    """Keys and values: L arrays [B, K, S, Dh] (a tuple, one buffer per layer), or under
    scan_layers one stacked [L, B, K, S, Dh] array each (the scan carries it)."""

    k: Any
    v: Any

    @property
    def shape(self) -> tuple:
        """(L, B, K, S, Dh) whichever the storage."""
        return cache_shape(self.k)

    @property
    def capacity(self) -> int:
        return self.shape[3]

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """(k, v) as [L, B, K, S, Dh] arrays (stacks per-layer buffers: a copy, for inspection)."""

        def stack(x):
            return jnp.stack(x) if isinstance(x, (tuple, list)) else x

        return stack(self.k), stack(self.v)

    def take_rows(self, rows: jax.Array, extra: int) -> KVCache:
        """A cache of U prefixes -> the caches of B rows: row b holds prefix rows[b] ([B] int32) in
        slots [0, Tpre), then `extra` empty slots. Per layer [U, K, Tpre, Dh] -> [B, K, Tpre + extra, Dh]
        (the shared-prefix prefill of strata_jax/sampling.py and the update's shared_sequence_logprobs;
        differentiable: the rows' gradients add up in their prefix)."""

        def one(x):
            axis = x.ndim - 4  # the batch axis: 0, or 1 under scan_layers
            pad = [(0, 0)] * x.ndim
            pad[-2] = (0, extra)
            return jnp.pad(jnp.take(x, rows, axis=axis), pad)

        return jax.tree.map(one, self)


def cache_shape(x) -> tuple:
    """(L, B, K, S, Dh) of a stacked cache array or of a tuple of per-layer [B, K, S, Dh] arrays."""
    if isinstance(x, (tuple, list)):
        return (len(x), *x[0].shape)
    return tuple(x.shape)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.initializer_range)
        self.dtype = cfg.compute_dtype
        self.embedding = _param(
            init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), cfg.params_dtype), ("vocab", "embed")
        )

    def __call__(self, tokens):  # [B, T] -> [B, T, D]
        table = _replicate_dim(self.embedding[...], 1)  # [V, D]: D whole under a mesh (FSDP gather)
        return jnp.take(table, tokens, axis=0).astype(self.dtype)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """One Block whose params carry a leading [L] axis (logical name "layers"), for lax.scan."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(r):
        return Block(cfg, r)

    return create(rngs)


class Decoder(nnx.Module):
    """Qwen2 / Llama causal decoder. See docs/CONTRACTS.md (Model) for the calling convention."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = Embed(cfg, rngs)
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg)
        if not cfg.tie_word_embeddings:
            init = nnx.initializers.normal(cfg.initializer_range)
            self.lm_head = _param(
                init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), cfg.params_dtype), ("embed", "vocab")
            )
        else:
            self.lm_head = None

    # -- public API ----------------------------------------------------------------------------

    def __call__(
        self,
        tokens,
        positions,
        attention_mask,
        cache: KVCache | None = None,
        cache_index=None,
        last_only: bool = False,
        tree_end=None,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions [B, T] int; attention_mask [B, T] (no cache) or [B, S] (cache).

        cache_index: a traced int32 scalar, or a Python int (static; 0 lets a prefill attend over
        its T fresh tokens only, see Attention). last_only: the last layer computes the last
        position only (a prefill that needs just the next-token logits), hidden is [B, 1, D].

        tree_end: optional int [B, T] (no cache), for a prefix tree packed into one row in preorder
        (strata_jax/tree.py): key j's subtree is columns [j, tree_end[j]), so query i sees key j iff
        j <= i < tree_end[j], i.e. exactly the tokens on its path from the root.

        Returns (hidden [B, T, D] after the final norm, updated cache or None).
        """
        cfg = self.cfg
        _check_inputs(cfg, tokens, positions, attention_mask, cache, cache_index)
        x = _constrain_batch(self.embed_tokens(tokens))  # [B, T, D]
        cos, sin = _rope_buffers(positions, rope_inv_freq(cfg))  # [B, T, Dh]
        mask = _attention_mask(attention_mask, tokens.shape[1], cache_index if cache is not None else None)
        if tree_end is not None:
            if tree_end.shape != tokens.shape:
                raise ValueError(f"tree_end: expected shape {tokens.shape} like tokens, got {tree_end.shape}")
            mask = mask & _tree_mask(tree_end, cache)
        ks = cache.k if cache is not None else None
        vs = cache.v if cache is not None else None
        x, ks, vs = self._run_layers(x, cos, sin, mask, ks, vs, cache_index, bool(last_only))
        hidden = self.norm(x)
        return hidden, (KVCache(k=ks, v=vs) if cache is not None else None)

    def unembed_kernel(self) -> jax.Array:
        """[D, V] output projection (tied: the embedding transposed)."""
        kernel = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head[...]
        return _replicate_dim(kernel, 0)  # D whole under a mesh context (see _replicate_dim)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, V] f32. Materialises all logits: small models and tests only."""
        return jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32), self.unembed_kernel().astype(jnp.float32))

    def init_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        """Zeroed cache for `batch` rows and `capacity` slots, in `dtype` (default: compute dtype):
        per-layer [B, K, S, Dh] tuples, or stacked [L, B, K, S, Dh] arrays under scan_layers."""
        cfg = self.cfg
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        dt = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype
        if cfg.scan_layers:
            shape = (cfg.num_layers, *shape)
            return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt))
        return KVCache(
            k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
            v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
        )

    # -- layers --------------------------------------------------------------------------------

    def _run_layers(self, x, cos, sin, mask, ks, vs, cache_index, last_only: bool = False):
        """x [B, T, D]; ks, vs per-layer tuples / stacked arrays (see KVCache) or None.
        Returns (x, ks, vs).

        Each layer writes its T new slots into its cache and reads it back from the result
        (Attention), so every buffer is updated in place (under scan the stacked cache rides in
        the carry, threaded layer to layer).
        last_only: the last layer runs its queries, o_proj and MLP on the last position only.
        """
        cfg = self.cfg

        def apply(graphdef, state, x, ks, vs, layer, last):
            return nnx.merge(graphdef, state)(x, cos, sin, mask, ks, vs, layer, cache_index, last)

        if cfg.scan_layers:
            if cfg.remat:
                apply = jax.checkpoint(apply, static_argnums=(0, 6))
            graphdef, state = nnx.split(self.layers)
            if last_only:  # the last layer runs outside the scan, on its own slice of the stack
                state, last_state = jax.tree.map(lambda a: a[:-1], state), jax.tree.map(lambda a: a[-1], state)

            def body(carry, st):
                h, ks, vs, i = carry
                h, ks, vs = apply(graphdef, st, h, ks, vs, i, False)
                return (h, ks, vs, i + 1), None

            # The cache rides in the carry (not xs/ys): each layer updates the carried buffer in
            # place, writing only its T new slots.
            (x, ks, vs, i), _ = jax.lax.scan(body, (x, ks, vs, jnp.zeros((), jnp.int32)), state)
            if last_only:
                x, ks, vs = apply(graphdef, last_state, x, ks, vs, i, True)
            return x, ks, vs

        if cfg.remat:
            apply = jax.checkpoint(apply, static_argnums=(0, 5, 6))
        n = len(self.layers)
        new_ks, new_vs = [], []
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            k, v = (None, None) if ks is None else (ks[i], vs[i])
            x, k, v = apply(graphdef, state, x, k, v, None, last_only and i == n - 1)
            new_ks.append(k)
            new_vs.append(v)
        if ks is None:
            return x, None, None
        return x, tuple(new_ks), tuple(new_vs)


# ----------------------------------------------------------------------------------------------
# Decode weights


class DecodeWeight(nnx.Variable):
    """A weight derived from the Params for decoding (prepare_decode): not trained, not saved."""


def prepare_decode(model: Decoder, fuse: bool = True) -> Decoder:
    """Ready a merged model for a decode loop, in place; call it inside jit, before the loop.

    - Every floating Param is cast to the compute dtype, once. The layers cast their weights at
      use; inside a `while_loop` XLA does not hoist those casts, so with float32 master weights
      and bf16 compute every decode step read 4 bytes a weight and wrote 2 more (the decode HLO
      showed the f32 kernels entering the loop). The values are the same: every use casts first.
    - fuse: each layer's q / k / v kernels become one [D, K, G + 2, Dh] kernel (GQA's query heads
      grouped under their kv head, then k and v) and gate / up one [D, 2, F] kernel, so a decode
      step runs 4 matmuls a layer instead of 7. The kv-head axis stays where tensor parallelism
      splits it. The separate kernels stay in the model for anything else.

    Under scan_layers the stacked [L, ...] weights are fused the same way (the axes count from
    the end). The copies cost one pass over the weights per call, against one read per step.
    """
    cfg = model.cfg
    if cfg.lora_rank:  # the fused kernels would drop the adapters: decode their merge instead
        raise ValueError(
            "prepare_decode: the model has LoRA adapters; decode the merged model "
            "(strata_jax.lora.merged_params with the model built without adapters)"
        )
    dtype = cfg.compute_dtype
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            value = var[...]
            if jnp.issubdtype(value.dtype, jnp.floating) and value.dtype != dtype:
                var.set_value(value.astype(dtype))
    if not fuse:
        return model
    blocks = [model.layers] if cfg.scan_layers else list(model.layers)
    kv, g, dh = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim

    def qkv(q, k, v):  # kernels [(L,) D, H | K, Dh] or biases [(L,) H | K, Dh] -> [..., K, G + 2, Dh]
        return jnp.concatenate([q.reshape(*q.shape[:-2], kv, g, dh), k[..., None, :], v[..., None, :]], axis=-2)

    def gate_up(gate, up):  # kernels [(L,) D, F] or biases [(L,) F] -> [..., 2, F]
        return jnp.stack([gate, up], axis=-2)

    for block in blocks:
        attn, mlp = block.self_attn, block.mlp
        # (An attribute is data or static from its first assignment: each is set once.)
        attn.qkv, attn.qkv_bias = _fused(qkv, attn.q_proj, attn.k_proj, attn.v_proj)
        mlp.gate_up, mlp.gate_up_bias = _fused(gate_up, mlp.gate_proj, mlp.up_proj)
    return model


def _fused(join, *layers: Dense):
    """(kernel, bias or None) as DecodeWeights: `join` applied to the layers' kernels, and to their
    biases when they have them."""
    kernel = DecodeWeight(join(*(d.kernel[...] for d in layers)))
    if layers[0].bias is None:
        return kernel, None
    return kernel, DecodeWeight(join(*(d.bias[...] for d in layers)))


# Sharding under a mesh context. These constraints are active only under `jax.set_mesh(mesh)` (an
# abstract mesh in context) whose axes are all Auto; jit with sharded arguments alone does not set
# one, and without a mesh every helper here is a no-op.
#
# Why: left to itself the partitioner gives the token lookup's output (and, in the backward pass,
# the scatter-add of its cotangent into the table's gradient) the embedding table's layout, hidden
# split over 'fsdp'. That conflicts with the batch split of the activations over ('data', 'fsdp'):
# XLA replicates the [B, T, D] activations ("[SPMD] Involuntary full rematerialization") and
# reshuffles them with all-to-alls. So the embedding table and the output kernel are used with
# their hidden dimension whole (all-gathered, as FSDP does for every weight; vocab keeps its own
# split), and the embedded activations are pinned to the batch split.

_BATCH_MESH_AXES = ("data", "fsdp")  # strata_jax.sharding.DEFAULT_RULES["batch"]


def _context_mesh():
    """The abstract mesh of a `jax.set_mesh` context with all axes Auto, else None."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is None or mesh.empty:
        return None
    auto = getattr(getattr(jax.sharding, "AxisType", None), "Auto", None)
    if auto is not None and any(t != auto for t in getattr(mesh, "axis_types", ()) or ()):
        return None  # Explicit / Manual axes: shardings live in the types, not in constraints
    return mesh


def _replicate_dim(w: jax.Array, dim: int) -> jax.Array:
    """`w` with dimension `dim` unsplit (all-gathered) under a mesh context, the others free."""
    if _context_mesh() is None:
        return w
    P = jax.sharding.PartitionSpec
    return jax.lax.with_sharding_constraint(w, P(*[None if d == dim else P.UNCONSTRAINED for d in range(w.ndim)]))


def _constrain_batch(x: jax.Array) -> jax.Array:
    """Activations [B, ...] split over those of ('data', 'fsdp') that the context mesh has and that
    divide B, the other dimensions whole; a no-op without a mesh context."""
    mesh = _context_mesh()
    if mesh is None:
        return x
    axes, size = [], 1
    for a in _BATCH_MESH_AXES:
        if a in mesh.axis_names and x.shape[0] % (size * mesh.shape[a]) == 0:
            axes.append(a)
            size *= mesh.shape[a]
    if size == 1:
        return x
    P = jax.sharding.PartitionSpec
    return jax.lax.with_sharding_constraint(x, P(tuple(axes), *([None] * (x.ndim - 1))))


def _check_inputs(cfg, tokens, positions, attention_mask, cache, cache_index):
    if tokens.ndim != 2:
        raise ValueError(f"tokens: expected [B, T], got shape {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ValueError(f"positions: expected shape {tokens.shape} like tokens, got {positions.shape}")
    b, t = tokens.shape
    if cache is None:
        if attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask: expected [B, T]={(b, t)} without a cache, got {attention_mask.shape}")
        if cache_index is not None:
            raise ValueError("cache_index given without a cache")
    else:
        n_layers, cache_b, _, s, _ = cache_shape(cache.k)
        if isinstance(cache.k, (tuple, list)) == cfg.scan_layers or n_layers != cfg.num_layers:
            want = "one stacked [L, B, K, S, Dh] array" if cfg.scan_layers else "a tuple of L [B, K, S, Dh] arrays"
            raise ValueError(
                f"cache: expected {want} with L={cfg.num_layers} per K and V (Decoder.init_cache), "
                f"got a {type(cache.k).__name__} with L={n_layers}"
            )
        if attention_mask.shape != (b, s):
            raise ValueError(
                f"attention_mask: expected [B, S]={(b, s)} with a cache of capacity {s}, got {attention_mask.shape}"
            )
        if cache_index is None:
            raise ValueError("a cache needs cache_index (the slot of the first new token)")
        if cache_b != b:
            raise ValueError(f"cache batch {cache_b} != tokens batch {b}")


def _attention_mask(attention_mask, t: int, cache_index) -> jax.Array:
    """[B, T, S'] bool: query i sees key j iff the key is valid and causal."""
    valid = attention_mask.astype(bool)  # [B, S']
    s = valid.shape[1]
    q_pos = jnp.arange(t)[:, None]  # [T, 1]
    if cache_index is not None:
        q_pos = q_pos + jnp.asarray(cache_index, jnp.int32)
    causal = jnp.arange(s)[None, :] <= q_pos  # [T, S']
    return valid[:, None, :] & causal[None]


def _tree_mask(tree_end, cache) -> jax.Array:
    """[B, T, T] bool: query i sees key j only inside j's subtree, i < tree_end[j] (causality,
    j <= i, comes from the attention mask)."""
    if cache is not None:
        raise ValueError("tree_end packs a whole prefix tree into the row: it takes no cache")
    t = tree_end.shape[1]
    return jnp.arange(t, dtype=jnp.int32)[None, :, None] < tree_end.astype(jnp.int32)[:, None, :]


# ----------------------------------------------------------------------------------------------
# Logical axes


def _axes_of(var: nnx.Variable) -> tuple:
    """Logical axes from the metadata key this flax version uses (newest name first)."""
    meta = var.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key) is not None:
            return tuple(meta[key])
    return (None,) * len(var.get_value().shape)  # an untagged Variable: replicated


def param_logical_axes(model_or_state) -> Any:
    """Logical axis tuples (e.g. ('embed', 'heads', 'head_dim')) as a pytree like nnx.state(model, nnx.Param).

    The leaves are plain tuples wrapped as `jax.tree_util` leaves under the same State paths, so
    `jax.tree.map(rule_fn, param_logical_axes(m), is_leaf=lambda x: isinstance(x, tuple))` works.
    """
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state, nnx.Param)
    return jax.tree.map(_axes_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
