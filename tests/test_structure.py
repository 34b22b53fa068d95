"""The package's import graph (``benchmarks/structure.py``): no cycle among the imports that run,
and the circles issue 43 opened stay open, annotation-only imports included."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from structure_support import ROOT, load_structure

# Run in CI's first stage only (the `once` marker): these checks read the source tree, the same
# on every torch release.
pytestmark = pytest.mark.once


@pytest.fixture(scope="module")
def structure() -> ModuleType:
    """``benchmarks/structure.py``."""
    return load_structure()


def test_the_script_finds_a_cycle(structure: ModuleType, tmp_path: Path) -> None:
    """A two-module package importing each other is one cycle; under TYPE_CHECKING, none that
    runs (so the checks below can fail)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    edges = structure.Edges(package)
    nodes = sorted(edges.files)
    assert structure.cycles(edges.merged("runtime", "deferred"), nodes) == []
    assert structure.cycles(edges.merged(*structure.KINDS), nodes) == [["pkg.a", "pkg.b"]]
    (package / "b.py").write_text("def f():\n    from .a import x\n")
    edges = structure.Edges(package)
    assert structure.cycles(edges.merged("runtime", "deferred"), nodes) == [["pkg.a", "pkg.b"]]


def test_no_cycle_among_imports_that_run(structure: ModuleType) -> None:
    """Module-level and in-function imports of ``checkpointing`` form no cycle."""
    edges = structure.Edges(ROOT / "checkpointing")
    assert structure.cycles(edges.merged("runtime", "deferred"), sorted(edges.files)) == []


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("_frame", "_keep"),  # the span record lives in _span, below both
        ("_offload", "_selective.cache"),  # OffloadStats is the engine's
        ("integrations.transformers", "integrations._hf_callback"),  # a thin face
        ("integrations.transformers", "integrations._hf_enable"),
    ],
)
def test_opened_circles_stay_open(structure: ModuleType, a: str, b: str) -> None:
    """Issue 43's three avoidable circles: no cycle through both modules, counting
    annotation-only imports too."""
    edges = structure.Edges(ROOT / "checkpointing")
    graph = edges.merged(*structure.KINDS)
    pair = {f"checkpointing.{a}", f"checkpointing.{b}"}
    assert not any(pair <= set(c) for c in structure.cycles(graph, sorted(edges.files)))
