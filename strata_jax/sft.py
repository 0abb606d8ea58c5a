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


def sequence_logprobs(model, tokens: jax.Array, attention_mask: jax.Array, chunk: int) -> jax.Array:
    """[S, L] log p(tokens[:, i] | tokens[:, :i]); column 0 is 0 (nothing predicts it)."""
    positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
    hidden, _ = model(tokens, positions, attention_mask)  # [S, L, D]
    logp, _ = token_logprobs(hidden[:, :-1], model.unembed_kernel(), tokens[:, 1:], chunk)  # [S, L-1]
    return jnp.pad(logp, ((0, 0), (1, 0)))


def nll(params, graphdef, tokens, attention_mask, loss_mask, chunk):
    model = nnx.merge(graphdef, params)
    logp = sequence_logprobs(model, tokens, attention_mask, chunk)
    w = loss_mask.astype(jnp.float32)
    return -(logp * w).sum() / jnp.maximum(w.sum(), 1.0)


def make_sft_step(graphdef, optimizer: optax.GradientTransformation, chunk: int = 8192):
    """One jitted AdamW step on the mean response-token NLL; returns (params, opt_state, loss)."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, attention_mask, loss_mask):
        loss, grads = jax.value_and_grad(nll)(params, graphdef, tokens, attention_mask, loss_mask, chunk)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
