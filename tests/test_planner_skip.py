"""Skipping in the replay the ops whose outputs nothing needs (issue 28; NOTE [Planner solve], Rule
S8).

A checkpointed region's recompute serves only what autograd saves in it, so a plan may answer
``SKIP_IN_REPLAY`` for an op none of whose outputs' values anything needs (a decoder block's down
projection, whose output feeds only dropout's ``mul``). Every applied plan is checked against the
plain run (gradients bit-identical, dropout on), against a FLOP-counting mode over the backward
(the FLOPs the plan predicts it recomputes are the ones the replay runs) and against the CPU
allocator (bytes held after forward); the replay's closure against a naive fixpoint, and the
solver against brute force.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from planner_support import (
    allocator_held,
    backward_flops,
    grads_of,
    loss_of,
    measured,
    pickled_grads,
    shared_storages,
)
from torch import nn

from checkpointing import ActivationPlan, plan_checkpointing
from checkpointing._planning import search as search_module
from checkpointing._planning.apply import plan as plan_module
from checkpointing._planning.measure.profile import (
    OpCall,
    RegionProfile,
    StepProfile,
    profile_step,
    structure,
)
from checkpointing._planning.solve.offload_choice import offloads
from checkpointing._planning.solve.options import Fronts, region_options
from checkpointing._planning.solve.problem import (
    Choice,
    Objective,
    Problem,
    RegionChoices,
    ReplayGraph,
    ReplayOp,
    Unit,
    kept_bytes,
    recompute_cost,
    recompute_flops,
    recompute_seconds,
    skipped,
)
from checkpointing._planning.solve.solver import solve
from checkpointing._selective import SKIP_IN_REPLAY

# --- models -------------------------------------------------------------------------------------


class DecoderBlock(nn.Module):
    """A GPT-2-style pre-norm block: attention and MLP, each branch ending in dropout then the
    residual sum (on CPU dropout is ``empty_like``, ``bernoulli_``, ``div_``, ``mul``)."""

    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, dropout=p, batch_first=True)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.drop1(self.attention(h, h, h, need_weights=False)[0])
        return x + self.drop2(self.down(F.gelu(self.up(self.norm2(x)))))


def decoder(depth: int = 3) -> nn.Sequential:
    return nn.Sequential(*(DecoderBlock() for _ in range(depth))).train()


class InPlaceBlock(nn.Module):
    """A block whose activation is applied in place (``relu_`` writes the first projection's
    output, Rule M5) and whose output projection ends in dropout."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.relu(self.fc1(self.norm(x)), inplace=True)))


