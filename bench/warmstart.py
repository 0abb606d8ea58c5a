"""Does a warm start leave room for RL? Reads the first training iteration of a run (its rollouts
are the warm-start policy at the training temperature) and prints the figures that decide it:

- invalid rate (goal: at most 0.10);
- exploration: the entropy (nats) of the actions the group's trajectories took at their first
  step, where they all see the same state, averaged over groups (0 = every sample the same);
- mixed outcomes: the share of task groups (per strategy for StraTA) with some wins and some
  losses, overall and per horizon bucket (goal: at least half of the medium-task groups).

    python bench/warmstart.py runs/tiny_household        # a workdir with batches/iter_00001.*

One line: `warm start: invalid 0.04, first-step action entropy 0.61 nats, mixed groups 0.55 (short
0.40, medium 0.62, long 0.50)`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections import Counter

import numpy as np

BUCKETS = (("short", 0, 4), ("medium", 5, 7), ("long", 8, 10**9))


def figures(workdir: pathlib.Path, iteration: int = 1) -> dict:
    base = workdir / "batches" / f"iter_{iteration:05d}"
    b = np.load(f"{base}.npz")
    texts = json.loads(pathlib.Path(f"{base}.texts.json").read_text())
    steps, invalid = b["step_mask"], b["invalid"]
    won, traj = b["won"], b["step_mask"].any(-1)  # [P, N, M]
    horizon = b["horizon"]  # [P]
    wins, n = (won & traj).sum(-1), traj.sum(-1)  # [P, N]
    mixed = (wins > 0) & (wins < n) & (n > 1)
    out = {
        "invalid_rate": float(invalid[steps].mean()) if steps.any() else 0.0,
        "mixed_groups": float(mixed[n > 1].mean()) if (n > 1).any() else 0.0,
    }
    for name, lo, hi in BUCKETS:
        sel = ((horizon >= lo) & (horizon <= hi))[:, None] & (n > 1)
        out[f"mixed_{name}"] = float(mixed[sel].mean()) if sel.any() else float("nan")
    first: dict[tuple, list[str]] = {}
    for tr in texts["trajectories"]:
        if tr["steps"]:
            p, g = tr["key"][0], tr["key"][1]
            first.setdefault((p, g), []).append(tr["steps"][0]["action"] or "<invalid>")
    ents = []
    for acts in first.values():
        if len(acts) > 1:
            c = np.asarray(list(Counter(acts).values()), np.float64) / len(acts)
            ents.append(float(-(c * np.log(c)).sum()))
    out["first_step_entropy"] = float(np.mean(ents)) if ents else 0.0
    return out


def line(f: dict) -> str:
    buckets = ", ".join(f"{name} {f[f'mixed_{name}']:.2f}" for name, _, _ in BUCKETS)
    return (
        f"warm start: invalid {f['invalid_rate']:.3f}, first-step action entropy {f['first_step_entropy']:.2f} "
        f"nats, mixed groups {f['mixed_groups']:.2f} ({buckets})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workdir")
    p.add_argument("--iteration", type=int, default=1)
    a = p.parse_args()
    print(line(figures(pathlib.Path(a.workdir), a.iteration)))


if __name__ == "__main__":
    main()
