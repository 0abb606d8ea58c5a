"""A corridor of locked doors: the learnability test bed (tests/test_learnability.py).

At each door a few coloured doors are listed in a random order; the red one opens and the agent
moves on, any other command is a no-op ("The door is locked."). Nothing in the observation says
which door opens: the rule is learnt from the reward alone. The episode has exactly one step per
door (max_steps = doors by default), so it is won only if every choice is right: a policy that
picks uniformly among k doors wins with probability k^-L, the rule-follower always.

A policy that knows the command format but not the rule is therefore valid but weak, with one
clear thing for RL to learn: a flipped advantage sign, log-probs misaligned with their tokens, or
advantages gathered onto the wrong rows all leave it flat (or make it worse).

Milestones: each door opened (BEACON's segments). L* = the number of doors.

`sign_at = s > 0` (the signpost corridor, a controlled study of strategy revision): from door s+1 on
(1-based) a task-specific colour opens instead of red, drawn from the other listed colours, and
only the observation at door s+1 says which ("A sign here reads: green. ..."). With the corridor's
prompts (no history), a flat policy sees the sign at that one door only: to use it later, the
agent has to carry it, which is what a revised strategy (`algo.revise_every = s`, revised before
step s+1) can do and a strategy fixed at reset cannot. A corridor of at most s doors has no sign.

Every step reports `info["state_changed"]` (a locked door changes nothing), so the self-judgment's
verifiable labels (rollout/judge.py) mark a locked door tried again as a bad step.
"""

from __future__ import annotations

import random

from rollout.envs.base import EnvError, TextEnv

COLORS = ("red", "blue", "green", "yellow", "white", "black")
OPENS = "red"  # the door that opens
LOCKED = "The door is locked. Nothing happens."


class DoorsEnv(TextEnv):
    """See the module docstring. `doors`: (lo, hi) number of doors; `options`: doors listed per step
    (the first `options` colours, shuffled); `sign_at`: the signpost (module docstring), 0 = none."""

    def __init__(
        self, max_steps: int | None = None, doors: tuple[int, int] = (2, 2), options: int = 2, sign_at: int = 0
    ):
        lo, hi = (int(doors), int(doors)) if isinstance(doors, int) else map(int, doors)
        if not 1 <= lo <= hi:
            raise ValueError(f"doors must be (lo, hi) with 1 <= lo <= hi, got {doors}")
        if not 2 <= options <= len(COLORS):
            raise ValueError(f"options={options} must be in [2, {len(COLORS)}]")
        if sign_at < 0 or (sign_at and options < 3):
            raise ValueError(
                f"sign_at={sign_at} must be 0 (no sign) or >= 1 with options >= 3 (the sign's "
                f"colour is one of the other listed colours; with 2 it would be the same one "
                f"every time), got options={options}"
            )
        super().__init__(hi if max_steps is None else int(max_steps))
        self.doors, self.options, self.sign_at = (lo, hi), int(options), int(sign_at)
        self.lists: list[list[str]] = []
        self.opens: list[str] = []  # [n] the colour that opens each door

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = random.Random(0 if seed is None else int(seed))
        n = rng.randint(*self.doors)
        self.lists = [
            [f"open the {c} door" for c in rng.sample(COLORS[: self.options], self.options)] for _ in range(n)
        ]
        after = rng.choice(COLORS[1 : self.options]) if self.sign_at else OPENS  # drawn after the lists
        self.opens = [OPENS if not self.sign_at or i < self.sign_at else after for i in range(n)]
        self.at, self.steps, self.done, self.won = 0, 0, False, False
        info = {
            "task": "go through every door.",
            "admissible_commands": list(self.lists[0]),
            "task_type": "doors",
            "horizon": n,
            "task_id": f"doors/{seed}",
            "won": False,
            "milestones_total": n,
        }
        return self._here(), info

    def _here(self) -> str:
        here = f"You are at door {self.at + 1} of {len(self.lists)}."
        if self.sign_at and self.at == self.sign_at < len(self.lists):
            # The colour right after "reads:", where no listed door's colour stands (the list has
            # every colour after "open the"). The tiny warm starts read neither this nor "only the
            # X door opens" under the plain SFT loss (docs/RESULTS.md, bench/read_probe.py).
            here += f" A sign here reads: {self.opens[self.at]}. From this door on, only that colour opens."
        return here

    def step(self, action: str):
        if not self.lists:
            raise EnvError("step() before reset()")
        if self.done:
            raise EnvError("step() after the episode ended; call reset()")
        self.steps += 1
        right = " ".join(str(action).lower().split()) == f"open the {self.opens[self.at]} door"
        if right:
            self.at += 1
            self.won = self.at == len(self.lists)
            obs = "The door opens. " + ("You are through the last door." if self.won else self._here())
        else:
            obs = f"{LOCKED} {self._here()}"
        truncated = not self.won and self.steps >= self.max_steps
        self.done = self.won or truncated
        admissible = [] if self.won else list(self.lists[self.at])
        info = {
            "won": self.won,
            "milestone": right,
            "milestone_name": f"door {self.at}" if right else None,
            "admissible_commands": admissible,
            "state_changed": right,
        }
        return obs, 0.0, self.won, truncated, info
