"""Self-judgment (ALGORITHMS 3.4): after its episode, the policy names the steps of a trajectory
that neither follow the strategy nor advance the task.

Pure text in, verdicts out; the rollout loop makes the one batched policy call between
`judge_prompts` and `verdicts` (so it is timed and checked like every other call).

Trained self-judgment (docs/CONTRACTS.md): `judge.samples = k` draws k judgments per trajectory and penalises
the strict-majority set; `step_labels` is what the environment proves about each step, which
rewards the judgments when `algo.judge_train` trains them (strata_jax/advantages/judge.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from rollout.parsing import parse_bad_steps
from rollout.prompts import judge_prompt
from strata_jax.advantages.judge import judge_quality


@dataclass(frozen=True)
class JudgeItem:
    key: tuple[int, int, int]  # (p, n, m)
    task: str
    strategy: str | None
    steps: Sequence[tuple[str, str]]  # (pre-action observation, action sent; "" = invalid)


@dataclass(frozen=True)
class Verdict:
    bad: frozenset[int]  # 1-based step numbers in I; empty when unparseable
    ok: bool  # the answer parsed
    text: str


def judge_prompts(items: Sequence[JudgeItem], excerpt_chars: int = 150) -> list[list[dict]]:
    return [judge_prompt(it.task, it.strategy, it.steps, excerpt_chars) for it in items]


def verdicts(items: Sequence[JudgeItem], gens: Sequence) -> list[Verdict]:
    """Parse each generation against its trajectory's step count."""
    out = []
    for it, g in zip(items, gens, strict=True):
        bad, ok = parse_bad_steps(g.text, len(it.steps))
        out.append(Verdict(frozenset(bad), ok, g.text))
    return out


def judge(policy, items: Sequence[JudgeItem], excerpt_chars: int = 150) -> list[Verdict]:
    """Prompts -> one batched policy call -> verdicts (standalone use, e.g. evaluation)."""
    if not items:
        return []
    gens = policy.generate(judge_prompts(items, excerpt_chars), "judge", keys=[it.key for it in items])
    return verdicts(items, gens)


# The TextWorld no-op answer (ALFWorld, household): the environment saying nothing changed.
NO_CHANGE_TEXT = "Nothing happens."


def state_changed(info: dict, obs: str) -> bool:
    """Did the step change the environment's state? `info["state_changed"]` when the environment
    reports it (household does, from its world state); otherwise only TextWorld's exact no-op
    answer counts as proof of no change."""
    if "state_changed" in info:
        return bool(info["state_changed"])
    return str(obs).strip() != NO_CHANGE_TEXT


def step_labels(
    step_mask: np.ndarray, milestone: np.ndarray, invalid: np.ndarray, action_id: np.ndarray, changed: np.ndarray
) -> np.ndarray:
    """[E, H] int32: +1 a milestone step (never bad), -1 an invalid step or a repeat of an action
    already taken earlier in the trajectory that changed nothing, 0 unknown (and padding)."""
    E, H = step_mask.shape
    out = np.zeros((E, H), np.int32)
    for e in range(E):
        seen: set[int] = set()
        for t in np.flatnonzero(step_mask[e]):
            a = int(action_id[e, t])
            repeat = a >= 0 and a in seen and not changed[e, t]
            if milestone[e, t]:
                out[e, t] = 1
            elif invalid[e, t] or repeat:
                out[e, t] = -1
            if a >= 0:
                seen.add(a)
    return out


def majority(sets: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """[E, k, H], [E, k] -> [E, H] bool: steps in a strict majority of the k sets (an unparsed
    judgment's set is empty); the host twin of strata_jax.advantages.judge.majority_sets."""
    votes = (sets & ok[..., None]).sum(axis=1)
    return 2 * votes > sets.shape[1]


_judge_quality = jax.jit(judge_quality)


def judge_quality_row(traj) -> dict[str, float]:
    """The metrics row of the self-judgment's quality against the environment's labels
    (strata_jax.advantages.judge.judge_quality): judge/precision, judge/recall and their counts."""
    q = jax.device_get(_judge_quality(traj))
    return {f"judge/{k.removeprefix('judge_')}": float(v) for k, v in q.items()}
