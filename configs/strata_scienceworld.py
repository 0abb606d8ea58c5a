"""StraTA on ScienceWorld: ALGORITHMS.md section 7 defaults."""

from configs.base import base_config, with_algo_env


def get_config():
    return with_algo_env(base_config(), "strata", "scienceworld")
