"""Time per training iteration on the household world, StraTA vs GRPO at equal trajectories.

Both runs use the embedded default (configs/tiny_household.py) from the same SFT'd tiny model,
which is built once in a temporary workdir with a short SFT (`--sft-steps`). StraTA runs
P x N x M = 4 x 2 x 4 trajectories per iteration, GRPO P x G = 4 x 8 (no strategies, no
self-judgment), everything else equal. Phases are taken from the trainer's own metrics row
(`time/*` of rollout/iteration.iteration_step):

    strategies   the StraTA strategy call (sigma*N candidates per task + selection)   time/strategy_s
    actions      the rest of the rollout: action calls, env steps, prompts, batches    time/rollout_s - strategy - judge
    judgment     the self-judgment call                                               time/judge_s
    scoring      reference (and, if configured, old) log-probs                        time/score_s
    advantages   advantages + diagnostics (jitted)                                    time/advantages_s
    update       the optimiser steps over the iteration's rows                        time/update_s

Compilation is kept out of the figures: each measured iteration is first run once from the same
train state (compiling whatever its shapes need), then the state is restored and the iteration
is run again and timed. An iteration is a pure function of (seed, iteration, state), so the timed
run repeats the warm-up exactly. Figures are means over `--iterations` such iterations (each a
different task set). The two algorithms take different actions, so their episodes differ in
length; the per-env-step time is printed too.

    python bench/iteration.py [--iterations 2] [--sft-steps 30] [--keep DIR] [--set KEY=VALUE ...]

`--set sampling.shared_prefix=False` (any config key, repeatable) changes both runs alike.
Prints one line per figure: each phase for each algorithm, the totals, the padded prefill tokens
the sampler ran and the padded tokens the update ran (`train.shared_prefix` shares prefixes) per iteration, and StraTA's overhead over GRPO in percent (per iteration and per
env step).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from rollout.cpu_memory import keep_freed_memory_on_cpu  # noqa: E402

keep_freed_memory_on_cpu()  # as launch.py does, before jax starts its threads

PHASES = ("strategies", "actions", "judgment", "scoring", "advantages", "update")


def configs(sft_steps: int, overrides: list[str] = ()):
    """(StraTA config, GRPO config) from the embedded default; same model, same everything else."""
    import ast
    import copy

    from configs.base import validate
    from configs.tiny_household import get_config

    strata = get_config()
    for item in overrides:
        key, _, value = item.partition("=")
        node, *path = key.split(".")
        target = strata[node]
        for name in path[:-1]:
            target = target[name]
        target[path[-1]] = ast.literal_eval(value)
    strata.sft.steps = sft_steps
    strata.log.progress = False
    strata.eval.every = 0
    strata.checkpoint.every = 0
    strata.log.save_batches = False
    grpo = copy.deepcopy(strata)  # same sizes, budgets, model and training settings
    grpo.algo.name = "grpo"
    grpo.algo.group_size = strata.algo.num_strategies * strata.algo.traj_per_strategy
    grpo.algo.judgment = False
    grpo.algo.diverse = False
    return validate(strata), validate(grpo)


def phases(row: dict) -> dict[str, float]:
    strategies, judgment = row["time/strategy_s"], row["time/judge_s"]
    return {"strategies": strategies, "actions": row["time/rollout_s"] - strategies - judgment,
            "judgment": judgment, "scoring": row["time/score_s"], "advantages": row["time/advantages_s"],
            "update": row["time/update_s"]}


def measure(config, workdir: pathlib.Path, iterations: int) -> dict[str, float]:
    """Mean phase seconds (compile-free) over `iterations` iterations, and env steps per iteration."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rollout.iteration import iteration_step
    from rollout.run import Run
    from rollout.setup import make_envs, trajectories_per_task

    run = Run(config, workdir)
    c = config
    per_iter = c.algo.tasks_per_iter * trajectories_per_task(c)
    envs = make_envs(c, per_iter, c.env.split)
    sums = dict.fromkeys(PHASES, 0.0)
    steps = 0.0
    samplers = run.policy.samplers.values()
    for it in range(1, iterations + 1):
        start = jax.tree.map(jnp.copy, run.state)  # the update donates the state: keep a copy
        iteration_step(run, envs, it, None)  # warm-up: compiles this iteration's shapes
        run.state = start
        before = sum(x.prefill_tokens for x in samplers)
        row, res = iteration_step(run, envs, it, None)
        sums["prefill_tokens"] = sums.get("prefill_tokens", 0.0) + (
            sum(x.prefill_tokens for x in samplers) - before) / iterations
        sums["update_tokens"] = sums.get("update_tokens", 0.0) + row["time/update_model_tokens"] / iterations
        for k, v in phases(row).items():
            sums[k] += v / iterations
        steps += float(np.asarray(res.traj.step_mask).sum()) / iterations
    if hasattr(envs, "close"):
        envs.close()
    return {**sums, "total": sum(sums[k] for k in PHASES), "env_steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=2, help="measured iterations per algorithm")
    ap.add_argument("--sft-steps", type=int, default=30, help="SFT steps of the shared tiny model")
    ap.add_argument("--keep", default=None, help="workdir to keep (default: a temporary one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for both runs, e.g. sampling.shared_prefix=False")
    a = ap.parse_args()

    from rollout.setup import make_mesh
    from rollout.warmstart import model_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(a.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        strata, grpo = configs(a.sft_steps, a.set)
        model = model_dir(strata, root / "model", make_mesh(strata))
        out = {}
        for name, cfg in (("strata", strata), ("grpo", grpo)):
            cfg.model.path = str(model)
            out[name] = measure(cfg, root / name, a.iterations)
    s, g = out["strata"], out["grpo"]
    for name, r in out.items():
        for k in PHASES:
            print(f"iteration {name:6s} {k:10s} {r[k]:8.2f} s")
        print(f"iteration {name:6s} {'total':10s} {r['total']:8.2f} s  ({r['env_steps']:.0f} env steps, "
              f"{1000 * r['total'] / max(r['env_steps'], 1):.1f} ms/step)")
        print(f"iteration {name:6s} {'prefill':10s} {r['prefill_tokens']:8.0f} padded prompt tokens")
        print(f"iteration {name:6s} {'update':10s} {r['update_tokens']:8.0f} padded tokens through the model")
    print(f"strata overhead over grpo per iteration: {100 * (s['total'] / g['total'] - 1):+.1f} %")
    per_step = (s["total"] / max(s["env_steps"], 1)) / (g["total"] / max(g["env_steps"], 1))
    print(f"strata overhead over grpo per env step:  {100 * (per_step - 1):+.1f} %")


if __name__ == "__main__":
    main()
