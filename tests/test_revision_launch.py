"""Strategy revision and self-judgment end to end through the real trainer: StraTA with strategy
revision (revise_every=2) and a trained self-judgment (judge.samples=2, judge_train) on the
household world with a tiny model; a resumed run equals the uninterrupted one; `ablate` re-scores
the saved batches (revisions included) in one vmapped call.

In-process and sized like tests/test_population.py (a random tiny model, single buckets, a
persistent compilation cache for this module) so the three trainings compile each program once.
"""

import json
import math
import shutil

import numpy as np
import pytest

from configs.base import start_from
from rollout import ablate, trainer
from rollout.setup import advantage_params, make_mesh
from rollout.warmstart import model_dir
from tests.test_population import compile_cache, small_config  # noqa: F401  (fixture)

# Trains models through the real trainer: the slow tier (`-m 'not slow'` skips it).
pytestmark = pytest.mark.slow


def config(iterations):
    c = small_config(judgment=True, revise_every=2, judge_train=True)
    c.judge.samples = 2
    c.eval.every = 0
    c.iterations = iterations
    c.sampling.prompt_buckets = c.train.length_buckets = (768,)
    return c


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, compile_cache):  # noqa: F811
    c = config(2)
    return str(model_dir(c, tmp_path_factory.mktemp("model15"), make_mesh(c)))


@pytest.fixture(scope="module")
def straight(model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("straight15")
    c = config(2)
    start_from(c, model_path)
    trainer.train(c, work)
    return work


def _metrics(work):
    with open(work / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_iterations_train_revisions_and_judgments(straight):
    rows = _metrics(straight)
    assert [r["iteration"] for r in rows] == [1, 2]
    for r in rows:
        assert np.isfinite(r["update/loss"]) and r["update/steps"] >= 1
        assert r["train/revisions"] >= 1  # every trajectory still running at step 2 revised once
        for k in ("judge/precision", "judge/recall", "judge/label_bad_steps"):
            assert k in r and np.isfinite(r[k])
        assert 0.0 <= r["judge/precision"] <= 1.0 and 0.0 <= r["judge/recall"] <= 1.0
    with np.load(straight / "batches" / "iter_00001.npz") as z:
        assert z["revision_mask"].shape == (2, 2, 2, 1) and z["revision_mask"].any()  # H=4, K=2: R=1
        assert z["judge_valid"].shape == (2, 2, 2, 2) and z["judge_valid"].any()
        assert z["step_label"][z["step_mask"]].min() == -1  # a random model's invalid steps are provably bad
    texts = json.loads((straight / "batches" / "iter_00001.texts.json").read_text())
    assert any(t["revisions"] for t in texts["trajectories"])


def test_resume_with_revisions_continues_exactly(straight, model_path, tmp_path):
    """Killed after iteration 1 (its checkpoint the latest): the restart redoes iteration 2 exactly."""
    killed = tmp_path / "killed"
    shutil.copytree(straight, killed)
    shutil.rmtree(killed / "checkpoints" / "2")
    c = config(2)
    start_from(c, model_path)
    trainer.train(c, killed)
    assert _metrics(killed)[0] == _metrics(straight)[0]  # iteration 1 was kept (its timings too), not redone
    a, b = _metrics(killed)[1], _metrics(straight)[1]
    compared = [k for k in b if not k.startswith("time/")]
    assert "judge/precision" in compared and "train/revisions" in compared and len(compared) > 20
    for k in compared:
        assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (k, a[k], b[k])


def test_ablate_vmaps_over_batches_with_revisions(straight):
    rows = ablate.ablation_table(
        ablate.load_batches(straight), advantage_params(config(2)), {"c_fmt": [0.0, 0.3], "kappa": [0.0, 0.2]}, "strata"
    )
    assert len(rows) == 4 and all(np.isfinite(r["esu"]) for r in rows)
