"""Import a script of ``benchmarks/`` (not a package) by name, once, for the tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_benchmark_module(name: str):
    """``benchmarks/<name>.py`` as module ``name`` (cached in ``sys.modules``)."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
