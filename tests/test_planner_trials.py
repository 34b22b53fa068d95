"""Candidate plans timed on the model, opt-in (issue 28, issue 43; NOTE [Planner measure], Rule
M12).

The cost model's two least sure prices are the selective policy's per-op cost and what a
checkpointed region costs beyond its ops. With ``timing_steps > 0``, ``plan_checkpointing`` also
solves with those prices moved, times the distinct plans that come out on the model and keeps the
fastest; by default (``timing_steps=0``) it times nothing. Checked here: the charge per
checkpointed region is an exact part of what the solver minimizes (brute force) and never of
what it predicts; the timing leaves the model as found and no plan applied, whatever a step
raises; the planner keeps the plan the timing names, and the plan it returns is exact (gradients
bit-identical to the plain run, bytes as predicted).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from planner_support import grads_of, least_per_budget, measured, shared_storages, transformer
from strategies import planner_problems
from torch import nn

from checkpointing import plan_checkpointing
from checkpointing._module import is_module_checkpointed
from checkpointing._planning import search as search_module
from checkpointing._planning.measure import trials
from checkpointing._planning.measure.trials import time_plans
from checkpointing._planning.solve.problem import Problem, RegionChoices, Unit, recompute_cost
from checkpointing._planning.solve.solver import solve


def _unit(index: int, storage: int) -> Unit:
    return Unit(("aten.mm.default", index), 0.0, (storage,))


# Checkpointing the second region recomputes nothing but pays its charge, so at budget 6 it must
# stay plain. Charged after its options were pruned, it could not: plain, with more bytes at the
# same (zero) cost, had been pruned already.
_TIPPED = Problem(
    (
        RegionChoices(frozenset({0, 1}), frozenset({0}), 0.0, (_unit(0, 1), _unit(1, 2))),
        RegionChoices(frozenset({4, 5}), frozenset({4}), 0.0, (_unit(0, 5), _unit(1, 6))),
    ),
    dict.fromkeys(range(7), 1),
    frozenset({0, 2, 3, 4, 6}),
)


@settings(max_examples=60)  # cheap (a few regions, brute force)
@example(_TIPPED, [0, 1, 0])
@given(planner_problems(), st.lists(st.integers(0, 12), min_size=3, max_size=3))
def test_a_frame_charge_is_minimized_exactly_and_never_predicted(
    problem: Problem, charges: list[int]
) -> None:
    """Rule M12: with a charge for checkpointing each region, the exact answer costs (charges
    included) the least of every choice that fits; its predicted seconds leave them out."""
    problem = dataclasses.replace(
        problem,
        regions=tuple(
            dataclasses.replace(r, frame_seconds=c / 1000)
            for r, c in zip(problem.regions, charges, strict=False)
        ),
    )
    for budget, best in least_per_budget(problem, recompute_cost):
        answer = solve(problem, budget)
        charged = sum(
            r.frame_seconds
            for r, c in zip(problem.regions, answer.choices, strict=True)
            if c.checkpoint
        )
        cost = recompute_cost(problem, answer.choices)
        assert answer.kept_bytes <= budget
        assert math.isclose(cost, answer.recompute_seconds + charged, rel_tol=1e-9, abs_tol=1e-12)
        assert cost >= best - 1e-12
        if answer.method == "exact" and not shared_storages(problem):
            assert math.isclose(cost, best, rel_tol=1e-9, abs_tol=1e-12)


class Recording:
    """A stand-in plan: records when it is applied and removed, and whether it is."""

    def __init__(self, name: str, events: list[tuple[str, str]]) -> None:
        self.name, self.events, self.applied = name, events, False

    def apply(self, model: nn.Module) -> nn.Module:
        assert not self.applied
        self.applied = True
        self.events.append(("apply", self.name))
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        assert self.applied
        self.applied = False
        self.events.append(("remove", self.name))
        return model


def normed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))


def test_each_plan_is_timed_in_turn_and_the_model_is_left_as_found() -> None:
    """Rule M12 (Rule M7): one warm-up and ``steps`` timed steps per plan, every plan once per
    round in an order turned each round; afterwards no plan is applied, and the buffers,
    ``.grad`` and the RNG state are as before."""
    model, x = normed(), torch.randn(4, 8, requires_grad=True)
    model[0].weight.grad = torch.ones(8, 8)
    buffers = [b.clone() for b in model.buffers()]
    state = torch.get_rng_state()
    events: list[tuple[str, str]] = []
    plans = [Recording(name, events) for name in "abc"]
    relative = time_plans(model, plans, (x,), {}, None, steps=2)
    assert len(relative) == 3
    assert all(0 < r < 3 for r in relative)
    applied = [name for kind, name in events if kind == "apply"]
    assert applied == list("abcbcacab")
    assert events[1::2] == [("remove", name) for name in applied]
    assert not any(p.applied for p in plans)
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers, strict=True))
    assert torch.equal(model[0].weight.grad, torch.ones(8, 8))
    assert model[3].weight.grad is None
    assert x.grad is None
    assert torch.equal(torch.get_rng_state(), state)


def test_a_step_that_raises_leaves_no_plan_applied() -> None:
    """The plan under a step that raises is removed before the error goes on."""
    model, x = normed(), torch.randn(4, 8)
    calls = []

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return output.sum()

    events: list[tuple[str, str]] = []
    plans = [Recording(name, events) for name in "ab"]
    with pytest.raises(RuntimeError, match="boom"):
        time_plans(model, plans, (x,), {}, loss_fn, steps=3)
    assert not any(p.applied for p in plans)
    assert events[-2:] == [("apply", "a"), ("remove", "a")]  # round 1 turned: b, then a


def decisions(plan: Any) -> list[tuple[bool, tuple[Any, ...], tuple[Any, ...], bool]]:
    return [(r.checkpoint, r.save, r.skip, r.keep_draws) for r in plan.regions]


# Prices moved far enough that a mid budget surely gives other plans: a free policy (keep
# outputs wherever that saves a recompute), a prohibitive one (whole blocks), and a charge of ten
# forward times per checkpointed region (as few regions as fit).
FAR: tuple[tuple[float, float], ...] = ((0.0, 0.0), (1000.0, 0.0), (1.0, 10.0))


@pytest.mark.parametrize("stub", [True, False], ids=["timing stubbed", "timed"])
def test_the_candidate_timed_fastest_is_the_plan(
    monkeypatch: pytest.MonkeyPatch, stub: bool
) -> None:
    """Rule M12: the candidates are distinct plans; the one the timing names fastest is returned
    (its timing first), unapplied, exact: gradients bit-identical to the plain run with
    dropout, bytes as predicted and within the budget."""
    seen: list[tuple[list[Any], list[float]]] = []

    def spy(model: nn.Module, plans: list[Any], *rest: Any) -> list[float]:
        if stub:  # the last is the fastest
            relative = [1.0 + 0.1 * (len(plans) - i) for i in range(len(plans))]
        else:
            relative = time_plans(model, plans, *rest)
        seen.append((list(plans), relative))
        return relative

    monkeypatch.setattr(search_module, "time_plans", spy)
    monkeypatch.setattr(search_module, "_PERTURBED", FAR)
    model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
    expected = grads_of(model, x, None)
    plan = plan_checkpointing(model, x, budget=0.5, timing_steps=3)
    assert len(seen) == 1
    candidates, relative = seen[0]
    assert len(candidates) >= 2
    assert len({str(decisions(c)) for c in candidates}) == len(candidates)
    fastest = relative.index(min(relative))
    assert plan is candidates[fastest]
    others = relative[:fastest] + relative[fastest + 1 :]
    assert plan.timed == pytest.approx((relative[fastest], *others))
    assert f"the fastest of {len(candidates)} candidate plans timed" in str(plan)
    assert not any(is_module_checkpointed(m) for m in model.modules())
    for candidate in candidates:
        assert candidate.kept_bytes <= candidate.budget_bytes
    plan.apply(model)
    report, grads = measured(model, x, None)
    plan.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert report.activation_bytes == plan.kept_bytes


def test_no_timing_without_steps_or_under_the_flops_objective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default (``timing_steps=0``) the prediction is taken as it is; FLOPs need no timing."""

    def refuse(*_: Any) -> list[float]:
        raise AssertionError("timed")

    monkeypatch.setattr(search_module, "time_plans", refuse)
    model, x = transformer(), torch.randn(2, 16, 32)
    for budget in (0.3, 0.5):
        assert plan_checkpointing(model, x, budget=budget).timed == ()
        assert plan_checkpointing(model, x, budget=budget, objective="flops").timed == ()


