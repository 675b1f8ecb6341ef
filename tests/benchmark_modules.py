"""Load a script of `benchmarks/` as a module, for tests of its report
(the benchmarks are scripts, not a package)."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name):
    """The module of `benchmarks/<name>.py`.

    Example:
        >>> load_benchmark("remat_peers").report
    """
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
