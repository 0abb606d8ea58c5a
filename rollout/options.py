"""The rollout's settings: their allowed values and the rules between them, once and without jax.

`RolloutConfig.validate` (rollout/collect.py) applies `first_problem` to its own fields, and
configs/base.py `validate()` to a run config's keys (`CONFIG_KEYS`), before any work; each names a
setting its own way (`RolloutConfig.judge_samples` / `config.judge.samples`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from strata_jax.names import STRATA_ALGOS

MODES = ("strata", "flat")  # RolloutConfig.mode: N strategies x M trajectories, or N = 1, M = G
# Where an invalid step's penalty lands (RolloutConfig.penalty_tokens, docs/CONTRACTS.md).
PENALTY_TOKENS = ("action", "divergence", "response")
# How the agent names its action: the command's text, or its number in the admissible list.
ACTION_FORMATS = ("text", "index")
# The run config key each RolloutConfig field that a rule reads comes from (RolloutConfig.from_config).
CONFIG_KEYS = {
    "group_size": "algo.group_size",
    "num_strategies": "algo.num_strategies",
    "traj_per_strategy": "algo.traj_per_strategy",
    "oversample": "algo.oversample",
    "max_steps": "env.max_steps",
    "row_multiple": "train.mini_batch_rows",
    "judge_samples": "judge.samples",
    "revise_every": "algo.revise_every",
    "judgment": "algo.judgment",
    "judge_train": "algo.judge_train",
    "penalty_tokens": "algo.invalid_penalty_tokens",
    "action_format": "env.action_format",
}
_AT_LEAST_ONE = (
    "group_size",
    "num_strategies",
    "traj_per_strategy",
    "oversample",
    "max_steps",
    "row_multiple",
    "judge_samples",
)


def first_problem(s: Mapping[str, Any], strata: bool, name: Callable[[str], str], algo: str) -> str | None:
    """The first rule the settings `s` (RolloutConfig field -> value, the fields of CONFIG_KEYS)
    break, as one line naming each setting by `name(field)`; None if they break none. `strata`:
    the rollout samples strategies; `algo`: what it runs, for the message ("'grpo'", "mode='flat'")."""
    for field, allowed in (("penalty_tokens", PENALTY_TOKENS), ("action_format", ACTION_FORMATS)):
        if s[field] not in allowed:
            return f"{name(field)}={s[field]!r} is not allowed; choose one of {list(allowed)}"
    for field in _AT_LEAST_ONE:
        if s[field] < 1:
            return f"{name(field)}={s[field]!r} must be >= 1"
    if s["revise_every"] < 0:
        return f"{name('revise_every')}={s['revise_every']!r} must be >= 0"
    if s["revise_every"] and not strata:
        return (
            f"{name('revise_every')}={s['revise_every']!r} revises a strategy: only "
            f"{' / '.join(STRATA_ALGOS)} have one, not {algo}"
        )
    if s["judge_train"] and not s["judgment"]:
        return f"{name('judge_train')}=True needs {name('judgment')}=True (there is nothing to train)"
    if s["judge_train"] and s["judge_samples"] < 2:
        return (
            f"{name('judge_train')}=True needs {name('judge_samples')} >= 2 (GRPO over the k judgments of a "
            f"trajectory), got {s['judge_samples']!r}"
        )
    if s["action_format"] == "index" and s["penalty_tokens"] == "divergence":
        return (
            f"{name('penalty_tokens')}='divergence' compares command text; with {name('action_format')}="
            "'index' the answer is a number: use 'action'"
        )
    return None
