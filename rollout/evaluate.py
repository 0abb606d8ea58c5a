"""Held-out evaluation: one episode per held-out task, success overall, by horizon bucket (L*) and
by task type, at the sampling temperature and (config.eval.greedy) greedily.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from rollout.collect import collect
from rollout.progress import note
from rollout.report import BUCKETS
from rollout.setup import env_kwargs, rollout_config

if TYPE_CHECKING:
    from rollout.run import Run


def evaluation_rollout(run: Run, envs, tasks: list[int], temperature: float):
    """One episode per held-out task at `temperature` -> the RolloutResult (trajectories and texts),
    with the same sampler keys for every checkpoint.

    Several processes: only process 0 evaluates (no collective inside), with the params
    iteration_step already gathered."""
    if run.nproc > 1 and not run.policy_synced:
        raise RuntimeError(
            "evaluate on several processes needs a policy synced by every process first "
            "(Run.sync_policy): gathering the params here would wait forever on the others"
        )
    run.sync_policy()
    run.policy.reseed(int(run.config.seed) + 1, 0)  # the same eval samples for every checkpoint
    run.set_temperature(temperature)
    # A line saying what runs, then the per-step bar (rate and ETA over the episodes' steps, from
    # the resets on; rollout/progress.py): a real model's evaluation takes minutes, and a silent
    # one looks hung.
    shown = bool(run.config.log.progress)
    note(f"evaluating {len(tasks)} held-out tasks at temperature {temperature:g}", enabled=shown)
    cfg = dataclasses.replace(rollout_config(run.config, eval_mode=True), progress=shown)
    return collect(envs, run.policy, tasks, cfg)


def evaluate(run: Run, envs, tasks: list[int], temperature: float, prefix: str, task_types: dict) -> dict:
    """Success overall, per horizon bucket and per task type on held-out tasks (one episode each,
    `evaluation_rollout`)."""
    res = evaluation_rollout(run, envs, tasks, temperature)
    won = np.asarray(res.traj.won)[:, 0, 0]
    valid = np.asarray(res.traj.traj_mask)[:, 0, 0]
    horizon = np.asarray(res.traj.horizon)
    # Each task's outcome, for whoever writes them out (the trainer: evals/iter_*.json): paired
    # comparisons of two checkpoints need the tasks, not only the means.
    run.eval_outcomes[prefix] = {
        "tasks": [int(t) for t in tasks],
        "won": won.astype(int).tolist(),
        "valid": valid.astype(int).tolist(),
        "horizon": horizon.astype(int).tolist(),
        "temperature": float(temperature),
    }
    steps = np.asarray(res.traj.step_mask) & valid[:, None, None, None]
    invalid = np.asarray(res.traj.invalid) & steps
    out = {
        f"{prefix}/success": float(won[valid].mean()) if valid.any() else 0.0,
        f"{prefix}/tasks": int(valid.sum()),
        # the share of the steps whose output parsed as an admissible action
        f"{prefix}/valid_action_rate": float(1.0 - invalid.sum() / max(int(steps.sum()), 1)),
    }
    bk = bucket_of(horizon)
    for i, name in enumerate(BUCKETS):
        sel = valid & (bk == i)
        if sel.any():
            out[f"{prefix}/success_{name}"] = float(won[sel].mean())
            out[f"{prefix}/n_{name}"] = int(sel.sum())
    types = np.asarray([task_types.get(t, "unknown") for t in tasks])
    for ty in sorted(set(types)):
        sel = valid & (types == ty)
        if sel.any():
            out[f"{prefix}/success_type/{ty}"] = float(won[sel].mean())
    return out


def bucket_of(h: np.ndarray) -> np.ndarray:
    return np.where(h <= 4, 0, np.where(h <= 7, 1, 2))


def task_types_of(config, tasks: list[int], split: str) -> dict:
    """task seed -> task type (reset each task once; cheap for household, a few ms per ALFWorld game)."""
    from rollout.envs import make_env

    env = make_env(config.env.name, **env_kwargs(config, split))
    out = {}
    for t in tasks:
        _, info = env.reset(seed=t)
        out[t] = str(info.get("task_type", "unknown"))
    if hasattr(env, "close"):
        env.close()
    return out


def timed_evals(run: Run, envs, tasks, types) -> dict:
    t0 = time.perf_counter()
    out = run_evals(run, envs, tasks, types)
    out["time/eval_s"] = time.perf_counter() - t0
    return out


def run_evals(run: Run, envs, tasks, types) -> dict:
    c = run.config
    out = evaluate(run, envs, tasks, float(c.sampling.eval_temperature), "eval", types)
    if c.eval.greedy:
        out.update(evaluate(run, envs, tasks, 0.0, "eval_greedy", types))
    return out
