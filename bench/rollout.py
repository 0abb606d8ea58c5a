"""Rollout benchmarks, one line per figure:

1. environment steps/s (household; ALFWorld when its env and data are present) through the env
   pool with 1 and 2 worker processes, random admissible actions;
2. the share of a rollout iteration's wall time spent outside the policy call (env stepping,
   prompt building, parsing, batch building), with a scripted policy on household. A scripted
   policy answers in microseconds, so the share is reported against a *simulated* sampler latency
   per batched call (`--policy-latency-s`, default 1 s: ~48 decode steps of a 1.5B model on one
   accelerator for a few hundred rows); the absolute non-policy time per step is printed too, so
   the share can be recomputed for any sampler.

    python bench/rollout.py [--quick] [--policy-latency-s 1.0] [--no-alfworld] [--only share|env]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import re
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.collect import RolloutConfig, collect, to_env_out  # noqa: E402
from rollout.policy import ScriptedPolicy  # noqa: E402

SHARED = Path(os.environ.get("STRATA_SHARED", Path(__file__).resolve().parents[2] / "shared"))


# --- 1. env steps/s -------------------------------------------------------------------------------


def make_pool(make_fn, num_envs: int, workers: int):
    """The project's EnvPool with `workers` processes (0: SerialEnvPool, in this process)."""
    from rollout.envs.vector import EnvPool, SerialEnvPool

    if workers == 0:
        return SerialEnvPool([make_fn] * num_envs)
    return EnvPool([make_fn] * num_envs, num_workers=workers, timeout_s=300.0)


def env_steps_per_s(pool, num_envs: int, steps: int, seed0: int = 0) -> float:
    """Random admissible actions on every env for `steps` steps (reset when done)."""
    rng = random.Random(0)
    idx = list(range(num_envs))
    adm = [_admissible(to_env_out(o, True)) for o in pool.reset(idx, [seed0 + i for i in idx])]
    n, t0 = 0, time.perf_counter()
    for _ in range(steps):
        res = [to_env_out(r, False) for r in pool.step(idx, [rng.choice(a) for a in adm])]
        n += len(idx)
        done = [i for i, r in enumerate(res) if r.crashed or r.terminated or r.truncated]
        adm = [_admissible(r) for r in res]
        for i, o in zip(done, pool.reset(done, [seed0 + num_envs + i for i in done])):
            adm[i] = _admissible(to_env_out(o, True))
    return n / (time.perf_counter() - t0)


def _admissible(r) -> list[str]:
    return r.info.get("admissible_commands") or ["look"]


def bench_env(name: str, make_fn, num_envs: int, steps: int) -> None:
    for workers in (0, 1, 2):  # 0 = in-process SerialEnvPool, for reference
        pool = make_pool(make_fn, num_envs, workers)
        try:
            sps = env_steps_per_s(pool, num_envs, steps)
        finally:
            getattr(pool, "close", lambda: None)()
        print(f"env_steps_per_s {name} workers={workers} envs={num_envs}: {sps:,.0f}")


def household_fn(max_steps: int):
    from rollout.envs import make_env

    return functools.partial(make_env, "household", max_steps=max_steps)  # picklable for workers


def alfworld_fn(data_dir: str, max_steps: int):
    from rollout.envs import make_env

    return functools.partial(make_env, "alfworld", data_dir=data_dir, split="valid_seen", max_steps=max_steps)


# --- 2. share of an iteration outside the policy -------------------------------------------------

_ADM = re.compile(r"Admissible actions: (.*)")


def bench_script(latency_s: float):
    """Random admissible action (10% garbage), fixed strategies / judgments, + simulated latency."""

    def script(messages, kind, key):
        h = zlib.crc32(repr(key).encode())
        if kind == "strategy":
            return f"<strategy>search place {h % 7} first, then finish the task</strategy>"
        if kind == "judge":
            return "<bad_steps>1</bad_steps>" if h % 3 else "<bad_steps>none</bad_steps>"
        m = _ADM.search(messages[-1]["content"])
        cmds = m.group(1)[1:-1].split("', '") if m else ["look"]
        if h % 10 == 0:
            return "I am not sure what to do."
        return f"<think>ok</think><action>{cmds[h % len(cmds)]}</action>"

    class Latent(ScriptedPolicy):
        latency = latency_s

        def generate(self, prompts, kind, keys=None):
            time.sleep(self.latency)  # stands in for one batched decode on the accelerator
            return super().generate(prompts, kind, keys)

    return Latent(script)


def bench_share(args) -> None:
    from rollout.envs.vector import SerialEnvPool

    cfg = RolloutConfig(
        mode="strata",
        num_strategies=args.n,
        traj_per_strategy=args.m,
        oversample=8,
        max_steps=args.max_steps,
        progress=False,
        row_multiple=256,
        length_buckets=None,
    )
    E = args.tasks * args.n * args.m
    envs = SerialEnvPool([household_fn(args.max_steps)] * E)  # the config default (num_workers=0)
    policy = bench_script(0.0)
    collect(envs, policy, list(range(args.tasks)), cfg)  # warm-up: jit of the strategy selection
    policy.latency, policy.calls = args.policy_latency_s, []
    res = collect(envs, policy, list(range(args.tasks)), cfg)
    s = res.stats
    calls = len(policy.calls)
    non_policy = s["time_s"] - s["policy_time_s"]
    print(
        f"rollout iteration P={args.tasks} N={args.n} M={args.m} H={args.max_steps}: "
        f"{s['time_s']:.2f} s, {calls} policy calls, {s['steps']:.0f} env steps, "
        f"{s['rows']:.0f} token rows"
    )
    print(
        f"rollout non-policy time: {non_policy:.3f} s per iteration, "
        f"{1e3 * non_policy / max(calls, 1):.1f} ms per policy call "
        f"(env {s['env_time_s']:.3f} s, batch build {s['build_time_s']:.3f} s)"
    )
    pure = non_policy / max(non_policy + calls * args.policy_latency_s, 1e-9)
    print(
        f"rollout non-policy share @ simulated sampler latency {args.policy_latency_s:g} s/call: "
        f"{100 * s['non_policy_share']:.1f}% (goal < 10%; {100 * pure:.1f}% against the sleep "
        f"alone, without the scripted policy's own tokenizing)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--envs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--policy-latency-s", type=float, default=1.0)
    ap.add_argument("--no-alfworld", action="store_true")
    ap.add_argument("--only", choices=("env", "share"), default=None)
    args = ap.parse_args()
    if args.quick:
        args.envs, args.steps, args.tasks, args.max_steps = 16, 10, 4, 10
        args.policy_latency_s = min(args.policy_latency_s, 0.2)

    if args.only in (None, "env"):
        bench_env("household", household_fn(30), args.envs, args.steps)
        if not args.no_alfworld:
            run_alfworld(args)
    if args.only in (None, "share"):
        bench_share(args)


def run_alfworld(args) -> None:
    try:
        import rollout.envs.alfworld  # noqa: F401
    except ImportError as e:
        print(f"env_steps_per_s alfworld: skipped (no rollout/envs/alfworld.py: {e})")
        return
    archive = SHARED / "data" / "alfworld" / "eval.tar.xz"
    if not archive.exists():
        print(f"env_steps_per_s alfworld: skipped ({archive} not found)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        n = min(args.envs, 8)  # a TextWorld game is ~100x heavier than a household step
        bench_env("alfworld", alfworld_fn(tmp, 30), n, max(args.steps // 4, 5))


if __name__ == "__main__":
    main()
