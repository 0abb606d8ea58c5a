"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared-data paths."""

import os
import pathlib
import tarfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent compilation cache for the whole session, its xdist workers and the launch.py
# subprocesses they start (rollout/jit_cache.py): the many small runs compile the same programs.
# STRATA_JIT_CACHE=0 turns it off.
from rollout.jit_cache import OFF as JIT_CACHE_OFF  # noqa: E402 (jax-free; before jax is imported)

if os.environ.get("STRATA_JIT_CACHE", "").strip().lower() not in JIT_CACHE_OFF:
    import tempfile

    os.environ.setdefault("STRATA_JIT_CACHE", os.path.join(tempfile.gettempdir(), "strata_jax_test_jit_cache"))
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["STRATA_JIT_CACHE"])
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402

from rollout.cpu_memory import keep_freed_memory_on_cpu  # noqa: E402

keep_freed_memory_on_cpu()  # before any test imports jax: faster XLA:CPU calls (rollout/cpu_memory.py)

REPO = pathlib.Path(__file__).resolve().parents[1]


def shared_dir() -> pathlib.Path:
    """The project's shared/ folder: $STRATA_SHARED, else ../shared beside the checkout."""
    env = os.environ.get("STRATA_SHARED")
    return pathlib.Path(env) if env else REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared():
    d = shared_dir()
    if not d.exists():
        pytest.fail(f"shared folder not found at {d} (set STRATA_SHARED)")
    return d


@pytest.fixture(scope="session")
def alf_data(tmp_path_factory):
    """ALFWorld's eval.tar.xz (valid_seen + valid_unseen) unpacked once per session into a
    temporary folder, never into the repository."""
    archive = shared_dir() / "data" / "alfworld" / "eval.tar.xz"
    if not archive.exists():
        pytest.fail(f"ALFWorld archive missing: {archive}")
    out = tmp_path_factory.mktemp("alfworld")
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out
