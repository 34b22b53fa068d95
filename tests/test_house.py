"""House rules: no module of the package over ``MOST_CODE_LINES`` lines of code (documentation
does not count), every annotation-only import that closes a circle says so where it is made,
private torch is reached only through ``checkpointing/_compat/``, the marks on our saved-tensors
hooks are read only through ``checkpointing/_hook_marks.py``, no test file imports another
(what tests share lives in ``tests/*_support.py``), and no file cites the design notes the project
was built from (a reader of the repository does not have them: a comment states its reason
itself). The import cycles that run are checked by ``test_structure.py``; both read the package
with ``benchmarks/structure.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import ModuleType

import pytest
from structure_support import ROOT, load_structure

from checkpointing._hook_marks import MARKS

# Run in CI's first stage only (the `once` marker): these checks read the source tree, the same
# on every torch release.
pytestmark = pytest.mark.once

_MARK = "# annotations only"
# The design notes' name as a word, or a section sign before a number (built in two parts so that
# this file does not match itself).
_CITATION = re.compile(r"\b" + "SP" + r"EC\b|§\s*\d")
# What the repository holds that a reader reads: the package, its tests, benchmarks, docs,
# examples, CI scripts and the top-level files.
_READ = ("checkpointing", "tests", "benchmarks", "docs", "examples", ".ci")
_TOP = ("pyproject.toml", "noxfile.py", "README.md", "CHANGELOG.md", "mkdocs.yml")
_TEXT = {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".sh", ".ini", ".json", ""}


@pytest.fixture(scope="module")
def structure() -> ModuleType:
    """``benchmarks/structure.py``."""
    return load_structure()


def over_long(structure: ModuleType, package: Path) -> dict[str, int]:
    """The modules under ``package`` with more than ``MOST_CODE_LINES`` code lines, with their
    counts."""
    lengths = {
        str(p.relative_to(package.parent)): structure.code_lines(p.read_text())
        for p in sorted(package.rglob("*.py"))
    }
    return {name: n for name, n in lengths.items() if n > structure.MOST_CODE_LINES}


def imported_tests(tests: Path) -> dict[str, list[str]]:
    """Per file under ``tests`` that imports a test module (``test_*``, anywhere in the file,
    ``import`` or ``from ... import``): the test modules it imports."""
    found = {}
    for path in sorted(tests.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
        tests_imported = sorted(m for m in imported if m.split(".")[0].startswith("test_"))
        if tests_imported:
            found[path.name] = tests_imported
    return found


def read_texts(root: Path) -> dict[Path, str]:
    """What a reader reads under ``root`` (``_TOP``, ``_READ``), as text, by path."""
    paths = [root / name for name in _TOP if (root / name).is_file()]
    for folder in _READ:
        paths += sorted(p for p in (root / folder).rglob("*") if p.is_file())
    texts = {}
    for path in paths:
        if path.suffix not in _TEXT or "__pycache__" in path.parts:
            continue
        try:
            texts[path] = path.read_text()
        except UnicodeDecodeError:
            continue
    return texts


def citations(root: Path) -> list[str]:
    """``path:line`` of every line under ``root`` that cites the design notes."""
    found = []
    for path, text in read_texts(root).items():
        for number, line in enumerate(text.splitlines(), 1):
            if _CITATION.search(line):
                found.append(f"{path.relative_to(root)}:{number}")
    return found


# The planner's rules: one NOTE per wing (``checkpointing/_planning/<wing>/__init__.py``), each
# rule labelled by its wing's letter ("Rule M3", "NOTE [Planner measure], Rules M4-M6 and M9").
_WINGS = {"M": "measure", "S": "solve", "A": "apply"}
_LABELS = r"[MSA]\d+(?:-[MSA]\d+)?(?:(?:,\s+|\s+and\s+)[MSA]\d+(?:-[MSA]\d+)?)*"
_CITED = re.compile(r"(?:NOTE\s+\[Planner\s+(\w+)\],?\s+)?\bRules?\s+(" + _LABELS + r")\b")
_DEFINED = re.compile(r"^  Rule ([MSA]\d+)\. ", re.MULTILINE)
# The single NOTE the wings' NOTEs replaced: named only where the past is recorded.
_RETIRED = re.compile(r"NOTE\s+\[Planner\s+model\](?:,?\s+Rules?\s+\d+)?")
_RECORDS = ("CHANGELOG.md", "RESULTS.md")


def planner_rules(planning: Path) -> dict[str, list[str]]:
    """Per wing, the labels of the rules its NOTE defines, in order."""
    found = {}
    for letter, wing in _WINGS.items():
        text = (planning / wing / "__init__.py").read_text()
        note = text[text.index(f"NOTE [Planner {wing}]") :] if f"[Planner {wing}]" in text else ""
        found[wing] = [label for label in _DEFINED.findall(note) if label.startswith(letter)]
    return found


def _expanded(labels: str) -> list[str]:
    """``"M4-M6 and S2"`` -> ``["M4", "M5", "M6", "S2"]``."""
    found = []
    for item in re.split(r",\s+|\s+and\s+", labels):
        first, _, last = item.partition("-")
        end = int((last or first)[1:])
        found += [f"{first[0]}{n}" for n in range(int(first[1:]), end + 1)]
    return found


def unresolved_rules(root: Path, defined: dict[str, list[str]]) -> list[str]:
    """``path: citation`` of every planner rule cited under ``root`` that no wing's NOTE
    defines, or named under another wing's NOTE, and of every citation of the retired NOTE."""
    known = {label for labels in defined.values() for label in labels}
    found = []
    for path, text in read_texts(root).items():
        if path == root / "tests" / "test_house.py":
            continue  # the check's own examples
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # a citation may break across lines
        where = path.relative_to(root)
        if path.name not in _RECORDS:
            found += [f"{where}: {m.group(0)}" for m in _RETIRED.finditer(flat)]
        for match in _CITED.finditer(flat):
            wing, labels = match.group(1), _expanded(match.group(2))
            wrong_wing = wing is not None and any(_WINGS[la[0]] != wing for la in labels)
            if wrong_wing or not set(labels) <= known:
                found.append(f"{where}: {match.group(0)}")
    return found


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
    """A long module, an unexplained annotation-only circle, a test importing a test and a
    citation are found; documentation does not count, an explained circle and a support module
    pass."""
    most = structure.MOST_CODE_LINES
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "long.py").write_text("x = 1\n" * (most + 1))
    documented = '"""Module.\n\n"""\n\n# A comment.\n\n\ndef f():\n    """Docs.\n\n    More."""\n'
    (package / "documented.py").write_text(documented + "x = 1  # counted\n" * (most - 1))
    (package / "a.py").write_text("from . import b\n")
    guard = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:{}\n    from .a import x\n"
    (package / "b.py").write_text(guard.format(""))
    assert structure.code_lines(documented) == 1
    assert over_long(structure, package) == {"pkg/long.py": most + 1}
    assert undocumented(structure, package) == ["pkg.b"]
    (package / "b.py").write_text(guard.format("  # annotations only: a imports b"))
    assert undocumented(structure, package) == []

    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("import pytest\nfrom x_support import helper\n")
    (tests / "test_b.py").write_text("def f():\n    from test_a import helper\n")
    (tests / "x_support.py").write_text("import test_b\n")
    assert imported_tests(tests) == {"test_b.py": ["test_a"], "x_support.py": ["test_b"]}

    (tests / "test_c.py").write_text(
        "RESPECT_HOOKS = 1  # no citation\n# see " + "SP" + "EC " + "§" + "4\n"
    )
    (tmp_path / "noxfile.py").write_text("# a reason, stated (" + "§" + " 12)\n")
    assert citations(tmp_path) == ["noxfile.py:1", "tests/test_c.py:2"]


