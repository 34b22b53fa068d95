"""Every numbered example script runs to completion (its own asserts are the checks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import checkpointing

# Run in CI's first stage only (the `once` marker): they call the library as the release stages do.
pytestmark = pytest.mark.once

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("[0-9][0-9]_*.py"))
# The scripts must import the same checkpointing as this test run (installed or source tree).
PACKAGE_PARENT = str(Path(checkpointing.__file__).parent.parent)


def test_there_are_examples() -> None:
    """The glob finds the examples, so the parametrized test below cannot pass vacuously."""
    assert EXAMPLES


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path) -> None:
    """Running the example in a fresh interpreter exits 0."""
    path = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout}\n{result.stderr}"
