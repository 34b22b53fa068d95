"""What ``import checkpointing`` costs: the compiler stack and the planner stay out until used."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import checkpointing
from checkpointing import _compat
from checkpointing._planning import ActivationPlan, plan_checkpointing

# Imported by ``torch._dynamo`` (about 1 s on top of ``import torch``) and never by plain torch.
_COMPILER_STACK = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp")


def _modules_after(code: str) -> set[str]:
    """The names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = code + "\nimport sys\nprint('\\n'.join(sys.modules))\n"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, check=True
    )
    return set(done.stdout.split())


def test_import_leaves_the_compiler_stack_unimported() -> None:
    """``import checkpointing`` imports none of the compiler stack that ``import torch`` leaves
    out (each would cost most of a second)."""
    plain = _modules_after("import torch")
    ours = _modules_after("import torch, checkpointing")
    assert not [name for name in _COMPILER_STACK if name in plain]
    assert [name for name in _COMPILER_STACK if name in ours] == []


def test_import_leaves_the_planner_unimported() -> None:
    """``import checkpointing`` does not import the planner (a quarter of the package, which
    most programs never use); asking for one of its names imports it."""
    ours = _modules_after("import torch, checkpointing")
    assert sorted(name for name in ours if name.startswith("checkpointing._planning")) == []
    asked = _modules_after("import torch, checkpointing\ncheckpointing.plan_checkpointing")
    assert "checkpointing._planning" in asked


def test_the_planner_names_are_there_before_their_import() -> None:
    """The lazily imported names are in ``__all__`` and ``dir()``, resolve to the planner's
    objects, and an unknown name is still an ``AttributeError``."""
    for name in ("ActivationPlan", "plan_checkpointing"):
        assert name in checkpointing.__all__
        assert name in dir(checkpointing)
    assert checkpointing.ActivationPlan is ActivationPlan
    assert checkpointing.plan_checkpointing is plan_checkpointing
    with pytest.raises(AttributeError, match="no attribute 'plan_checkpoint'"):
        checkpointing.plan_checkpoint  # the look-up is the test


def test_our_constant_result_mark_is_torchs() -> None:
    """``_compat.assume_constant_result`` marks a function exactly as
    ``torch.compiler.assume_constant_result`` does (same attributes set), so dynamo still calls
    our once-only warnings at trace time without a graph break."""

    def theirs() -> bool:
        return True

    def ours() -> bool:
        return True

    before = set(vars(theirs))
    torch.compiler.assume_constant_result(theirs)
    _compat.assume_constant_result(ours)
    added = {name: getattr(theirs, name) for name in set(vars(theirs)) - before}
    assert added  # torch marks something; if not, our mark has nothing to mirror
    assert {name: getattr(ours, name, None) for name in added} == added
