"""Supervised warm start: next-token cross-entropy on the response tokens of demonstrations.

Rows use the TokenBatch layout (left-padded prompt + response, `loss_mask` on the response), so
the same bucketing and padding code serves SFT and RL.

`make_ptx_step` is the same loss as a step on the RL TrainState (InstructGPT's PPO-ptx, run as
interleaved steps): `coef x` the demonstrations' mean NLL, through the RL run's own optimiser, so
that the behaviours RL has no signal for (solved tasks: zero advantage) keep a gradient that holds
them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from strata_jax.sharding import data_sharding, param_shardings, replicated
from strata_jax.train import TrainState, sequence_logprobs, train_state_shardings


def read_token_weights(
    contexts: Sequence[np.ndarray], responses: Sequence[np.ndarray], max_share: float = 0.25
) -> list[np.ndarray]:
    """Per-response-token 0/1 weights of the SFT reading phase (`config.sft.read_steps`): 1 on a
    response token that occurs in its row's context (the prompt's task, strategy and observations)
    and is a content token there: one that occurs in at most `max_share` of the contexts of the rows
    whose response starts with the same token (the same kind of call: strategies, actions,
    judgments, each with its own template).

    Why: trained on whole answers, the tiny models learn every template token and never the one
    word the answer copies from its prompt (docs/RESULTS.md: the signpost's colour stays
    at chance after 8,000 steps); trained on that word alone they read it within 250 steps. The
    share filter drops the words every prompt of a kind has (`door`, `to`, `1`, the template's
    `strategy`), which the template predicts without reading.
    contexts[s], responses[s]: token ids of row s. Returns a float32 array per response.
    """
    if len(contexts) != len(responses):
        raise ValueError(f"read_token_weights: {len(contexts)} contexts, {len(responses)} responses")
    sets = [np.unique(np.asarray(c, np.int64)) for c in contexts]
    kinds = np.asarray([int(r[0]) if len(r) else -1 for r in responses])
    content = {}
    for k in np.unique(kinds):
        rows = np.flatnonzero(kinds == k)
        ids, counts = np.unique(np.concatenate([sets[s] for s in rows]), return_counts=True)
        content[int(k)] = ids[counts <= max_share * len(rows)]
    out = []
    for c, r, k in zip(sets, responses, kinds):
        r = np.asarray(r, np.int64)
        out.append((np.isin(r, content[int(k)]) & np.isin(r, c)).astype(np.float32))
    return out


def nll(params, graphdef, tokens, attention_mask, loss_mask, chunk, window=None):
    # The update's own forward (train.sequence_logprobs): SFT and RL score tokens identically.
    logp, _ = sequence_logprobs(graphdef, params, tokens, attention_mask, chunk, False, window)
    w = loss_mask.astype(jnp.float32)
    return -(logp * w).sum() / jnp.maximum(w.sum(), 1.0)


def make_sft_step(graphdef, optimizer: optax.GradientTransformation, chunk: int = 8192, window: int | None = None):
    """One jitted AdamW step on the mean response-token NLL; returns (params, opt_state, loss).

    `window`: see `train.sequence_logprobs`; the caller keeps every loss_mask token inside it.
    """

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, attention_mask, loss_mask):
        loss, grads = jax.value_and_grad(nll)(params, graphdef, tokens, attention_mask, loss_mask, chunk, window)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_ptx_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules=None,
    chunk: int = 8192,
    window: int | None = None,
):
    """`ptx_step(state, tokens, attention_mask, loss_mask, coef) -> (state, nll)`: one optimiser step
    of the RL TrainState on `coef x` the mean response-token NLL of demonstration rows [S, L].

    The same optimiser (and so the same Adam moments and clipping) as the policy update; `step`
    and `skipped` are the policy update's counters and stay as they are. A non-finite loss leaves
    the state unchanged. Jitted with the state's shardings, state donated; rows split over the data
    axes (S must divide by the data-parallel size).
    """

    def fn(state: TrainState, tokens, attention_mask, loss_mask, coef):
        p_sh = param_shardings(state.params, mesh, rules)

        def loss_of(trained):  # with LoRA, the adapters' NLL over the frozen base (TrainState.frozen)
            return nll(
                state.replace(params=trained).model_params, graphdef, tokens, attention_mask, loss_mask, chunk, window
            )

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        grads = jax.tree.map(lambda g: coef * g, grads)

        def update(params, opt_state):
            updates, new_opt = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        ok = jnp.isfinite(loss) & (coef > 0)
        params, opt_state = jax.lax.cond(ok, update, lambda p, o: (p, o), state.params, state.opt_state)
        return state.replace(params=jax.lax.with_sharding_constraint(params, p_sh), opt_state=opt_state), loss

    jitted = {}

    def step(state: TrainState, tokens, attention_mask, loss_mask, coef):
        if "f" not in jitted:
            st_sh, dsh, repl = train_state_shardings(state, mesh, rules), data_sharding(mesh), replicated(mesh)
            jitted["f"] = jax.jit(
                fn, in_shardings=(st_sh, dsh, dsh, dsh, repl), out_shardings=(st_sh, repl), donate_argnums=(0,)
            )
        return jitted["f"](state, tokens, attention_mask, loss_mask, jnp.asarray(coef, jnp.float32))

    return step
