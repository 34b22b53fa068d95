"""An ``ActivationPlan`` as a value: equality consistent with its JSON, and a readable printout.

Two plans with the same JSON (the same decisions, budget and predictions) compare equal, whether
made twice, read back from JSON or unpickled; a plan is unhashable, as a mutable value. The
printout says the recomputed matrix work in a unit that reads (``12.6 kFLOP``), never
``0.000 GFLOP``.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from torch import nn

from checkpointing import ActivationPlan, plan_checkpointing
from checkpointing._units import format_flops


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)))


def _plan(budget: float = 0.5) -> ActivationPlan:
    return plan_checkpointing(_mlp(), torch.randn(4, 16), budget=budget)


def test_equal_plans_compare_equal_and_follow_their_json() -> None:
    """The same plan made twice, read back from JSON, copied or unpickled is ``==``; a plan for
    another budget, or with a changed field, is not; comparing with another type is False."""
    plan = _plan()
    again = _plan()
    assert plan.to_json() == again.to_json()
    assert plan == again
    assert plan == ActivationPlan.from_json(plan.to_json())
    assert plan == pickle.loads(pickle.dumps(plan))
    assert plan == copy.deepcopy(plan)
    other = ActivationPlan.from_json(plan.to_json())
    other.budget_bytes += 1
    assert plan != other
    changed = ActivationPlan.from_json(plan.to_json())
    changed.regions = (dataclasses.replace(changed.regions[0], checkpoint=True),) * len(
        changed.regions
    )
    assert (plan == changed) == (plan.to_json() == changed.to_json())
    assert plan != plan.to_json()
    assert plan != 42


def test_a_plan_is_unhashable() -> None:
    """A plan is a mutable value: equal plans would hash apart after a change, so none hashes."""
    with pytest.raises(TypeError, match="unhashable"):
        hash(_plan())


def test_the_printout_names_recomputed_work_in_a_readable_unit() -> None:
    """The totals line says the recomputed matrix work as ``format_flops`` prints it: a unit
    that keeps the number at least 1, or "no matrix work" when nothing is recomputed."""
    plan = _plan(budget=0.5)
    text = str(plan)
    assert "0.000 GFLOP" not in text
    if plan.recompute_flops:
        assert f"and {format_flops(plan.recompute_flops)} of matrix work per step" in text
    nothing = _plan(budget=1.0)
    assert nothing.recompute_flops == 0
    assert "and no matrix work per step" in str(nothing)


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (0, "none"),
        (750, "750 FLOP"),
        (1_000, "1 kFLOP"),
        (12_600, "12.6 kFLOP"),
        (999_999, "1 MFLOP"),
        (40_900_000, "40.9 MFLOP"),
        (1_074_000_000, "1.074 GFLOP"),
        (3.2e12, "3.2 TFLOP"),
    ],
)
def test_format_flops(count: float, text: str) -> None:
    """Four significant digits in the largest unit that keeps the number at least 1."""
    assert format_flops(count) == text
