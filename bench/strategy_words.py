"""Does a StraTA run's strategy carry anything that wins? Read from its saved training batches.

    python bench/strategy_words.py runs/strata [--word red --word blue] [--permutations 200]

For every saved iteration (`batches/iter_*.texts.json`, written by every run) it prints:
- the share of trajectories that won;
- **eta^2 of the strategy slot**: per task with mixed outcomes, the share of the outcome variance
  that lies between its N strategies (each run by M trajectories), averaged over those tasks;
  beside it the same figure with the trajectories' strategy slots shuffled within each task, the
  mean over `--permutations` shuffles. With M trajectories per strategy, chance alone puts eta^2
  near (N - 1) / (N M - 1), so a strategy that changes nothing scores near its shuffled figure,
  and one that decides the outcome scores near 1;
- the share of trajectories run with the iteration's most common strategy text, and the win rate
  with it against every other strategy (does departing from the usual plan cost or pay?);
- per `--word` (whole word, any case): the share of strategies that name it, and the win rate of
  trajectories whose strategy names it against those whose strategy does not.

The last line is one comparable figure: eta^2 minus its shuffled figure, averaged over iterations.
Flat algorithms (GRPO, GiGPO, BEACON) sample no strategies; their runs are refused.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import numpy as np


def outcomes(texts: dict) -> dict:
    """task p -> (slot n per trajectory [E_p], won per trajectory [E_p], strategy text per trajectory)."""
    by_task: dict = {}
    for t in texts["trajectories"]:
        p, n, _ = t["key"]
        slot, won, strat = by_task.setdefault(p, ([], [], []))
        slot.append(int(n))
        won.append(float(bool(t["won"])))
        strat.append(t.get("strategy") or "")
    return by_task


def eta2(slot: np.ndarray, won: np.ndarray) -> float:
    """Between-slot share of the outcome variance, sum_n M_n (mean_n - mean)^2 / sum (won - mean)^2.
    NaN when every outcome is the same (nothing to explain)."""
    total = float(((won - won.mean()) ** 2).sum())
    if total == 0.0:
        return float("nan")
    between = sum(float((slot == n).sum()) * (won[slot == n].mean() - won.mean()) ** 2 for n in np.unique(slot))
    return between / total


def iteration_figures(texts: dict, words: list[str], permutations: int, rng: np.random.Generator) -> dict:
    tasks = outcomes(texts)
    won_all = np.concatenate([np.asarray(w) for _, w, _ in tasks.values()]) if tasks else np.zeros(0)
    etas, nulls = [], []
    for slot, won, _ in tasks.values():
        slot, won = np.asarray(slot), np.asarray(won)
        e = eta2(slot, won)
        if np.isnan(e):
            continue
        etas.append(e)
        nulls.append(np.mean([eta2(rng.permutation(slot), won) for _ in range(permutations)]))
    out = {
        "trajectories": int(won_all.size),
        "won": float(won_all.mean()) if won_all.size else float("nan"),
        "mixed_tasks": len(etas),
        "eta2": float(np.mean(etas)) if etas else float("nan"),
        "eta2_shuffled": float(np.mean(nulls)) if nulls else float("nan"),
        "words": {},
    }
    strategies = [s for _, _, ss in tasks.values() for s in ss]
    if strategies:  # the most common strategy text against every other: does departing from it cost?
        top = max(set(strategies), key=strategies.count)
        is_top = np.asarray([s == top for s in strategies])
        out["top"] = {
            "text": top,
            "share": float(is_top.mean()),
            "won_with": float(won_all[is_top].mean()),
            "won_without": float(won_all[~is_top].mean()) if (~is_top).any() else float("nan"),
        }
    for w in words:
        pat = re.compile(rf"\b{re.escape(w)}\b", re.IGNORECASE)
        has = np.asarray([bool(pat.search(s)) for s in strategies])
        out["words"][w] = {
            "share": float(has.mean()) if has.size else float("nan"),
            "won_with": float(won_all[has].mean()) if has.any() else float("nan"),
            "won_without": float(won_all[~has].mean()) if (~has).any() else float("nan"),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir")
    ap.add_argument("--word", action="append", default=[], help="a word a winning strategy might name (repeatable)")
    ap.add_argument("--permutations", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    wd = pathlib.Path(args.workdir)
    files = sorted((wd / "batches").glob("iter_*.texts.json"))
    if not files:
        raise SystemExit(f"{wd}/batches holds no iter_*.texts.json: not a run directory, or it saved no batches")
    algo = json.loads((wd / "config.json").read_text())["algo"]["name"] if (wd / "config.json").exists() else "strata"
    if not algo.startswith("strata"):
        raise SystemExit(
            f"{wd} ran algo.name={algo!r}, which samples no strategies; this asks what a StraTA strategy carries"
        )
    rng = np.random.default_rng(args.seed)
    rows = []
    for f in files:
        texts = json.loads(f.read_text())
        r = iteration_figures(texts, args.word, args.permutations, rng)
        r["iteration"] = int(f.name.split("_")[1].split(".")[0])
        rows.append(r)
        top = r.get("top")
        words = (
            f"  most common strategy: {top['share']:.2f} of them, won {top['won_with']:.2f} with / "
            f"{top['won_without']:.2f} without"
            if top
            else ""
        )
        words += "  " + "  ".join(
            f"{w}: {v['share']:.2f} of strategies, won {v['won_with']:.2f} with / {v['won_without']:.2f} without"
            for w, v in r["words"].items()
        )
        print(
            f"iteration {r['iteration']:3d}: won {r['won']:.2f} of {r['trajectories']}, eta2 {r['eta2']:.3f} "
            f"(shuffled {r['eta2_shuffled']:.3f}) over {r['mixed_tasks']} mixed tasks  {words}",
            flush=True,
        )
    ex = [r["eta2"] - r["eta2_shuffled"] for r in rows if not np.isnan(r["eta2"])]
    print(
        f"strategy slot eta2 minus shuffled, mean over {len(ex)} iterations: "
        f"{np.mean(ex) if ex else float('nan'):+.3f} ({wd})"
    )


if __name__ == "__main__":
    main()
