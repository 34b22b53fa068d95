"""Development sessions: ``nox`` runs tests, lint, typecheck, examples, docs; ``nox -s bench`` on
demand.

Every session that imports torch installs torch first, then the package, then its tools from
``[dependency-groups]`` in ``pyproject.toml``. ``tests`` has one session per supported release
(``nox -s "tests(torch='2.15.0')"``; ``nox -s tests`` runs all five); the default list runs it on
2.13.0 only: on the project's machines that is a local CPU wheel installed in seconds, while each
other release is a ~5 GB CUDA build from the registry (it runs on CPU too). ``typecheck``,
``examples`` and ``bench`` use 2.13.0.
Arguments after ``--`` pass through to the tool:
``nox -s "tests(torch='2.13.0')" -- -x tests/test_public_api.py``.
"""

from __future__ import annotations

from pathlib import Path

import nox

# dependency_groups() appeared in nox 2025.02.09.
nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
# The supported releases (those `checkpointing._compat` is checked against; pyproject's
# `dependencies` is their floor), oldest first.
TORCH_RELEASES = ["2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
# The release every other session uses, and the one `tests` runs on by default.
DEFAULT_TORCH = "2.13.0"

nox.options.sessions = [f"tests(torch='{DEFAULT_TORCH}')", "lint", "typecheck", "examples", "docs"]


def _install(
    session: nox.Session, *groups: str, torch: str = DEFAULT_TORCH, editable: bool = False
) -> None:
    """Install torch ``torch``, then the package (a wheel unless ``editable``), then ``groups``."""
    session.install(f"torch=={torch}")
    if editable:
        session.install("-e", ".")
    else:
        session.install(".")
    for group in groups:
        session.install(*nox.project.dependency_groups(PYPROJECT, group))


@nox.session
@nox.parametrize("torch", TORCH_RELEASES)
def tests(session: nox.Session, torch: str) -> None:
    """Run the test suite on one torch release, against the installed wheel (args go to pytest)."""
    _install(session, "test", torch=torch)
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Run ``ruff check`` (arguments pass through, e.g. ``-- --fix``) and ``ruff format --check``
    on the repository, as ``.ci/run`` does.

    Ruff does not import the code, so this session installs neither torch nor the package.
    """
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", *session.posargs)
    session.run("ruff", "format", "--check")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Run ``mypy --strict`` (configured in pyproject) on ``checkpointing/``."""
    _install(session, "typecheck", editable=True)
    session.run("mypy", *session.posargs)


@nox.session
def examples(session: nox.Session) -> None:
    """Run every ``examples/*.py`` script against the installed wheel; each must exit 0."""
    _install(session, "hf")  # examples/08_transformers.py
    scripts = sorted((ROOT / "examples").glob("*.py"))
    if not scripts:
        session.error("no examples/*.py to run")
    for script in scripts:
        session.run("python", str(script.relative_to(ROOT)), *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site strictly (``mkdocs build --strict``: a broken link, anchor
    or API reference fails); ``-- serve`` serves it instead. The site goes to ``site/``.

    mkdocstrings reads the docstrings without importing the package: no torch here.
    """
    session.install(*nox.project.dependency_groups(PYPROJECT, "docs"))
    # Material prints a notice about MkDocs 2.0 on every build; docs/about.md says why we pin.
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Run ``benchmarks/run.py`` (not a default session; ``nox -s bench -- --quick``)."""
    _install(session, "bench")
    session.run("python", "benchmarks/run.py", *session.posargs)
