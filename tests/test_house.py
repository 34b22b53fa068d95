"""House rules on the package's shape (issue 43, point 6): no module over 700 lines, and every
annotation-only import that closes a circle says so where it is made. The import cycles that
run are checked by ``test_structure.py``; both read the package with ``benchmarks/structure.py``."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import pytest
from structure_support import ROOT, load_structure

MOST_LINES = 700
_MARK = "# annotations only"


@pytest.fixture(scope="module")
def structure() -> ModuleType:
    """``benchmarks/structure.py``."""
    return load_structure()


def over_long(package: Path) -> dict[str, int]:
    """The modules under ``package`` longer than ``MOST_LINES`` lines, with their lengths."""
    lengths = {
        str(p.relative_to(package.parent)): len(p.read_text().splitlines())
        for p in sorted(package.rglob("*.py"))
    }
    return {name: n for name, n in lengths.items() if n > MOST_LINES}


def undocumented(structure: ModuleType, package: Path) -> list[str]:
    """The annotation-only imports ``a -> b`` inside an import cycle whose ``if TYPE_CHECKING:``
    line does not say why (``# annotations only: ...``)."""
    edges = structure.Edges(package)
    cycles = structure.cycles(edges.merged(*structure.KINDS), sorted(edges.files))
    found = []
    for cycle in cycles:
        members = set(cycle)
        for a in cycle:
            if not edges.by_kind["annotation"].get(a, set()) & members:
                continue
            source = edges.files[a].read_text()
            lines = source.splitlines()
            guards = [
                lines[node.lineno - 1]
                for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.If) and structure.is_type_checking(node.test)
            ]
            if not guards or not all(_MARK in line for line in guards):
                found.append(a)
    return sorted(found)


def test_the_checks_can_fail(structure: ModuleType, tmp_path: Path) -> None:
    """A long module and an unexplained annotation-only circle are found; explained, it is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "long.py").write_text("x = 1\n" * (MOST_LINES + 1))
    (package / "a.py").write_text("from . import b\n")
    guard = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:{}\n    from .a import x\n"
    (package / "b.py").write_text(guard.format(""))
    assert over_long(package) == {"pkg/long.py": MOST_LINES + 1}
    assert undocumented(structure, package) == ["pkg.b"]
    (package / "b.py").write_text(guard.format("  # annotations only: a imports b"))
    assert undocumented(structure, package) == []


def test_no_module_over_700_lines() -> None:
    """One concept per module, none over 700 lines (checkpointing/)."""
    assert over_long(ROOT / "checkpointing") == {}


def test_annotation_only_circles_are_explained(structure: ModuleType) -> None:
    """An import under ``TYPE_CHECKING`` that closes a circle says why, where it is made."""
    assert undocumented(structure, ROOT / "checkpointing") == []


def private_torch_uses(package: Path) -> dict[str, list[str]]:
    """Outside ``<package>/_compat/``: each module's imports of a private torch module or name
    (``torch._C``, ``torch.utils._pytree``, ``from torch.x import _y``) and its attribute chains
    from ``torch`` through a private name (``torch.autograd._is_checkpoint_valid``)."""
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if "_compat" in path.relative_to(package).parts:
            continue
        uses = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                uses += [a.name for a in node.names if _private_torch(a.name)]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                uses += [n for n in names if _private_torch(n)]
            elif isinstance(node, ast.Attribute):
                chain = _dotted(node)
                if chain is not None and _private_torch(chain):
                    uses.append(chain)
        if uses:
            found[str(path.relative_to(package.parent))] = sorted(set(uses))
    return found


def _private_torch(dotted: str) -> bool:
    """Whether a dotted name is torch's and passes through a private part (not a dunder). Op
    handles under ``torch.ops`` are public whatever the op's name (``aten._addmm_activation``)."""
    parts = dotted.split(".")
    return (
        parts[0] == "torch"
        and parts[1:2] != ["ops"]
        and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])
    )


def _dotted(node: ast.Attribute) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a plain name, else None."""
    parts = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    return ".".join([value.id, *reversed(parts)]) if isinstance(value, ast.Name) else None


def test_the_private_torch_check_can_fail(tmp_path: Path) -> None:
    """Private torch reached by import or by attribute is found outside ``_compat``, not in it."""
    package = tmp_path / "pkg"
    (package / "_compat").mkdir(parents=True)
    (package / "_compat" / "__init__.py").write_text("import torch._C\n")
    (package / "a.py").write_text("from torch.utils._pytree import tree_leaves\n")
    (package / "b.py").write_text("import torch\nx = torch.autograd._is_checkpoint_valid()\n")
    (package / "c.py").write_text("import torch\nx = torch.nn.Module.__init__\n")
    (package / "d.py").write_text("import torch\nx = torch.ops.aten._addmm_activation\n")
    assert private_torch_uses(package) == {
        "pkg/a.py": ["torch.utils._pytree.tree_leaves"],
        "pkg/b.py": ["torch.autograd._is_checkpoint_valid"],
    }


def test_only_compat_reaches_private_torch() -> None:
    """Private torch APIs are reached only through ``checkpointing/_compat/``, the one place to
    fix when torch moves them."""
    assert private_torch_uses(ROOT / "checkpointing") == {}
