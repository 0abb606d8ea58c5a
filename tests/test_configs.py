"""Every config loads and validates; bad keys and values fail naming the key."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from configs.base import ALGOS, ENVS, TEST_ENVS, ConfigError, base_config, validate

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted(p for p in (REPO / "configs").glob("*.py") if p.name not in ("__init__.py",))


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def test_one_config_per_algo_and_env():
    names = {p.stem for p in CONFIG_FILES}
    for algo in ALGOS:
        for env in (e for e in ENVS if e not in TEST_ENVS):
            assert f"{algo.replace('+', '_')}_{env}" in names
    assert "tiny_household" in names


def test_the_embedded_default_is_the_signpost_corridor_with_a_revision_at_the_sign():
    """README command 1 (a bare `python launch.py`) runs configs/tiny_signs.py: StraTA whose
    strategy is revised right where the sign is read, from a warm start with the reading phase."""
    import launch

    assert launch.DEFAULT_CONFIG == REPO / "configs" / "tiny_signs.py"
    c = validate(_load(launch.DEFAULT_CONFIG))
    assert (c.algo.name, c.env.name, c.env.doors_sign_at, c.algo.revise_every) == ("strata", "doors", 3, 3)
    assert c.env.history_length == 0  # the sign leaves the prompt: only a revised strategy carries it
    assert c.sft.read_steps > 0  # without the reading phase the tiny model never reads the sign
    assert c.eval.num_tasks >= 64 and c.train.warmup_steps > 0


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_validates(path):
    c = validate(_load(path))
    if path.stem != "base" and not path.stem.startswith(("tiny_", "smol_")):  # model-sized configs
        algo, env = c.algo.name.replace("+", "_"), c.env.name
        assert path.stem == f"{algo}_{env}"
        # ALGORITHMS.md section 7: ALFWorld max steps 50 (BEACON 30); synthetic 30.
        if env == "alfworld":
            assert c.env.max_steps == (30 if c.algo.name == "beacon" else 50)
        if env == "household":
            assert c.env.max_steps == 30
        assert c.algo.judgment == c.algo.name.startswith("strata")


@pytest.mark.parametrize("key,value,fragment", [
    ("algo.name", "ppo", "config.algo.name='ppo' is not allowed"),
    ("algo.delta", 0.0, "config.algo.delta=0.0 must be in (0, 1]"),
    ("train.aggregation", "sum", "config.train.aggregation='sum'"),
    ("env.name", "webshop", "config.env.name='webshop'"),
    ("algo.kappa", -1.0, "config.algo.kappa=-1.0 must be >= 0"),
    ("algo.judge_train", True, "judge_train=True needs config.judge.samples >= 2"),
    ("judge.samples", 0, "config.judge.samples=0 must be >= 1"),
    ("algo.revise_every", -1, "config.algo.revise_every=-1 must be >= 0"),
    ("algo.milestones", "expert_plan", "config.algo.milestones='expert_plan' is only wired for env.name='alfworld'"),
    ("train.eps_low", 1.0, "config.train.eps_low=1.0 must be in (0, 1)"),
    ("train.dual_clip", 1.0, "config.train.dual_clip=1.0 must be > 1"),
    ("sampling.prompt_buckets", (256, 128), "config.sampling.prompt_buckets=(256, 128) must be strictly ascending"),
    ("train.length_buckets", (0, 128), "config.train.length_buckets=(0, 128) must be strictly ascending"),
    ("train.bucket_steps", 3, "config.train.bucket_steps=3: expected 1, 2, 4, 8 or 16 sizes per octave"),
])
def test_bad_values_name_the_key(key, value, fragment):
    c = base_config()
    section, leaf = key.split(".")
    c[section][leaf] = value
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert fragment in str(e.value)


def test_revision_and_judge_training_are_wired_for_strata_only():
    for algo in ALGOS:
        c = base_config()
        c.algo.name, c.algo.judgment, c.algo.revise_every = algo, algo.startswith("strata"), 2
        if algo.startswith("strata"):
            c.judge.samples, c.algo.judge_train, c.algo.tasks_per_iter = 3, True, 4
            validate(c)  # issue #15: built
        else:
            with pytest.raises(ConfigError, match="revise_every=2 revises a strategy"):
                validate(c)
    c = base_config()
    c.algo.judgment, c.judge.samples = False, 3
    with pytest.raises(ConfigError, match="judge.samples=3 needs config.algo.judgment=True"):
        validate(c)
    c = base_config()
    c.judge.samples = 3  # P * N * M * k = 16 * 32 * 3 judgments in one call
    with pytest.raises(ConfigError, match="judge.samples = 1536 rows exceeds the largest bucket"):
        validate(c)
    c = base_config()
    c.env.name, c.algo.milestones = "alfworld", "expert_plan"  # built there: accepted
    validate(c)


def test_judgment_on_a_flat_algorithm_fails_loudly():
    c = base_config()
    c.algo.name = "grpo"
    c.algo.judgment = True
    with pytest.raises(ConfigError, match="judgment=True is only wired for strata"):
        validate(c)


def test_diverse_selection_without_candidates_to_select_from_fails_loudly():
    """Farthest-point selection of N strategies among oversample x N candidates keeps all N when
    oversample is 1: the doors configs had diverse=True with oversample=1, a silent no-op."""
    c = base_config()
    c.algo.oversample = 1
    with pytest.raises(ConfigError, match="algo.diverse=True selects N strategies.*oversample=1"):
        validate(c)
    c.algo.diverse = False
    validate(c)
    c.algo.oversample, c.algo.diverse = 2, True
    validate(c)


def _launch(*args):
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_unknown_key_and_bad_value():
    r = _launch("--config", "configs/grpo_household.py", "--config.algo.delt=0.3", "--dry_run")
    assert r.returncode == 2 and "unknown config key config.algo.delt" in r.stderr and "delta" in r.stderr
    r = _launch("--config", "configs/grpo_household.py", "--config.algo.delta=1.5", "--dry_run")
    assert r.returncode == 2 and "config.algo.delta=1.5 must be in (0, 1]" in r.stderr
    r = _launch("--config", "configs/strata_alfworld.py", "--config.algo.delta=0.25", "--dry_run")
    assert r.returncode == 0 and "delta: 0.25" in r.stdout


def test_cli_unknown_mode():
    r = _launch("fly", "--dry_run")
    assert r.returncode != 0 and "unknown mode 'fly'" in (r.stderr + r.stdout)


def test_policy_calls_larger_than_the_batch_buckets_are_refused_before_any_work():
    """64 held-out tasks with buckets up to 32 used to fail at the first evaluation, after SFT."""
    from configs.tiny_household import get_config

    c = get_config()
    c.sampling.batch_buckets = (8, 16, 32)
    with pytest.raises(ConfigError, match=r"eval.num_tasks = 64 rows exceeds the largest bucket 32"):
        validate(c)
    c.eval.every = 0  # no evaluation: no such call
    validate(c)
    c.algo.tasks_per_iter = 8  # 8 tasks x 2 strategies x 4 trajectories = 64 action rows
    with pytest.raises(ConfigError, match=r"trajectories per task = 64"):
        validate(c)


def test_attention_choices_are_the_models():
    """The config's allowed model.attention values are exactly what the model implements."""
    from configs.base import CHOICES
    from strata_jax.models.config import ATTENTION_IMPLS

    assert CHOICES["model.attention"] == ATTENTION_IMPLS


def test_pack_segments_needs_shared_prefixes():
    """train.pack_segments packs the remainders of rows that share a prefix: without
    train.shared_prefix it would be a silent no-op, so it is refused."""
    c = base_config()
    c.train.pack_segments, c.train.shared_prefix = True, False
    with pytest.raises(ConfigError, match="pack_segments=True needs train.shared_prefix=True"):
        validate(c)
    c.train.shared_prefix = True
    validate(c)
