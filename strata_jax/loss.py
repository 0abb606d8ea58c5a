"""Policy loss of ALGORITHMS.md section 5: token-level PPO clip, dual clip, k3 KL, entropy bonus.

Everything returns *(sum, count)* instead of a mean, so a batch split into micro-batches (or
sharded over devices) sums the pieces and divides once: the result equals one full batch exactly.

Aggregations (static):
  token_mean            sum_s sum_i w_s l_si m_si  /  sum_s sum_i m_si       (tokens of the batch)
  seq_mean_token_mean   sum_s w_s (sum_i l_si m_si / n_s)  /  #{s : n_s > 0}  (rows of the batch)
with m the loss mask (restricted to valid rows), n_s = sum_i m_si, and w_s the row weight:
1 for an action row, `lam_strategy` for a strategy row (row_index t = -1), 0 for a padding row.
The weight scales a row's contribution only; the count is the plain number of tokens / rows
(J = J_act + lam * J_str over one shared denominator).

Metrics, each a (value, count) pair: loss, pg_loss, kl (k3 to the reference; absent without a
reference, `LossConfig.reference`) and entropy use the
loss's aggregation and row weights, so loss = pg_loss + kl_coef * kl (- entropy_coef * entropy);
clip_frac, dual_clip_frac, approx_kl (k3 of old vs current) and ratio_mean are plain means over
the loss tokens; ratio_max / ratio_min combine by max / min (METRIC_REDUCE).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.batch import TokenBatch
from strata_jax.names import AGGREGATIONS

# How each metric's (value, count) pairs combine across micro-batches; absent = "sum".
METRIC_REDUCE = {"ratio_max": "max", "ratio_min": "min"}


@struct.dataclass
class LossConfig:
    """Loss hyper-parameters: traced floats (sweepable) and static switches."""

    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low
    eps_high: float = 0.2  # ... and above at 1 + eps_high
    dual_clip: float = 3.0  # c: for A < 0 the loss is capped at -c * A
    kl_coef: float = 0.01  # beta, k3 KL to the reference policy
    kl_clamp: float = 10.0  # q = ref_logp - logp clamped to [-kl_clamp, kl_clamp]
    entropy_coef: float = 0.001  # used only when entropy_bonus is on
    # |logp - old_logp| is clamped before exp so an extreme ratio cannot overflow to inf, whose
    # derivative times a zero cotangent (a clipped branch) would be NaN.
    log_ratio_clamp: float = 20.0
    aggregation: str = struct.field(pytree_node=False, default="token_mean")
    entropy_bonus: bool = struct.field(pytree_node=False, default=False)
    track_entropy: bool = struct.field(pytree_node=False, default=True)  # report entropy metric
    # Whether batches carry the reference policy's log-probs (ref_logp). False: the run has no KL
    # term (kl_coef must be 0), skips the reference scoring pass and keeps no reference params
    # (train.kl_coef = 0 in a run); the loss has no KL and the metrics no "kl".
    reference: bool = struct.field(pytree_node=False, default=True)

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LossConfig.aggregation: unknown mode {self.aggregation!r}; choose from {AGGREGATIONS}")
        for f in ("eps_low", "eps_high", "dual_clip", "kl_clamp"):
            v = getattr(self, f)
            if isinstance(v, (int, float)) and v <= 0:
                raise ValueError(f"LossConfig.{f} must be > 0, got {v}")
        if isinstance(self.eps_low, (int, float)) and self.eps_low >= 1:
            raise ValueError(f"LossConfig.eps_low must be < 1, got {self.eps_low}")
        if isinstance(self.dual_clip, (int, float)) and self.dual_clip <= 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1, got {self.dual_clip}")
        if not self.reference and not (isinstance(self.kl_coef, (int, float)) and self.kl_coef == 0):
            raise ValueError(
                f"LossConfig.reference=False (no reference log-probs) needs kl_coef = 0, got {self.kl_coef}"
            )

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_bonus or self.track_entropy


def row_weights(row_index: jax.Array, row_valid: jax.Array, lam_strategy) -> jax.Array:
    """[S] f32: lam_strategy for strategy rows (t = -1), 1 for action rows, 0 for padding rows."""
    is_strategy = row_index[:, 3] < 0
    w = jnp.where(is_strategy, jnp.asarray(lam_strategy, jnp.float32), 1.0)
    return jnp.where(row_valid, w, 0.0).astype(jnp.float32)


def token_terms(logp, old_logp, ref_logp, advantage, cfg: LossConfig) -> dict[str, jax.Array]:
    """Per-token pieces, each [S, L]: pg (clipped policy loss), kl (k3), ratio, clip flags."""
    log_ratio = jnp.clip(logp - old_logp, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    # clip in log space: log(1 - eps_low) <= log_ratio <= log(1 + eps_high)
    clipped = jnp.exp(jnp.clip(log_ratio, jnp.log1p(-cfg.eps_low), jnp.log1p(cfg.eps_high)))
    pg1 = -advantage * ratio
    pg2 = -advantage * clipped
    pg_clip = jnp.maximum(pg1, pg2)
    pg3 = -advantage * cfg.dual_clip
    pg = jnp.where(advantage < 0, jnp.minimum(pg_clip, pg3), pg_clip)
    if cfg.reference:
        q = jnp.clip(ref_logp - logp, -cfg.kl_clamp, cfg.kl_clamp)
        kl = jnp.exp(q) - q - 1.0
    else:  # no reference log-probs (ref_logp is not filled): no KL term
        kl = jnp.zeros_like(logp)
    # approx KL(old || new), k3 with q = old - new: a drift diagnostic, not a loss term
    q_old = -log_ratio
    return {
        "pg": pg,
        "kl": kl,
        "ratio": ratio,
        "approx_kl": jnp.exp(q_old) - q_old - 1.0,
        "clipped": (pg2 > pg1).astype(jnp.float32),
        "dual_clipped": ((advantage < 0) & (pg_clip > pg3)).astype(jnp.float32),
    }


def aggregate(x: jax.Array, mask: jax.Array, weight: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of x [S, L] over mask [S, L] with row weights [S]; see the module docstring."""
    m = mask.astype(jnp.float32)
    if mode == "token_mean":
        return jnp.sum(weight[:, None] * x * m), jnp.sum(m)
    if mode == "seq_mean_token_mean":
        n = jnp.sum(m, axis=1)  # [S]
        row_mean = jnp.sum(x * m, axis=1) / jnp.maximum(n, 1.0)
        return jnp.sum(weight * row_mean), jnp.sum((n > 0).astype(jnp.float32))
    raise ValueError(f"unknown aggregation {mode!r}; choose from {AGGREGATIONS}")


