"""Chains: consecutive regions checkpointed in one frame, as ``checkpoint_sequential``'s segments
(NOTE [Planner solve], Rule S9). What the profile lets join, what a joined region keeps and costs,
the solver against brute force with joins, the peak, and a joined plan's table and JSON."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from allocator_support import allocator_step
from hypothesis import given, settings
from planner_support import (
    TinyLlama,
    all_choices,
    encoder,
    encoder_inputs,
    forced_plan,
    grads_of,
    measured,
    mlp,
    shared_storages,
)
from strategies import planner_problems
from torch import nn

import checkpointing
from checkpointing import ActivationPlan
from checkpointing._planning import search
from checkpointing._planning.measure.profile import profile_step
from checkpointing._planning.measure.step_profile import StepProfile
from checkpointing._planning.solve.peak import predicted_peak
from checkpointing._planning.solve.problem import (
    Choice,
    Problem,
    RegionChoices,
    join_breaks,
    kept_bytes,
    recompute_cost,
)
from checkpointing._planning.solve.solver import solve

WHOLE, JOINED, PLAIN = Choice(True), Choice(True, joined=True), Choice(False)


def _profile(model: nn.Module, x: torch.Tensor) -> StepProfile:
    return profile_step(model, search.find_regions(model, None), (x,), {}, None)


@settings(max_examples=60, deadline=None)
@given(planner_problems(max_regions=4, max_units=2, joins=True))
def test_solver_with_joins_is_the_brute_force_optimum(problem: Problem) -> None:
    """Rule S9 with Rule S5: at every budget from the floor up, the answer fits, joins only
    where the run can hold it, and on the exact grid costs (frames included) the least of every
    choice that fits, joins included; on a coarse grid it fits and is valid."""
    choices = list(all_choices(problem))
    plain = kept_bytes(problem, [PLAIN] * len(problem.regions))
    floor = solve(problem, plain).floor_bytes
    if not shared_storages(problem):  # the floor counts on joins: never above the unjoined one
        apart = [c for c in choices if not any(choice.joined for choice in c)]
        assert floor <= min(kept_bytes(problem, c) for c in apart)
    for budget in range(floor, plain + 1):
        fitting = [recompute_cost(problem, c) for c in choices if kept_bytes(problem, c) <= budget]
        best = min(fitting)
        for grid in (8192, 2):
            answer = solve(problem, budget, grid_points=grid)
            assert not join_breaks(problem, answer.choices)
            assert answer.kept_bytes == kept_bytes(problem, answer.choices) <= budget
            cost = recompute_cost(problem, answer.choices)
            assert cost >= best - 1e-12
            if answer.method == "exact" and not shared_storages(problem):
                assert math.isclose(cost, best, abs_tol=1e-9), (budget, answer.choices)


def _blocks(count: int, joinable: bool) -> Problem:
    """``count`` blocks of 10 ms in a row: each receives the one before's output (100 bytes; the
    first, an input of its own), draws (an RNG state, 8), saves its input and 50 bytes more,
    and runs 2 ms past its early stop."""
    sizes: dict[int, int] = {}
    regions = []
    for index in range(count):  # ``given``: the storage the block before returned
        given, state, extra = (len(sizes) + i for i in range(3))
        sizes.update({given: 100, state: 8, extra: 50})
        regions.append(
            RegionChoices(
                frozenset({given, extra}),
                frozenset({given, state}),
                0.010,
                (),
                joinable=joinable and index > 0,
                boundary=frozenset({given}) if index else frozenset(),
                states=frozenset({state}),
                drew=True,
                rest_seconds=0.002,
            )
        )
    return Problem(tuple(regions), sizes, frozenset())


def test_joined_region_keeps_neither_its_boundary_nor_a_second_state() -> None:
    """Rule S9: joined, a block keeps neither the output of the one before nor an RNG state of
    its own (the one before draws: the chain keeps one), and pays the one before's ops past its
    early stop. At the floor of three blocks (each whole, 324 bytes: 30 ms) the plan joins two
    and keeps the third plainly (258 bytes, 22 ms); where they cannot join, all three are
    whole."""
    problem = _blocks(3, joinable=True)
    assert kept_bytes(problem, (WHOLE, WHOLE, WHOLE)) == 324
    assert kept_bytes(problem, (WHOLE, JOINED, JOINED)) == 108
    assert math.isclose(recompute_cost(problem, (WHOLE, JOINED, JOINED)), 0.034)
    found = solve(problem, 324)
    assert found.kept_bytes == 258
    assert math.isclose(recompute_cost(problem, found.choices), 0.022)
    assert sum(c.joined for c in found.choices) == 1
    apart = _blocks(3, joinable=False)
    assert join_breaks(apart, (WHOLE, JOINED, PLAIN)) == [1]
    assert join_breaks(problem, (Choice(True, draws=True), JOINED, PLAIN)) == [1]
    assert join_breaks(problem, (WHOLE, Choice(True, frozenset({0}), joined=True), PLAIN)) == [1]
    assert solve(apart, 324).choices == (WHOLE, WHOLE, WHOLE)


def test_chain_peak_holds_every_member_s_saves() -> None:
    """Rule S6 with Rule S9: while backward runs the second member, the chain's one recompute
    has restored the first member's saves too: its working set is the first's input and state
    (kept), the first's saves and its own (308 bytes), where apart it is 266."""
    problem = dataclasses.replace(_blocks(2, joinable=True), plain_peak=1000)
    apart = predicted_peak(problem, (WHOLE, WHOLE))
    chained = predicted_peak(problem, (WHOLE, JOINED))
    assert chained - apart == 308 - 266


