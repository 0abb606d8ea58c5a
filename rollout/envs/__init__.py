"""Environment registry: `make_env(name, **kwargs)` builds a TextEnv by name.

Imports are lazy so that the household world (pure Python) never pulls in TextWorld or the JVM.
"""

from __future__ import annotations

import importlib

from rollout.envs.base import EnvError, TextEnv

# name -> (module, class)
REGISTRY = {
    "household": ("rollout.envs.household", "HouseholdEnv"),
    "alfworld": ("rollout.envs.alfworld", "AlfWorldEnv"),
    "scienceworld": ("rollout.envs.scienceworld", "ScienceWorldEnv"),
    "doors": ("rollout.envs.doors", "DoorsEnv"),
}


def make_env(name: str, **kwargs) -> TextEnv:
    """Build the environment `name` (household | alfworld | scienceworld | doors) with its kwargs."""
    if name not in REGISTRY:
        raise ValueError(f"unknown environment {name!r}; allowed: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["EnvError", "REGISTRY", "TextEnv", "make_env"]
