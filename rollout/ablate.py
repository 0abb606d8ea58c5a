"""`launch.py ablate`: advantages and diagnostics of saved rollout batches over a hyper-parameter grid,
in ONE vmapped, jitted call per batch (the grid is a stacked AdvantageParams, so nothing retraces).

    python launch.py ablate --workdir runs/x --grid delta=0.25,0.5,0.75,1 --grid kappa=0,0.1,0.2

Writes ablation.csv (one row per grid point, metrics averaged over the saved batches) and
ablation.png (ESU, CAR, CCR and strategy-ranking agreement per grid point).
"""

from __future__ import annotations

import csv
import itertools
import pathlib

import jax
import numpy as np

from rollout.setup import advantage_params
from strata_jax.advantages import compute_advantages
from strata_jax.advantages.params import AdvantageParams, stack_params
from strata_jax.batch import TrajectoryBatch
from strata_jax.diagnostics import compute_diagnostics
from strata_jax.names import BEACON_ALGOS, STRATA_ALGOS

# Traced advantage parameters a saved batch can be re-scored under.
SWEEPABLE = ("delta", "kappa", "gamma", "beacon_gamma", "lam_seg", "omega", "invalid_penalty", "r_ms", "c_len", "c_fmt")
# lam_strategy weights the strategy rows in the loss only (ALGORITHMS.md 3.5): re-scoring cannot see
# it, so only a population training (`ablate --train`) sweeps it.
LOSS_ONLY = ("lam_strategy",)
METRICS = ("esu", "zero_adv_ratio", "car", "ccr")
# The algorithms whose advantages (or loss) read each parameter (strata_jax/advantages/). A grid
# over a parameter the run's algorithm never reads would train or score K identical copies.
READ_BY = {
    "delta": STRATA_ALGOS,
    "kappa": STRATA_ALGOS,
    "c_len": STRATA_ALGOS,
    "c_fmt": STRATA_ALGOS,
    "lam_strategy": STRATA_ALGOS,
    "gamma": ("gigpo",),
    "omega": ("gigpo",),
    "beacon_gamma": BEACON_ALGOS,
    "lam_seg": BEACON_ALGOS,
    "r_ms": BEACON_ALGOS,
}


