"""The text-environment interface every environment implements (gymnasium API, text spaces).

Contract (the rollout loop relies on exactly this):

    obs, info = env.reset(seed=task_seed)
        The task is a deterministic function of `task_seed` (household: generated from it; ALFWorld:
        game index `task_seed % num_tasks` of the split in sorted order). Resetting twice with the
        same seed gives the same task, which is how the G (or N x M) trajectories of a group share it.
        info: task (str, the goal line), admissible_commands (list[str]), task_type (str),
              horizon (int, L* = expert plan length), task_id (str), won (False),
              milestones_total (int, number of goal milestones, -1 if unknown)

    obs, reward, terminated, truncated, info = env.step(action)
        `action == ""` is the no-op for an invalid model output: the world does not change, a step
        is consumed, the observation says nothing happened.
        info: won (bool), milestone (bool: a goal-relevant fact became true for the first time),
              milestone_name (str or None), admissible_commands (list[str])
        terminated = won (shop: the purchase, which ends the episode whatever it scores);
        truncated = step budget reached (max_steps, set at construction).

Rewards: `reward` is the environment's own per-step shaping (0 for household / ALFWorld; the shop's
purchase score); the episode return R(tau) = r_succ * won is computed by the rollout loop, not the
env, plus the env rewards for the environments in rollout/envs REWARD_IN_RETURN (shop).
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
from gymnasium import spaces

# Printable ASCII is enough for every environment's commands and observations.
CHARSET = frozenset(string.printable)
MAX_TEXT = 8192


def text_space() -> spaces.Text:
    return spaces.Text(max_length=MAX_TEXT, min_length=0, charset=CHARSET)


class EnvError(RuntimeError):
    """An environment failed (crashed engine, missing game files); the message says which."""


class GamesNotFoundError(EnvError):
    """The environment's game files are not where the config says (raised before any episode)."""


class TextEnv(gym.Env):
    """Base class: observation and action spaces are printable text."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, max_steps: int):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = int(max_steps)
        self.observation_space = text_space()
        self.action_space = text_space()

    @property
    def num_tasks(self) -> int | None:
        """How many distinct tasks the seed cycles through (None = unbounded / procedural)."""
        return None

    def _begin_step(self, action, started: bool) -> None:
        """What every step() does first: refuse a step before reset() (`started` False), after the
        episode ended (`self.done`) or of a non-text action, then count the step (`self.steps`)."""
        if not started:
            raise EnvError("step() before reset()")
        if self.done:
            raise EnvError("step() after the episode ended; call reset()")
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        self.steps += 1