def test_profile_joins_blocks_that_run_back_to_back() -> None:
    """Rule S9 in the profile: the blocks of an ``nn.Sequential`` ran one after the other with
    no op between, each received the one before's output: every block but the first may join,
    and its boundary is that output (the storage the block before returned)."""
    model, x = mlp(4), torch.randn(8, 32)
    profile = _profile(model, x)
    problem = profile.problem(0.0)
    assert [r.joinable for r in problem.regions] == [False, True, True, True]
    for before, region, after in zip(
        profile.regions, problem.regions[1:], profile.regions[1:], strict=False
    ):
        assert region.boundary == frozenset(after.inputs) == frozenset(before.outputs)
    everything = (WHOLE, JOINED, JOINED, JOINED)
    # No block draws: the chain keeps the CPU state the first captured (the runtime always
    # preserves one), which the second, joined, captured too.
    assert not any(r.drew for r in problem.regions)
    assert problem.regions[1].states == problem.regions[0].states != frozenset()
    first = problem.outside | problem.regions[0].inputs | problem.regions[0].states
    assert kept_bytes(problem, everything) == sum(problem.storage_bytes[s] for s in first)


class _Gapped(nn.Module):
    """Blocks with an op between each two (a scale), and one block called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = self.blocks[1](x * 0.5)
        return self.blocks[2](self.blocks[2](x))


def test_no_join_across_an_op_or_a_second_call() -> None:
    """Rule S9: an op between two blocks, or a block called twice, leaves no join there: the
    run would break the chain, so the plan never counts on it."""
    model, x = _Gapped(), torch.randn(4, 8, requires_grad=True)
    problem = _profile(model, x).problem(0.0)
    assert not any(r.joinable for r in problem.regions)


def test_no_join_after_or_into_a_trail() -> None:
    """Rule S9 with Rule M13: a post-norm block that ends at its trail is neither followed by a
    joined block nor joined itself; without trails the same blocks may join."""
    model, x = encoder(norm_first=False, depth=3), encoder_inputs()
    profile = _profile(model, x)
    assert [r.joinable for r in profile.problem(0.0).regions] == [False, True, True]
    trailed = profile.trailed()
    assert trailed is not None
    assert not any(r.joinable for r in trailed[0].problem(0.0).regions)


def _joined_plan() -> ActivationPlan:
    model, x = encoder(norm_first=True, depth=3), encoder_inputs()
    return forced_plan(model, x, lambda problem, i: (WHOLE, JOINED, PLAIN)[i])


def test_joined_plan_says_so_and_round_trips_through_json() -> None:
    """A joined decision reads "with <the region before> in one frame" in the table; JSON
    writes and reads ``joined``; JSON without the field (older plans) reads it as False."""
    plan = _joined_plan()
    assert [r.joined for r in plan.regions] == [False, True, False]
    assert "with 0 in one frame" in plan.table()
    again = ActivationPlan.from_json(plan.to_json())
    assert again == plan
    assert again.regions[1].joined
    data = json.loads(plan.to_json())
    for region in data["regions"]:
        del region["joined"]
    assert not any(r.joined for r in ActivationPlan.from_json(data).regions)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({0: {"checkpoint": False}}, "regions[0] ('0') is not"),
        ({1: {"keep_draws": True}}, "regions[1] ('1') is not"),
        ({0: {"joined": True}}, "it is the first region"),
    ],
)
def test_joined_json_must_follow_a_whole_region(change: dict[int, dict[str, object]], why: str):
    """``from_json`` refuses a joined region after one that is not checkpointed whole (or
    itself not whole, or first), naming the region, why, and the fix."""
    data = json.loads(_joined_plan().to_json())
    for index, fields in change.items():
        data["regions"][index].update(fields)
    with pytest.raises(ValueError, match="joined") as raised:
        ActivationPlan.from_json(data)
    assert why in str(raised.value)
    assert "Fix" in str(raised.value)


@pytest.mark.parametrize("name", ["encoder", "llama"])
def test_joined_plan_applied_keeps_what_it_predicts_with_the_plain_gradients(name: str) -> None:
    """Rule S9 against the run: a plan joining blocks 0-2 (post-norm encoder blocks with
    dropout; a tiny Llama's decoder layers, which receive the rotary tables as constants),
    applied, keeps exactly the bytes it predicts (``saved_tensors_report``), its gradients are
    bitwise the plain run's (dropout replayed from the chain's one RNG state); the Llama's
    predicted peak is at least the allocator's and at most 6 % above it, as with blocks apart
    (the chain's recompute holds every member's saves at once: here 332,360 bytes, to the byte,
    where three blocks apart peak at 244,360). (The post-norm
    encoder's predicted peak is 5 % under the allocator's with its blocks apart too: a gap of
    Rule S6's, not of chains.)"""
    torch.manual_seed(0)
    if name == "encoder":
        model, x = encoder(norm_first=False, depth=4), encoder_inputs()
    else:
        model, x = TinyLlama(depth=4), torch.randint(0, 64, (2, 16))
    plain = grads_of(model, x, None)
    plan = forced_plan(model, x, lambda problem, i: (WHOLE, JOINED, JOINED, PLAIN)[i])
    assert [r.joined for r in plan.regions[:4]] == [False, True, True, False]
    plan.apply(model)
    try:
        report, grads = measured(model, x, None)
        model.zero_grad(set_to_none=True)
        peak = allocator_step(lambda: model(x).sum()).peak
    finally:
        plan.remove(model)
    assert report.activation_bytes == plan.kept_bytes
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
    if name == "llama":
        assert peak <= plan.peak_bytes <= 1.06 * peak, (plan.peak_bytes, peak)


def test_floor_counts_on_chains_and_a_budget_below_the_unjoined_floor_is_planned() -> None:
    """Rule S9's floor: the smallest reachable counts on joins. Six Linear + GELU blocks, each
    checkpointed alone, keep every block's input; chained they keep the first's. The floor is
    below the blocks-apart floor, and a plan at the budget between the two joins blocks, keeps
    what it predicts and gives the plain gradients bitwise."""
    problem = _blocks(4, joinable=True)
    assert solve(problem, 0).floor_bytes == kept_bytes(problem, (WHOLE, JOINED, JOINED, JOINED))
    assert solve(problem, 0).choices == (WHOLE, JOINED, JOINED, JOINED)
    torch.manual_seed(0)
    model, x = mlp(6, 64), torch.randn(8, 64, requires_grad=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(search, "JOINS", False)
        apart = checkpointing.plan_checkpointing(model, x, budget=1.0).floor_bytes
    plan = checkpointing.plan_checkpointing(model, x, budget=apart - 1)
    assert plan.floor_bytes < apart - 1
    assert plan.kept_bytes <= apart - 1
    assert any(region.joined for region in plan.regions)
    plain = grads_of(model, x, None)
    plan.apply(model)
    try:
        report, grads = measured(model, x, None)
    finally:
        plan.remove(model)
    assert report.activation_bytes == plan.kept_bytes
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
