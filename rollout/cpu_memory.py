"""Keep freed heap memory in the process (glibc), so XLA:CPU's per-call buffers are not faulted in again.

    from rollout.cpu_memory import keep_freed_memory
    keep_freed_memory()   # first thing in the process, before jax starts its threads

XLA:CPU allocates each executable call's temporary buffer (85 MB for the tiny model's train step,
~250 MB for a 64-point advantage grid with diagnostics) and frees it when the call returns. glibc
serves a block over 32 MB with a fresh mmap and unmaps it on free, and a worker thread's arena
maps its own heaps the same way, so every call writes into fresh pages: one minor page fault per
4 KB, about 4 us each on the development VM (21,000 faults, ~85 ms, per train step of a ~170 ms
step). With mmap off, a high trim threshold and a single arena, freed blocks stay in the main heap
and the next call reuses pages that are already mapped.

`launch.py` and the test suite call `keep_freed_memory_on_cpu()`, which applies it only in a process
that will run on the CPU (the household config's SFT: 300 steps in 60 s against 78 s with glibc's
defaults, docs/BENCHMARKS.md); `STRATA_KEEP_FREED_MEMORY=0` turns it off, `=1` forces it.

Costs: memory the process frees is not returned to the OS (the heap keeps its peak), and every
thread allocates from one arena (more lock contention for malloc-heavy multi-threaded code).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 2**31 - 1  # bytes free at the heap top before it is returned: never, in effect


def keep_freed_memory() -> bool:
    """Apply the three mallopt settings. Returns False, changing nothing, where libc is not glibc
    (no mallopt: macOS, musl); raises RuntimeError if glibc refuses one of them."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, 1)):
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc mallopt({param}, {value}) failed")
    return True


ACCELERATOR_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/accel0", "/dev/vfio/0", "/dev/kfd")


def runs_on_cpu(environ=None) -> bool:
    """Whether this process's jax will run on the CPU, decided before jax is imported: JAX_PLATFORMS
    names only cpu, or no accelerator device file (NVIDIA, TPU, ROCm) exists."""
    env = os.environ if environ is None else environ
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    return not any(os.path.exists(d) for d in ACCELERATOR_DEVICES)


def keep_freed_memory_on_cpu(environ=None) -> bool:
    """keep_freed_memory() in a CPU process (see the module docstring); STRATA_KEEP_FREED_MEMORY=0 or 1
    overrides the decision. Returns whether the settings were applied."""
    env = os.environ if environ is None else environ
    choice = env.get("STRATA_KEEP_FREED_MEMORY", "auto").strip().lower()
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"STRATA_KEEP_FREED_MEMORY={choice!r}: use auto, 0 or 1")
    if choice == "0" or (choice == "auto" and not runs_on_cpu(env)):
        return False
    return keep_freed_memory()
