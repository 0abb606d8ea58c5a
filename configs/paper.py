"""One algorithm on one environment with the papers' defaults (ALGORITHMS.md section 7): ARG = "ALGO,ENV".

    python launch.py train --config configs/paper.py:strata,alfworld --workdir runs/strata_alfworld
    python launch.py --config configs/paper.py:grpo,household --dry_run     # validate + print
    python launch.py --config configs/paper.py                              # strata,household

ALGO is one of grpo, gigpo, strata, beacon, strata+beacon (configs.base.ALGOS) and ENV one of
household, alfworld, scienceworld, shop (configs.base.STUDY_ENVS; the doors corridor is a test world:
configs/tiny_doors.py, configs/tiny_signs.py). The config is `with_algo_env(base_config(), ALGO, ENV)`;
without a workdir a run writes to runs/ALGO_ENV (launch.py).
"""

from configs.base import ALGOS, STUDY_ENVS, base_config, with_algo_env

DEFAULT = "strata,household"  # the argument when none is given: StraTA on the built-in household world


def parse(arg: str) -> tuple[str, str]:
    """ "ALGO,ENV" -> (ALGO, ENV), or a ValueError naming the valid algorithms and environments."""
    algo, sep, env = (part.strip() for part in arg.partition(","))
    if not sep or algo not in ALGOS or env not in STUDY_ENVS:
        raise ValueError(
            f"configs/paper.py:{arg}: expected ALGO,ENV with ALGO one of {', '.join(ALGOS)} and ENV "
            f"one of {', '.join(STUDY_ENVS)} (e.g. configs/paper.py:strata,alfworld)"
        )
    return algo, env


def get_config(arg: str = DEFAULT):
    return with_algo_env(base_config(), *parse(arg))