@pytest.mark.parametrize(
    ("steps", "error"), [(-1, ValueError), (2.0, TypeError), (True, TypeError), ("5", TypeError)]
)
def test_timing_steps_must_be_a_count(steps: object, error: type[Exception]) -> None:
    """A bad ``timing_steps`` fails before anything runs, naming what it expects."""
    with pytest.raises(error, match=r"timing_steps must be an int >= 0"):
        plan_checkpointing(transformer(), torch.randn(2, 16, 32), budget=0.5, timing_steps=steps)  # type: ignore[arg-type]


def test_a_plan_leaves_the_race_once_a_sign_test_says_it_is_slower() -> None:
    """A plan slower than the fastest in every round leaves after seven rounds (a coin would do
    it with a chance of 1/128 < 1 %), not after six (1/64); one round it won needs more."""

    def racing(rounds: list[list[float]]) -> list[int]:
        by_plan = [dict(enumerate(r)) for r in rounds]
        relative = [[r[i] / statistics.fmean(r) for r in rounds] for i in range(len(rounds[0]))]
        return trials._still_racing(relative, by_plan, list(range(len(rounds[0]))))

    assert racing([[1.0, 1.1, 1.2]] * 6) == [0, 1, 2]
    assert racing([[1.0, 1.1, 1.2]] * 7) == [0]
    assert racing([[1.0, 1.1, 1.2]] * 6 + [[1.0, 0.9, 1.2]]) == [0, 1]
    assert racing([[1.0, 1.1, 1.2]] * 9 + [[1.0, 0.9, 1.2]]) == [0, 1]  # 9 of 10: 11/1024
    assert racing([[1.0, 1.1, 1.2]] * 10 + [[1.0, 0.9, 1.2]]) == [0]  # 10 of 11: 12/2048


