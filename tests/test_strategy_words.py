"""bench/strategy_words.py: what a StraTA run's strategies carry, on hand-built batches."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.bench_modules import load_bench
from tests.test_learning_bench import REPO


@pytest.fixture(scope="module")
def sw():
    return load_bench("strategy_words")


def _traj(p, n, m, won, strategy):
    return {"key": [p, n, m], "won": won, "strategy": strategy}


# task 0: strategy slot 0 wins both, slot 1 loses both (the slot decides: eta^2 = 1);
# task 1: each slot wins one of two (the slot explains nothing: eta^2 = 0);
# task 2: every trajectory wins (no variance: left out).
TEXTS = {
    "strategies": [["take red", "go blue"], ["take red", "take red"], ["x", "y"]],
    "trajectories": [
        _traj(0, 0, 0, True, "take red"),
        _traj(0, 0, 1, True, "take red"),
        _traj(0, 1, 0, False, "go blue"),
        _traj(0, 1, 1, False, "go blue"),
        _traj(1, 0, 0, True, "take red"),
        _traj(1, 0, 1, False, "take red"),
        _traj(1, 1, 0, True, "take red"),
        _traj(1, 1, 1, False, "take red"),
        _traj(2, 0, 0, True, "x"),
        _traj(2, 1, 0, True, "y"),
    ],
}


def test_eta2_by_hand(sw):
    assert sw.eta2(np.array([0, 0, 1, 1]), np.array([1.0, 1.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert sw.eta2(np.array([0, 0, 1, 1]), np.array([1.0, 0.0, 1.0, 0.0])) == pytest.approx(0.0)
    # slot means 2/3 and 0 around 1/3 over six: between 3 (1/3)^2 + 3 (1/3)^2 = 2/3, total 6 (2/9) = 4/3
    assert sw.eta2(np.array([0, 0, 0, 1, 1, 1]), np.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])) == pytest.approx(0.5)
    assert np.isnan(sw.eta2(np.array([0, 1]), np.array([1.0, 1.0])))


def test_iteration_figures_by_hand(sw):
    r = sw.iteration_figures(TEXTS, ["red", "blue", "green"], permutations=3000, rng=np.random.default_rng(0))
    assert r["trajectories"] == 10 and r["won"] == pytest.approx(0.6) and r["mixed_tasks"] == 2
    assert r["eta2"] == pytest.approx(0.5)
    # shuffling 2+2 slot labels: 2 of the 6 arrangements keep the slots pure (eta^2 1), 4 mix them (0)
    assert r["eta2_shuffled"] == pytest.approx(1 / 3, abs=0.02)
    red = r["words"]["red"]
    assert red["share"] == pytest.approx(0.6) and red["won_with"] == pytest.approx(4 / 6)  # 2 of 2, 2 of 4
    assert red["won_without"] == pytest.approx(2 / 4)  # "go blue" x2 lost, "x", "y" won
    assert r["words"]["blue"]["won_with"] == 0.0
    assert r["words"]["green"]["share"] == 0.0 and np.isnan(r["words"]["green"]["won_with"])
    assert r["top"]["text"] == "take red" and r["top"]["share"] == pytest.approx(0.6)


def _run(args):
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "strategy_words.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_command_line_prints_per_iteration_and_refuses_flat_runs(tmp_path):
    (tmp_path / "batches").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"algo": {"name": "strata"}}))
    for it in (1, 2):
        (tmp_path / "batches" / f"iter_{it:05d}.texts.json").write_text(json.dumps(TEXTS))
    out = _run([str(tmp_path), "--word", "red", "--permutations", "50"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("iteration   1: won 0.60 of 10, eta2 0.500")
    assert "red: 0.60 of strategies, won 0.67 with / 0.50 without" in lines[1]
    assert lines[-1].startswith("strategy slot eta2 minus shuffled, mean over 2 iterations: +0.1")
    (tmp_path / "config.json").write_text(json.dumps({"algo": {"name": "grpo"}}))
    out = _run([str(tmp_path)])
    assert out.returncode != 0 and "algo.name='grpo', which samples no strategies" in out.stderr
    out = _run([str(tmp_path / "nowhere")])
    assert out.returncode != 0 and "holds no iter_*.texts.json" in out.stderr
