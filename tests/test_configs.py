"""Every config loads and validates; bad keys and values fail naming the key."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from configs.base import ALGOS, ENVS, STUDY_ENVS, TEST_ENVS, ConfigError, base_config, validate, with_algo_env

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted(p for p in (REPO / "configs").glob("*.py") if p.name not in ("__init__.py",))
PAPER = REPO / "configs" / "paper.py"
PAIRS = [(algo, env) for algo in ALGOS for env in STUDY_ENVS]


def _load(path, *args):
    """get_config(*args) of a config file, loaded as ml_collections loads `path[:arg]`."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(*args)


def test_study_envs_are_every_world_but_the_test_ones():
    assert set(STUDY_ENVS) | set(TEST_ENVS) == set(ENVS) and not set(STUDY_ENVS) & set(TEST_ENVS)
    assert "tiny_household" in {p.stem for p in CONFIG_FILES}


@pytest.mark.parametrize("algo,env", PAIRS, ids=[f"{a}-{e}" for a, e in PAIRS])
def test_paper_config_is_the_algorithm_on_the_environment(algo, env):
    """configs/paper.py:ALGO,ENV is with_algo_env(base_config(), ALGO, ENV) (what the 20 files
    configs/<algo>_<env>.py it replaced each returned), validated, with ALGORITHMS.md section 7's
    per-environment defaults."""
    c = validate(_load(PAPER, f"{algo},{env}"))
    assert c.to_dict() == validate(with_algo_env(base_config(), algo, env)).to_dict()
    assert (c.algo.name, c.env.name) == (algo, env)
    # ALGORITHMS.md section 7: ALFWorld max steps 50 (BEACON 30); synthetic 30.
    if env == "alfworld":
        assert c.env.max_steps == (30 if algo == "beacon" else 50)
    if env == "household":
        assert c.env.max_steps == 30
    assert c.algo.judgment == algo.startswith("strata")
    assert _load(PAPER, f" {algo} , {env} ").to_dict() == c.to_dict()  # spaces around the names are fine


def test_paper_config_without_an_argument_is_strata_on_the_household_world():
    assert _load(PAPER).to_dict() == with_algo_env(base_config(), "strata", "household").to_dict()


@pytest.mark.parametrize(
    "arg", ["strata", "ppo,household", "strata,doors", "strata,webshop", "strata,household,x", "strata_beacon,shop", ""]
)
def test_paper_config_refuses_a_bad_argument_naming_the_choices(arg):
    with pytest.raises(ValueError) as e:
        _load(PAPER, arg)
    for name in (*ALGOS, *STUDY_ENVS):
        assert name in str(e.value)


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
    validate(_load(path))


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("algo.name", "ppo", "config.algo.name='ppo' is not allowed"),
        ("algo.delta", 0.0, "config.algo.delta=0.0 must be in (0, 1]"),
        ("train.aggregation", "sum", "config.train.aggregation='sum'"),
        ("env.name", "webshop", "config.env.name='webshop'"),
        ("algo.kappa", -1.0, "config.algo.kappa=-1.0 must be >= 0"),
        ("algo.judge_train", True, "judge_train=True needs config.judge.samples >= 2"),
        ("judge.samples", 0, "config.judge.samples=0 must be >= 1"),
        ("algo.revise_every", -1, "config.algo.revise_every=-1 must be >= 0"),
        (
            "algo.milestones",
            "expert_plan",
            "config.algo.milestones='expert_plan' is only wired for env.name='alfworld'",
        ),
        ("train.eps_low", 1.0, "config.train.eps_low=1.0 must be in (0, 1)"),
        ("train.dual_clip", 1.0, "config.train.dual_clip=1.0 must be > 1"),
        ("sampling.prompt_buckets", (256, 128), "config.sampling.prompt_buckets=(256, 128) must be strictly ascending"),
        ("train.length_buckets", (0, 128), "config.train.length_buckets=(0, 128) must be strictly ascending"),
        ("train.bucket_steps", 3, "config.train.bucket_steps=3: expected 1, 2, 4, 8 or 16 sizes per octave"),
    ],
)
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
            validate(c)  # revision and judge training build
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
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_cli_unknown_key_and_bad_value():
    r = _launch("--config", "configs/paper.py:grpo,household", "--config.algo.delt=0.3", "--dry_run")
    assert r.returncode == 2 and "unknown config key config.algo.delt" in r.stderr and "delta" in r.stderr
    r = _launch("--config", "configs/paper.py:grpo,household", "--config.algo.delta=1.5", "--dry_run")
    assert r.returncode == 2 and "config.algo.delta=1.5 must be in (0, 1]" in r.stderr
    r = _launch("--config", "configs/paper.py:strata,alfworld", "--config.algo.delta=0.25", "--dry_run")
    assert r.returncode == 0 and "delta: 0.25" in r.stdout
    assert "name: alfworld" in r.stdout and "max_steps: 50" in r.stdout


