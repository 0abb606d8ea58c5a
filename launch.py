"""strata_jax command line.

    python launch.py                          # the embedded default: SFT + StraTA, tiny model, signpost corridor
    python launch.py train --config configs/paper.py:strata,alfworld --config.algo.delta=0.25 --workdir runs/x
    python launch.py eval   --workdir runs/x           # success overall / per task type / per horizon bucket
    python launch.py sft    --config configs/tiny_household.py --workdir runs/x
    python launch.py ablate --workdir runs/x --grid delta=0.25,0.5,0.75,1 --grid kappa=0,0.1,0.2
    python launch.py ablate --train --workdir runs/pop --grid delta=0.25,0.5   # train 2 copies in one vmapped program
    python launch.py export --workdir runs/x --out exported/   # Hugging Face format

Every mode validates the config before any work: a missing config file, an unknown key (with its
close matches), a bad value or an option that is not built yet is one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

REPO = pathlib.Path(__file__).resolve().parent
MODES = ("train", "eval", "sft", "ablate", "export")
# The embedded default: the configuration a bare `python launch.py` runs (README command 1). The
# signpost corridor, where RL visibly lifts the tiny model in minutes; the household world's tiny
# config (configs/tiny_household.py) does not rise with training (docs/RESULTS.md).
DEFAULT_CONFIG = REPO / "configs" / "tiny_signs.py"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define the command-line flags (called from __main__, after `check_command_line`).

    Not at import: ml_collections parses the config file and the `--config.a.b=v` overrides in
    sys.argv while DEFINE_config_file runs, so a typo would end in its traceback before any check
    of ours could name it in one line.
    """
    config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "Experiment config file.", lock_config=True)
    flags.DEFINE_string(
        "workdir",
        None,
        "Run directory (checkpoints, metrics, plots). Default: runs/<config name>, "
        "runs/ALGO_ENV for configs/paper.py:ALGO,ENV.",
    )
    flags.DEFINE_multi_string(
        "grid",
        [],
        "ablate: NAME=v1,v2,... (delta, kappa, gamma, beacon_gamma, lam_strategy, "
        "lam_seg, omega, invalid_penalty); repeat for a product grid.",
    )
    flags.DEFINE_bool(
        "train",
        False,
        "ablate: train one copy of the model per grid point, all in one vmapped "
        "program (rollout/population.py), instead of re-scoring a run's saved batches.",
    )
    flags.DEFINE_string("out", None, "export: output directory for the Hugging Face model.")
    flags.DEFINE_bool("dry_run", False, "Validate and print the resolved config, then exit.")


def _workdir(config) -> pathlib.Path:
    if FLAGS.workdir:
        return pathlib.Path(FLAGS.workdir)
    return REPO / "runs" / run_name(config_flags.get_config_filename(FLAGS["config"]))


def run_name(config_spec: str) -> str:
    """The default run directory's name for `--config config_spec`: the config file's name, or for
    a parameterised one (`file.py:arg`) the argument, each run of characters other than letters,
    digits, - and _ as one _ (configs/paper.py:strata+beacon,alfworld -> strata_beacon_alfworld)."""
    import re

    path, _, arg = config_spec.partition(":")
    return re.sub(r"[^A-Za-z0-9_-]+", "_", arg).strip("_") or pathlib.Path(path).stem


