"""Every ```python block of README.md and docs/ runs, and the API reference lists the public names.

A page's blocks run in order in one namespace (a later block may use what an earlier one made),
in a temporary working directory. Marks are HTML comments on the line before a block, invisible
on the site:

- ``<!-- docs-test: skip REASON -->``: the block is not run (a GPU, several processes, a model
  from the Hub). ``SKIPPED`` pins how many such blocks each page has, so a mark cannot be added
  or forgotten unnoticed; a CUDA-only block without one fails here, on a machine without a GPU.
- ``<!-- docs-test: requires NAME -->``: run only where ``checkpointing.NAME`` exists (an entry
  point still landing; ``NAME`` may be dotted, ``policies.save_attention``), skipped otherwise.

A hidden set-up block (``<!-- docs-test: setup`` then code then ``-->``) runs where it stands,
for the tiny model or tensors that a fragment on the page assumes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from compile_support import COMPILE_MARKS, fresh_dynamo  # noqa: F401 (an autouse fixture)

import checkpointing
import checkpointing.policies

# A page on torch.compile compiles (see COMPILE_MARKS for the warnings torch raises inside). The
# pages run in CI's first stage only (the `once` marker): the release stages test the same calls.
pytestmark = [*COMPILE_MARKS, pytest.mark.once]

ROOT = Path(__file__).parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# Blocks marked "skip" per page (relative path): each one says why on its mark.
SKIPPED: dict[str, int] = {
    "docs/guide/transformers.md": 1,
}

_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)$")
_MARK = re.compile(r"^ *<!-- docs-test: (?P<kind>skip|requires) (?P<arg>.+?) -->$")
_SETUP_START = "<!-- docs-test: setup"


@dataclass
class Block:
    """One code block to run (or a hidden set-up), with the line it starts on."""

    line: int
    code: str
    skip: str | None = None
    requires: list[str] = field(default_factory=list)


def _blocks(path: Path) -> list[Block]:
    """The ```python blocks and hidden set-ups of ``path``, in page order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.strip() == _SETUP_START:
            end = lines.index("-->", index)
            blocks.append(Block(index + 1, "\n".join(lines[index + 1 : end])))
            index = end + 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            index += 1
            continue
        indent, info = fence["indent"], fence["info"].strip()
        end = next(k for k in range(index + 1, len(lines)) if lines[k] == f"{indent}```")
        if info.lower().startswith("py"):
            assert info == "python", f"{path.name}:{index + 1}: write ```python, not ```{info}"
            marks = []
            back = index - 1
            while back >= 0 and (mark := _MARK.match(lines[back])):
                marks.append(mark)
                back -= 1
            body = "\n".join(text[len(indent) :] for text in lines[index + 1 : end])
            blocks.append(
                Block(
                    index + 2,
                    body,
                    skip=next((m["arg"] for m in marks if m["kind"] == "skip"), None),
                    requires=[m["arg"] for m in marks if m["kind"] == "requires"],
                )
            )
        index = end + 1
    return blocks


def _has(dotted: str) -> bool:
    """Whether ``checkpointing.<dotted>`` exists (e.g. ``policies.save_attention``)."""
    target: object = checkpointing
    for part in dotted.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_pages_have_python_blocks() -> None:
    """The parser finds the pages and many blocks, so the tests below cannot pass vacuously."""
    found = {_name(page): len(_blocks(page)) for page in PAGES}
    assert found["README.md"] >= 1
    assert found["docs/index.md"] >= 1
    assert sum(found.values()) >= 40, found


def test_skip_marks_are_counted() -> None:
    """Each page has exactly the skipped blocks SKIPPED names (a new or lost mark fails)."""
    counted = {_name(page): sum(b.skip is not None for b in _blocks(page)) for page in PAGES}
    assert {k: v for k, v in counted.items() if v} == {k: v for k, v in SKIPPED.items() if v}


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=_name)
def test_page_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's unmarked ```python blocks run in order, in one namespace, without error."""
    blocks = _blocks(page)
    monkeypatch.chdir(tmp_path)
    # A real module: dynamo (torch 2.11) imports the module a traced function's globals name.
    module = types.ModuleType("docs_page_under_test")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace: dict[str, Any] = module.__dict__
    missing: list[str] = []
    try:
        for block in blocks:
            if block.skip is not None:
                continue
            absent = [n for n in block.requires if not _has(n)]
            if absent:
                missing += absent
                continue
            exec(compile(block.code, f"{_name(page)}:{block.line}", "exec"), namespace)
    finally:  # a page that starts a (one-rank) process group ends it; one that failed, too
        if dist.is_initialized():
            dist.destroy_process_group()
    if missing:
        pytest.skip(f"blocks need checkpointing.{', '.join(sorted(set(missing)))}")


def _documented(page: str) -> set[str]:
    text = (ROOT / "docs" / "reference" / page).read_text()
    return set(re.findall(r"^::: ([\w.]+)$", text, flags=re.MULTILINE))


def test_reference_lists_every_public_name() -> None:
    """Every name of checkpointing.__all__ and checkpointing.policies.__all__ has an entry."""
    wanted = {f"checkpointing.{n}" for n in checkpointing.__all__}
    wanted |= {f"checkpointing.policies.{n}" for n in checkpointing.policies.__all__}
    listed = _documented("checkpointing.md") | _documented("policies.md")
    assert wanted - listed == set()


def test_readme_is_a_front_page() -> None:
    """README.md stays short and keeps the marker and the one-line command .ci/run executes."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    marker = next(i for i, line in enumerate(lines) if line.startswith("<!-- .ci/run executes"))
    assert lines[marker + 1] == "```bash"
    assert lines[marker + 2].startswith("python3.11 -m venv .venv && ")
    assert lines[marker + 3] == "```"


def test_readme_links_resolve() -> None:
    """Every relative link of README.md names a file of the repository (the site's own links
    are checked by ``mkdocs build --strict``)."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert len(local) >= 10, local
    assert [t for t in local if not (ROOT / t).exists()] == []


def _catalogue_hook() -> Any:
    """docs/hooks/messages.py, loaded as MkDocs loads it (by path: docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("messages", ROOT / "docs/hooks/messages.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_troubleshooting_catalogue_has_every_message() -> None:
    """The troubleshooting page's catalogue (built from the source) shows every ``_MSG_*``
    constant of the package, each with its text."""
    hook = _catalogue_hook()
    defined = set()
    for path in (ROOT / "checkpointing").rglob("*.py"):
        dotted = ".".join(path.relative_to(ROOT / "checkpointing").with_suffix("").parts)
        for name in re.findall(r"^(_MSG_\w+)\b", path.read_text(), flags=re.MULTILINE):
            defined.add(f"{dotted}.{name}")
    page = hook.on_page_markdown((ROOT / "docs" / "troubleshooting.md").read_text())
    assert hook.MARKER not in page
    shown = set(re.findall(r"^`([\w.]+\._MSG_\w+)`$", page, flags=re.MULTILINE))
    assert len(defined) >= 100
    assert defined - shown == set()


def test_troubleshooting_catalogue_shows_each_message_whole() -> None:
    """Each catalogued text is the constant's value once its module is imported: a message
    completed after its first lines (``_MSG_X += _FIX``) is shown with its fix."""
    hook = _catalogue_hook()
    catalogued = [item for items in hook.messages().values() for item in items]
    assert "_selective.unkept._MSG_RANDOM_OP" in dict(catalogued)
    for name, text in catalogued:
        module, _, constant = f"checkpointing.{name}".rpartition(".")
        assert getattr(importlib.import_module(module), constant) == text, name
