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
"""

from __future__ import annotations

import random

from rollout.envs.base import EnvError, TextEnv

COLORS = ("red", "blue", "green", "yellow", "white", "black")
OPENS = "red"  # the door that opens
LOCKED = "The door is locked. Nothing happens."


class DoorsEnv(TextEnv):
    """See the module docstring. `doors`: (lo, hi) number of doors; `options`: doors listed per step
    (the first `options` colours, shuffled)."""

    def __init__(self, max_steps: int | None = None, doors: tuple[int, int] = (2, 2), options: int = 2):
        lo, hi = (int(doors), int(doors)) if isinstance(doors, int) else map(int, doors)
        if not 1 <= lo <= hi:
            raise ValueError(f"doors must be (lo, hi) with 1 <= lo <= hi, got {doors}")
        if not 2 <= options <= len(COLORS):
            raise ValueError(f"options={options} must be in [2, {len(COLORS)}]")
        super().__init__(hi if max_steps is None else int(max_steps))
        self.doors, self.options = (lo, hi), int(options)
        self.lists: list[list[str]] = []

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = random.Random(0 if seed is None else int(seed))
        n = rng.randint(*self.doors)
        self.lists = [[f"open the {c} door" for c in rng.sample(COLORS[: self.options], self.options)]
                      for _ in range(n)]
        self.at, self.steps, self.done, self.won = 0, 0, False, False
        info = {"task": "go through every door.", "admissible_commands": list(self.lists[0]),
                "task_type": "doors", "horizon": n, "task_id": f"doors/{seed}", "won": False,
                "milestones_total": n}
        return self._here(), info

    def _here(self) -> str:
        return f"You are at door {self.at + 1} of {len(self.lists)}."

    def step(self, action: str):
        if not self.lists:
            raise EnvError("step() before reset()")
        if self.done:
            raise EnvError("step() after the episode ended; call reset()")
        self.steps += 1
        right = " ".join(str(action).lower().split()) == f"open the {OPENS} door"
        if right:
            self.at += 1
            self.won = self.at == len(self.lists)
            obs = "The door opens. " + ("You are through the last door." if self.won else self._here())
        else:
            obs = f"{LOCKED} {self._here()}"
        truncated = not self.won and self.steps >= self.max_steps
        self.done = self.won or truncated
        admissible = [] if self.won else list(self.lists[self.at])
        info = {"won": self.won, "milestone": right, "milestone_name": f"door {self.at}" if right else None,
                "admissible_commands": admissible}
        return obs, 0.0, self.won, truncated, info
