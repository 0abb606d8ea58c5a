"""launch.py end to end on the tiny household setup: train, resume, ablate, export.

The runs are real subprocesses of the command a user types, shrunk by overrides so the whole file
stays within a few minutes on 2 CPU cores. One SFT'd tiny model is built once and shared.
"""

import csv
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# A run small enough for CI: 2 tasks x 2 strategies x 2 trajectories, 4 steps, tiny model.
SMALL = [
    "--config.algo.tasks_per_iter=2",
    "--config.algo.num_strategies=2",
    "--config.algo.traj_per_strategy=2",
    "--config.algo.oversample=2",
    "--config.env.max_steps=4",
    "--config.env.horizon_min=2",
    "--config.env.horizon_max=4",
    "--config.eval.num_tasks=4",
    "--config.eval.every=2",
    "--config.eval.greedy=False",
    "--config.checkpoint.every=1",
    "--config.train.mini_batch_rows=16",
    "--config.train.lr=1e-3",
    "--config.sampling.max_action_tokens=12",
    "--config.sampling.max_strategy_tokens=16",
    "--config.sampling.max_judge_tokens=8",
    "--config.log.progress=False",
    "--config.train.recompute_old_logp=True",
]
TINY = [
    "--config.model.tiny_hidden=32",
    "--config.model.tiny_layers=1",
    "--config.model.tiny_heads=2",
    "--config.model.tiny_kv_heads=1",
    "--config.model.tiny_intermediate=64",
    "--config.model.tiny_vocab=1024",
    "--config.sft.steps=3",
    "--config.sft.read_steps=2",
    "--config.sft.num_tasks=8",
    "--config.sft.batch_rows=8",
]
CONFIG = ["--config", str(REPO / "configs" / "tiny_household.py")]


def start_from_flags(model) -> list[str]:
    """The overrides of a run that starts from an already warm-started model (no second SFT)."""
    return [f"--config.model.path={model}", "--config.sft.steps=0", "--config.sft.read_steps=0"]


