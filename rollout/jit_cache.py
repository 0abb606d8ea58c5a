"""JAX's persistent compilation cache for launch.py runs: a restarted or repeated run loads its
compiled programs from disk instead of compiling them again.

On the CPU the household config compiles about 80 programs (a sampler per batch and prompt
bucket, the train step, the advantages); with the cache warm, a second run skips most of that
compile time. A program is looked up by its HLO, the jax version and the compile options, so a
changed model or config compiles anew.

    STRATA_JIT_CACHE=DIR   cache folder (default: $JAX_COMPILATION_CACHE_DIR, else
                           ~/.cache/strata_jax/jit)
    STRATA_JIT_CACHE=0     off
"""

from __future__ import annotations

import os
import pathlib

DEFAULT_DIR = pathlib.Path("~/.cache/strata_jax/jit")
OFF = ("0", "off", "none", "false")


def jit_cache_dir(environ=None) -> pathlib.Path | None:
    """The cache folder this process should use, or None when the cache is turned off."""
    env = os.environ if environ is None else environ
    choice = env.get("STRATA_JIT_CACHE", "").strip()
    if choice.lower() in OFF:
        return None
    path = choice or env.get("JAX_COMPILATION_CACHE_DIR", "").strip() or str(DEFAULT_DIR)
    return pathlib.Path(path).expanduser()


def enable_jit_cache(environ=None) -> pathlib.Path | None:
    """Point jax at the cache folder (created if missing) and cache every program, however quick
    its compile (the tiny model's programs each take well under jax's default 1 s threshold).
    Returns the folder, or None when turned off or not writable (the run then compiles as usual)."""
    path = jit_cache_dir(environ)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(path, os.W_OK):
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path