class Clock:
    """A stand-in for ``time.perf_counter`` that only the model moves: the race's rounds then
    read the same seconds on a loaded machine as on a quiet one."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Sleepy(nn.Module):
    """A linear layer whose forward takes 1 ms of ``clock``, and 5 ms while plan "b" is
    applied."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.linear, self.slow, self.clock = nn.Linear(8, 8), False, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.005 if self.slow else 0.001
        return self.linear(x)


class Slowing(Recording):
    def apply(self, model: nn.Module) -> nn.Module:
        model.slow = self.name == "b"
        return super().apply(model)


def test_the_race_times_only_the_plans_still_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan slower every round leaves the race after seven timed rounds; with one plan left
    the timing ends, long before ``steps``. The race reads a clock the model moves (a real
    sleep lost the race's order to a loaded machine's scheduling)."""
    clock = Clock()
    monkeypatch.setattr(trials, "time", clock)
    model, x = Sleepy(clock), torch.randn(4, 8, requires_grad=True)
    events: list[tuple[str, str]] = []
    plans = [Slowing("a", events), Slowing("b", events)]
    relative = time_plans(model, plans, (x,), {}, None, steps=20)
    applied = [name for kind, name in events if kind == "apply"]
    assert applied.count("a") == applied.count("b") == 1 + 7  # a warm-up and seven timed rounds
    assert relative[0] < 1 < relative[1]
