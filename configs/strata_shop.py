"""StraTA on the offline WebShop-style store (rollout/envs/shop.py): ALGORITHMS.md section 7 defaults, 15 steps."""

from configs.base import base_config, with_algo_env


def get_config():
    return with_algo_env(base_config(), "strata", "shop")
