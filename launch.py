"""strata_jax command line.

    python launch.py                                   # the embedded default: sft + StraTA, tiny model, household
    python launch.py train --config configs/strata_alfworld.py --config.algo.delta=0.25 --workdir runs/x
    python launch.py eval   --workdir runs/x           # success overall / per task type / per horizon bucket
    python launch.py sft    --config configs/tiny_household.py --workdir runs/x
    python launch.py ablate --workdir runs/x --grid delta=0.25,0.5,0.75,1 --grid kappa=0,0.1,0.2
    python launch.py ablate --train --workdir runs/pop --grid delta=0.25,0.5   # train 2 copies in one vmapped program
    python launch.py export --workdir runs/x --out exported/   # Hugging Face format

Every mode validates the config before any work; an unknown key or a bad value names the key.
"""

from __future__ import annotations

import os
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

REPO = pathlib.Path(__file__).resolve().parent
MODES = ("train", "eval", "sft", "ablate", "export")

config_flags.DEFINE_config_file(
    "config", str(REPO / "configs" / "tiny_household.py"), "Experiment config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, plots). Default: runs/<config name>.")
flags.DEFINE_multi_string("grid", [], "ablate: NAME=v1,v2,... (delta, kappa, gamma, beacon_gamma, lam_strategy, "
                          "lam_seg, omega, invalid_penalty); repeat for a product grid.")
flags.DEFINE_bool("train", False, "ablate: train one copy of the model per grid point, all in one vmapped "
                  "program (rollout/population.py), instead of re-scoring a run's saved batches.")
flags.DEFINE_string("out", None, "export: output directory for the Hugging Face model.")
flags.DEFINE_bool("dry_run", False, "Validate and print the resolved config, then exit.")
FLAGS = flags.FLAGS


def _workdir(config) -> pathlib.Path:
    if FLAGS.workdir:
        return pathlib.Path(FLAGS.workdir)
    name = pathlib.Path(config_flags.get_config_filename(FLAGS["config"])).stem
    return REPO / "runs" / name


def main(argv: list[str]) -> int:
    from absl import logging

    from configs.base import ConfigError, validate

    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO

    rest = argv[1:]
    if len(rest) > 1 or (rest and rest[0] not in MODES):
        raise app.UsageError(f"unknown mode {' '.join(rest)!r}; choose one of {list(MODES)}")
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
        raise app.UsageError("--train belongs to the ablate mode: launch.py ablate --train --grid NAME=v1,v2")
    if mode == "ablate":  # a bad grid fails before any model is built
        from rollout.ablate import parse_grid
        from rollout.population import parse_train_grid

        try:
            (parse_train_grid if FLAGS.train else parse_grid)(FLAGS.grid)
        except ValueError as e:
            print(f"grid error: {e}", file=sys.stderr)
            return 2
    workdir = _workdir(config)
    from rollout import trainer  # heavy imports (jax, transformers) only after validation

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
    return 0


def check_override_keys(argv: list[str]) -> str | None:
    """Name the first `--config.a.b=v` whose key the config file does not have (None if all exist).

    ml_collections would fail on it too, but with a bare AttributeError deep in absl.
    """
    import difflib
    import importlib.util

    path = str(REPO / "configs" / "tiny_household.py")
    keys = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config."):
            keys.append(arg[len("--config."):].split("=", 1)[0])
    if not keys:
        return None
    sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location("_cfg_check", path)
    if spec is None or not os.path.exists(path):
        return f"config file {path!r} not found"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
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


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    problem = check_override_keys(sys.argv[1:])
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        sys.exit(2)
    app.run(main)