def parse_grid(
    specs: list[str], allowed: tuple[str, ...] = SWEEPABLE, algo: str | None = None
) -> dict[str, list[float]]:
    """['delta=0.25,0.5', 'kappa=0,0.1'] -> {'delta': [0.25, 0.5], 'kappa': [0.0, 0.1]}; names checked,
    and with `algo` also that the algorithm reads each name (READ_BY)."""
    if not specs:
        raise ValueError("ablate needs at least one --grid NAME=v1,v2,...")
    grid = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep or not values.strip():
            raise ValueError(f"--grid {spec!r}: expected NAME=v1,v2,...")
        if name in LOSS_ONLY and name not in allowed:
            raise ValueError(
                f"--grid {name!r} weights the loss only, so re-scoring saved batches cannot show it: "
                "sweep it with `launch.py ablate --train`"
            )
        if name not in allowed:
            raise ValueError(f"--grid {name!r} is not sweepable; choose from {list(allowed)}")
        if algo is not None and algo not in READ_BY.get(name, (algo,)):
            raise ValueError(
                f"--grid {name!r} is not read by algo.name={algo!r} (only by {', '.join(READ_BY[name])}): "
                "every grid point would give the same result"
            )
        if name in grid:
            raise ValueError(f"--grid {name!r} given twice")
        try:
            grid[name] = [float(v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"--grid {spec!r}: values must be numbers") from None
    return grid


def grid_points(base: AdvantageParams, grid: dict[str, list[float]]) -> tuple[list[dict], AdvantageParams]:
    """The product grid as dicts and as one stacked AdvantageParams with leading axis [G]."""
    names = list(grid)
    points = [dict(zip(names, vals)) for vals in itertools.product(*(grid[n] for n in names))]
    return points, stack_params([base.replace(**p) for p in points])


def load_batches(workdir: pathlib.Path) -> list[TrajectoryBatch]:
    files = sorted((workdir / "batches").glob("iter_*.npz"))
    if not files:
        raise FileNotFoundError(
            f"no saved rollout batches under {workdir / 'batches'} (train with log.save_batches=True)"
        )
    out = []
    for f in files:
        with np.load(f) as z:
            out.append(TrajectoryBatch.from_numpy(**{k: z[k] for k in z.files}))
    return out


def _grid_fn(algo: str):
    def one(batch, params):
        adv = compute_advantages(batch, params, algo)
        diag = compute_diagnostics(batch, adv)
        return adv.strategy, {k: diag[k] for k in METRICS}

    return jax.jit(jax.vmap(one, in_axes=(None, 0)))


def _rank_agreement(strategy_adv: np.ndarray, mask: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """[G] mean Spearman correlation, over tasks with >= 2 strategies, of each grid point's
    strategy ranking with the reference ranking (the run's own config)."""
    g = strategy_adv.shape[0]
    out = np.full(g, np.nan)
    tasks = [p for p in range(mask.shape[0]) if mask[p].sum() >= 2]
    if not tasks:
        return out

    def ranks(x):
        return np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(float)

    for i in range(g):
        cors = []
        for p in tasks:
            a, b = ranks(strategy_adv[i, p][mask[p]]), ranks(ref[p][mask[p]])
            if a.std() > 0 and b.std() > 0:
                cors.append(np.corrcoef(a, b)[0, 1])
        out[i] = np.mean(cors) if cors else np.nan
    return out


def ablation_table(
    batches: list[TrajectoryBatch], base: AdvantageParams, grid: dict[str, list[float]], algo: str
) -> list[dict]:
    points, stacked = grid_points(base, grid)
    fn = _grid_fn(algo)
    ref_fn = jax.jit(lambda b, p: compute_advantages(b, p, algo).strategy)
    acc = {k: np.zeros(len(points)) for k in (*METRICS, "strategy_rank_agreement")}
    counts = {k: np.zeros(len(points)) for k in acc}
    for batch in batches:
        s_adv, diag = jax.device_get(fn(batch, stacked))
        ref = np.asarray(ref_fn(batch, base))
        vals = {k: np.asarray(v, float) for k, v in diag.items()}
        vals["strategy_rank_agreement"] = _rank_agreement(np.asarray(s_adv), np.asarray(batch.strategy_mask), ref)
        for k, v in vals.items():
            ok = np.isfinite(v)
            acc[k][ok] += v[ok]
            counts[k][ok] += 1
    rows = []
    for i, p in enumerate(points):
        row = dict(p)
        for k in acc:
            row[k] = acc[k][i] / counts[k][i] if counts[k][i] else float("nan")
        rows.append(row)
    return rows


def write_outputs(rows: list[dict], grid: dict, out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(out_dir / "ablation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    labels = [", ".join(f"{k}={r[k]:g}" for k in grid) for r in rows]
    keys = [*METRICS, "strategy_rank_agreement"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(max(6, 0.45 * len(rows) + 2), 2.2 * len(keys)), squeeze=False)
    for ax, k in zip(axes[:, 0], keys):
        ax.bar(range(len(rows)), [r[k] for r in rows])
        ax.set_ylabel(k, fontsize=8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels if ax is axes[-1, 0] else [], rotation=60, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("ablation over saved rollout batches")
    fig.tight_layout()
    fig.savefig(out_dir / "ablation.png", dpi=90)
    plt.close(fig)


def run_ablation(config, workdir: pathlib.Path, specs: list[str]) -> pathlib.Path:
    grid = parse_grid(specs, algo=config.algo.name)
    batches = load_batches(workdir)
    rows = ablation_table(batches, advantage_params(config), grid, config.algo.name)
    write_outputs(rows, grid, workdir)
    print(f"{len(rows)} grid points x {len(batches)} batches -> {workdir / 'ablation.csv'}")
    for r in rows:
        print("  ".join(f"{k}={v:.4g}" for k, v in r.items()))
    return workdir / "ablation.csv"
