"""Output head without materialising [B, T, V] logits: per-token log-probs chunked over the vocab.

Used by the sampler's `score` (old / reference log-probs) and by the train step. The logsumexp and
entropy are accumulated online over vocabulary chunks in a `lax.scan`, so peak memory is
[B, T, chunk] instead of [B, T, V]. The softmax statistics are float32. The logits are the
products of the hidden states and the kernel in the hidden states' dtype, accumulated in float32:
exact float32 for a float32 model; for a bf16 model, the bf16 products that the sampler's head
(`sampling._last_logits`) computes too, so the trainer's log-probs match the sampler's, and the
head's matmuls run at bf16 speed instead of float32's (on an H200 they took a quarter of a 0.5B
update step in float32: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.models.linear import linear

_NEG = -1e30


def token_logprobs(
    hidden: jax.Array,  # [B, T, D]
    kernel: jax.Array,  # [D, V]
    targets: jax.Array,  # [B, T] int
    chunk_size: int = 8192,
    return_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """log softmax(hidden @ kernel)[targets] -> [B, T] f32, and optionally the entropy [B, T].

    The caller handles the shift (hidden at position i predicts token i + 1).
    """
    d, v = kernel.shape
    chunk = min(int(chunk_size), v)
    n_chunks = -(-v // chunk)
    pad = n_chunks * chunk - v
    h = hidden  # [B, T, D], in the compute dtype
    kernel = kernel.astype(h.dtype)
    w = jnp.pad(kernel, ((0, 0), (0, pad))) if pad else kernel
    w = w.reshape(d, n_chunks, chunk).transpose(1, 0, 2)  # [C, D, chunk]
    # Target logit straight from its column: no gather over a [B, T, V] tensor. The same products
    # and f32 accumulation as the chunks' logits, so logp = tgt - lse mixes no precisions.
    tgt_logit = jnp.einsum("btd,btd->bt", h, jnp.take(kernel.T, targets, axis=0),
                           preferred_element_type=jnp.float32)

    def body(carry, xs):
        m, s, sz = carry  # running max, sum exp(l - m), sum exp(l - m) * l   (each [B, T])
        wc, start = xs
        logits = linear(h, wc, 1, jnp.float32)  # [B, T, chunk] f32; its kernel gradient runs without a transposed softmax

        valid = (start + jnp.arange(chunk)) < v  # [chunk]
        # A finite floor, not -inf: -inf * 0 in the backward pass of the entropy term gives NaN.
        logits = jnp.where(valid, logits, _NEG)
        m_new = jnp.maximum(m, logits.max(-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(logits - m_new[..., None])
        s = s * scale + e.sum(-1)
        if return_entropy:
            sz = sz * scale + jnp.where(valid, e * logits, 0.0).sum(-1)
        return (m_new, s, sz), None

    b, t = targets.shape
    init = (jnp.full((b, t), _NEG, jnp.float32), jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t), jnp.float32))
    starts = jnp.arange(n_chunks) * chunk
    (m, s, sz), _ = jax.lax.scan(jax.checkpoint(body), init, (w, starts))
    lse = m + jnp.log(s)  # [B, T]
    logp = tgt_logit - lse
    ent = (lse - sz / s) if return_entropy else None  # H = lse - E_p[logit]
    return logp, ent