def main(argv: list[str]) -> int:
    from absl import logging

    from configs.base import ConfigError, validate

    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO

    rest = argv[1:]
    if len(rest) > 1 or (rest and rest[0] not in MODES):
        print(f"usage error: unknown mode {' '.join(rest)!r}; choose one of {list(MODES)}", file=sys.stderr)
        return 2
    mode = rest[0] if rest else "train"
    config = FLAGS.config
    try:
        validate(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if FLAGS.dry_run:
        print(config)
        return 0
    if FLAGS.train and mode != "ablate":
        print(
            "usage error: --train belongs to the ablate mode: launch.py ablate --train --grid NAME=v1,v2",
            file=sys.stderr,
        )
        return 2
    if mode == "ablate":  # a bad grid fails before any model is built
        from rollout.ablate import parse_grid
        from rollout.population import parse_train_grid

        try:
            (parse_train_grid if FLAGS.train else parse_grid)(FLAGS.grid, algo=config.algo.name)
        except ValueError as e:
            print(f"grid error: {e}", file=sys.stderr)
            return 2
        if FLAGS.train and config.mesh.rollout_shards > 1:  # rollout/population.py would refuse it after SFT
            print(
                f"config error: ablate --train collects each copy's rollouts as one shard; "
                f"config.mesh.rollout_shards={config.mesh.rollout_shards}: set it to 0 or 1",
                file=sys.stderr,
            )
            return 2
    workdir = _workdir(config)
    from rollout.jit_cache import enable_jit_cache

    enable_jit_cache()  # compiled programs kept on disk: a restarted run skips most compiles
    from rollout import trainer  # heavy imports (jax, transformers) only after validation

    try:
        if mode == "train":
            trainer.train(config, workdir)
        elif mode == "sft":
            trainer.sft_only(config, workdir)
        elif mode == "eval":
            trainer.evaluate_run(config, workdir)
        elif mode == "ablate" and FLAGS.train:
            from rollout.population import train_population

            train_population(config, workdir, FLAGS.grid)
        elif mode == "ablate":
            trainer.ablate(config, workdir, FLAGS.grid)
        elif mode == "export":
            trainer.export(config, workdir, FLAGS.out or str(workdir / "export"))
    except input_errors() as e:
        print(f"{_error_kind(e)}: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def input_errors() -> tuple[type, ...]:
    """What a user's input can be wrong with before any work (a model path, a model file, missing
    game files, a run that cannot fit): one line and exit 2, no traceback. Everything else is a bug
    and keeps its traceback."""
    from rollout.envs.base import GamesNotFoundError
    from rollout.warmstart import ModelPathError
    from strata_jax.memory import DoesNotFitError
    from strata_jax.models.config import ConfigError as ModelConfigError
    from strata_jax.models.config import UnsupportedArchitectureError
    from strata_jax.models.gguf import GGUFError
    from strata_jax.models.hf import CheckpointMismatchError, NotAModelDirectoryError

    return (
        ModelPathError,
        GGUFError,
        CheckpointMismatchError,
        NotAModelDirectoryError,
        UnsupportedArchitectureError,
        ModelConfigError,
        GamesNotFoundError,
        DoesNotFitError,
    )


def _error_kind(e: BaseException) -> str:
    from rollout.envs.base import GamesNotFoundError
    from strata_jax.memory import DoesNotFitError

    if isinstance(e, GamesNotFoundError):
        return "data error"
    if isinstance(e, DoesNotFitError):
        return "memory error"
    return "model error"


def _config_path(argv: list[str]) -> str:
    """The config file argument as ml_collections reads it (the last --config wins)."""
    path = str(DEFAULT_CONFIG)
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path


def check_command_line(argv: list[str]) -> str | None:
    """Name the first problem ml_collections would otherwise report as a traceback (None if none).

    The config file must exist and load; every `--config.a.b=v` key must be in it (close matches
    are suggested). Values are checked by the flag parser (`_parse_flags`) and by `validate()`.
    """
    import difflib
    import re

    spec_arg = _config_path(argv)
    path = spec_arg.split(":", 1)[0]  # ml_collections passes "file.py:arg" to get_config
    if not os.path.isfile(path):
        return f"config file {path!r} not found"
    sys.path.insert(0, str(REPO))  # config files import configs.base
    try:
        from configs.base import load_config_file

        config = load_config_file(spec_arg)
    except Exception as e:  # noqa: BLE001 (any failure of the user's file is reported, in one line)
        return f"config file {spec_arg!r} failed to load: {type(e).__name__}: {_one_line(e)}"
    # The override forms ml_collections accepts: -config.k=v, --config.k=v, --noconfig.k (booleans).
    keys = [m.group(1) for m in map(re.compile(r"^--?(?:no)?config\.([^=]+)").match, argv) if m]
    for key in keys:
        node = config
        for depth, part in enumerate(key.split(".")):
            if not hasattr(node, "keys") or part not in node.keys():
                here = ".".join(key.split(".")[:depth]) or "<top>"
                options = list(node.keys()) if hasattr(node, "keys") else []
                near = difflib.get_close_matches(part, options, n=3)
                hint = f"; did you mean {near}?" if near else f"; keys under {here}: {sorted(options)}"
                return f"unknown config key config.{key} (no {part!r} under {here}){hint}"
            node = node[part]
    return None


def _one_line(e) -> str:
    """An exception's message on one line (ml_collections' messages span several)."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parse, but a bad flag (e.g. --config.algo.delta=abc) is one line and exit code 2."""
    try:
        return FLAGS(argv)
    except Exception as e:  # noqa: BLE001 (flags.Error, or ml_collections' own errors while parsing)
        message = _one_line(e)
        _fail(f"{'config' if 'config' in message else 'command line'} error: {message}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from rollout.cpu_memory import keep_freed_memory_on_cpu

    keep_freed_memory_on_cpu()  # before jax starts its threads: 1.3x faster SFT on the CPU (rollout/cpu_memory.py)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' "PyTorch was not found" advice: we use its tokenizers and configs only.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    problem = check_command_line(sys.argv[1:])
    if problem:
        _fail(f"config error: {problem}")
    try:
        define_flags()
    except Exception as e:  # noqa: BLE001 (ml_collections parses the default config and overrides here)
        _fail(f"config error: {_one_line(e)}")
    app.run(main, flags_parser=_parse_flags)
