"""ScienceWorld (Wang et al., 2022) through the `scienceworld` package (a Scala simulator in a JVM).

Tasks by seed: `reset(seed=s)` plays task `tasks[s % T]` (sorted task names, or the ones given),
variation `variations[(s // T) % V]` of the chosen split (train / dev / test, ScienceWorld's own
variation lists). A task + variation is a deterministic world (the simulator's promise, checked by
the tests); ScienceWorld's gold-path generator is *not* deterministic, so it is used only for the
optional horizon.

Milestones: the task score rising above its best so far (score points come from completed
subgoals). The number of milestones is not known in advance: milestones_total = -1.
won = the task is completed (score 100). A failed task (score < 0, e.g. focusing on the wrong
object) ends the episode too: terminated is True with info["lost"] = True and won False.
horizon: -1, or with `gold_horizon=True` the length of the simulator's gold action sequence
(computed once per task + variation; it costs seconds).
"""

from __future__ import annotations

import random

from rollout.envs.base import EnvError, TextEnv

SPLITS = ("train", "dev", "test")
NOTHING = "No known action matches that input."


class ScienceWorldEnv(TextEnv):
    """One ScienceWorld JVM; see the module docstring."""

    def __init__(
        self,
        max_steps: int = 50,
        split: str = "train",
        task_names: tuple[str, ...] | None = None,
        simplification: str = "easy",
        gold_horizon: bool = False,
    ):
        super().__init__(max_steps)
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
        self.split, self.simplification, self.gold_horizon = split, simplification, gold_horizon
        self.task_names = tuple(task_names) if task_names else None
        self._sim = None
        self._variations: dict[str, list[int]] = {}
        self._horizons: dict[tuple[str, int], int] = {}
        self._seed_rng = random.Random()
        self.started, self.done = False, True

    # -- the simulator ---------------------------------------------------------------------

    def _simulator(self):
        """Start the JVM on first use; a failure says why (Java 17 must be on PATH)."""
        if self._sim is None:
            try:
                from scienceworld import ScienceWorldEnv as Simulator

                # The simulator's own step limit is kept out of the way: ours truncates.
                self._sim = Simulator("", envStepLimit=10 * self.max_steps + 100)
                names = sorted(self._sim.get_task_names())
            except Exception as e:  # noqa: BLE001
                raise EnvError(
                    f"ScienceWorld could not start its JVM (needs Java 17 on PATH; "
                    f"check `java -version`): {type(e).__name__}: {e}"
                ) from e
            if self.task_names is None:
                self.task_names = tuple(names)
            unknown = [t for t in self.task_names if t not in names]
            if unknown:
                raise ValueError(f"unknown ScienceWorld tasks {unknown}; allowed: {', '.join(names)}")
        return self._sim

    def _variations_of(self, task: str) -> list[int]:
        if task not in self._variations:
            sim = self._sim
            sim.load(task, 0, self.simplification)
            get = {"train": sim.get_variations_train, "dev": sim.get_variations_dev, "test": sim.get_variations_test}[
                self.split
            ]
            self._variations[task] = sorted(int(v) for v in get())
            if not self._variations[task]:
                raise EnvError(f"ScienceWorld task {task} has no {self.split} variations")
        return self._variations[task]

    def _horizon(self, task: str, variation: int) -> int:
        if not self.gold_horizon:
            return -1
        key = (task, variation)
        if key not in self._horizons:
            self._sim.load(task, variation, self.simplification, generateGoldPath=True)
            gold = self._sim.get_gold_action_sequence()
            self._horizons[key] = len(gold) if self._sim.goldPathGenerated else -1
        return self._horizons[key]

    # -- gym API -----------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None:
            seed = self._seed_rng.randrange(2**31)
        sim = self._simulator()
        tasks = self.task_names
        task = tasks[int(seed) % len(tasks)]
        try:
            variations = self._variations_of(task)
            variation = variations[(int(seed) // len(tasks)) % len(variations)]
            horizon = self._horizon(task, variation)
            sim.load(task, variation, self.simplification)
            look, info = sim.reset()
            goal = sim.get_task_description()
        except EnvError:
            raise
        except Exception as e:  # noqa: BLE001
            raise EnvError(f"ScienceWorld failed to reset {task} #{variation}: {type(e).__name__}: {e}") from e
        self.task, self.variation = task, variation
        self.steps, self.started, self.done, self.won = 0, True, False, False
        self.best = int(info["score"])  # some tasks start above 0
        self.valid = list(info["valid"])
        out = {
            "task": goal,
            "admissible_commands": list(self.valid),
            "task_type": task,
            "horizon": horizon,
            "task_id": f"{task}/{self.split}/{variation}",
            "won": False,
            "milestones_total": -1,
            "score": self.best,
        }
        return f"{goal}\n\n{look}", out

    def step(self, action: str):
        self._begin_step(action, started=self.started)
        command = " ".join(action.split())
        milestone, lost = None, False
        if command == "":  # the no-op: "wait" would let simulated time pass, so nothing is sent
            obs, score = NOTHING, self.best
        else:
            try:
                obs, _, _, info = self._sim.step(command)
            except Exception as e:  # noqa: BLE001
                self.done = True
                raise EnvError(f"ScienceWorld failed on {command!r}: {type(e).__name__}: {e}") from e
            score, self.valid = int(info["score"]), list(info["valid"])
            if score > self.best:
                milestone = f"score {self.best} -> {score}"
                self.best = score
            lost = score < 0
        self.won = score >= 100
        truncated = not (self.won or lost) and self.steps >= self.max_steps
        self.done = self.won or lost or truncated
        out = {
            "won": self.won,
            "milestone": milestone is not None,
            "milestone_name": milestone,
            "admissible_commands": list(self.valid),
            "score": score,
            "lost": lost,
        }
        return obs, 0.0, self.won or lost, truncated, out

    def close(self) -> None:
        if self._sim is not None:
            try:
                self._sim.close()
            finally:
                self._sim = None
