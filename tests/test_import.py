"""What ``import checkpointing`` costs: the compiler stack and the planner stay out until used."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

import checkpointing
from checkpointing import _compat
from checkpointing._planning import ActivationPlan, plan_checkpointing, plan_sweep

# Imported by ``torch._dynamo`` (about 1 s on top of ``import torch``) and never by plain torch.
_COMPILER_STACK = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp")


# One fresh interpreter runs these steps in order (a fresh interpreter's torch import costs
# seconds, so the tests share it).
_STEPS = ("import torch", "import checkpointing", "checkpointing.plan_checkpointing")


@functools.cache
def _modules_after_each_step() -> dict[str, set[str]]:
    """Per step of ``_STEPS``, the names in ``sys.modules`` once it ran, in a fresh interpreter
    that runs the steps in order."""
    report = "print('\\n'.join(sys.modules))\nprint('-- step end --')"
    script = "\n".join(["import sys", *(f"{step}\n{report}" for step in _STEPS)])
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, check=True
    )
    outputs = done.stdout.split("-- step end --")[: len(_STEPS)]
    assert len(outputs) == len(_STEPS), done.stdout[-2000:]
    return {step: set(out.split()) for step, out in zip(_STEPS, outputs, strict=True)}


def test_import_leaves_the_compiler_stack_unimported() -> None:
    """``import checkpointing`` imports none of the compiler stack that ``import torch`` leaves
    out (each would cost most of a second)."""
    plain = _modules_after_each_step()["import torch"]
    ours = _modules_after_each_step()["import checkpointing"]
    assert "checkpointing" in ours
    assert not [name for name in _COMPILER_STACK if name in plain]
    assert [name for name in _COMPILER_STACK if name in ours] == []


def test_import_leaves_the_planner_unimported() -> None:
    """``import checkpointing`` does not import the planner (a quarter of the package, which
    most programs never use); asking for one of its names imports it."""
    ours = _modules_after_each_step()["import checkpointing"]
    assert sorted(name for name in ours if name.startswith("checkpointing._planning")) == []
    asked = _modules_after_each_step()["checkpointing.plan_checkpointing"]
    assert "checkpointing._planning" in asked


def test_the_planner_names_are_there_before_their_import() -> None:
    """The lazily imported names are in ``__all__`` and ``dir()``, resolve to the planner's
    objects, and an unknown name is still an ``AttributeError``."""
    for name in ("ActivationPlan", "plan_checkpointing", "plan_sweep"):
        assert name in checkpointing.__all__
        assert name in dir(checkpointing)
    assert checkpointing.ActivationPlan is ActivationPlan
    assert checkpointing.plan_checkpointing is plan_checkpointing
    assert checkpointing.plan_sweep is plan_sweep
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
