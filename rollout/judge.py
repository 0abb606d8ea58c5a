"""Self-judgment (ALGORITHMS 3.4): after its episode, the policy names the steps of a trajectory
that neither follow the strategy nor advance the task.

Pure text in, verdicts out; the rollout loop makes the one batched policy call between
`judge_prompts` and `verdicts` (so it is timed and checked like every other call). Judgment tokens
are not trained (`judge_train` raises in RolloutConfig.validate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rollout.parsing import parse_bad_steps
from rollout.prompts import judge_prompt


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
    gens = policy.generate(judge_prompts(items, excerpt_chars), "judge",
                           keys=[it.key for it in items])
    return verdicts(items, gens)
