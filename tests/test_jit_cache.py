"""rollout/jit_cache.py: which folder the persistent compilation cache uses, and that a process
that enables it writes its compiled programs there (a fresh subprocess, as launch.py runs)."""

import os
import pathlib
import subprocess
import sys

from rollout.jit_cache import DEFAULT_DIR, jit_cache_dir

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_cache_folder_choice():
    assert jit_cache_dir({"STRATA_JIT_CACHE": "/x/y"}) == pathlib.Path("/x/y")
    assert jit_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/z"}) == pathlib.Path("/z")
    assert jit_cache_dir({"STRATA_JIT_CACHE": "/x", "JAX_COMPILATION_CACHE_DIR": "/z"}) == pathlib.Path("/x")
    assert jit_cache_dir({}) == DEFAULT_DIR.expanduser()
    for off in ("0", "off", "None"):
        assert jit_cache_dir({"STRATA_JIT_CACHE": off}) is None


def test_enabled_process_writes_its_programs(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.pop("XLA_FLAGS", None)
    env["STRATA_JIT_CACHE"] = str(tmp_path / "cache")
    code = (
        "from rollout.jit_cache import enable_jit_cache; import jax, jax.numpy as jnp; "
        "print(enable_jit_cache()); print(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(5)).sum())"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(tmp_path / "cache")
    assert any((tmp_path / "cache").iterdir()), "no compiled program was written to the cache"