def launch(*args, timeout=900):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI runs on the plain CPU device, as a user would
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=env,
    )
    if r.returncode != 0:
        raise AssertionError(f"launch.py {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return r


def metrics(workdir) -> list[dict]:
    with open(pathlib.Path(workdir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """The tiny model after a short SFT, built by `launch.py sft`; shared by every run below."""
    work = tmp_path_factory.mktemp("sft")
    launch("sft", *CONFIG, *TINY, *SMALL, "--workdir", str(work))
    path = work / "sft_model"
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    saved = json.loads((work / "config.json").read_text())  # the run's config, for eval_dump / launch.py eval
    assert saved["sft"]["steps"] == 3 and saved["model"]["tiny_hidden"] == 32  # TINY's overrides
    info = json.loads((path / "sft_info.json").read_text())  # TINY's reading phase ran first
    assert info["read_steps"] == 2 and info["steps"] == 3 and np.isfinite(info["read_final_loss"])
    return path


@pytest.fixture(scope="module")
def straight_run(sft_model, tmp_path_factory):
    """3 iterations without interruption."""
    work = tmp_path_factory.mktemp("straight")
    launch(*CONFIG, *SMALL, *start_from_flags(sft_model), "--config.iterations=3", "--workdir", str(work))
    return work


@pytest.mark.slow
def test_train_end_to_end_writes_everything(straight_run, sft_model):
    rows = metrics(straight_run)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]  # 0 = evaluation of the starting model
    assert "eval/success" in rows[0] and "eval/success" in rows[2]
    for r in rows[1:]:
        assert np.isfinite(r["update/loss"]) and r["update/steps"] >= 1
        assert r["train/num_trajectories"] == 8  # P * N * M
        assert 0.0 <= r["train/success"] <= 1.0
        for k in ("time/rollout_s", "time/update_s", "train/esu", "train/invalid_rate", "update/kl"):
            assert k in r
    for png in ("learning_curves.png", "success_by_horizon.png"):
        assert (straight_run / png).stat().st_size > 1000
    assert sorted(p.name for p in (straight_run / "checkpoints").iterdir() if p.name.isdigit())[-1] == "3"
    assert len(list((straight_run / "batches").glob("iter_*.npz"))) == 3
    assert (straight_run / "tb").is_dir() and any((straight_run / "tb").iterdir())
    resolved = json.loads((straight_run / "config.json").read_text())
    assert resolved["model"]["path"] == str(sft_model) and resolved["iterations"] == 3


@pytest.mark.slow
def test_resume_continues_exactly(straight_run, sft_model, tmp_path):
    """Stopped after iteration 2 and restarted: iteration 3 equals the uninterrupted run's."""
    common = [*CONFIG, *SMALL, *start_from_flags(sft_model), "--workdir", str(tmp_path)]
    launch(*common, "--config.iterations=2")
    assert [r["iteration"] for r in metrics(tmp_path)] == [0, 1, 2]
    launch(*common, "--config.iterations=3")
    resumed, straight = metrics(tmp_path), metrics(straight_run)
    assert [r["iteration"] for r in resumed] == [0, 1, 2, 3]
    a, b = resumed[3], straight[3]
    compared = [k for k in b if not k.startswith("time/")]
    assert len(compared) > 20
    for k in compared:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


@pytest.mark.slow
def test_ablate_equals_a_loop_over_the_grid(straight_run):
    import jax

    from configs.tiny_household import get_config
    from rollout.ablate import load_batches
    from rollout.setup import advantage_params
    from strata_jax.advantages import compute_advantages
    from strata_jax.diagnostics import compute_diagnostics

    launch("ablate", *CONFIG, *SMALL, "--workdir", str(straight_run), "--grid", "delta=0.25,1", "--grid", "kappa=0,0.2")
    with open(straight_run / "ablation.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and (straight_run / "ablation.png").exists()
    config = get_config()
    batches = load_batches(straight_run)
    base = advantage_params(config)
    for row in table:
        params = base.replace(delta=float(row["delta"]), kappa=float(row["kappa"]))
        for key in ("esu", "car", "ccr", "zero_adv_ratio"):
            vals = []
            for b in batches:  # a plain loop, one point and one batch at a time
                d = compute_diagnostics(b, compute_advantages(b, params, "strata"))
                v = float(jax.device_get(d[key]))
                if np.isfinite(v):
                    vals.append(v)
            expect = np.mean(vals) if vals else float("nan")
            got = float(row[key])
            assert (np.isnan(expect) and np.isnan(got)) or got == pytest.approx(expect, rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_ablate_rejects_unknown_grid_names(straight_run):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "ablate",
            "--workdir",
            str(straight_run),
            "--grid",
            "temperature=0.1,0.2",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert r.returncode != 0 and "'temperature' is not sweepable" in r.stderr


@pytest.mark.slow
def test_export_loads_in_transformers_with_equal_logits(straight_run, sft_model, tmp_path):
    import torch
    import transformers

    from strata_jax.models.hf import load_hf_model, read_safetensors

    torch.set_num_threads(1)
    out = tmp_path / "exported"
    launch("export", *CONFIG, *SMALL, *start_from_flags(sft_model), "--workdir", str(straight_run), "--out", str(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tok("go to countertop 1 and take apple 1", return_tensors="np")["input_ids"].astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    model, _ = load_hf_model(out)
    pos = np.arange(ids.shape[1], dtype=np.int32)[None]
    hidden, _ = model(ids, pos, np.ones_like(ids, bool))
    ours = np.asarray(model.logits(hidden))
    assert np.abs(ours - ref).max() <= 1e-4
    # Training changed the weights: the export is the trained policy, not the starting model.
    before, after = read_safetensors(sft_model / "model.safetensors"), read_safetensors(out / "model.safetensors")
    assert set(before) == set(after)
    assert any(not np.array_equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------------------------
# Bad command lines: one line on stderr, exit code 2, before any work


def typed(*args, cwd=REPO):
    """`python launch.py ARGS` exactly as a user types it (no config added)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "launch.py", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "args,names",
    [
        (["--config.algo.deltaa=0.3"], ["config.algo.deltaa", "did you mean ['delta']"]),
        (["--noconfig.algo.judgmen"], ["config.algo.judgmen", "'judgment'"]),
        (
            ["--config", "configs/paper.py:strata,alfworld", "--config.env.max_step=9"],
            ["config.env.max_step", "'max_steps'"],
        ),
        (["--config.algo.delta=abc"], ["--config.algo.delta=abc", "could not convert string to float: 'abc'"]),
        (["--config.algo.name=foo"], ["config.algo.name='foo'", "'strata'"]),
        (["--config.model.attention=flash"], ["config.model.attention='flash'", "'cudnn'"]),
        (["--config.model.attention=cudnn"], ["config.model.attention='cudnn' needs config.model.dtype='bfloat16'"]),
        (["--config=configs/nope.py"], ["config file 'configs/nope.py' not found"]),
        (["--workdirr=x"], ["'workdirr'", "workdir"]),
        (["fly"], ["unknown mode 'fly'", "'train'"]),
    ],
    ids=[
        "unknown-key",
        "unknown-bool-key",
        "unknown-key-other-file",
        "bad-float",
        "bad-choice",
        "bad-attention",
        "cudnn-needs-bf16",
        "no-config-file",
        "unknown-flag",
        "unknown-mode",
    ],
)
def test_bad_command_line_is_one_line(args, names, tmp_path):
    r = typed(*args, "--workdir", str(tmp_path / "run"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith(("config error: ", "command line error: ", "usage error: "))
    for name in names:
        assert name in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_unbuilt_option_fails_before_any_work(tmp_path):
    """judge_train with one judgment has no group to train in: refused by validate(), before the
    model or SFT."""
    r = typed("--config.algo.judge_train=True", "--workdir", str(tmp_path / "run"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert "config.algo.judge_train=True needs config.judge.samples >= 2" in lines[0]
    assert not (tmp_path / "run").exists()  # no workdir, so no tiny model and no SFT


@pytest.mark.slow
def test_ptx_and_type_stratified_run_resumes_exactly(sft_model, tmp_path):
    """PPO-ptx steps (`train.ptx_coef`) and type-stratified task sets run through the command line,
    and a run stopped after iteration 1 continues as the uninterrupted one (the ptx rows of an
    iteration are a function of (seed, iteration)). The ptx-only control runs no policy step.
    Without a KL term (`train.kl_coef=0`: no reference params, no reference scoring) the run
    reports no KL."""
    extra = [
        "--config.train.ptx_coef=0.5",
        "--config.train.ptx_rows=4",
        "--config.train.ptx_tasks=4",
        "--config.algo.task_sampling=by_type",
        "--config.eval.every=0",
        "--config.train.kl_coef=0",
    ]
    common = [*CONFIG, *SMALL, *extra, *start_from_flags(sft_model)]
    launch(*common, "--config.iterations=2", "--workdir", str(tmp_path / "straight"))
    launch(*common, "--config.iterations=1", "--workdir", str(tmp_path / "split"))
    launch(*common, "--config.iterations=2", "--workdir", str(tmp_path / "split"))
    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "split")
    for r in straight[1:]:
        assert r["update/ptx_steps"] >= 1 and np.isfinite(r["update/ptx_nll"]) and r["update/ptx_nll"] > 0
        assert np.isfinite(r["update/loss"]) and "update/kl" not in r
    a, b = split[-1], straight[-1]
    assert a["iteration"] == b["iteration"] == 2
    for k in [k for k in b if not k.startswith("time/")]:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    launch(*common, "--config.iterations=1", "--config.train.rl_update=False", "--workdir", str(tmp_path / "ctrl"))
    ctrl = metrics(tmp_path / "ctrl")[-1]
    first = next(r for r in straight if r["iteration"] == 1)  # the same rollout, so the same mini-batches
    assert ctrl["iteration"] == 1 and ctrl["update/steps"] == 0
    assert ctrl["update/ptx_steps"] == first["update/ptx_steps"]
