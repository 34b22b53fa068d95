"""Keeping a region's random draws as a group (issue 28; NOTE [Planner solve], Rule S7).

A plan may keep all of a checkpointed region's random ops' outputs (dropout's masks, an
attention's dropout) so that recompute draws nothing. Every applied plan is checked against the
plain run (gradients bit-identical) and against the CPU allocator (the bytes held after forward
are the plan's prediction, the kept draws included); the solver against brute force.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from planner_support import (
    Chooser,
    allocator_held,
    draws_and_units,
    draws_only,
    forced_plan,
    grads_of,
    loss_of,
    mixer,
    pickled_grads,
    shared_storages,
    transformer,
)
from strategies import planner_problems

from checkpointing import ActivationPlan
from checkpointing._planning.solve.problem import (
    Choice,
    Objective,
    Problem,
    RegionChoices,
    Unit,
    kept_bytes,
    recompute_cost,
    recompute_seconds,
)
from checkpointing._planning.solve.solver import solve


def draws_in_every_second(problem: Problem, index: int) -> Choice:
    """Alternate regions keep their draws, the others replay them from the RNG state."""
    return Choice(True, draws=index % 2 == 0 and problem.regions[index].draws is not None)


MODELS = {
    "W2 transformer": (transformer, lambda: torch.randn(2, 16, 32, requires_grad=True)),
    "mixer": (mixer, lambda: torch.randn(4, 16, 8, requires_grad=True)),
}


@pytest.mark.parametrize("choose", [draws_only, draws_and_units, draws_in_every_second])
@pytest.mark.parametrize("case", list(MODELS))
def test_kept_draws_keep_gradients_and_the_predicted_bytes(case: str, choose: Chooser) -> None:
    """Rule S7: with the random draws of checkpointed regions kept (alone, under a selective
    policy, or in every second region), gradients equal the plain run bit for bit, and the
    allocator holds after forward exactly the bytes the plan predicts."""
    build, inputs = MODELS[case]
    torch.manual_seed(0)
    model, x = build(), inputs()
    expected = grads_of(model, x, None)
    plan = forced_plan(model, x, choose)
    assert any(r.keep_draws for r in plan.regions), str(plan)
    plan.apply(model)
    try:
        torch.manual_seed(7)
        held = allocator_held(lambda: loss_of(model, x, None))
        grads = grads_of(model, x, None)
    finally:
        plan.remove(model)
    assert held == plan.kept_bytes, str(plan)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_kept_draws_are_not_drawn_again() -> None:
    """Rule S7: recompute of a region that keeps its draws draws nothing (the RNG is not asked),
    and a second backward through it raises instead of reusing handed-out draws."""
    torch.manual_seed(0)
    model, x = transformer(1), torch.randn(2, 16, 32, requires_grad=True)
    plan = forced_plan(model, x, draws_only)
    plan.apply(model)
    try:
        loss = model(x).sum()
        calls = []

        class Spy(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.bernoulli_.float:
                    calls.append(func)
                return func(*args, **(kwargs or {}))

        with Spy():
            loss.backward(retain_graph=True)
        assert calls == []
        with pytest.raises(RuntimeError, match="recomputed a second time"):
            loss.backward()
    finally:
        plan.remove(model)


def test_keep_draws_round_trips_through_json_and_pickle() -> None:
    """``keep_draws`` is in the JSON text (read as false where absent) and survives pickling an
    applied model; the loaded plan gives the same gradients."""
    torch.manual_seed(0)
    model, x = transformer(2), torch.randn(2, 16, 32, requires_grad=True)
    expected = grads_of(model, x, None)
    plan = forced_plan(model, x, draws_and_units)
    text = plan.to_json()
    assert all(r["keep_draws"] for r in json.loads(text)["regions"])
    loaded = ActivationPlan.from_json(text)
    assert loaded.to_json() == text
    old = json.loads(text)
    for region in old["regions"]:
        del region["keep_draws"]
    assert not any(r.keep_draws for r in ActivationPlan.from_json(old).regions)
    grads = pickled_grads(loaded, model, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert "keep draws" in str(plan)


def test_draws_with_flops_are_kept_under_the_flops_objective() -> None:
    """Rules S4 and S7: a region whose random op carries FLOPs (attention with dropout) keeps
    its draws when the budget allows, under "flops" as under "time", and the prediction counts
    the group's bytes and takes its seconds and FLOPs off the recompute."""
    units = (Unit(("aten.mm.default", 0), 0.001, (1,), 100),)
    draws = Unit(("random", 0), 0.002, (2,), 1000)
    region = RegionChoices(
        frozenset({0, 1, 2}), frozenset({0}), 0.003, units, forced_flops=1000, draws=draws
    )
    for objective in (Objective(), Objective(seconds=0.0, flops=1.0)):
        problem = Problem((region,), {0: 1, 1: 4, 2: 2}, frozenset(), objective)
        solution = solve(problem, 3)
        assert solution.choices == (Choice(True, draws=True),)
        assert solution.kept_bytes == 3
        assert math.isclose(solution.recompute_seconds, 0.002)
        assert solution.recompute_flops == 100
        assert solve(problem, 1).choices == (Choice(True),)


