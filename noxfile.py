"""Development sessions: ``nox`` runs tests, lint, typecheck, examples; ``nox -s bench`` on demand.

Every session that imports torch installs ``torch==2.13.0`` first (the release the code is checked
against), then the package, then its tools from ``[dependency-groups]`` in ``pyproject.toml``.
Arguments after ``--`` pass through to the tool: ``nox -s tests -- -x tests/test_public_api.py``.
"""

from __future__ import annotations

from pathlib import Path

import nox

# dependency_groups() appeared in nox 2025.02.09.
nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck", "examples"]

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
TORCH = "torch==2.13.0"


def _install(session: nox.Session, *groups: str, editable: bool = False) -> None:
    """Install torch first, then the package (as a wheel unless ``editable``), then ``groups``."""
    session.install(TORCH)
    if editable:
        session.install("-e", ".")
    else:
        session.install(".")
    for group in groups:
        session.install(*nox.project.dependency_groups(PYPROJECT, group))


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite against the installed wheel (pytest arguments pass through)."""
    _install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Run ``ruff check`` on the repository (arguments pass through, e.g. ``-- --fix``).

    Ruff does not import the code, so this session installs neither torch nor the package.
    """
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", *session.posargs)


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


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Run ``benchmarks/run.py`` (not a default session; ``nox -s bench -- --quick``)."""
    _install(session, "bench")
    session.run("python", "benchmarks/run.py", *session.posargs)
