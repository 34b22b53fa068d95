"""``benchmarks/structure.py`` for the tests of the package's shape (``test_house.py``,
``test_structure.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_structure() -> ModuleType:
    """``benchmarks/structure.py``, loaded by path (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("structure", ROOT / "benchmarks/structure.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
