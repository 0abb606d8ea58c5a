"""Diverse strategy selection (ALGORITHMS.md 3.2): greedy farthest-point sampling by cosine distance.

Batched over tasks: `P` tasks, `K` candidate strategies each (K = sigma * N), `D` embedding dims.
Start from the candidate with the highest mean token log-prob, then repeatedly add the candidate
whose minimum cosine distance to the kept set is largest. Ties (e.g. exact duplicates of each other)
go to the higher start score, then the lower index. Duplicates of a kept candidate have distance 0,
so they are only picked once no distinct candidate remains.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Distances below this are duplicates (f32 dot products of identical unit vectors give ~1e-7).
DUP_TOL = 1e-6


def cosine_distances(emb: jax.Array) -> jax.Array:
    """[P, K, D] -> [P, K, K] f32 cosine distance 1 - cos, in [0, 2]; near-duplicates snap to 0.

    A zero embedding has distance 1 to everything (cos = 0), never NaN.
    """
    e = emb.astype(jnp.float32)
    u = e / jnp.maximum(jnp.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
    d = jnp.clip(1.0 - jnp.einsum("pkd,pjd->pkj", u, u), 0.0, 2.0)
    return jnp.where(d < DUP_TOL, 0.0, d)


def _check(emb, mask, score, n):
    if emb.ndim != 3:
        raise ValueError(f"diversity: emb must be [P, K, D], got shape {emb.shape}")
    if mask.shape != emb.shape[:2]:
        raise ValueError(f"diversity: mask must be [P, K]={emb.shape[:2]}, got {mask.shape}")
    if score is not None and score.shape != emb.shape[:2]:
        raise ValueError(f"diversity: start_score must be [P, K]={emb.shape[:2]}, got {score.shape}")
    if not 1 <= n <= emb.shape[1]:
        raise ValueError(f"diversity: n must be in [1, K={emb.shape[1]}], got {n}")


def _pick(primary: jax.Array, secondary: jax.Array, allowed: jax.Array) -> jax.Array:
    """Per row, the allowed index with the largest (primary, secondary), lowest index on ties.

    primary, secondary: [P, K] f32; allowed: [P, K] bool. Rows with nothing allowed give 0.
    """
    neg = -jnp.inf
    best = jnp.max(jnp.where(allowed, primary, neg), axis=-1, keepdims=True)  # [P, 1]
    tied = allowed & (primary >= best)
    return jnp.argmax(jnp.where(tied, secondary, neg), axis=-1).astype(jnp.int32)  # [P]


@functools.partial(jax.jit, static_argnames=("n",))
def farthest_point_select(
    emb: jax.Array,  # [P, K, D]
    mask: jax.Array,  # [P, K] bool, candidate exists
    start_score: jax.Array,  # [P, K] f32, mean token log-prob (NaN counts as -inf)
    n: int,
) -> tuple[jax.Array, jax.Array]:
    """Greedy farthest-point choice of n of K -> (indices [P, n] int32, kept [P, n] bool).

    Slot i is kept iff the task has more than i valid candidates; indices of slots not kept are 0.
    """
    _check(emb, mask, start_score, n)
    p_, k_ = mask.shape
    score = jnp.nan_to_num(start_score.astype(jnp.float32), nan=-jnp.inf)
    score = jnp.where(jnp.isfinite(score) | (score > 0), score, jnp.finfo(jnp.float32).min)
    dist = cosine_distances(emb)  # [P, K, K]
    rows = jnp.arange(p_)
    first = _pick(jnp.zeros((p_, k_)), score, mask)  # [P]
    chosen = jax.nn.one_hot(first, k_, dtype=bool) & mask
    min_d = dist[rows, first]  # [P, K] distance to the kept set
    idx = jnp.zeros((p_, n), jnp.int32).at[:, 0].set(first)

    def body(i, state):
        idx, chosen, min_d = state
        avail = mask & ~chosen
        pick = _pick(min_d, score, avail)  # [P]
        chosen = chosen | (jax.nn.one_hot(pick, k_, dtype=bool) & avail)
        min_d = jnp.minimum(min_d, dist[rows, pick])
        return idx.at[:, i].set(pick), chosen, min_d

    idx, _, _ = jax.lax.fori_loop(1, n, body, (idx, chosen, min_d))
    kept = jnp.arange(n)[None, :] < mask.sum(-1, keepdims=True)  # [P, n]
    return jnp.where(kept, idx, 0), kept


@functools.partial(jax.jit, static_argnames=("n",))
def first_n(mask: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The diverse=off ablation: the first n valid candidates in index order -> ([P, n], [P, n])."""
    if mask.ndim != 2 or not 1 <= n <= mask.shape[1]:
        raise ValueError(f"first_n: mask must be [P, K] with 1 <= n <= K, got {mask.shape}, n={n}")
    order = jnp.argsort(~mask, axis=-1, stable=True)[:, :n].astype(jnp.int32)  # valid ones first
    kept = jnp.arange(n)[None, :] < mask.sum(-1, keepdims=True)
    return jnp.where(kept, order, 0), kept
