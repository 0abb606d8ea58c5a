"""What a workdir's model does on the held-out tasks: one evaluation, every trajectory's text saved.

    python bench/eval_dump.py runs/tiny_household [--temperature 0.4] [--tasks 256] [--first-seed 0]

Prints one line: success and how the failures split (lost with every action valid, with some
invalid, with all invalid), and writes `eval_dump_T{temperature}.json` into the workdir (the
strategies and, per trajectory, each step's observation, output and parse result) so two
checkpoints can be compared task by task. Uses the workdir's config.json and its latest checkpoint
(or its SFT model when no iteration was trained). `--first-seed 0` evaluates the SFT
demonstrations' own tasks instead of held-out ones (seen against unseen: is the model memorising?).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo's rollout/, not bench/rollout.py

import numpy as np

from configs.base import PROCEDURAL_ENVS, base_config


def _merge(config, saved: dict):
    for k, v in saved.items():
        if isinstance(v, dict) and k in config:
            _merge(config[k], v)
        else:
            config[k] = tuple(v) if isinstance(v, list) else v
    return config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--temperature", type=float, default=None, help="default: the config's eval_temperature")
    ap.add_argument("--tasks", type=int, default=None, help="default: the config's eval.num_tasks")
    ap.add_argument(
        "--first-seed",
        type=int,
        default=None,
        help="procedural worlds: evaluate seeds from this one instead of the held-out offset; "
        "0 = the SFT demonstrations' own tasks (seeds below sft.num_tasks), to compare "
        "success on seen and unseen tasks",
    )
    args = ap.parse_args()
    from rollout.evaluate import evaluation_rollout
    from rollout.run import Run
    from rollout.setup import eval_tasks, make_envs, num_tasks

    wd = pathlib.Path(args.workdir)
    # the run's saved values over today's defaults, so a run saved before a key existed still loads
    config = _merge(base_config(), json.loads((wd / "config.json").read_text()))
    if args.tasks is not None:
        config.eval.num_tasks = int(args.tasks)
        buckets = sorted(config.sampling.batch_buckets)
        while buckets[-1] < args.tasks:  # the held-out tasks are sampled in one call
            buckets.append(2 * buckets[-1])
        config.sampling.batch_buckets = tuple(buckets)
    if args.first_seed is not None:
        if config.env.name not in PROCEDURAL_ENVS:  # the others' tasks are a fixed game list
            ap.error(f"--first-seed needs a procedural world ({', '.join(PROCEDURAL_ENVS)}), not {config.env.name!r}")
        config.env.eval_seed_offset = int(args.first_seed)
    temp = float(config.sampling.eval_temperature if args.temperature is None else args.temperature)
    saved_config = (wd / "config.json").read_text()
    run = Run(config, wd, for_training=False)
    (wd / "config.json").write_text(saved_config)  # Run records its config; keep the run's own record
    tasks = eval_tasks(config, num_tasks(config, config.env.eval_split))
    envs = make_envs(config, len(tasks), config.env.eval_split)
    res = evaluation_rollout(run, envs, tasks, temp)  # what `launch.py eval` runs, same keys
    kinds = collections.Counter()
    for tr in res.texts["trajectories"]:
        bad = sum(s.get("reason") is not None for s in tr["steps"])
        kinds[
            "won"
            if tr["won"]
            else "lost_all_valid"
            if bad == 0
            else "lost_all_invalid"
            if bad == len(tr["steps"])
            else "lost_some_invalid"
        ] += 1
    name = (
        f"eval_dump_T{temp:g}"
        + ("" if args.tasks is None else f"_n{len(tasks)}")
        + ("" if args.first_seed is None else f"_from{args.first_seed}")
    )
    out = wd / f"{name}.json"
    out.write_text(json.dumps(res.texts, indent=1, default=str))
    won = np.asarray(res.traj.won)[:, 0, 0]
    print(
        f"eval dump: success {won.mean():.3f} on {len(tasks)} tasks (seeds {tasks[0]}..{tasks[-1]}) at T {temp:g}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        + f" -> {out}"
    )


if __name__ == "__main__":
    main()
