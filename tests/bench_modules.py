"""bench/ scripts as modules: the tests call their functions (bench/ is not a package)."""

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """bench/<name>.py, imported under the module name bench_<name>."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