class SavedActivationBlock(nn.Module):
    """Linear, tanh, Linear, GELU, Linear: tanh's and GELU's outputs are saved (by themselves or
    the next matmul), so never skipped, and so is GELU's input; the first projection's output
    (tanh saves its result, not its input) is skipped once tanh's output is kept."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c(F.gelu(self.b(torch.tanh(self.a(x)))))


MODELS = {
    "decoder": decoder,
    "in place": lambda: nn.Sequential(*(InPlaceBlock() for _ in range(3))).train(),
    "saved activations": lambda: nn.Sequential(*(SavedActivationBlock() for _ in range(3))),
}


def inputs() -> torch.Tensor:
    return torch.randn(2, 8, 32, requires_grad=True)


def step_problem(model: nn.Module, x: torch.Tensor) -> tuple[StepProfile, Problem]:
    """The profile of ``model`` and its problem under the FLOP objective, as the planner poses
    it (the policy's cost measured)."""
    regions = search_module.find_regions(model, None)
    profile = profile_step(model, regions, (x,), {}, None)
    return profile, profile.problem(profile.policy_seconds_per_op, profile.objective("flops"))


def without_skipping(problem: Problem) -> Problem:
    """The same problem with no replay graph: nothing is ever skipped (the planner before
    Rule S8)."""
    regions = tuple(dataclasses.replace(r, replay=None) for r in problem.regions)
    return dataclasses.replace(problem, regions=regions)


def last_matmul(region: RegionProfile) -> tuple[str, int]:
    """The key of the region's last op with FLOPs before its early stop: a decoder block's down
    projection."""
    op = [op for op in region.ops[: region.stop] if op.flops][-1]
    return op.op, op.index


# --- end to end ---------------------------------------------------------------------------------


def test_decoder_skips_the_down_projection_and_keeps_gradients() -> None:
    """Rule S8 on a decoder with dropout, objective "flops", at budgets 0.2, 0.3 and 0.5: every
    checkpointed block skips its down projection; gradients equal the plain run bit for bit;
    the FLOPs the plan predicts it recomputes are those the backward runs above the plain
    backward, fewer than the same choices without skipping and no more than the best plan
    without skipping; the allocator holds after forward what the plan predicts, and so does
    the report."""
    torch.manual_seed(0)
    model, x = decoder(), inputs()
    expected = grads_of(model, x, None)
    plain = backward_flops(model, x, None)
    profile, problem = step_problem(model, x)
    down = last_matmul(profile.regions[0])
    for budget in (0.2, 0.3, 0.5):
        plan = plan_checkpointing(model, x, budget=budget, objective="flops")
        checkpointed = [r for r in plan.regions if r.checkpoint]
        assert checkpointed, str(plan)
        assert all(down in r.skip for r in checkpointed), str(plan)
        plan.apply(model)
        try:
            recomputed = backward_flops(model, x, None) - plain
            held = allocator_held(lambda: loss_of(model, x, None))
            report, grads = measured(model, x, None)
        finally:
            plan.remove(model)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
        assert recomputed == plan.recompute_flops, str(plan)
        assert held == plan.kept_bytes == report.activation_bytes <= plan.budget_bytes, str(plan)
        # The solver on the same step: skipping lowers the FLOPs of its own choices, and no
        # plan without skipping recomputes fewer.
        answer = solve(problem, plan.budget_bytes)
        unskipped = [dataclasses.replace(c, skip=False) for c in answer.choices]
        assert answer.recompute_flops < recompute_flops(problem, unskipped)
        fewest = solve(without_skipping(problem), plan.budget_bytes).recompute_flops
        assert answer.recompute_flops <= fewest


@pytest.mark.parametrize("case", ["in place", "saved activations"])
def test_other_blocks_keep_gradients_and_predicted_flops(case: str) -> None:
    """Rule S8 with an op writing a projection's output in place (Rule M5: the projection is
    never skipped) and with activations whose outputs are saved (never skipped): gradients equal
    the plain run, predicted recompute FLOPs are measured, the allocator holds the prediction."""
    torch.manual_seed(0)
    model, x = MODELS[case](), inputs()
    expected = grads_of(model, x, None)
    plain = backward_flops(model, x, None)
    reference = plan_checkpointing(model, x, budget=1.0, objective="flops")
    floor, baseline = reference.floor_bytes, reference.baseline_bytes
    for budget in (floor, (floor + baseline) // 2):
        plan = plan_checkpointing(model, x, budget=budget, objective="flops")
        assert any(r.checkpoint for r in plan.regions), str(plan)
        plan.apply(model)
        try:
            recomputed = backward_flops(model, x, None) - plain
            held = allocator_held(lambda: loss_of(model, x, None))
            _, grads = measured(model, x, None)
        finally:
            plan.remove(model)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
        assert recomputed == plan.recompute_flops, str(plan)
        assert held == plan.kept_bytes, str(plan)


@pytest.mark.parametrize("case", list(MODELS))
def test_no_option_skips_a_needed_op(case: str) -> None:
    """Rule S8 on the profiled graphs, for every option the solver offers: no kept unit is one
    the replay would skip anyway; no skipped op is random, in place or a view, a kept unit, or
    writes a storage autograd saves or an op the replay runs reads; in particular tanh's and
    GELU's outputs (saved) and the projection that ``relu_`` writes are never skipped."""
    torch.manual_seed(0)
    model, x = MODELS[case](), inputs()
    profile, problem = step_problem(model, x)
    ever: set[tuple[str, int]] = set()
    for index, region in enumerate(problem.regions):
        graph = region.replay
        assert graph is not None
        options = region_options(problem, index)
        for option in range(len(options.nbytes)):
            choice = options.choice(option)
            if not choice.checkpoint:
                continue
            draws = choice.draws and region.draws is not None
            assert not graph.useless(choice.saved, draws)  # settled: no unit kept for nothing
            running, needed = graph.running(choice.saved, draws)
            keys = set(skipped(problem, index, choice))
            ever |= keys
            for position, op in enumerate(graph.ops):
                if op.key not in keys:
                    continue
                assert op.role == "skippable"
                assert op.unit not in choice.saved
                assert not running[position]
                assert not any(needed[s] for s in op.writes)
                assert graph.saved.isdisjoint(op.writes)
    assert ever  # every model skips something at some budget
    region = profile.regions[0]
    kinds = {(op.op, op.index): op.kind for op in region.ops}
    roles = {op.key: op.role for op in problem.regions[0].replay.ops}  # type: ignore[union-attr]
    # Rules M5 and M6: in-place and random ops, and ops without a tensor output, run for real.
    assert all(roles[k] in ("root", "random") for k in roles if kinds[k] in ("inplace", "none"))
    assert all(roles[k] == "random" for k in roles if kinds[k] == "random")
    written = {s for op in region.ops if op.kind == "inplace" for s in op.storages}
    never = {
        (op.op, op.index)
        for op in region.ops
        if op.op in ("aten.tanh.default", "aten.gelu.default", "aten.bernoulli_.float")
        or (op.kind == "unit" and written.intersection(op.storages))
    }
    assert never
    assert never.isdisjoint(ever)


def test_skips_round_trip_through_json_pickle_and_the_table() -> None:
    """``RegionDecision.skip`` is in the JSON text (op names), read back the same, read as
    nothing from older text without it; an applied model with skips pickles and its twin gives
    the plain gradients; ``print(plan)`` says how many ops each region skips."""
    torch.manual_seed(0)
    model, x = decoder(2), inputs()
    expected = grads_of(model, x, None)
    plan = plan_checkpointing(model, x, budget=0.3, objective="flops")
    assert any(r.skip for r in plan.regions), str(plan)
    text = plan.to_json()
    names = [op for r in json.loads(text)["regions"] for op, _ in r["skip"]]
    assert names
    assert all(n.startswith("aten.") and n.count(".") == 2 for n in names)
    loaded = ActivationPlan.from_json(text)
    assert loaded.to_json() == text
    assert [r.skip for r in loaded.regions] == [r.skip for r in plan.regions]
    old = json.loads(text)
    for region in old["regions"]:
        del region["skip"]
    assert all(r.skip == () for r in ActivationPlan.from_json(old).regions)
    region = next(r for r in plan.regions if r.skip)
    count = len(region.skip)
    assert f"skips {count} op{'s' if count > 1 else ''} in replay" in str(plan)
    bad = json.loads(text)
    next(r for r in bad["regions"] if r["skip"])["skip"][0][0] = "aten.no_such_op.default"
    with pytest.raises(ValueError, match="unknown op"):
        ActivationPlan.from_json(bad)
    grads = pickled_grads(loaded, model, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_a_region_that_only_skips_gets_the_selective_contexts() -> None:
    """Rule A1 with Rule S8: a region that keeps nothing but skips ops is installed with the
    selective modes (its skips answered ``SKIP_IN_REPLAY``), alone or over the draws modes;
    one that keeps and skips nothing runs as plain checkpoint."""
    decision = plan_module.RegionDecision("0", "Block", True, skip=(("aten.mm.default", 0),))
    contexts = plan_module._context_fn(decision)
    assert isinstance(contexts, plan_module._RegionContexts)
    assert list(contexts.decisions.values()) == [SKIP_IN_REPLAY]
    drawn = plan_module._context_fn(dataclasses.replace(decision, keep_draws=True))
    assert drawn.keep_draws
    assert drawn.decisions == contexts.decisions
    plain = plan_module._context_fn(dataclasses.replace(decision, skip=()))
    assert not isinstance(plain, plan_module._RegionContexts)
    assert decision.describe() == "checkpoint, recompute, skips 1 op in replay"


# --- profile ------------------------------------------------------------------------------------


def test_identical_blocks_are_one_structure_and_solved_once() -> None:
    """Rules M8, S5 and S8: a decoder's blocks (the first one reading the example input, the
    others a block's output) have one structure, equal replay graphs, and the solver computes
    one unit front and one set of options for all of them."""
    torch.manual_seed(0)
    model, x = decoder(4), inputs()
    profile, problem = step_problem(model, x)
    assert len({structure(r, profile.storage_bytes) for r in profile.regions}) == 1
    assert len({r.replay for r in problem.regions}) == 1
    fronts = Fronts()
    for index in range(len(problem.regions)):
        region_options(problem, index, fronts)
    assert len(fronts.known) == 1
    assert len(fronts.replayed) == 1


def test_structure_tells_apart_blocks_that_read_differently() -> None:
    """Rule M8 with Rule S8: two regions with the same ops, kinds and sizes but a different
    reading pattern (which of the region's storages an op reads) are not one structure; the
    storage ids themselves do not matter, nor reads from outside the region."""

    def region(first: int, reads: tuple[int, ...]) -> RegionProfile:
        ops = [
            OpCall("aten.mm.default", 0, 1e-3, 10, "unit", (first,), (99,), True),
            OpCall("aten.mm.default", 1, 1e-3, 10, "unit", (first + 1,), (99,), True),
            OpCall("aten.mul.Tensor", 0, 1e-3, 0, "unit", (first + 2,), reads, True),
        ]
        return RegionProfile("r", "Block", 1, ops, {first + 2}, set(), set(), 0, 3)

    sizes = dict.fromkeys(range(100), 4)
    a, b = region(0, (0, 1)), region(10, (10, 11, 98))
    assert structure(a, sizes) == structure(b, sizes)
    assert structure(a, sizes) != structure(region(20, (20, 20)), sizes)


# --- the closure --------------------------------------------------------------------------------


def dropout_branch() -> ReplayGraph:
    """A decoder's MLP branch end by hand: ``down = mm(a)``, the dropout mask made and drawn in
    place, ``mul(down, mask)`` saving the mask, the residual ``add`` (saved by the next norm)."""
    return ReplayGraph(
        (
            ReplayOp(("aten.gelu.default", 0), 1.0, 0, (), (0,), "skippable", 0),
            ReplayOp(("aten.mm.default", 0), 1.0, 100, (0,), (1,), "skippable", 1),
            ReplayOp(("aten.empty_like.default", 0), 0.1, 0, (), (2,), "skippable"),
            ReplayOp(("aten.bernoulli_.float", 0), 0.2, 0, (2,), (2,), "random"),
            ReplayOp(("aten.div_.Scalar", 0), 0.1, 0, (2,), (2,), "root"),
            ReplayOp(("aten.mul.Tensor", 0), 0.3, 0, (1, 2), (3,), "skippable", 2),
            ReplayOp(("aten.add.Tensor", 0), 0.4, 0, (3,), (4,), "skippable", 3),
        ),
        frozenset({0, 2, 4}),
    )


def test_closure_skips_what_only_unneeded_ops_read() -> None:
    """Rule S8 by hand: with nothing kept the down projection (read only by the ``mul`` that
    saves the mask) is still run, as the saved sum needs the ``mul``; keeping the sum skips
    both; the mask's ops always run (the draw and the in-place scaling are roots); keeping the
    draws leaves the mask's ``empty_like`` to the in-place write that needs it."""
    graph = dropout_branch()
    cost = [op.seconds for op in graph.ops]
    seconds, flops, skips = graph.replay(frozenset(), False, True)
    assert skips == ()
    assert flops == 100
    assert math.isclose(seconds, sum(cost))
    seconds, flops, skips = graph.replay(frozenset({3}), False, True)
    assert [graph.ops[p].key for p in skips] == [("aten.mm.default", 0), ("aten.mul.Tensor", 0)]
    assert flops == 0
    assert math.isclose(seconds, 1.0 + 0.1 + 0.2 + 0.1)
    assert graph.replay(frozenset({3}), False, False)[2] == ()  # no skipping asked
    assert graph.replay(frozenset({3}), True, True)[1:] == (0, (1, 5))
    assert graph.useless(frozenset({1, 3}), False) == {1}  # the mm kept for nothing


def test_closure_runs_what_roots_read() -> None:
    """Rules M5, M6 and S8: a random op (a draw from probabilities computed in the region) and an
    in-place write run for real and need what they read, even where nothing needs their
    outputs; a random op answered from the kept draws needs nothing."""
    graph = ReplayGraph(
        (
            ReplayOp(("aten.sigmoid.default", 0), 1.0, 0, (), (0,), "skippable", 0),
            ReplayOp(("aten.bernoulli.default", 0), 1.0, 0, (0,), (1,), "random"),
            ReplayOp(("aten.mm.default", 0), 1.0, 10, (), (2,), "skippable", 1),
            ReplayOp(("aten.mm.default", 1), 1.0, 10, (), (3,), "skippable"),
            ReplayOp(("aten.add_.Tensor", 0), 1.0, 0, (2, 3), (3,), "root"),
        ),
        frozenset(),
    )
    assert graph.replay(frozenset(), False, True)[2] == ()
    assert graph.replay(frozenset(), True, True)[2] == (0,)


def test_units_that_free_each_other_are_one_group() -> None:
    """Rule S8: a residual sum whose keeping frees the dropout ``mul`` and the projection before
    it (each of which, kept alone, frees the projection too) is one group of the knapsack, so
    the three are not counted as three times the projection: at room for three bytes of units
    the plan keeps the projection worth more, not the chain's three units (which would settle
    to the sum alone). The sum's value includes what it frees."""
    graph = ReplayGraph(
        (
            ReplayOp(("aten.addmm.default", 0), 0.0, 100, (), (0,), "skippable", 0),
            ReplayOp(("aten.mul.Tensor", 0), 0.0, 0, (0,), (1,), "skippable", 1),
            ReplayOp(("aten.add.Tensor", 0), 0.0, 0, (1,), (2,), "skippable", 2),
            ReplayOp(("aten.addmm.default", 1), 0.0, 250, (), (3,), "skippable", 3),
        ),
        frozenset({2, 3}),
    )
    units = tuple(Unit(op.key, 0.0, (op.writes[0],), op.flops) for op in graph.ops if op.unit >= 0)
    region = RegionChoices(
        frozenset({0, 1, 2, 3, 4}), frozenset({4}), 0.0, units, 0.0, 0, replay=graph
    )
    sizes = {0: 1, 1: 1, 2: 1, 3: 3, 4: 1}
    problem = Problem((region,), sizes, frozenset(), Objective(seconds=0.0, flops=1.0))
    answer = solve(problem, 4)
    assert answer.choices[0].saved == {3}
    assert answer.recompute_flops == 100
    assert solve(problem, 5).recompute_flops == 0
    # With one byte of room, the sum or the mul (no FLOPs of their own) is worth the projection
    # it frees.
    wide = dataclasses.replace(problem, storage_bytes={**sizes, 0: 3})
    assert solve(wide, 2).choices[0].saved in ({1}, {2})
    assert solve(wide, 2).recompute_flops == 250


def test_units_kept_for_nothing_are_dropped() -> None:
    """Rule S8: a projection read only by two units the plan keeps is not kept with them: the
    replay would skip it anyway, so keeping it is bytes for nothing (the knapsack, blind to
    the pair, proposes all three)."""
    graph = ReplayGraph(
        (
            ReplayOp(("aten.mm.default", 0), 0.0, 100, (), (0,), "skippable", 0),
            ReplayOp(("aten.mul.Tensor", 0), 0.0, 10, (0,), (1,), "skippable", 1),
            ReplayOp(("aten.mul.Tensor", 1), 0.0, 10, (0,), (2,), "skippable", 2),
        ),
        frozenset({1, 2}),
    )
    units = tuple(Unit(op.key, 0.0, (op.writes[0],), op.flops) for op in graph.ops)
    region = RegionChoices(frozenset({1, 2, 3, 4}), frozenset({3}), 0.0, units, replay=graph)
    sizes = {0: 1, 1: 1, 2: 1, 3: 1, 4: 100}
    problem = Problem((region,), sizes, frozenset(), Objective(seconds=0.0, flops=1.0))
    answer = solve(problem, 4)
    assert answer.choices[0].saved == {1, 2}
    assert answer.kept_bytes == 3
    assert answer.recompute_flops == 0


def naive_running(graph: ReplayGraph, kept: frozenset[int], draws: bool) -> list[bool]:
    """Rule S8's definition as a fixpoint, iterated until nothing changes: an op computes if it
    is a root or writes a needed storage; a storage is needed if saved or read by a computing
    op that reads values."""
    ops = graph.ops
    on = [False] * len(ops)
    changed = True
    while changed:
        changed = False
        needed = set(graph.saved)
        for position, op in enumerate(ops):
            if on[position] and op.role != "view" and not (draws and op.role == "random"):
                needed.update(op.reads)
        for position, op in enumerate(ops):
            served = op.unit in kept
            root = op.role == "root" or (op.role == "random" and not draws)
            now = not served and (root or bool(needed.intersection(op.writes)))
            if now != on[position]:
                on[position], changed = now, True
    return on


@st.composite
def replay_graphs(draw: st.DrawFn, *, max_ops: int = 7) -> tuple[ReplayGraph, int]:
    """A small replay graph as the profile makes them: ops in order, each writing a fresh
    storage or (an in-place or random op) reading and writing an earlier one, reading earlier
    storages; roles and saved storages drawn; units among the ops that make a storage nothing
    writes later. Returns the graph and its number of units."""
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    storages = 0
    for _ in range(draw(st.integers(1, max_ops))):
        role = draw(st.sampled_from(["skippable", "skippable", "root", "random", "view"]))
        earlier = st.integers(0, max(storages - 1, 0))
        reads = tuple(sorted(set(draw(st.lists(earlier, max_size=2))))) if storages else ()
        if role == "view":
            writes: tuple[int, ...] = ()
        elif role in ("root", "random") and storages and draw(st.booleans()):
            target = draw(earlier)  # in place
            reads, writes = tuple(sorted({*reads, target})), (target,)
        else:
            writes, storages = (storages,), storages + 1
        shapes.append((role, reads, writes))
    writers: dict[int, int] = {}
    for _role, _, writes in shapes:
        for storage in writes:
            writers[storage] = writers.get(storage, 0) + 1
    ops: list[ReplayOp] = []
    units = 0
    for position, (role, reads, writes) in enumerate(shapes):
        candidate = role in ("skippable", "root") and bool(writes) and writers[writes[0]] == 1
        unit = units if candidate and draw(st.booleans()) else -1
        units += unit >= 0
        seconds = draw(st.integers(0, 5)) / 1000
        flops = draw(st.integers(0, 3)) * 100
        key = ("aten.op.default", position)
        ops.append(ReplayOp(key, seconds, flops, reads, writes, role, unit))  # type: ignore[arg-type]
    saved = frozenset(s for s in range(storages) if draw(st.booleans()))
    return ReplayGraph(tuple(ops), saved), units


@given(replay_graphs(), st.data())
def test_closure_is_the_rule_s_fixpoint(
    drawn: tuple[ReplayGraph, int], data: st.DataObject
) -> None:
    """Rule S8: the solver's closure computes exactly the ops the naive fixpoint does, for any
    kept units and draws; the replay's cost is the ops that run."""
    graph, units = drawn
    kept = frozenset(data.draw(st.sets(st.integers(0, max(units - 1, 0)))) if units else set())
    draws = data.draw(st.booleans())
    running, _ = graph.running(kept, draws)
    assert [bool(r) for r in running] == naive_running(graph, kept, draws)
    _seconds, flops, skips = graph.replay(kept, draws, True)
    served = {
        p for p, op in enumerate(graph.ops) if op.unit in kept or (draws and op.role == "random")
    }
    runs = [p for p in range(len(graph.ops)) if p not in served and p not in skips]
    assert flops == sum(graph.ops[p].flops for p in runs)
    assert all(graph.ops[p].role == "skippable" and not running[p] for p in skips)


@st.composite
def skip_problems(draw: st.DrawFn) -> Problem:
    """1-2 regions, each a replay graph with its units (storages of 1-4 bytes), its inputs, a
    policy cost, possibly its draws as a group; the objective drawn."""
    storage_bytes: dict[int, int] = {}
    regions = []
    for _ in range(draw(st.integers(1, 2))):
        graph, count = draw(replay_graphs(max_ops=5))
        base = len(storage_bytes)
        local = 1 + max((s for op in graph.ops for s in op.writes), default=-1)
        for storage in range(local + 1):  # the last one: the region's input
            storage_bytes[base + storage] = draw(st.integers(1, 4))
        units = [None] * count
        for op in graph.ops:
            if op.unit >= 0:
                units[op.unit] = Unit(
                    op.key, op.seconds, tuple(base + s for s in op.writes), op.flops
                )
        random = [op for op in graph.ops if op.role == "random"]
        draws = None
        if random and draw(st.booleans()):
            made = tuple(dict.fromkeys(base + s for op in random for s in op.writes))
            draws = Unit(
                ("random", 0), sum(o.seconds for o in random), made, sum(o.flops for o in random)
            )
        forced = [op for op in graph.ops if op.unit < 0]
        inputs = frozenset({base + local})
        regions.append(
            RegionChoices(
                inputs | {base + s for s in graph.saved},
                inputs,
                sum(op.seconds for op in forced),
                tuple(u for u in units if u is not None),
                draw(st.sampled_from([0.0, 0.002])),
                sum(op.flops for op in forced),
                draws=draws,
                replay=graph,
            )
        )
    objective = draw(st.sampled_from([Objective(), Objective(seconds=1e-6, flops=1.0)]))
    return Problem(tuple(regions), storage_bytes, frozenset(), objective)


def every_choice(problem: Problem, skip: tuple[bool, ...]):
    """Every choice of every region (brute force), skipping in the replay or not."""
    per_region = []
    for region in problem.regions:
        options = [Choice(False)]
        flags = (False, True) if region.draws is not None else (False,)
        for size in range(len(region.units) + 1):
            for kept in itertools.combinations(range(len(region.units)), size):
                options += [Choice(True, frozenset(kept), d, s) for d in flags for s in skip]
        per_region.append(options)
    return itertools.product(*per_region)


@given(skip_problems())
def test_solver_with_skipping_is_exact_and_never_worse(problem: Problem) -> None:
    """Rule S8 in the solver: every answer fits the exact byte count, its predicted cost is the
    closure's for its choices, no choice costs less (brute force, skipping or not), and where
    no storage is shared it costs no more than the best choice without skipping."""
    plain = kept_bytes(problem, [Choice(False)] * len(problem.regions))
    floor = solve(problem, plain).floor_bytes
    every = list(every_choice(problem, (False, True)))
    unskipped = list(every_choice(problem, (False,)))
    for budget in range(floor, plain + 1):
        answer = solve(problem, budget)
        assert answer.kept_bytes == kept_bytes(problem, answer.choices) <= budget
        assert answer.recompute_seconds == recompute_seconds(problem, answer.choices)
        assert answer.recompute_flops == recompute_flops(problem, answer.choices)
        cost = recompute_cost(problem, answer.choices)
        fits = [c for c in every if kept_bytes(problem, c) <= budget]
        assert cost >= min(recompute_cost(problem, c) for c in fits) - 1e-9
        if answer.method == "exact" and not shared_storages(problem):
            best = min(
                recompute_cost(problem, c) for c in unskipped if kept_bytes(problem, c) <= budget
            )
            assert cost <= best + 1e-9


def two_matmuls(first: float, second: float, policy: float) -> Problem:
    """One region of two independent skippable matmuls taking ``first`` and ``second``
    seconds; backward needs only the second's output, so the replay may skip the first; its
    selective policy costs ``policy``."""
    graph = ReplayGraph(
        (
            ReplayOp(("aten.mm.default", 0), first, 0, (), (0,), "skippable", 0),
            ReplayOp(("aten.mm.default", 1), second, 0, (), (1,), "skippable", 1),
        ),
        frozenset({1}),
    )
    units = (Unit(("aten.mm.default", 0), first, (1,)), Unit(("aten.mm.default", 1), second, (2,)))
    region = RegionChoices(frozenset({0, 2}), frozenset({0}), 0.0, units, policy, replay=graph)
    return Problem((region,), {0: 1, 1: 1, 2: 1}, frozenset())


def test_keeping_nothing_but_skipping_pays_the_policy() -> None:
    """Rules S3 and S8: a region that keeps nothing but skips an op pays the selective policy;
    where the policy costs more than the skipped op, it runs as plain checkpoint."""
    problem = two_matmuls(0.004, 0.001, policy=0.001)
    region = problem.regions[0]
    cheap = solve(problem, 1)
    assert cheap.choices == (Choice(True, skip=True),)
    assert math.isclose(cheap.recompute_seconds, 0.002)
    assert skipped(problem, 0, cheap.choices[0]) == (("aten.mm.default", 0),)
    costly = dataclasses.replace(
        problem, regions=(dataclasses.replace(region, policy_seconds=0.01),)
    )
    assert solve(costly, 1).choices == (Choice(True),)
    assert math.isclose(recompute_seconds(costly, [Choice(True, skip=True)]), 0.011)


def test_offload_leaves_skipped_units_alone() -> None:
    """Rules S2 and S8: a unit the replay skips is never offloaded (there is nothing to serve)."""
    problem = two_matmuls(1.0, 1.0, policy=0.0)
    answer = dataclasses.replace(solve(problem, 1), choices=(Choice(True, skip=True),))
    assert offloads(problem, answer, 100) == [frozenset({1})]


def test_many_llama_sized_graphs_are_solved_once() -> None:
    """Rules S5 and S8: 32 blocks of 300 units with replay graphs (a chain of matmuls, saved and
    unsaved activations, views and an in-place op) are solved on one unit front and one set of
    options, and the answer fits by the exact count and is priced by the closure."""
    storage_bytes: dict[int, int] = {}
    regions = []
    for _ in range(32):
        base = len(storage_bytes)
        ops, units = [], []
        for position in range(300):
            storage_bytes[base + position] = 1024 * (1 + position % 7)
            reads = (position - 1,) if position else ()
            role = "root" if position % 50 == 49 else "skippable"
            flops = 1000 * (position % 3)
            ops.append(
                ReplayOp(
                    ("aten.mm.default", position), 1e-5, flops, reads, (position,), role, position
                )
            )
            units.append(Unit(("aten.mm.default", position), 1e-5, (base + position,), flops))
            if position % 10 == 0:
                ops.append(
                    ReplayOp(("aten.view.default", position), 1e-6, 0, (position,), (), "view")
                )
        storage_bytes[len(storage_bytes)] = 4096
        inputs = frozenset({len(storage_bytes) - 1})
        graph = ReplayGraph(tuple(ops), frozenset(p for p in range(300) if p % 3 == 1))
        saved = inputs | {base + p for p in graph.saved}
        regions.append(RegionChoices(saved, inputs, 1e-6 * 30, tuple(units), 1e-3, replay=graph))
    problem = Problem(tuple(regions), storage_bytes, frozenset(), Objective(1e-9, 1.0))
    fronts = Fronts()
    for index in range(len(regions)):
        region_options(problem, index, fronts)
    assert len(fronts.known) == 1
    assert len(fronts.replayed) == 1
    baseline = solve(problem, 0).baseline_bytes
    answer = solve(problem, baseline // 3)
    assert answer.kept_bytes <= baseline // 3
    assert answer.recompute_flops == recompute_flops(problem, answer.choices)
    assert any(c.saved and c.skip for c in answer.choices)