def _masked_extreme(x, mask, kind):
    fill = -jnp.inf if kind == "max" else jnp.inf
    v = jnp.where(mask, x, fill)
    return jnp.max(v) if kind == "max" else jnp.min(v)


def policy_loss(
    logp: jax.Array,  # [S, L] f32, log-prob of tokens[s, i] under the current policy
    batch: TokenBatch,
    cfg: LossConfig,
    lam_strategy,  # scalar: weight of strategy rows (StraTA's lambda); traced
    entropy: jax.Array | None = None,  # [S, L] f32 per-token entropy (required by entropy_bonus)
) -> tuple[jax.Array, jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
    """-> (loss_sum, count, metrics) with loss = loss_sum / count; metrics name -> (value, count)."""
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {cfg.aggregation!r}; choose from {AGGREGATIONS}")
    if cfg.entropy_bonus and entropy is None:
        raise ValueError("LossConfig.entropy_bonus is on but no per-token entropy was given")
    if logp.shape != batch.loss_mask.shape:
        raise ValueError(f"policy_loss: logp shape {logp.shape} != loss_mask shape {batch.loss_mask.shape}")
    mask = batch.loss_mask & batch.row_valid[:, None]  # [S, L]
    # Off-mask inputs zeroed *before* the math: a NaN/inf there would otherwise reach the
    # gradient as 0 * NaN through the unselected branch of a where.
    zero = lambda x: jnp.where(mask, x, 0.0)  # noqa: E731
    t = token_terms(logp, zero(batch.old_logp), zero(batch.ref_logp), zero(batch.advantage), cfg)
    w = row_weights(batch.row_index, batch.row_valid, lam_strategy)
    per_token = t["pg"] + cfg.kl_coef * t["kl"]
    if cfg.entropy_bonus:
        per_token = per_token - cfg.entropy_coef * entropy
    loss_sum, count = aggregate(per_token, mask, w, cfg.aggregation)

    ones = jnp.ones_like(w)
    n_tok = jnp.sum(mask.astype(jnp.float32))
    sg = jax.lax.stop_gradient
    metrics = {
        "loss": (loss_sum, count),
        "pg_loss": aggregate(t["pg"], mask, w, cfg.aggregation),
        **({"kl": aggregate(t["kl"], mask, w, cfg.aggregation)} if cfg.reference else {}),
        # diagnostics: plain (unweighted) token means over the loss tokens
        "clip_frac": aggregate(t["clipped"], mask, ones, "token_mean"),
        "dual_clip_frac": aggregate(t["dual_clipped"], mask, ones, "token_mean"),
        "approx_kl": aggregate(t["approx_kl"], mask, ones, "token_mean"),
        "ratio_mean": aggregate(t["ratio"], mask, ones, "token_mean"),
        "ratio_max": (_masked_extreme(t["ratio"], mask, "max"), n_tok),
        "ratio_min": (_masked_extreme(t["ratio"], mask, "min"), n_tok),
    }
    if entropy is not None:
        metrics["entropy"] = aggregate(entropy, mask, w, cfg.aggregation)
    metrics = {k: (sg(v), sg(c)) for k, (v, c) in metrics.items()}
    return loss_sum, count, metrics


def combine_metrics(a: dict, b: dict) -> dict:
    """Merge two metric dicts of (value, count): sums add, max/min take the extreme."""
    out = {}
    for k, (va, ca) in a.items():
        vb, cb = b[k]
        kind = METRIC_REDUCE.get(k, "sum")
        v = va + vb if kind == "sum" else jnp.maximum(va, vb) if kind == "max" else jnp.minimum(va, vb)
        out[k] = (v, ca + cb)
    return out


def empty_metrics(like: dict) -> dict:
    """Identity element of `combine_metrics` with the structure of `like`."""

    def zero(k, v):
        kind = METRIC_REDUCE.get(k, "sum")
        fill = 0.0 if kind == "sum" else (-jnp.inf if kind == "max" else jnp.inf)
        return jnp.full(jnp.shape(v), fill, jnp.float32)

    return {k: (zero(k, v), jnp.zeros_like(c)) for k, (v, c) in like.items()}


def finalize_metrics(m: dict) -> dict[str, jax.Array]:
    """(value, count) -> scalar: sum / count for sums, the extreme for max/min; 0 with no tokens."""
    out = {}
    for k, (v, c) in m.items():
        if METRIC_REDUCE.get(k, "sum") == "sum":
            out[k] = v / jnp.maximum(c, 1.0)
        else:
            out[k] = jnp.where(c > 0, v, 0.0)
    return out


def config_from_dict(d: dict) -> LossConfig:
    """LossConfig from a plain dict; an unknown key raises naming it."""
    names = {f.name for f in dataclasses.fields(LossConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"LossConfig: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return LossConfig(**d)
