"""Every ```python block of README.md and docs/ runs, and the API reference lists the public names.

A page's blocks run in order in one namespace (a later block may use what an earlier one made),
in a temporary working directory. Marks are HTML comments on the line before a block, invisible
on the site:

- ``<!-- docs-test: skip REASON -->``: the block is not run (a GPU, several processes, a model
  from the Hub). ``SKIPPED`` pins how many such blocks each page has, so a mark cannot be added
  or forgotten unnoticed; a CUDA-only block without one fails here, on a machine without a GPU.
- ``<!-- docs-test: requires NAME -->``: run only where ``checkpointing.NAME`` exists (an entry
  point still landing; ``NAME`` may be dotted, ``policies.save_attention``, or a module that
  needs an optional package, ``integrations.torchtitan``), skipped otherwise.

A hidden set-up block (``<!-- docs-test: setup`` then code then ``-->``) runs where it stands,
for the tiny model or tensors that a fragment on the page assumes.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import subprocess
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
    "docs/migrate/torchtitan.md": 1,
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
    parts = dotted.split(".")
    for index, part in enumerate(parts):
        if not hasattr(target, part):
            try:  # a module not imported yet (an integration): there if it imports
                importlib.import_module(".".join(["checkpointing", *parts[: index + 1]]))
            except ImportError:
                return False
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


# The site, built once into a temporary directory (a few seconds; the docs group, which the test
# group includes, has MkDocs). It must read from disk and offline: air-gapped clusters read it
# from a copy of site/, opened as file:// pages.


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` into a temporary directory: the built site."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _built_pages(site: Path) -> list[Path]:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 25, pages
    return pages


_TAG = re.compile(r"<(?P<tag>script|link|img|a)\b(?P<attrs>[^>]*)>", flags=re.IGNORECASE)
_ATTR = re.compile(r'\b(?P<name>src|href|rel)="(?P<value>[^"]*)"')
_CSS_URL = re.compile(r"""@import\s+(?:url\()?["']?(?P<a>[^"')\s;]+)|url\(\s*["']?(?P<b>[^"')]+)""")


def _references(page: Path) -> list[tuple[str, dict[str, str]]]:
    """The (tag, attributes) of every script, link, img and a element of a built page."""
    found = []
    for tag in _TAG.finditer(page.read_text()):
        attrs = {m["name"]: html.unescape(m["value"]) for m in _ATTR.finditer(tag["attrs"])}
        found.append((tag["tag"].lower(), attrs))
    return found


def _is_web(url: str) -> bool:
    return re.match(r"(https?:)?//", url) is not None


def test_site_loads_nothing_from_the_web(site: Path) -> None:
    """No script, stylesheet, font, icon or preconnect comes from the web: no <script src> or
    <link href> with an http(s) URL, no @import or url() of one in the CSS (page text may link
    to other sites; those are <a> elements)."""
    loaded = []
    for page in _built_pages(site):
        for tag, attrs in _references(page):
            url = attrs.get("src" if tag in ("script", "img") else "href", "")
            if tag != "a" and _is_web(url):
                loaded.append(f"{page.relative_to(site)}: <{tag}> {url}")
        for style in re.findall(r"<style\b[^>]*>(.*?)</style>", page.read_text(), flags=re.S):
            loaded += [
                f"{page.name}: {u}"
                for m in _CSS_URL.finditer(style)
                if _is_web(u := m["a"] or m["b"])
            ]
    for sheet in site.rglob("*.css"):
        urls = [m["a"] or m["b"] for m in _CSS_URL.finditer(sheet.read_text())]
        loaded += [f"{sheet.relative_to(site)}: {u}" for u in urls if _is_web(u)]
    assert loaded == []


def test_site_links_name_files(site: Path) -> None:
    """Every internal href and src of every page names an existing file, relative to the page:
    from disk, a link to a directory opens a directory listing, not the page."""
    broken = []
    # 404.html is what a server answers for a missing page, from any depth: its links are
    # absolute paths on purpose, and a reader on disk never meets it.
    for page in [p for p in _built_pages(site) if p.name != "404.html"]:
        for tag, attrs in _references(page):
            for name in ("href", "src"):
                url = attrs.get(name)
                if url is None or _is_web(url) or re.match(r"[a-z]+:", url):  # mailto:, data:
                    continue
                path = url.split("#")[0].split("?")[0]
                if not path:  # an anchor on the same page
                    continue
                if not (page.parent / path).is_file():
                    broken.append(f"{page.relative_to(site)}: <{tag} {name}={url!r}>")
    assert broken == []


def test_site_search_works_without_a_server(site: Path) -> None:
    """Search from file://: the index is also a script (``var __index = ...``, which the theme
    loads when the page is a file), and every page loads the local Web Worker stand-in before
    the theme's bundle (browsers refuse workers on file:// pages); the worker's script exists."""
    index = (site / "search" / "search_index.js").read_text()
    prefix = "var __index = "
    assert index.startswith(prefix)
    assert len(json.loads(index[len(prefix) :])["docs"]) >= 100
    for page in [p for p in _built_pages(site) if p.name != "404.html"]:  # as above
        scripts = [a["src"] for tag, a in _references(page) if tag == "script" and "src" in a]
        shim = next(i for i, src in enumerate(scripts) if src.endswith("iframe-worker/shim.js"))
        bundle = next(i for i, src in enumerate(scripts) if "javascripts/bundle." in src)
        assert shim < bundle, page
        config = re.search(
            r'<script id="__config" type="application/json">(.*?)</script>',
            page.read_text(),
            flags=re.S,
        )
        assert config is not None, page
        settings = json.loads(config[1])
        assert (page.parent / settings["search"]).is_file(), page  # relative to the page


def test_site_diagrams_are_pictures(site: Path) -> None:
    """The mental model's diagram is an SVG file the page shows as an image, not diagram source
    for a script from the web to render; no page has such source."""
    for page in _built_pages(site):
        assert 'class="mermaid"' not in page.read_text(), page
        assert "flowchart LR" not in page.read_text(), page
    images = [a["src"] for tag, a in _references(site / "mental-model.html") if tag == "img"]
    assert "diagrams/kept-recomputed.svg" in images
    assert (site / "diagrams" / "kept-recomputed.svg").read_text().startswith("<svg ")


def test_reference_leads_with_checkpoints_one_signature(site: Path) -> None:
    """The reference shows ``checkpoint`` with its one real signature (the function and every
    option), not its overloads for type checkers first."""
    page = (site / "reference" / "checkpointing.html").read_text()
    start = page.index('id="checkpointing.checkpoint"')
    section = page[start : page.index('id="checkpointing.CheckpointFunction"', start)]
    assert section.count("doc-signature") == 1
    assert "doc-overload" not in section
    signature = html.unescape(re.sub(r"<[^>]+>", "", section))
    assert "function: Callable[..., Any] | None = None" in signature
    assert "**kwargs: Any" in signature


def test_diagram_is_what_its_script_draws() -> None:
    """docs/diagrams/kept-recomputed.svg is the output of the script beside it (edit the script,
    run it, commit both)."""
    spec = importlib.util.spec_from_file_location(
        "diagram", ROOT / "docs/diagrams/kept_recomputed.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TARGET.read_text() == module.render()


# Code blocks fit the page's column: a reader sees every line without scrolling sideways. The
# theme's column at its default font (a 20 px rem; the page at most 61 rem wide, less two
# sidebars of 12.1 rem and margins of 1.2 rem): 688 px; less a code block's padding (1.18 em
# each side of 13.6 px code): 656 px, 80 characters of a monospace font 0.6 em wide. 76 leaves
# room for the indent of a list item or an admonition (about 30 px) and the copy button.
CODE_COLUMNS = 76
_CODE_BLOCK = re.compile(r'<div class="(?P<classes>[^"]*)"><pre\b[^>]*>(?P<body>.*?)</pre>', re.S)


def test_site_code_blocks_fit_the_column(site: Path) -> None:
    """Every line of every code block of the site is at most ``CODE_COLUMNS`` characters,
    except in blocks that wrap (the troubleshooting page's messages, one long line each)."""
    wide = []
    for page in _built_pages(site):
        blocks = list(_CODE_BLOCK.finditer(page.read_text()))
        for block in blocks:
            if "wrap" in block["classes"].split():
                continue
            text = html.unescape(re.sub(r"<[^>]+>", "", block["body"]))
            wide += [
                f"{page.relative_to(site)}: {line}"
                for line in text.splitlines()
                if len(line) > CODE_COLUMNS
            ]
    assert wide == []
    wrapping = (site / "troubleshooting.html").read_text()
    assert wrapping.count('<div class="wrap highlight">') >= 100
    assert "white-space: pre-wrap" in (site / "assets" / "site.css").read_text()


def _shell_blocks(path: Path) -> list[list[str]]:
    """The lines of every ```bash block of ``path``."""
    blocks, current = [], None
    for line in path.read_text().splitlines():
        if current is None and line.strip() == "```bash":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_group_installs_upgrade_pip_first() -> None:
    """A command that installs a dependency group (``--group``, pip 25.1 or newer) upgrades pip
    first, in the same block: a fresh virtualenv's pip (23.x) refuses the option."""
    late = []
    for page in PAGES:
        for block in _shell_blocks(page):
            upgraded = False
            for line in block:
                upgraded = upgraded or 'pip install "pip>=25.1"' in line.split("--group")[0]
                if "--group" in line and not upgraded:
                    late.append(f"{_name(page)}: {line}")
    assert late == []
    assert sum("--group" in line for b in _shell_blocks(ROOT / "README.md") for line in b) >= 2


def test_readme_says_why_with_a_measured_number() -> None:
    """The front page says why this library over torch's with a measured number and its
    source in benchmarks/RESULTS.md."""
    readme = (ROOT / "README.md").read_text()
    why = next(p for p in readme.split("\n\n") if p.startswith("Why not `torch.utils.checkpoint`"))
    assert re.search(r"\d+ ?(MiB|GiB|x)\b", why), why
    assert "benchmarks/RESULTS.md" in why


def test_main_demo_prints_no_numpy_warning() -> None:
    """The README's first command installs torch without NumPy: the demo's output does not open
    with torch's "Failed to initialize NumPy" warning (NumPy is hidden from this run)."""
    demo = ROOT / "examples" / "01_main_demo.py"
    hide = (
        "import runpy, sys; sys.modules['numpy'] = None; "
        "runpy.run_path(sys.argv[1], run_name='__main__')"
    )
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", hide, str(demo)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "identical" in done.stdout
    assert "NumPy" not in done.stderr, done.stderr


def test_choose_names_every_recipe_of_the_policies_page() -> None:
    """ "Which tool do I use?" has a row for each ready-made policy the policies page teaches
    (``save_attention()``, ``save_routing()``, ...), except the two units of combining."""
    taught = set(re.findall(r"`(save_\w+)\(\)`", (ROOT / "docs/guide/policies.md").read_text()))
    taught -= {"save_everything", "save_nothing"}
    assert {"save_matmuls", "save_attention", "save_routing"} <= taught
    choose = (ROOT / "docs" / "choose.md").read_text()
    assert [name for name in sorted(taught) if f"policies.{name}()" not in choose] == []


def test_pages_define_the_workloads_they_name() -> None:
    """A page that names a benchmark workload (W1 ... W5) says on that page what it is, by its
    size ("W1: 32 x ...", "W2 (4 x ...", "W3: 200 tiny ops"): the names stand for models of
    different sizes in different benchmarks (benchmarks/run.py, benchmarks/planner.py)."""
    undefined = []
    for page in PAGES:
        text = page.read_text()
        for name in sorted(set(re.findall(r"\bW[1-5]\b", text))):
            if not re.search(rf"\b{name}\b[^.\n]{{0,6}}\d+ (x|tiny) ", text):
                undefined.append(f"{_name(page)}: {name}")
    assert undefined == []


def test_planner_page_quotes_the_real_size_measurement() -> None:
    """The planner page's figures for the GPT-2-small-shaped model are RESULTS.md's: every
    number of that passage appears in RESULTS.md's section on it."""
    page = (ROOT / "docs" / "guide" / "planner.md").read_text()
    start = page.index("At real size, a GPT-2-small-shaped model")
    passage = page[start : page.index("\n- ", start)]
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    section = results[results.index("## The planner at real size") :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else None]
    figures = re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?", passage)
    assert {"2.37-2.58", "14.2", "2.71"} <= set(figures)
    assert [f for f in figures if f not in section] == []
