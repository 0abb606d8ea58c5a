"""Advantage + diagnostics throughput: one jitted call vs. the slow numpy reference, and vmap cost.

    python bench/advantages.py [--default-malloc]

At P=16, N=4, M=8, H=50 on one random batch: (1) one jitted call computing all five algorithms
plus diagnostics, against tests/advantage_reference.py (all five algorithms plus its ESU/CAR/CCR)
on the same inputs in the same process; (2) a 64-point vmap grid of AdvantageParams against one
point (each line also gives the two times). Prints one line per figure, then the load average.

The process keeps its freed heap memory (rollout/cpu_memory.py): XLA:CPU frees each call's
temporary buffers (a 64-point grid's are ~100x one point's) and a fresh mapping costs ~4 us per
4 KB page on the development VM. --default-malloc leaves glibc as it is.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# Before jax starts its threads (see rollout/cpu_memory.py).
if "--default-malloc" in sys.argv:
    MALLOC = "default"
else:
    from rollout.cpu_memory import keep_freed_memory  # noqa: E402

    MALLOC = "glibc, freed memory kept" if keep_freed_memory() else "default (not glibc)"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax.advantages import ALGOS, AdvantageParams, compute_advantages, stack_params  # noqa: E402
from strata_jax.batch import TrajectoryBatch  # noqa: E402
from strata_jax.diagnostics import compute_diagnostics  # noqa: E402
from tests.advantage_reference import reference_advantages, reference_diagnostics  # noqa: E402

P, N, M, H = 16, 4, 8, 50
GRID = 64


def make_batch(rng) -> dict:
    """Random ALFWorld-like batch: prefix masks, returns 10 * won, repeated anchors and actions."""
    lengths = rng.integers(5, H + 1, (P, N, M))
    mask = np.arange(H) < lengths[..., None]
    won = rng.random((P, N, M)) < 0.4
    return dict(
        step_mask=mask,
        won=won,
        episode_return=(10.0 * won).astype(np.float32),
        env_reward=np.zeros((P, N, M, H), np.float32),
        invalid=rng.random((P, N, M, H)) < 0.05,
        milestone=rng.random((P, N, M, H)) < 0.08,
        judged_bad=rng.random((P, N, M, H)) < 0.1,
        anchor_id=rng.integers(0, 40, (P, N, M, H)).astype(np.int64),
        action_id=rng.integers(0, 6, (P, N, M, H)).astype(np.int64),
        strategy_mask=np.ones((P, N), bool),
        strategy_len=rng.integers(20, 90, (P, N)).astype(np.int32),
        strategy_malformed=rng.random((P, N)) < 0.1,
        horizon=rng.integers(2, 12, P).astype(np.int32),
    )


def all_algos(batch, params):
    """Every algorithm plus the diagnostics of each: one program."""
    out = {}
    for algo in ALGOS:
        adv = compute_advantages(batch, params, algo)
        out[algo] = (adv, compute_diagnostics(batch, adv))
    return out


def best_times(fns: dict, reps: int) -> dict:
    """Minimum wall time per function over `reps` rounds, calling them in turn each round, so
    that load drift on a shared machine hits all of them alike."""
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main():
    d = make_batch(np.random.default_rng(0))
    batch = TrajectoryBatch.from_numpy(**d)
    params = AdvantageParams()
    hp = {k: (v if isinstance(v, (str, bool)) else float(v)) for k, v in vars(params).items()}
    one = jax.jit(all_algos)
    res = jax.block_until_ready(one(batch, params))

    def reference():
        out = {}
        for a in ALGOS:
            step, strategy = reference_advantages(d, hp, a)
            out[a] = (step, strategy, reference_diagnostics(d, step))
        return out

    ref = reference()
    for a in ALGOS:  # the two must agree before their speeds are compared
        np.testing.assert_allclose(np.asarray(res[a][0].step), ref[a][0], atol=1e-4, err_msg=a)
        np.testing.assert_allclose(np.asarray(res[a][0].strategy), ref[a][1], atol=1e-4, err_msg=a)
        np.testing.assert_allclose(float(res[a][1]["car"]), ref[a][2][2], atol=1e-6, err_msg=a)
    t = best_times({"ref": reference, "jit": lambda: one(batch, params)}, 3)
    t.update(best_times({"jit": lambda: one(batch, params)}, 30))

    vals = np.linspace(0.05, 0.95, GRID)
    grid = stack_params(
        [
            params.replace(
                delta=float(v),
                kappa=float(v) / 5,
                gamma=float(v),
                omega=float(v),
                lam_seg=float(v),
                beacon_gamma=float(v),
            )
            for v in vals
        ]
    )
    print(f"jit, 5 algorithms + diagnostics, P={P} N={N} M={M} H={H}: {t['jit'] * 1e3:.2f} ms/call")
    print(f"numpy reference, same work: {t['ref'] * 1e3:.0f} ms/call")
    print(f"speed-up jit vs reference: {t['ref'] / t['jit']:.0f}x (goal >= 50x)")

    adv_only = lambda b, p: {a: compute_advantages(b, p, a) for a in ALGOS}  # noqa: E731
    cases = [("5 algorithms + diagnostics", all_algos), ("5 algorithms", adv_only)]
    cases += [(a, lambda b, p, a=a: compute_advantages(b, p, a)) for a in ALGOS]
    for name, fn in cases:
        f1, fg = jax.jit(fn), jax.jit(jax.vmap(fn, in_axes=(None, 0)))
        jax.block_until_ready((f1(batch, params), fg(batch, grid)))
        bt = best_times({"one": lambda f1=f1: f1(batch, params), "grid": lambda fg=fg: fg(batch, grid)}, 10)
        goal = " (goal <= 8x)" if name.startswith("5") else ""
        print(
            f"vmap {GRID}-point grid / 1 point, {name}: {bt['grid'] / bt['one']:.2f}x{goal}"
            f"  ({bt['one'] * 1e3:.2f} ms / {bt['grid'] * 1e3:.2f} ms)"
        )
    print(f"load average {os.getloadavg()[0]:.1f}; malloc {MALLOC}")


if __name__ == "__main__":
    main()
