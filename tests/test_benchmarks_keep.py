"""``benchmarks/keep.py``'s checks pass: keep's gradients bitwise, its kept bytes the SAC's."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

# Run in CI's first stage only (the `once` marker): they call the library as the release stages do.
pytestmark = pytest.mark.once

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def keep_benchmark(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``benchmarks/keep.py`` imported in this process (the interpreter's imports are most of a
    fresh run's time); its helper modules and ``sys.path`` entries are removed afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("benchmarks_keep", BENCHMARKS / "keep.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    yield module
    for name, loaded in list(sys.modules.items()):
        if Path(getattr(loaded, "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]


def test_keep_benchmark_checks_pass(
    keep_benchmark: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """``keep.py --quick --no-timing`` returns 0 and says keep matched the plain run and the SAC."""
    assert keep_benchmark.main(["--quick", "--no-timing"]) == 0
    out = capsys.readouterr().out
    assert "keep's gradients bitwise equal to no checkpoint, dropout on: yes" in out
    assert "keep's bytes held after forward equal the SAC's: yes" in out
