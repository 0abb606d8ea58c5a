"""The prefix cache (`sampling.prefix_cache`) on a real model's rollouts: the same iterations'
rollouts collected with and without it, side by side in one process.

One Run of the config (default configs/smol_household.py: SmolLM2-135M-Instruct, StraTA, 2 tasks x
2 strategies x 2 trajectories) starts from a warm-started model (`--model DIR`, e.g. a run's
sft_model/; without it the config's own SFT runs first, into `--keep`). Two policies share its
params: the config's sampler without the cache and the same with it. Each measured iteration's
rollout is first collected once by each (compiling the shapes it needs), then `--repeats` times
by each, alternating, from the same sampling keys; the minimum of each figure is kept. The two
collect the same rollouts up to float rounding (a near-tie can flip a token; the bench counts the
action rows whose tokens differ).

Prints per policy the rollout's wall time, the sampler seconds of each call kind, the action
calls' prefill and decode seconds, their padded prefill tokens and the cache's hits; with
`--eval-tasks K`, the same for an evaluation of K held-out tasks; then one line:

    prefix cache rollout speed-up: X.XXx

    python bench/prefix_cache.py --model runs/smol_household/sft_model [--iterations 2] [--repeats 2]
                                 [--eval-tasks 16] [--config configs/smol_household.py] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ARGS.add_argument("--model", default=None, help="warm-started HF model dir (default: run the config's SFT)")
ARGS.add_argument("--config", default="configs/smol_household.py")
ARGS.add_argument("--iterations", type=int, default=2, help="measured iterations (each its own tasks)")
ARGS.add_argument("--repeats", type=int, default=2, help="timed collections per iteration and policy")
ARGS.add_argument("--eval-tasks", type=int, default=0, help="also time an evaluation of this many held-out tasks")
ARGS.add_argument("--keep", default=None, help="workdir to keep (default: a temporary one)")
ARGS.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
OPTS = ARGS.parse_args()

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from rollout.cpu_memory import keep_freed_memory_on_cpu  # noqa: E402

keep_freed_memory_on_cpu()

import numpy as np  # noqa: E402


def load_config(path: str, overrides):
    from configs.base import apply_overrides, load_config_file, validate

    c = load_config_file(path)
    apply_overrides(c, overrides)
    c.log.progress = False
    c.eval.every = 0
    c.checkpoint.every = 0
    c.sampling.prefix_cache = False
    return validate(c)


def policies(run):
    """(without the cache: the run's own policy, with it: a twin over the same params)."""
    base = run.policy
    cached = run.new_policy(base.params, prefix_cache=True)
    cached.kind_sampling = dict(base.kind_sampling)
    return {"no cache": base, "cache": cached}


def counters(policy) -> dict:
    a = policy.samplers["action"]
    out = {f"{k}_s": v for k, v in policy.seconds_by_kind.items()}
    out.update(
        prefill_s=a.seconds["prefill"],
        decode_s=a.seconds["decode"],
        prefill_tokens=a.prefill_tokens,
        hit_rows=a.cache_stats["hit_rows"],
        reused_tokens=a.cache_stats["reused_tokens"],
    )
    return out


def timed(policy, fn) -> tuple[dict, object]:
    before = counters(policy)
    t0 = time.perf_counter()
    res = fn()
    out = {"wall_s": time.perf_counter() - t0}
    out.update({k: v - before[k] for k, v in counters(policy).items()})
    return out, res


def action_rows(res) -> np.ndarray:
    """The action-step rows' tokens [rows, L] (what the two policies should agree on)."""
    t = np.asarray(res.tokens.row_index)[:, 3]
    keep = np.asarray(res.tokens.row_valid) & (t >= 0) & (t < np.asarray(res.traj.step_mask).shape[-1])
    return np.asarray(res.tokens.tokens)[keep]


def main() -> None:
    from configs.base import start_from
    from rollout.collect import collect
    from rollout.evaluate import evaluation_rollout
    from rollout.run import Run
    from rollout.setup import eval_tasks, make_envs, make_mesh, rollout_config, train_tasks, trajectories_per_task
    from rollout.warmstart import model_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(OPTS.keep or tmp)
        config = load_config(OPTS.config, OPTS.set)
        model = OPTS.model or model_dir(config, root / "model", make_mesh(config))
        start_from(config, model)
        run = Run(config, root / "run", for_training=False)
        pols = policies(run)
        cfg = rollout_config(config)
        envs = make_envs(config, config.algo.tasks_per_iter * trajectories_per_task(config), config.env.split)
        best: dict[str, dict] = {name: {} for name in pols}
        differ = total = 0
        for it in range(1, OPTS.iterations + 1):
            tasks = train_tasks(config, it, None)
            figs: dict[str, list] = {name: [] for name in pols}
            rows = {}
            for r in range(OPTS.repeats + 1):  # pass 0 compiles
                for name, pol in pols.items():
                    pol.reseed(int(config.seed), it)
                    fig, res = timed(pol, lambda p=pol, t=tasks: collect(envs, p, t, cfg))
                    if r:
                        figs[name].append(fig)
                    rows[name] = action_rows(res)
                    print(f"  iteration {it} pass {r} {name:8s} rollout {fig['wall_s']:7.2f} s", flush=True)
            a, b = rows["no cache"], rows["cache"]
            if a.shape == b.shape:
                differ += int(np.any(a != b, axis=1).sum())
            else:
                differ += max(len(a), len(b))
            total += len(a)
            for name, fl in figs.items():
                for k in fl[0]:
                    best[name][k] = best[name].get(k, 0.0) + min(f[k] for f in fl) / OPTS.iterations
        evals = {}
        if OPTS.eval_tasks:
            config.eval.num_tasks = OPTS.eval_tasks
            tasks = eval_tasks(config, None)
            eval_envs = make_envs(config, len(tasks), config.env.eval_split)
            base = run.policy
            for name, pol in pols.items():
                run.policy = pol
                evaluation_rollout(run, eval_envs, tasks, float(config.sampling.eval_temperature))  # compiles
                evals[name], _ = timed(
                    pol, lambda: evaluation_rollout(run, eval_envs, tasks, float(config.sampling.eval_temperature))
                )
            run.policy = base
            if hasattr(eval_envs, "close"):
                eval_envs.close()
        if hasattr(envs, "close"):
            envs.close()
    for name, f in best.items():
        print(
            f"rollout {name:8s} {f['wall_s']:7.2f} s: strategies {f['strategy_s']:6.2f}, "
            f"actions {f['action_s']:6.2f} (prefill {f['prefill_s']:6.2f}, decode {f['decode_s']:6.2f}), "
            f"judgment {f.get('judge_s', 0.0):6.2f} s; "
            f"{f['prefill_tokens']:7.0f} padded prefill tokens, {f['hit_rows']:4.0f} cached rows "
            f"reusing {f['reused_tokens']:6.0f} tokens"
        )
    for name, f in evals.items():
        print(
            f"evaluation of {OPTS.eval_tasks} tasks {name:8s} {f['wall_s']:7.2f} s: actions prefill "
            f"{f['prefill_s']:6.2f}, decode {f['decode_s']:6.2f} s; {f['prefill_tokens']:7.0f} padded prefill tokens"
        )
    print(f"action rows whose tokens differ between the two: {differ} of {total} (float rounding at near-ties)")
    if evals:
        print(f"prefix cache evaluation speed-up: {evals['no cache']['wall_s'] / evals['cache']['wall_s']:.2f}x")
    print(f"prefix cache rollout speed-up: {best['no cache']['wall_s'] / best['cache']['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