def draw_choices(problem: Problem):
    """Every choice of every region, its draws kept or not where it has some (brute force)."""
    per_region = []
    for region in problem.regions:
        options = [Choice(False)]
        flags = (False, True) if region.draws is not None else (False,)
        for size in range(len(region.units) + 1):
            for chosen in itertools.combinations(range(len(region.units)), size):
                options += [Choice(True, frozenset(chosen), flag) for flag in flags]
        per_region.append(options)
    return itertools.product(*per_region)


@st.composite
def problems_with_draws(draw: st.DrawFn) -> Problem:
    """``planner_problems`` whose regions may draw: a group of a fresh storage, some seconds
    (its recompute part of the forced seconds), some FLOPs; and a policy cost."""
    problem = draw(planner_problems(max_regions=2))
    storage_bytes = dict(problem.storage_bytes)
    regions = []
    for region in problem.regions:
        policy = draw(st.sampled_from([0.0, 0.002]))
        if draw(st.booleans()):
            storage = len(storage_bytes)
            storage_bytes[storage] = draw(st.integers(1, 8))
            seconds = draw(st.integers(0, 5)) / 1000
            flops = draw(st.integers(0, 3)) * 1000
            region = dataclasses.replace(
                region,
                saved=region.saved | {storage},
                forced_seconds=region.forced_seconds + seconds,
                forced_flops=region.forced_flops + flops,
                draws=Unit(("random", 0), seconds, (storage,), flops),
            )
        regions.append(dataclasses.replace(region, policy_seconds=policy))
    objective = draw(st.sampled_from([Objective(), Objective(seconds=1e-6, flops=1.0)]))
    return Problem(tuple(regions), storage_bytes, problem.outside, objective)


@given(problems_with_draws())
def test_solver_with_draws_is_brute_force_optimal(problem: Problem) -> None:
    """Rule S7 in the solver: every answer fits the exact byte count, and where no storage is
    shared between regions the exact answer costs what the brute-force optimum costs."""
    choices = list(draw_choices(problem))
    plain = kept_bytes(problem, [Choice(False)] * len(problem.regions))
    floor = solve(problem, plain).floor_bytes
    shared = shared_storages(problem)  # one region's unit may be the next one's input
    for budget in range(floor, plain + 1):
        best = min(
            (recompute_cost(problem, c) for c in choices if kept_bytes(problem, c) <= budget),
            default=math.inf,
        )
        solution = solve(problem, budget)
        assert solution.kept_bytes == kept_bytes(problem, solution.choices) <= budget
        cost = recompute_cost(problem, solution.choices)
        assert cost >= best - 1e-9
        if solution.method == "exact" and not shared:
            assert math.isclose(cost, best, rel_tol=1e-9, abs_tol=1e-12)


def test_draws_modes_are_charged_beside_the_selective_ones() -> None:
    """Rule S3: a region keeping outputs and its draws runs two pairs of dispatch modes (the
    selective ones over the draws ones, Rule S7), so it pays the policy's time twice; keeping
    only its draws, once."""
    units = (Unit(("aten.mm.default", 0), 0.5, (1,)),)
    draws = Unit(("random", 0), 0.25, (2,))
    region = RegionChoices(
        frozenset({1, 2}), frozenset({0}), 0.25, units, policy_seconds=0.01, draws=draws
    )
    problem = Problem((region,), {0: 1, 1: 1, 2: 1}, frozenset())
    both = Choice(True, frozenset({0}), draws=True)
    only_draws = Choice(True, draws=True)
    assert math.isclose(recompute_seconds(problem, [both]), 0.25 - 0.25 + 2 * 0.01)
    assert math.isclose(recompute_seconds(problem, [only_draws]), 0.25 - 0.25 + 0.5 + 0.01)
