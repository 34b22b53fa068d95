"""``plan_sweep``: several budgets from one profile, and the promise a sweep keeps (NOTE [Budget
sweep]).

Rule 1: each plan of a sweep is the plan ``plan_checkpointing`` gives at that budget, to the byte
of its JSON, and the model runs as often as for one call. Rule 2: over a 12-point sweep from the
floor to 1.0 (budgets as fractions and as bytes), every plan keeps at most its budget, the kept
bytes never rise as the budget falls, the objective's predicted cost (``plan.cost``) never
falls, and one budget gives one plan; on tiny models of six families, and of Hugging Face ones
through ``tests/hf_support.py`` (``once``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from planner_support import (
    SpannedEncoder,
    TinyLlama,
    encoder,
    encoder_inputs,
    llama_loss,
    mixer,
    mlp,
    transformer,
)
from torch import nn

from checkpointing import ActivationPlan, plan_checkpointing, plan_sweep

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POINTS = 12


Step = tuple[nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor] | None]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


FAMILIES: dict[str, Callable[[], Step]] = {
    "mlp": lambda: (mlp(), (torch.randn(8, 32, requires_grad=True),), {}, None),
    "transformer": lambda: (transformer(), (torch.randn(2, 16, 32),), {}, None),
    "llama-style": lambda: (TinyLlama().train(), (_tokens(),), {}, llama_loss),
    "mixer": lambda: (mixer(6), (torch.randn(2, 16, 8),), {}, None),
    "post-norm encoder": lambda: (encoder(), (encoder_inputs(),), {}, None),
    "decoder with spans": lambda: (SpannedEncoder().train(), (_tokens(),), {}, None),
}


def _sweep(step: Step, budgets: list[float | int], objective: str = "time") -> list[ActivationPlan]:
    model, args, kwargs, loss_fn = step
    return plan_sweep(
        model,
        args,
        budgets=budgets,
        example_kwargs=kwargs,
        loss_fn=loss_fn,
        objective=objective,  # type: ignore[arg-type]
    )


def _assert_promise(step: Step, objective: str) -> None:
    """Rule 2 over ``POINTS`` budgets from the floor to 1.0, in bytes and as fractions (each
    list from the largest down, in one sweep with one budget repeated)."""
    widest = _sweep(step, [1.0], objective)[0]
    floor, baseline = widest.floor_bytes, widest.baseline_bytes
    assert 0 < floor < baseline
    in_bytes = [baseline - (baseline - floor) * i // (POINTS - 1) for i in range(POINTS)]
    low = min(1.0, (floor + 1) / baseline)  # a share whose bytes round to the floor or above
    shares = [1.0 - (1.0 - low) * i / (POINTS - 1) for i in range(POINTS)]
    plans = _sweep(step, [*in_bytes, *shares, in_bytes[4]], objective)
    assert plans[-1] == plans[4], "the same budget gave two plans"
    for budgets, swept in ((in_bytes, plans[:POINTS]), (shares, plans[POINTS:-1])):
        limits = [plan.budget_bytes for plan in swept]
        assert limits == [b if isinstance(b, int) else int(b * baseline) for b in budgets]
        assert limits[-1] >= floor
        for plan in swept:
            assert plan.kept_bytes <= plan.budget_bytes, plan
            assert (plan.floor_bytes, plan.baseline_bytes) == (floor, baseline)
        for wider, narrower in itertools.pairwise(swept):
            where = f"budget {wider.budget_bytes:,} then {narrower.budget_bytes:,}"
            assert narrower.kept_bytes <= wider.kept_bytes, f"kept bytes rose: {where}"
            assert narrower.cost >= wider.cost, f"predicted cost fell: {where}"
        assert swept[0].kept_bytes == baseline
        assert swept[0].cost == swept[0].recompute_ms == 0


# Two families on every release (what a release changes is the ops a step dispatches); the other
# four, which only widen the solver's cases, on CI's first stage only (the `once` marker).
_EVERY_RELEASE = ("mlp", "decoder with spans")


@pytest.mark.parametrize("objective", ["time", "flops"])
@pytest.mark.parametrize(
    "family",
    [
        name if name in _EVERY_RELEASE else pytest.param(name, marks=pytest.mark.once)
        for name in FAMILIES
    ],
)
def test_a_sweep_keeps_its_promise(family: str, objective: str) -> None:
    """Rule 2 on tiny models of six families (a trail, head and tail spans, random draws)."""
    _assert_promise(FAMILIES[family](), objective)


@pytest.mark.once
@pytest.mark.parametrize("objective", ["time", "flops"])
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama", "vit"])
def test_a_sweep_keeps_its_promise_on_hugging_face_families(family: str, objective: str) -> None:
    """Rule 2 on tiny Hugging Face models of the planner's zoo (their own loss, a key/value
    cache handed to each layer, dropout)."""
    from hf_support import ZOO

    member = ZOO[family]()
    step = (member.model, member.args, member.kwargs, member.loss_fn)
    _assert_promise(step, objective)


@pytest.mark.parametrize("objective", ["time", "flops"])
@pytest.mark.parametrize("family", ["transformer", "decoder with spans"])
def test_each_plan_of_a_sweep_is_the_plan_of_its_own_call(family: str, objective: str) -> None:
    """Rule 1: the plans of one sweep, in the order of the budgets (fractions and bytes mixed),
    equal separate ``plan_checkpointing`` calls decision for decision and byte for byte (their
    JSON, predicted times included); a second sweep gives the same plans, each bound to the
    model."""
    step = FAMILIES[family]()
    model, args, kwargs, loss_fn = step
    baseline = _sweep(step, [1.0], objective)[0].baseline_bytes
    budgets: list[float | int] = [0.5, int(0.8 * baseline), 0.35, 1.0]
    swept = _sweep(step, budgets, objective)
    again = _sweep(step, budgets, objective)
    for budget, plan, second in zip(budgets, swept, again, strict=True):
        alone = plan_checkpointing(
            model,
            args,
            budget=budget,
            example_kwargs=kwargs,
            loss_fn=loss_fn,
            objective=objective,  # type: ignore[arg-type]
        )
        assert plan.to_json() == alone.to_json() == second.to_json()
        assert plan.regions == alone.regions
        assert plan.spans == alone.spans
    plan = swept[2]
    plan.apply(model)  # bound to the profiled model
    plan.remove(model)


def test_a_sweep_runs_the_model_as_one_call_does() -> None:
    """Rule 1: twelve budgets cost the model runs of one ``plan_checkpointing`` call."""
    model, args, _, _ = FAMILIES["transformer"]()
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    handle = model.register_forward_pre_hook(count)
    try:
        plan_checkpointing(model, args, budget=0.5)
        one = calls[0]
        calls[0] = 0
        plan_sweep(model, args, budgets=[1.0 - 0.05 * i for i in range(POINTS)])
    finally:
        handle.remove()
    assert calls[0] == one == 3


def test_a_timed_sweep_keeps_its_budgets() -> None:
    """With ``timing_steps`` the plans are measured choices: each still fits its budget."""
    model, args, _, _ = FAMILIES["transformer"]()
    plans = plan_sweep(model, args, budgets=[0.4, 0.7], timing_steps=2)
    assert all(plan.kept_bytes <= plan.budget_bytes for plan in plans)


@pytest.mark.parametrize(
    ("budgets", "error", "phrase"),
    [
        (0.5, TypeError, "non-empty list or tuple"),
        ([], TypeError, "non-empty list or tuple"),
        ([0.5, "half"], TypeError, "got 'half'"),
        ([0.5, 1.5], ValueError, "got 1.5"),
        ([0.5, 1], ValueError, "below the smallest reachable"),
    ],
)
def test_bad_budgets_are_refused_whole(budgets: Any, error: type[Exception], phrase: str) -> None:
    """Rule 1: a bad budget anywhere in the list raises, naming ``plan_sweep``, before any plan
    is made (the types before the model runs, the floor before any solve)."""
    model, args, _, _ = FAMILIES["mlp"]()
    with pytest.raises(error, match=r"checkpointing\.plan_sweep") as raised:
        plan_sweep(model, args, budgets=budgets)
    assert phrase in str(raised.value)
    assert "Fix" in str(raised.value)
