"""bench/learning.py: per-algorithm configs at equal trajectories, and the run summary."""

import argparse
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learning():
    spec = importlib.util.spec_from_file_location("bench_learning", REPO / "bench" / "learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**kw):
    a = dict(iterations=4, sft_steps=10, horizon=(2, 6), eval_every=2, eval_tasks=8, progress=False)
    a.update(kw)
    return argparse.Namespace(**a)


def test_every_algorithm_gets_a_valid_config_with_equal_trajectories(learning):
    base = learning.base_config(_args())
    assert base.sft.styles == "both"
    for algo in learning.ALGOS:
        c = learning.run_config(base, algo, seed=3, model_path="/m")
        strata = algo.startswith("strata")
        per_task = c.algo.num_strategies * c.algo.traj_per_strategy if strata else c.algo.group_size
        assert per_task == 8 and c.algo.name == algo and c.seed == 3 and c.model.path == "/m"
        assert c.algo.judgment == strata and c.algo.diverse == strata
        assert (c.env.horizon_min, c.env.horizon_max, c.iterations) == (2, 6, 4)


def test_summary_of_a_hand_written_history(learning, tmp_path):
    rows = [
        {"iteration": 0, "eval/success": 0.5, "eval/success_short": 1.0, "eval_greedy/success": 0.25},
        {"iteration": 1, "train/success": 0.1, "train/esu": 0.4, "train/car": 0.2, "train/invalid_rate": 0.3,
         "time/iteration_s": 10.0},
        {"iteration": 2, "train/success": 0.3, "train/esu": 0.6, "train/car": 0.4, "train/invalid_rate": 0.1,
         "time/iteration_s": 20.0, "eval/success": 0.75, "eval/success_short": 0.5, "eval/success_long": 0.0,
         "eval/n_long": 2, "eval_greedy/success": 1.0},
    ]
    s = learning.summarise(rows)
    assert (s["eval_start"], s["eval_end"], s["greedy_start"], s["greedy_end"]) == (0.5, 0.75, 0.25, 1.0)
    assert (s["train_success_first"], s["train_success_last"]) == (0.1, 0.3)
    assert s["esu"] == pytest.approx(0.5) and s["car"] == pytest.approx(0.3)
    assert s["invalid_rate"] == pytest.approx(0.2) and s["iteration_s"] == pytest.approx(15.0)
    assert (s["start_short"], s["end_short"], s["end_long"], s["n_long"], s["end_medium"]) == (1.0, 0.5, 0.0, 2, None)
    assert s["curve"] == [(0, 0.5), (2, 0.75)]
    md = learning.table({"grpo/s0": s, "grpo/s1": dict(s, eval_end=0.25)}, ["grpo", "strata"], [0, 1])
    lines = md.splitlines()
    assert len(lines) == 3  # header, rule, one algorithm with results (strata has none)
    assert "| grpo | 0.500 ± 0.000 | 0.500 ± 0.250 |" in lines[2]
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "metrics.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in rows) + "\n")
    assert learning.finished(wd, 2) and not learning.finished(wd, 3)
