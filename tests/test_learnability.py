"""Learnability: every algorithm, run through the real trainer, learns the doors world, and the
same run with lr 0 does not.

The doors world (rollout/envs/doors.py) is won only by taking the red door at each of two doors,
a rule nothing in the prompt states. The warm start imitates a demonstrator that knows the
command format but picks doors at random, so the starting policy is valid but weak (success
~ 0.5^2 = 0.25). Only a correct pipeline, from the sampled tokens through the advantages to the
update, lifts it: a flipped sign, log-probs misaligned with their tokens or advantages gathered
onto the wrong rows all leave it flat (or worse). The lr 0 control shows that the rise is the
update's doing, not the sampler's luck.
"""

import json
import pathlib

import numpy as np
import pytest

from configs.base import base_config, validate, with_algo_env

ALGOS = ("grpo", "gigpo", "strata", "beacon", "strata+beacon")
ITERATIONS = 10


def doors_config(algo: str, model_path: str = "") -> object:
    c = with_algo_env(base_config(), algo, "doors")
    c.seed = 0
    c.iterations = ITERATIONS
    c.algo.tasks_per_iter = 8
    c.algo.group_size = 8
    c.algo.num_strategies, c.algo.traj_per_strategy, c.algo.oversample = 2, 4, 1
    c.algo.strategy_budget = 24
    c.env.horizon_min = c.env.horizon_max = 2
    c.env.max_steps = 2
    c.env.doors_options = 2
    c.env.history_length = 0
    c.env.show_first_observation = False
    c.model.path = model_path
    c.model.tiny_hidden, c.model.tiny_layers, c.model.tiny_intermediate = 64, 2, 128
    c.model.tiny_heads, c.model.tiny_kv_heads, c.model.tiny_vocab = 4, 2, 640
    c.sampling.max_action_tokens, c.sampling.max_strategy_tokens, c.sampling.max_judge_tokens = 32, 24, 12
    c.sampling.prompt_buckets = (64, 128, 256, 512)
    c.sampling.batch_buckets = (16, 32, 64)
    c.train.length_buckets = (64, 128, 256, 512)
    c.train.lr = 1e-3
    c.train.mini_batch_rows = 16
    c.train.recompute_old_logp = False
    c.sft.steps, c.sft.lr, c.sft.batch_rows, c.sft.num_tasks = 200, 1e-2, 16, 64
    c.sft.styles = "both"
    c.eval.every = 0
    c.checkpoint.every = ITERATIONS
    c.log.progress = False
    c.log.plots_every = 0
    c.log.save_batches = False
    return validate(c)


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """One format-only warm start (strategy and flat prompts) shared by every algorithm."""
    from rollout.setup import make_mesh
    from rollout.warmstart import model_dir

    work = tmp_path_factory.mktemp("doors_sft")
    c = doors_config("strata")
    return str(model_dir(c, work, make_mesh(c)))


def _success(workdir: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train/success"] for r in rows if r.get("iteration", 0) >= 1]


@pytest.mark.parametrize("algo", ALGOS)
def test_algorithm_learns_the_doors(algo, warm_start, tmp_path):
    from rollout.trainer import train

    train(doors_config(algo, warm_start), tmp_path / "run")
    s = _success(tmp_path / "run")
    assert len(s) == ITERATIONS
    assert s[0] <= 0.4, f"{algo}: the warm start should be weak, got training success {s}"
    assert np.mean(s[-2:]) >= 0.8, f"{algo}: training success did not rise to 0.8: {s}"


def test_lr_zero_stays_flat(warm_start, tmp_path):
    from rollout.trainer import train

    c = doors_config("grpo", warm_start)
    c.train.lr = 0.0
    c.iterations = c.checkpoint.every = 5
    train(c, tmp_path / "run")
    s = _success(tmp_path / "run")
    assert len(s) == 5 and max(s) <= 0.45, f"with lr 0 the policy must not improve: {s}"
