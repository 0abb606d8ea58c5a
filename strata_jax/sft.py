"""Supervised warm start: next-token cross-entropy on the response tokens of demonstrations.

Rows use the TokenBatch layout (left-padded prompt + response, `loss_mask` on the response), so
the same bucketing and padding code serves SFT and RL.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from strata_jax.train import sequence_logprobs


def nll(params, graphdef, tokens, attention_mask, loss_mask, chunk, window=None):
    # The update's own forward (train.sequence_logprobs): SFT and RL score tokens identically.
    logp, _ = sequence_logprobs(graphdef, params, tokens, attention_mask, chunk, False, window)
    w = loss_mask.astype(jnp.float32)
    return -(logp * w).sum() / jnp.maximum(w.sum(), 1.0)


def make_sft_step(graphdef, optimizer: optax.GradientTransformation, chunk: int = 8192,
                  window: int | None = None):
    """One jitted AdamW step on the mean response-token NLL; returns (params, opt_state, loss).

    `window`: see `train.sequence_logprobs`; the caller keeps every loss_mask token inside it.
    """

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, attention_mask, loss_mask):
        loss, grads = jax.value_and_grad(nll)(params, graphdef, tokens, attention_mask, loss_mask, chunk, window)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
