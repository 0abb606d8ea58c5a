"""`launch.py ablate --train` (rollout/population.py): K copies trained in one vmapped program equal
K separate `trainer.train` runs given the corresponding grid values (params, optimiser state and
metrics); a killed population resumes exactly; the vmapped step pads and idles copies without
changing them; grids that cannot be vmapped and populations that cannot fit are refused.

Sized for CI: a random tiny model, 2 tasks x 2 strategies x 2 trajectories, one sampler and one
update shape (single prompt / batch / length buckets), and a persistent compilation cache for this
module, so that the separate runs and the population (each a new Run with its own jitted sampler)
compile each program once.
"""

import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.base import start_from
from rollout import population, trainer
from rollout.run import Run
from rollout.setup import make_mesh
from rollout.warmstart import model_dir
from strata_jax import train as T
from strata_jax.names import ALGOS
from tests.test_train import FAST, LOSS, one_device, random_batch, tiny_model

REPO = pathlib.Path(__file__).resolve().parents[1]
GRID = ["invalid_penalty=0.1,0.4"]
ITERATIONS = 2


def small_config(**algo):
    from configs.tiny_household import get_config

    c = get_config()
    a = c.algo
    a.tasks_per_iter, a.num_strategies, a.traj_per_strategy, a.oversample = 2, 2, 2, 2
    a.judgment = False  # one sampler kind less to compile; the judge is not what differs here
    c.env.max_steps, c.env.horizon_min, c.env.horizon_max = 4, 2, 4
    c.eval.num_tasks, c.eval.every, c.eval.greedy = 2, 2, False
    c.checkpoint.every = 1
    c.train.mini_batch_rows, c.train.lr, c.train.recompute_old_logp = 16, 1e-3, True
    c.train.length_buckets = (512,)
    s = c.sampling
    s.max_action_tokens, s.max_strategy_tokens, s.max_judge_tokens = 12, 16, 8
    s.prompt_buckets, s.batch_buckets = (512,), (16,)
    c.log.progress, c.log.plots_every = False, 0
    m = c.model
    m.tiny_hidden, m.tiny_layers, m.tiny_intermediate, m.tiny_vocab = 32, 1, 64, 1024
    m.tiny_heads, m.tiny_kv_heads = 2, 1
    c.sft.steps = c.sft.read_steps = 0  # a random model: every task fails, which is all the equality needs
    c.iterations = ITERATIONS
    for k, v in algo.items():
        a[k] = v
    return c


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent compilation cache for this module only: every Run jits its own sampler, so
    without it each of the three trainings below compiles the same programs again."""
    from jax._src import compilation_cache

    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # the cache is set up once per process; re-read the settings
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, compile_cache):
    c = small_config()
    return str(model_dir(c, tmp_path_factory.mktemp("model"), make_mesh(c)))


def _metrics(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


def _compare_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for a, b in zip(got, want):
        compared = [key for key in b if not key.startswith("time/")]
        assert len(compared) > (20 if a["iteration"] else 3)
        for key in compared:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (a["iteration"], key, a[key], b[key])


@pytest.mark.slow
def test_population_equals_separate_runs_and_resumes_exactly(model_path, tmp_path):
    """invalid_penalty (not delta) differs between the copies: the random tiny model fails every
    task, so every return is 0 and delta would leave the copies identical; every step is invalid,
    so the penalty moves every advantage."""
    values = [0.1, 0.4]
    separate = []
    for v in values:
        c = small_config(invalid_penalty=v)
        start_from(c, model_path)
        trainer.train(c, tmp_path / f"sep_{v}")
        separate.append(Run(c, tmp_path / f"sep_{v}", for_training=False).state)
    c = small_config()
    start_from(c, model_path)
    work = tmp_path / "pop"
    population.train_population(c, work, GRID)

    pop = population.Population(c, work, GRID)  # restores the stacked checkpoint
    assert pop.start_iteration == ITERATIONS + 1 and pop.labels == ["invalid_penalty=0.1", "invalid_penalty=0.4"]
    spread = _max_diff(separate[0].params, separate[1].params)
    assert spread > 1e-4  # the copies really differ, by far more than the tolerance below
    for k, v in enumerate(values):
        mine = population.slice_copy(pop.state, k)
        assert _max_diff(mine.params, separate[k].params) < 1e-5
        assert _max_diff(mine.opt_state, separate[k].opt_state) < 1e-5
        assert int(mine.step) == int(separate[k].step) and np.array_equal(mine.rng, separate[k].rng)
        got = _metrics(work / "copies" / pop.labels[k] / "metrics.jsonl")
        want = _metrics(tmp_path / f"sep_{v}" / "metrics.jsonl")
        assert [r["iteration"] for r in got] == list(range(ITERATIONS + 1))
        assert "eval/success" in got[-1] and all(r["copy"] == k and r["grid/invalid_penalty"] == v for r in got)
        _compare_rows(got, want)
    assert (work / "population_curves.png").stat().st_size > 1000
    final = pop.state

    # Killed after iteration 1 (its checkpoint is the latest): the restart redoes iteration 2 exactly.
    killed = tmp_path / "killed"
    shutil.copytree(work, killed)
    shutil.rmtree(killed / "population_checkpoints" / str(ITERATIONS))
    population.train_population(c, killed, GRID)
    resumed = population.Population(c, killed, GRID)
    assert resumed.start_iteration == ITERATIONS + 1
    assert _max_diff(resumed.state.params, final.params) < 1e-6
    for label in pop.labels:
        _compare_rows(
            _metrics(killed / "copies" / label / "metrics.jsonl"), _metrics(work / "copies" / label / "metrics.jsonl")
        )


def test_vmapped_step_pads_columns_and_idles_copies_exactly():
    """Copy k's step on its own batch equals the plain jitted step, though its batch is left-padded
    to the widest copy's; a copy whose epoch ended (active False) keeps every bit of its state."""
    mesh = one_device()
    graphdef, params = tiny_model()
    opt = T.make_optimizer(dict(lr=1e-3, eps=1e-3))
    step_fn = T.train_step_fn(graphdef, opt, LOSS, mesh)
    single = jax.jit(step_fn, compiler_options=FAST)
    vmapped = jax.jit(jax.vmap(population.copy_step(step_fn)), compiler_options=FAST)
    s0 = T.init_train_state(graphdef, params, opt, 0, mesh)
    a1, a2, b1 = random_batch(1), random_batch(2), random_batch(3)  # [16, 12] each
    want_a1, m_a1 = single(s0, a1, 0.5)
    want_b1, m_b1 = single(s0, b1, 0.3)
    want_a2, _ = single(want_a1, a2, 0.5)

    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), s0)
    lam = np.asarray([0.5, 0.3], np.float32)
    batch = population.stack_batches([population.pad_width(a1, 20, 0), population.pad_width(b1, 20, 0)])
    stacked, m = vmapped(stacked, batch, lam, np.asarray([True, True]))
    for k, (want, wm) in enumerate(((want_a1, m_a1), (want_b1, m_b1))):
        got = population.slice_copy(stacked, k)
        assert _max_diff(got.params, want.params) < 1e-6 and _max_diff(got.opt_state, want.opt_state) < 1e-6
        assert int(got.step) == 1
        for key in ("loss", "pg_loss", "kl", "entropy", "tokens"):
            assert float(m[key][k]) == pytest.approx(float(wm[key]), rel=1e-5, abs=1e-7), key
    before = population.slice_copy(stacked, 1)
    batch = population.stack_batches([population.pad_width(a2, 20, 0), population.idle_batch(a2, 20, 0)])
    stacked, _ = vmapped(stacked, batch, lam, np.asarray([True, False]))
    assert _max_diff(population.slice_copy(stacked, 0).params, want_a2.params) < 1e-6
    idle = population.slice_copy(stacked, 1)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(idle), jax.tree.leaves(before)))


