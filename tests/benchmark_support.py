"""Importing a benchmark script (``benchmarks/<name>.py``) as a module, for the tests that read
its tables or reuse its workloads and hand policies."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as ``benchmark_<name>`` (registered in ``sys.modules``:
    its dataclasses look their module up there; it puts benchmarks/ on the path itself)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
