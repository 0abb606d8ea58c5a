"""Issue #15 end to end: `launch.py` trains StraTA with strategy revision (revise_every=2) and a
trained self-judgment (judge.samples=2, judge_train) on the household world with a tiny model;
a resumed run equals the uninterrupted one; `ablate` re-scores the saved batches (revisions
included) in one vmapped call."""

import csv
import json

import numpy as np
import pytest

from tests.test_launch import CONFIG, SMALL, TINY, launch, metrics  # noqa: F401

ISSUE15 = ["--config.algo.revise_every=2", "--config.judge.samples=2", "--config.algo.judge_train=True",
           "--config.eval.every=0"]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    work = tmp_path_factory.mktemp("sft15")
    launch("sft", *CONFIG, *TINY, *SMALL, "--workdir", str(work))
    return work / "sft_model"


@pytest.fixture(scope="module")
def straight(sft_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("straight15")
    launch(*CONFIG, *SMALL, *ISSUE15, f"--config.model.path={sft_model}", "--config.iterations=2",
           "--workdir", str(work))
    return work


def test_one_iteration_trains_revisions_and_judgments(straight):
    rows = metrics(straight)
    assert [r["iteration"] for r in rows] == [1, 2]
    for r in rows:
        assert np.isfinite(r["update/loss"]) and r["update/steps"] >= 1
        assert r["train/revisions"] >= 1  # every trajectory running at step 2 revised once
        for k in ("judge/precision", "judge/recall", "judge/label_bad_steps"):
            assert k in r and np.isfinite(r[k])
        assert 0.0 <= r["judge/precision"] <= 1.0 and 0.0 <= r["judge/recall"] <= 1.0
    with np.load(straight / "batches" / "iter_00001.npz") as z:
        assert z["revision_mask"].shape == (2, 2, 2, 1) and z["revision_mask"].any()  # H=4, K=2: R=1
        assert z["judge_valid"].shape == (2, 2, 2, 2) and z["judge_valid"].any()
        slot = z["step_slot"][z["step_mask"]]
        assert set(np.unique(slot)) <= {0, 1}
    texts = json.loads((straight / "batches" / "iter_00001.texts.json").read_text())
    assert any(t["revisions"] for t in texts["trajectories"])


def test_resume_with_revisions_continues_exactly(straight, sft_model, tmp_path):
    common = [*CONFIG, *SMALL, *ISSUE15, f"--config.model.path={sft_model}", "--workdir", str(tmp_path)]
    launch(*common, "--config.iterations=1")
    launch(*common, "--config.iterations=2")
    a, b = metrics(tmp_path)[1], metrics(straight)[1]
    compared = [k for k in b if not k.startswith("time/")]
    assert "judge/precision" in compared and "train/revisions" in compared
    for k in compared:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


def test_ablate_vmaps_over_batches_with_revisions(straight):
    launch("ablate", *CONFIG, *SMALL, *ISSUE15, "--workdir", str(straight), "--grid", "c_fmt=0,0.3",
           "--grid", "kappa=0,0.2")
    with open(straight / "ablation.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and all(np.isfinite(float(r["esu"])) for r in table)
