"""The package's import structure: import cycles and the largest modules, read with ``ast``.

Usage (from the repository root)::

    python benchmarks/structure.py               # checkpointing/
    python benchmarks/structure.py PATH/TO/PKG

An edge A -> B is an import of B by A. Three kinds are told apart: module-level imports (run when
A is imported), imports inside functions (deferred: run when the function is first called), and
imports under ``if TYPE_CHECKING:`` (annotation-only: never run). ``from . import x`` is an edge to
the submodule ``x``; ``from .pkg import name`` is an edge to ``pkg`` (its ``__init__`` runs) and to
``pkg.name`` when that is a module. A module's own ancestors are not edges (they are being
imported already). Imports through ``importlib`` are not seen. Cycles are the strongly connected
components of more than one module, reported outside ``_planning`` and with it.

A module's size is its code lines: lines that hold code, not blank lines, comments, or the
docstrings of the module, its classes and its functions (a string elsewhere is code).
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

Graph = dict[str, set[str]]
KINDS = ("runtime", "deferred", "annotation")
# A reader takes in a module as one concept; past about 500 lines of code it holds two, and
# should be split where they part. Code lines only: documentation never counts against a module,
# so nobody trims a docstring or a NOTE to fit (``tests/test_house.py`` enforces the limit).
MOST_CODE_LINES = 500
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}
_DOCUMENTED = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def code_lines(source: str) -> int:
    """The lines of ``source`` that hold code: not blank, not only a comment, and not part of the
    docstring of the module, a class or a function."""
    rows: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            rows.update(range(token.start[0], token.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, _DOCUMENTED) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                rows.difference_update(range(first.lineno, (first.end_lineno or 0) + 1))
    return len(rows)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class Edges:
    """The import edges of every module under ``root``, by kind."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
        self.packages = {module_name(root, p) for p in root.rglob("__init__.py")}
        self.by_kind: dict[str, Graph] = {kind: {} for kind in KINDS}
        for name, path in self.files.items():
            self._visit(name, ast.parse(path.read_text()), "runtime")

    def merged(self, *kinds: str, planning: bool = True) -> Graph:
        graph: Graph = {}
        for kind in kinds:
            for a, bs in self.by_kind[kind].items():
                graph.setdefault(a, set()).update(bs)
        if planning:
            return graph
        outside = {m for m in self.files if "._planning" not in m}
        return {a: bs & outside for a, bs in graph.items() if a in outside}

    def _add(self, kind: str, a: str, b: str) -> None:
        if b in self.files and b != a and not a.startswith(b + "."):
            self.by_kind[kind].setdefault(a, set()).add(b)

    def _resolve(self, current: str, level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        base = current.split(".")
        if current not in self.packages:
            base = base[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def _visit(self, current: str, node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for sub in child.body:
                    self._statement(current, sub, "annotation")
                for sub in child.orelse:
                    self._statement(current, sub, kind)
                continue
            inner = kind
            if kind == "runtime" and isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            ):
                inner = "deferred"
            self._statement(current, child, inner)

    def _statement(self, current: str, node: ast.AST, kind: str) -> None:
        package = self.root.name
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(package):
                    self._add(kind, current, alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = self._resolve(current, node.level, node.module)
            if target.startswith(package):
                self._add(kind, current, target)
                for alias in node.names:
                    self._add(kind, current, f"{target}.{alias.name}")
        self._visit(current, node, kind)


def cycles(graph: Graph, nodes: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def show(title: str, graph: Graph, nodes: list[str]) -> None:
    found = cycles(graph, nodes)
    print(f"{title}: {len(found)} cycle(s)")
    for component in found:
        inside = set(component)
        for a in component:
            print(f"    {a} -> {', '.join(sorted(graph.get(a, set()) & inside))}")


def main(argv: list[str]) -> None:
    edges = Edges(Path(argv[0] if argv else "checkpointing"))
    nodes = sorted(edges.files)
    outside = [m for m in nodes if "._planning" not in m]
    run = ("runtime", "deferred")
    where = ", outside _planning"
    show("module-level imports" + where, edges.merged("runtime", planning=False), outside)
    show("+ deferred imports" + where, edges.merged(*run, planning=False), outside)
    show("+ annotation-only imports" + where, edges.merged(*KINDS, planning=False), outside)
    show("module-level + deferred, _planning included", edges.merged(*run), nodes)
    print("annotation-only imports that close a cycle:")
    executed = edges.merged(*run)
    for a, bs in sorted(edges.by_kind["annotation"].items()):
        for b in sorted(bs):
            graph = {k: set(v) for k, v in executed.items()}
            graph.setdefault(a, set()).add(b)
            if any(a in c and b in c for c in cycles(graph, nodes)):
                print(f"    {a} -> {b}")
    sizes = sorted(((code_lines(p.read_text()), m) for m, p in edges.files.items()), reverse=True)
    over = sum(n > MOST_CODE_LINES for n, _ in sizes)
    print(f"largest modules by code lines ({len(nodes)} modules, {over} over {MOST_CODE_LINES}):")
    for lines, name in sizes[:8]:
        print(f"    {lines:5d} {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
