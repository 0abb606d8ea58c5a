"""Supervised warm start: next-token cross-entropy on the response tokens of demonstrations.

Rows use the TokenBatch layout (left-padded prompt + response, `loss_mask` on the response), so
the same bucketing and padding code serves SFT and RL.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from strata_jax.models.heads import token_logprobs


def sequence_logprobs(model, tokens: jax.Array, attention_mask: jax.Array, chunk: int,
                      window: int | None = None) -> jax.Array:
    """[S, L] log p(tokens[:, i] | tokens[:, :i]); column 0 is 0 (nothing predicts it).

    `window` (static): log-probs of the last `window` columns only, 0 before them. Responses end
    their rows, so a window covering the longest response gives the same loss while the vocabulary
    head runs on `window` columns instead of L (it dominates a small model's step otherwise).
    """
    positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
    hidden, _ = model(tokens, positions, attention_mask)  # [S, L, D]
    length = tokens.shape[1]
    w = length - 1 if window is None else min(int(window), length - 1)
    logp, _ = token_logprobs(hidden[:, -w - 1:-1], model.unembed_kernel(), tokens[:, -w:], chunk)  # [S, w]
    return jnp.pad(logp, ((0, 0), (length - w, 0)))


def nll(params, graphdef, tokens, attention_mask, loss_mask, chunk, window=None):
    model = nnx.merge(graphdef, params)
    logp = sequence_logprobs(model, tokens, attention_mask, chunk, window)
    w = loss_mask.astype(jnp.float32)
    return -(logp * w).sum() / jnp.maximum(w.sum(), 1.0)


def make_sft_step(graphdef, optimizer: optax.GradientTransformation, chunk: int = 8192,
                  window: int | None = None):
    """One jitted AdamW step on the mean response-token NLL; returns (params, opt_state, loss).

    `window`: see `sequence_logprobs`; the caller keeps every loss_mask token inside it.
    """

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, attention_mask, loss_mask):
        loss, grads = jax.value_and_grad(nll)(params, graphdef, tokens, attention_mask, loss_mask, chunk, window)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
