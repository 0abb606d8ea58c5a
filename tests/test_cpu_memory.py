"""rollout/cpu_memory.py: after keep_freed_memory, a freed 64 MB block's pages stay mapped, so
allocating it again does not fault them in (counted with getrusage, independent of malloc)."""

import platform
import resource

import numpy as np
import pytest

from rollout.cpu_memory import keep_freed_memory


def _faults_touching(n_bytes: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(n_bytes, np.uint8)
    a[::4096] = 1  # touch every page
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    assert keep_freed_memory() is True
    n = 64 << 20  # above glibc's 32 MB ceiling for serving a block from the heap by default
    _faults_touching(n)  # first touch: the heap grows, its pages fault in once
    again = _faults_touching(n)
    assert again < (n // 4096) // 10, f"{again} page faults re-touching a freed {n >> 20} MB block"


def test_applied_only_where_jax_runs_on_the_cpu():
    from rollout.cpu_memory import keep_freed_memory_on_cpu, runs_on_cpu

    assert runs_on_cpu({"JAX_PLATFORMS": "cpu"})
    assert not runs_on_cpu({"JAX_PLATFORMS": "cuda"})
    assert not runs_on_cpu({"JAX_PLATFORMS": "cuda,cpu"})  # cpu is only the fallback there
    assert keep_freed_memory_on_cpu({"JAX_PLATFORMS": "tpu"}) is False
    assert keep_freed_memory_on_cpu({"JAX_PLATFORMS": "cpu", "STRATA_KEEP_FREED_MEMORY": "0"}) is False
    with pytest.raises(ValueError, match="STRATA_KEEP_FREED_MEMORY"):
        keep_freed_memory_on_cpu({"STRATA_KEEP_FREED_MEMORY": "yes"})
