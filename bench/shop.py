"""Shop environment speed: steps/s of random admissible play, in this process.

One env plays random admissible actions; `search[<your query>]` is filled with 1-4 random words of
the instruction. Episodes end at `buy now` or after 15 steps and reset onto the next of 16 task
seeds, cycling, as a training iteration resets its P tasks N x M times (each task is generated once
per process, then cached). The catalogue and index are built before the clock starts.

    python bench/shop.py [--steps 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.envs.shop import SEARCH, ShopEnv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--tasks", type=int, default=16)
    args = ap.parse_args()
    env = ShopEnv(max_steps=15)  # builds (and caches) the catalogue and its BM25 index
    rng = random.Random(0)
    episodes = 0

    def reset():
        nonlocal episodes
        _, info = env.reset(seed=episodes % args.tasks)
        episodes += 1
        return info["task"].split(","), info["admissible_commands"]

    t0 = time.perf_counter()
    words, adm = reset()
    words = " ".join(words).split()
    for _ in range(args.steps):
        a = rng.choice(adm)
        if a == SEARCH:
            a = f"search[{' '.join(rng.sample(words, rng.randint(1, min(4, len(words)))))}]"
        _, _, term, trunc, info = env.step(a)
        adm = info["admissible_commands"]
        if term or trunc:
            words, adm = reset()
            words = " ".join(words).split()
    dt = time.perf_counter() - t0
    print(f"env_steps_per_s shop random admissible, resets over {args.tasks} tasks included: {args.steps / dt:,.0f}")


if __name__ == "__main__":
    main()
