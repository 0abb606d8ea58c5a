"""AdvantageParams: the hyper-parameters of every advantage estimator, as one small pytree.

Numeric fields are traced f32 scalar leaves, so `jax.vmap(compute_advantages, in_axes=(None, 0,
None))` sweeps a stacked grid of them in one compiled call. Switches that change the program
(normalisation modes) are static metadata (`pytree_node=False`): a different switch is a
different program, by design. Defaults are those of ALGORITHMS.md.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.names import GIGPO_NORMS, SEG_NORMS

# Checks applied when a traced field holds a concrete number (not inside jit / vmap).
_RANGES = {
    "delta": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "gamma": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "beacon_gamma": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "r_succ": (lambda v: v > 0.0, "> 0"),
    "strategy_budget": (lambda v: v > 0.0, "> 0"),
}


def _f32(x):
    return np.float32(x)


@struct.dataclass
class AdvantageParams:
    """Traced scalars (vmappable) and static switches; `AdvantageParams()` = ALGORITHMS.md."""

    delta: jax.Array = _f32(0.5)  # StraTA: share of top returns scoring a strategy (3.3)
    kappa: jax.Array = _f32(0.1)  # StraTA: self-judgment penalty per bad step (3.4)
    gamma: jax.Array = _f32(0.95)  # GiGPO: discount of step returns (2)
    beacon_gamma: jax.Array = _f32(0.9)  # BEACON: temporal shaping decay (4)
    lam_strategy: jax.Array = _f32(0.5)  # StraTA: weight of J_str in the loss (3.5); not in A^str
    lam_seg: jax.Array = _f32(1.0)  # BEACON: weight of the segment advantage (4)
    omega: jax.Array = _f32(1.0)  # GiGPO: weight of the anchor-state advantage (2)
    invalid_penalty: jax.Array = _f32(0.1)  # all: subtracted after normalisation (0)
    r_succ: jax.Array = _f32(10.0)  # R_succ, scales R(tau) back to [0, 1] for R(z) (3.3)
    r_ms: jax.Array = _f32(10.0)  # BEACON: milestone reward R_ms (4)
    c_len: jax.Array = _f32(0.1)  # StraTA: over-length strategy penalty (3.3)
    c_fmt: jax.Array = _f32(0.1)  # StraTA: malformed strategy penalty (3.3)
    strategy_budget: jax.Array = _f32(64.0)  # StraTA: L_z, strategy token budget (3.3)
    # Static switches.
    stats_over_steps: bool = struct.field(pytree_node=False, default=False)  # GRPO / GiGPO A^E
    gigpo_norm: str = struct.field(pytree_node=False, default="std")  # 'std' | 'mean'
    seg_norm: str = struct.field(pytree_node=False, default="mean")  # 'mean' | 'std'

    def __post_init__(self):
        _check_static(self)
        for f in _traced_fields():
            v = getattr(self, f)
            # Plain numbers become f32 so `replace(delta=0.25)` hits the same jit cache entry
            # as the defaults; tracers, arrays and jax's own placeholders pass untouched.
            if isinstance(v, (numbers.Real, np.number)) and not isinstance(v, bool):
                _check_range(f, float(v))
                object.__setattr__(self, f, _f32(v))


def _traced_fields() -> tuple[str, ...]:
    return tuple(f.name for f in AdvantageParams.__dataclass_fields__.values() if f.metadata.get("pytree_node", True))


def _check_static(p: AdvantageParams) -> None:
    if not isinstance(p.stats_over_steps, bool):
        raise ValueError(f"AdvantageParams.stats_over_steps must be a bool, got {p.stats_over_steps!r}")
    if p.gigpo_norm not in GIGPO_NORMS:
        raise ValueError(f"AdvantageParams.gigpo_norm must be one of {GIGPO_NORMS}, got {p.gigpo_norm!r}")
    if p.seg_norm not in SEG_NORMS:
        raise ValueError(f"AdvantageParams.seg_norm must be one of {SEG_NORMS}, got {p.seg_norm!r}")


def _check_range(name: str, v: float) -> None:
    if not np.isfinite(v):
        raise ValueError(f"AdvantageParams.{name} must be finite, got {v}")
    rule = _RANGES.get(name)
    if rule is not None and not rule[0](v):
        raise ValueError(f"AdvantageParams.{name} must be {rule[1]}, got {v}")


def stack_params(params: list[AdvantageParams]) -> AdvantageParams:
    """Stack a list of params into one with leading axis [G] for `jax.vmap(in_axes=0)`.

    All members must share the static switches (they select the program, not a value).
    """
    if not params:
        raise ValueError("stack_params: empty list")
    static = [(p.stats_over_steps, p.gigpo_norm, p.seg_norm) for p in params]
    if len(set(static)) != 1:
        raise ValueError(f"stack_params: static switches differ across the grid: {sorted(set(static))}")
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x, jnp.float32) for x in xs]), *params)