def test_grids_that_cannot_be_vmapped_are_refused_by_name():
    for spec in ("num_strategies=2,4", "name=1,2", "lr=1e-3,1e-4"):
        with pytest.raises(ValueError, match=f"'{spec.split('=')[0]}' cannot be trained as one vmapped population"):
            population.parse_train_grid(["delta=0.5", spec])
    with pytest.raises(ValueError, match="delta"):  # a value out of range names its key
        population.copy_configs(small_config(), [{"delta": 1.5}])
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "ablate", "--train", "--grid", "num_strategies=2,4"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2 and "'num_strategies' cannot be trained" in r.stderr, r.stderr[-2000:]


def test_grids_over_a_parameter_the_algorithm_does_not_read_are_refused():
    """gamma is GiGPO's step discount: a StraTA population over it trained identical copies (seen on
    the embedded default: kappa x gamma gave two pairs of equal curves). Refused before any work."""
    from rollout.ablate import READ_BY, parse_grid

    for name, algos in READ_BY.items():
        for algo in ALGOS:
            spec = [f"{name}=0.5,0.9"]
            if algo in algos:
                assert list(population.parse_train_grid(spec, algo)) == [name]
            else:
                with pytest.raises(ValueError, match=re.escape(f"'{name}' is not read by algo.name='{algo}'")):
                    population.parse_train_grid(spec, algo)
    assert parse_grid(["invalid_penalty=0,0.1"], algo="grpo") == {"invalid_penalty": [0.0, 0.1]}  # every algo
    with pytest.raises(ValueError, match="'gamma' is not read by algo.name='strata' \\(only by gigpo\\)"):
        parse_grid(["gamma=0.8,0.95"], algo="strata")  # `launch.py ablate` re-scoring too
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "ablate", "--train", "--grid", "gamma=0.8,0.95"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2 and "'gamma' is not read by algo.name='strata'" in r.stderr, r.stderr[-2000:]


def test_memory_check_refuses_only_what_cannot_fit():
    """K x (params + AdamW moments + gradients) + reference params, against the devices' memory."""

    def state(n_params):  # fp32 params, AdamW's two moments
        leaf = jax.ShapeDtypeStruct((n_params,), jnp.float32)
        return types.SimpleNamespace(params={"w": leaf}, opt_state=({"mu": leaf}, {"nu": leaf}))

    h200 = 141 * 2**30
    small = population.check_memory(state(500_000_000), 4, h200, "1 x H200")  # 0.5B: 4 x 4 x 2 + 2 = 34 GB
    assert small["needed_bytes"] == (4 * 4 + 1) * 2_000_000_000
    # 1.9B params (7.6 GB): 4 x 4 x 7.6 + 7.6 = 129.2 GB = 120.3 GiB > 100 GiB
    with pytest.raises(MemoryError, match=r"K=4 copies cannot fit in 1 x H200 \(100\.0 GiB\).* = 120\.3 GiB"):
        population.check_memory(state(1_900_000_000), 4, 100 * 2**30, "1 x H200")
    # LoRA: 4 copies of 10M adapters (4 x 4 x 40 MB) over one 1.9B base held twice (frozen + merged
    # decode copy, 2 x 7.6 GB): 15.84 GB, where full fine-tuning needed 129.2 GB
    lora = state(10_000_000)
    lora.frozen = {"w": jax.ShapeDtypeStruct((1_900_000_000,), jnp.float32)}
    fits = population.check_memory(lora, 4, 100 * 2**30, "1 x H200")
    assert fits["needed_bytes"] == 4 * 4 * 40_000_000 + 2 * 7_600_000_000