def test_no_module_over_the_code_line_limit(structure: ModuleType) -> None:
    """One concept per module, none over ``MOST_CODE_LINES`` code lines (checkpointing/)."""
    assert over_long(structure, ROOT / "checkpointing") == {}


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


def mark_probes(package: Path, marks: frozenset[str]) -> list[str]:
    """``path:line`` of each ``getattr``/``hasattr`` call that reads one of ``marks`` by name in
    a module under ``package`` other than ``_hook_marks.py`` and those of ``_compat/``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if "_compat" in parts or path.name == "_hook_marks.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in marks
            ):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_the_mark_check_can_fail(tmp_path: Path) -> None:
    """A mark read by getattr or hasattr is found outside ``_hook_marks.py`` and ``_compat/``;
    there, and reads of other names, pass."""
    package = tmp_path / "pkg"
    (package / "_compat").mkdir(parents=True)
    (package / "_compat" / "a.py").write_text("x = getattr(hook, 'frame', None)\n")
    (package / "_hook_marks.py").write_text("x = getattr(hook, 'frame', None)\n")
    (package / "b.py").write_text("y = 1\nx = getattr(hook.__self__, 'region_label')\n")
    (package / "c.py").write_text("x = hasattr(hook, 'frame') or getattr(hook, 'name', None)\n")
    marks = frozenset({"frame", "region_label"})
    assert mark_probes(package, marks) == ["pkg/b.py:2", "pkg/c.py:1"]


def test_hook_marks_are_read_through_hook_marks() -> None:
    """The marks on our saved-tensors hooks are set and read through ``_hook_marks``' typed
    accessors, one protocol in one place: no other module probes a hook for one by name."""
    assert mark_probes(ROOT / "checkpointing", MARKS) == []


def test_no_test_file_imports_another() -> None:
    """What tests share lives in ``tests/*_support.py``: importing a test module runs its
    module-level code twice under two names and ties a test file to another's internals."""
    assert imported_tests(ROOT / "tests") == {}


def test_nothing_cites_the_design_notes() -> None:
    """Comments, docstrings and docs state their reasons themselves: the design notes the
    project was built from are not in the repository, so a citation of them explains nothing."""
    assert citations(ROOT) == []


def test_the_planner_rule_check_can_fail(tmp_path: Path) -> None:
    """A rule no NOTE defines, a rule named under another wing's NOTE (across a line break) and
    the retired NOTE's numbers are found; defined rules, ranges and other NOTEs' rules pass."""
    for letter, wing in _WINGS.items():
        folder = tmp_path / "checkpointing" / "_planning" / wing
        folder.mkdir(parents=True)
        rules = "".join(f"  Rule {letter}{n}. A rule.\n" for n in (1, 2, 3))
        (folder / "__init__.py").write_text(f'"""Wing.\n\nNOTE [Planner {wing}]\n{rules}"""\n')
    defined = planner_rules(tmp_path / "checkpointing" / "_planning")
    assert defined == {w: [f"{x}1", f"{x}2", f"{x}3"] for x, w in _WINGS.items()}
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "Rules M1-M3 and S2; NOTE [Selective checkpoint cache], Rule 10; Rule A4; NOTE [Planner\n"
        "solve], Rule M2; NOTE [Planner model], Rule 22.\n"
    )
    assert unresolved_rules(tmp_path, defined) == [
        "docs/a.md: NOTE [Planner model], Rule 22",
        "docs/a.md: Rule A4",
        "docs/a.md: NOTE [Planner solve], Rule M2",
    ]


def test_every_cited_planner_rule_exists() -> None:
    """Every planner rule cited in the package, tests, benchmarks and docs is defined by its
    wing's NOTE (``checkpointing/_planning/<wing>/__init__.py``), under that wing's NOTE name,
    and each wing numbers its rules 1, 2, 3, ... in order."""
    defined = planner_rules(ROOT / "checkpointing" / "_planning")
    for letter, wing in _WINGS.items():
        assert defined[wing] == [f"{letter}{n}" for n in range(1, len(defined[wing]) + 1)], wing
        assert defined[wing], wing
    assert unresolved_rules(ROOT, defined) == []
