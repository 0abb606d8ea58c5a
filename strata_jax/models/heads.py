"""Output head without materialising [B, T, V] logits: per-token log-probs chunked over the vocab.

Used by the sampler's `score` (old / reference log-probs) and by the train step. The logsumexp and
entropy are accumulated online over vocabulary chunks in a `lax.scan`, so peak memory is
[B, T, chunk] instead of [B, T, V]. The softmax statistics are float32. The logits are the
products of the hidden states and the kernel in the hidden states' dtype, accumulated in float32:
exact float32 for a float32 model; for a bf16 model, the bf16 products that the sampler's head
(`sampling._last_logits`) computes too, so the trainer's log-probs match the sampler's, and the
head's matmuls run at bf16 speed instead of float32's (on an H200 they took a quarter of a 0.5B
update step in float32: docs/BENCHMARKS.md).

The backward is written by hand (`_lse_mean`'s custom VJP) rather than differentiated through the
online recurrence. Autodiff of the scan replays each chunk's running max, rescaling and masking
backwards: several elementwise passes over the [B, T, chunk] float32 logits, which a GPU profile of
the update found to be most of the head's time after its matmuls. By hand, a chunk's backward is
its logits recomputed, one fused pass that turns them into the bf16 gradient
dL/dlogit = p * (g_lse + g_mean * (1 + logit - mean)), and the two gradient matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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
    chunk = min(int(chunk_size), kernel.shape[1])
    kernel_c = kernel.astype(hidden.dtype)
    # Target logit straight from its column: no gather over a [B, T, V] tensor. The same products
    # and f32 accumulation as the chunks' logits, so logp = tgt - lse mixes no precisions.
    tgt_logit = jnp.einsum(
        "btd,btd->bt", hidden, jnp.take(kernel_c.T, targets, axis=0), preferred_element_type=jnp.float32
    )
    lse, mean = _lse_mean(hidden, kernel, chunk, bool(return_entropy))  # [B, T] each
    logp = tgt_logit - lse
    ent = (lse - mean) if return_entropy else None  # H = lse - E_p[logit]
    return logp, ent


def _chunked(kernel: jax.Array, dtype, chunk: int) -> jax.Array:
    """kernel [D, V] in `dtype`, zero-padded to whole chunks: [C, D, chunk]."""
    d, v = kernel.shape
    n_chunks = -(-v // chunk)
    pad = n_chunks * chunk - v
    w = kernel.astype(dtype)
    w = jnp.pad(w, ((0, 0), (0, pad))) if pad else w
    return w.reshape(d, n_chunks, chunk).transpose(1, 0, 2)


def _chunk_logits(h, wc, start, v: int):
    """One chunk's f32 logits [..., chunk] of h [..., D] @ wc [D, chunk], and its real columns
    [chunk] (the last chunk's padding columns are not in the vocabulary)."""
    logits = jax.lax.dot_general(h, wc, (((h.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    valid = (start + jnp.arange(wc.shape[1])) < v
    return logits, valid


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lse_mean(h: jax.Array, kernel: jax.Array, chunk: int, with_mean: bool):
    """logsumexp_v (h @ kernel)[..., v] and, with `with_mean`, the softmax mean of the logits
    E_p[logit] (else 0): two [...] float32 arrays."""
    return _lse_mean_fwd(h, kernel, chunk, with_mean)[0]


def _lse_mean_fwd(h, kernel, chunk, with_mean):
    v = kernel.shape[1]
    w = _chunked(kernel, h.dtype, chunk)

    def body(carry, xs):
        m, s, sz = carry  # running max, sum exp(l - m), sum exp(l - m) * l   (each [...])
        logits, valid = _chunk_logits(h, *xs, v)
        # A finite floor, not -inf, so that padding columns give exp(...) = 0 without inf - inf.
        logits = jnp.where(valid, logits, _NEG)
        m_new = jnp.maximum(m, logits.max(-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(logits - m_new[..., None])
        s = s * scale + e.sum(-1)
        if with_mean:
            sz = sz * scale + jnp.where(valid, e * logits, 0.0).sum(-1)
        return (m_new, s, sz), None

    lead = h.shape[:-1]
    init = (jnp.full(lead, _NEG, jnp.float32), jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.float32))
    (m, s, sz), _ = jax.lax.scan(body, init, (w, jnp.arange(w.shape[0]) * chunk))
    lse = m + jnp.log(s)
    mean = sz / s if with_mean else jnp.zeros_like(lse)
    return (lse, mean), (h, kernel, lse, mean)


def _lse_mean_bwd(chunk, with_mean, res, g):
    """d lse / d logit = p; d E_p[logit] / d logit = p * (1 + logit - mean). Per chunk: recompute
    the logits, one fused pass to the gradient in h's dtype, then dh += dl @ wc^T and
    dwc = h^T dl (h on the left, as `linear`'s backward, for XLA:CPU's sake)."""
    h, kernel, lse, mean = res
    g_lse, g_mean = g
    d, v = kernel.shape
    w = _chunked(kernel, h.dtype, chunk)
    lead = h.ndim - 1

    def body(dh, xs):
        logits, valid = _chunk_logits(h, *xs, v)
        p = jnp.where(valid, jnp.exp(logits - lse[..., None]), 0.0)
        coef = g_lse[..., None]
        if with_mean:
            coef = coef + g_mean[..., None] * (1.0 + logits - mean[..., None])
        dl = (p * coef).astype(h.dtype)  # [..., chunk]
        dh = dh + jax.lax.dot_general(dl, xs[0], (((lead,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dw = jax.lax.dot_general(
            h, dl, ((tuple(range(lead)), tuple(range(lead))), ((), ())), preferred_element_type=jnp.float32
        )  # [D, chunk]
        return dh, dw

    dh, dw = jax.lax.scan(body, jnp.zeros(h.shape, jnp.float32), (w, jnp.arange(w.shape[0]) * chunk))
    dw = dw.transpose(1, 0, 2).reshape(d, -1)[:, :v]  # [C, D, chunk] -> [D, V]
    return dh.astype(h.dtype), dw.astype(kernel.dtype)


_lse_mean.defvjp(_lse_mean_fwd, _lse_mean_bwd)
