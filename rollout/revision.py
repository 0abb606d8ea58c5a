"""Strategy revision inside the rollout loop (objective in docs/CONTRACTS.md).

Before step (r+1)*K every running trajectory asks the policy, in ONE batched "strategy" call
(keys (p, n, m, r)), for a revised strategy. A well-formed answer replaces the trajectory's
strategy for the later step prompts; a malformed one keeps the strategy in force (no answer is no
rewrite) and is penalised by c_fmt in the revision's reward. Host-side records only; the batch
fields (revision_* [P,N,M,R], step_slot [P,N,M,H]) are assembled by rollout/collect.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollout import prompts
from rollout.parsing import parse_strategy


def num_revisions(max_steps: int, revise_every: int) -> int:
    """R = floor((H - 1) / K): revisions happen before steps K, 2K, ... < H (0 when K = 0)."""
    return 0 if revise_every <= 0 else (max_steps - 1) // revise_every


def is_revision_step(t: int, revise_every: int) -> bool:
    return revise_every > 0 and t > 0 and t % revise_every == 0


@dataclass
class Revisions:
    """Per-iteration revision records for E trajectories and R slots."""

    E: int
    R: int
    current: list  # [E] the strategy text in force (None for flat / no strategy)
    slot: np.ndarray = None  # [E] i32: 0 = the reset strategy, r + 1 = revision r in force
    mask: np.ndarray = None  # [E, R] bool: revision r was sampled
    malformed: np.ndarray = None  # [E, R] bool
    gens: dict = field(default_factory=dict)  # (e, r) -> Generation
    log: list = None  # [E] list of dicts, for the texts of the iteration

    def __post_init__(self):
        self.slot = np.zeros(self.E, np.int32)
        self.mask = np.zeros((self.E, self.R), bool)
        self.malformed = np.zeros((self.E, self.R), bool)
        self.log = [[] for _ in range(self.E)]

    def strategy_history(self, e: int) -> str | None:
        """The reset strategy followed by every adopted revision (for the self-judgment prompt)."""
        first = self.log[e][0]["before"] if self.log[e] else None
        text = first if first is not None else self.current[e]
        for rec in self.log[e]:
            if not rec["malformed"]:
                text = f"{text} (revised before step {rec['step'] + 1}: {rec['strategy']})"
        return text


def revision_prompts(st, active: list[int], t: int, cfg, words: int) -> list:
    return [
        prompts.revision_prompt(
            st.task_line[st.pnm(e)[0]],
            st.obs[e],
            st.rev.current[e],
            st.history[e],
            step=t,
            recent=cfg.revise_every,
            max_words=words,
            intro=cfg.intro,
        )
        for e in active
    ]


def apply_revisions(rev: Revisions, active: list[int], r: int, t: int, gens: list, budget: int | None) -> None:
    """Record revision r of each active trajectory and adopt the well-formed ones."""
    for e, g in zip(active, gens, strict=True):
        z, malformed = parse_strategy(g.text, budget)
        rev.mask[e, r], rev.malformed[e, r] = True, malformed
        rev.gens[(e, r)] = g
        rev.log[e].append(
            {"step": t, "text": g.text, "strategy": z, "malformed": bool(malformed), "before": rev.current[e]}
        )
        if not malformed:
            rev.current[e] = z
            rev.slot[e] = r + 1
