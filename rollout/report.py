"""Run outputs a person reads: metrics.jsonl, TensorBoard events, and PNG plots in the workdir;
and each iteration's saved rollout batch (what `launch.py ablate` re-scores) with its texts.

`MetricsLog.append` is the only writer; plots are re-drawn from the whole history so a resumed run
(which re-reads metrics.jsonl) draws one continuous curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from strata_jax.batch import TrajectoryBatch

# Curves drawn on the learning-curve figure, in this order, when present.
CURVE_KEYS = (
    "train/success",
    "train/episode_return",
    "train/esu",
    "train/car",
    "train/ccr",
    "train/invalid_rate",
    "train/episode_len",
    "update/loss",
    "update/kl",
    "update/clip_frac",
    "update/entropy",
    "update/grad_norm",
    "time/iteration_s",
    "time/sample_tok_s",
)
BUCKETS = ("short", "medium", "long")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """The rows of `workdir`/metrics.jsonl, oldest first ([] when the run has not written any)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLog:
    """metrics.jsonl (+ TensorBoard) under `workdir`; `history` holds every row written so far."""

    def __init__(self, workdir: str | os.PathLike, tensorboard: bool = True):
        self.dir = pathlib.Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.history: list[dict] = read_metrics(self.dir)
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tb"))

    def truncate_after(self, iteration: int) -> None:
        """Drop rows past `iteration` (a resumed run redoes them from its checkpoint)."""
        self.history = [r for r in self.history if r.get("iteration", -1) <= iteration]
        with open(self.path, "w") as f:
            for r in self.history:
                f.write(json.dumps(r) + "\n")

    def append(self, row: dict) -> None:
        row = {
            k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v) for k, v in row.items()
        }
        self.history.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = int(row.get("iteration", len(self.history)))
            for k, v in row.items():
                if k != "iteration" and _finite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _series(history: list[dict], key: str):
    xs, ys = [], []
    for r in history:
        if _finite(r.get(key)):
            xs.append(r.get("iteration", len(xs)))
            ys.append(r[key])
    return xs, ys


EVAL_KEYS = (("eval/success", "sampled"), ("eval_greedy/success", "greedy"))


def _eval_panel(ax, history: list[dict]) -> None:
    """Held-out success over training, each line with its start (the warm start, iteration 0)
    drawn as a dashed level and the gain over it in the legend."""
    for key, label in EVAL_KEYS:
        xs, ys = _series(history, key)
        if not xs:
            continue
        # the gain goes in the legend: written at the last point, two lines that end together
        # (sampled and greedy often do) printed their gains over each other
        (line,) = ax.plot(xs, ys, marker="o", ms=4, lw=2, label=f"{label}: {ys[-1] - ys[0]:+.2f} over the start")
        ax.axhline(ys[0], color=line.get_color(), ls="--", lw=1, alpha=0.7)
    ax.set_title("held-out success (dashed: start)", fontsize=10, fontweight="bold")
    ax.set_xlabel("iteration", fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)


def plot_learning_curves(history: list[dict], path: str | os.PathLike, title: str = "") -> bool:
    """Held-out success first (with its start marked), then one panel per metric present in the
    history. Returns False if nothing to draw."""
    has_eval = any(_series(history, k)[0] for k, _ in EVAL_KEYS)
    keys = [k for k in CURVE_KEYS if _series(history, k)[0]]
    if not keys and not has_eval:
        return False
    cols = 4
    rows = -(-(len(keys) + has_eval) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    panels = list(axes.flat)
    if has_eval:
        _eval_panel(panels.pop(0), history)
    for ax, key in zip(panels, keys):
        xs, ys = _series(history, key)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in panels[len(keys) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_success_by_horizon(history: list[dict], path: str | os.PathLike, prefix: str = "eval") -> bool:
    """Success per horizon bucket (short / medium / long) over iterations, plus the latest bars."""
    series = {b: _series(history, f"{prefix}/success_{b}") for b in BUCKETS}
    if not any(xs for xs, _ in series.values()):
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    latest = []
    for b in BUCKETS:
        xs, ys = series[b]
        if xs:
            ax1.plot(xs, ys, marker="o", ms=3, label=b)
        latest.append(ys[-1] if ys else 0.0)
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("success")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax1.set_title(f"{prefix}: success by horizon bucket")
    ax2.bar(BUCKETS, latest, color=["tab:green", "tab:orange", "tab:red"])
    ax2.set_ylim(0, 1)
    ax2.set_title("latest (short L*<=4, medium 5-7, long >7)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_population(
    histories: list[list[dict]], labels: list[str], path: str | os.PathLike, keys: tuple[str, ...], title: str = ""
) -> bool:
    """Learning curves of a population run side by side: one panel per metric, one line per copy
    (labelled by its grid values). Returns False if nothing to draw."""
    keys = [k for k in keys if any(_series(h, k)[0] for h in histories)]
    if not keys:
        return False
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.0 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for history, label in zip(histories, labels):
            xs, ys = _series(history, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=label)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 4), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(names) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def save_batch(workdir: pathlib.Path, iteration: int, traj: TrajectoryBatch, texts: dict | None = None) -> None:
    """The iteration's TrajectoryBatch (what `ablate` reads) and, beside it, its texts (strategies,
    actions, judgments) so a person can read what the numbers were computed from."""
    d = workdir / "batches"
    d.mkdir(exist_ok=True)
    np.savez_compressed(
        d / f"iter_{iteration:05d}.npz", **{f.name: np.asarray(getattr(traj, f.name)) for f in dataclasses.fields(traj)}
    )
    if texts is not None:
        (d / f"iter_{iteration:05d}.texts.json").write_text(json.dumps(texts, indent=1, default=str))