def test_default_run_directory_is_named_after_the_config():
    import launch

    assert launch.run_name("configs/tiny_signs.py") == "tiny_signs"
    assert launch.run_name("configs/paper.py") == "paper"
    assert launch.run_name("configs/paper.py:strata,alfworld") == "strata_alfworld"
    assert launch.run_name("configs/paper.py:strata+beacon, household") == "strata_beacon_household"


def test_cli_paper_config():
    """configs/paper.py through the command line: ALGO,ENV after the colon (either flag form),
    the default without one, and a bad argument as one line naming the choices, exit 2."""
    r = _launch("--config=configs/paper.py:strata+beacon,shop", "--dry_run")
    assert r.returncode == 0 and "name: strata+beacon" in r.stdout and "name: shop" in r.stdout, r.stderr
    r = _launch("--config", "configs/paper.py", "--dry_run")
    assert r.returncode == 0 and "name: strata" in r.stdout and "name: household" in r.stdout, r.stderr
    r = _launch("--config", "configs/paper.py:ppo,alfworld", "--dry_run")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("config error: config file 'configs/paper.py:ppo,alfworld' failed to load")
    assert "ALGO one of grpo, gigpo, strata, beacon, strata+beacon" in lines[0]
    assert "ENV one of household, alfworld, scienceworld, shop" in lines[0]


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


def test_choices_are_the_librarys_own():
    """The config's allowed values are the constants the code they configure checks against,
    imported (strata_jax/names.py, rollout/options.py), not retyped."""
    from configs.base import CHOICES
    from rollout.collect import RolloutConfig
    from rollout.envs import REGISTRY
    from rollout.envs.alfworld import MILESTONE_MODES, SPLITS
    from strata_jax import loss, train
    from strata_jax.advantages import ALGOS as ADVANTAGE_ALGOS
    from strata_jax.advantages import params, weighting
    from strata_jax.models.config import ATTENTION_IMPLS

    assert CHOICES["algo.name"] is ADVANTAGE_ALGOS and CHOICES["env.name"] == tuple(REGISTRY)
    assert (CHOICES["algo.milestones"], CHOICES["env.split"]) == (MILESTONE_MODES, SPLITS)
    assert (CHOICES["algo.gigpo_norm"], CHOICES["algo.seg_norm"]) == (params.GIGPO_NORMS, params.SEG_NORMS)
    assert CHOICES["model.attention"] is ATTENTION_IMPLS and CHOICES["train.aggregation"] is loss.AGGREGATIONS
    assert CHOICES["train.schedule"] is train.SCHEDULES
    assert CHOICES["train.step_weighting"] is weighting.STEP_WEIGHTINGS
    # the rollout's own rules: refused alike by validate() and RolloutConfig.validate, each naming its key
    c = base_config()
    c.env.action_format, c.algo.invalid_penalty_tokens = "index", "divergence"
    with pytest.raises(ConfigError, match="config.algo.invalid_penalty_tokens='divergence' compares command text"):
        validate(c)
    with pytest.raises(ValueError, match="RolloutConfig.penalty_tokens='divergence' compares command text"):
        RolloutConfig(action_format="index", penalty_tokens="divergence").validate()
    for algo in ALGOS:  # RolloutConfig.from_config of every valid config is valid
        c = with_algo_env(base_config(), algo, "household")
        RolloutConfig.from_config(validate(c)).validate()
