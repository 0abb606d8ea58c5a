"""Environment registry: `make_env(name, **kwargs)` builds a TextEnv by name.

Imports are lazy so that the household world (pure Python) never pulls in TextWorld or the JVM.
"""

from __future__ import annotations

import importlib

from rollout.envs.base import EnvError, TextEnv

# name -> (module, class): every world, the names a config's env.name may take (configs/base.py ENVS)
REGISTRY = {
    "household": ("rollout.envs.household", "HouseholdEnv"),
    "alfworld": ("rollout.envs.alfworld", "AlfWorldEnv"),
    "scienceworld": ("rollout.envs.scienceworld", "ScienceWorldEnv"),
    "shop": ("rollout.envs.shop", "ShopEnv"),
    "doors": ("rollout.envs.doors", "DoorsEnv"),
}
# First line of every prompt, for environments whose own differs from prompts.INTRO (household's).
INTROS = {
    "shop": "You are an expert autonomous agent operating in the WebShop e-commerce environment.",
    "scienceworld": "You are an agent in a text-based science experiment environment.",
    "doors": "You are an agent in a corridor of locked doors.",
}
# Environments whose step rewards are part of the episode return R (rollout/collect.py): the shop's
# purchase score, so a partial match earns partial credit (rollout/envs/shop.py).
REWARD_IN_RETURN = frozenset({"shop"})


def make_env(name: str, **kwargs) -> TextEnv:
    """Build the environment `name` (household | alfworld | scienceworld | shop | doors) with its kwargs."""
    if name not in REGISTRY:
        raise ValueError(f"unknown environment {name!r}; allowed: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["EnvError", "INTROS", "REGISTRY", "REWARD_IN_RETURN", "TextEnv", "make_env"]
