"""Memory-budget planning: profile, solver, ``ActivationPlan``.

The models (``planner_support``) are small versions of the benchmark's W1 (Linear+GELU blocks)
and W2 (TransformerEncoderLayer with dropout), and a tiny Llama-style decoder built from plain
modules. Every applied plan is checked against the plain run (gradients bit-identical, dropout
included) and against ``saved_tensors_report`` (activation bytes within the budget).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from planner_support import (
    DecoderLayer,
    RMSNorm,
    TinyLlama,
    all_choices,
    allocator_held,
    grads_of,
    least_per_budget,
    llama_loss,
    loss_of,
    measured,
    mixer,
    mlp,
    shared_storages,
    transformer,
)
from strategies import planner_problems
from torch import nn

import checkpointing
from checkpointing import ActivationPlan, plan_checkpointing
from checkpointing._planning.measure import costs as costs_module
from checkpointing._planning.measure.profile import profile_step
from checkpointing._planning.solve.problem import (
    Choice,
    Problem,
    RegionChoices,
    Unit,
    kept_bytes,
    recompute_seconds,
)
from checkpointing._planning.solve.solver import solve

BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


# --- models -------------------------------------------------------------------------------------


class ScaledBlock(nn.Module):
    """Linear and GELU, times a ``scale`` received by keyword."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.linear(x)) * scale


class KeywordStack(nn.Module):
    """Blocks that receive a tensor made in forward by keyword (as HF decoders receive their
    position embeddings): a checkpointed block keeps it by reference, out of every hook's
    sight. No block draws random numbers: all checkpointed blocks share one RNG state."""

    def __init__(self, depth: int = 6, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.linspace(0.5, 1.5, x.shape[-1]).expand(*x.shape[:-1], -1).contiguous()
        for block in self.blocks:
            x = block(x, scale=scale)
        return x


Case = tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], Callable | None]
CASES: dict[str, Case] = {
    # 64 rows: a region's ~5 KB RNG state (Rule A3) stays small next to its activations.
    "W1 mlp": (mlp, lambda: torch.randn(64, 32, requires_grad=True), None),
    "W2 transformer": (transformer, lambda: torch.randn(2, 16, 32, requires_grad=True), None),
    "llama": (TinyLlama, lambda: torch.randint(0, 64, (2, 16)), llama_loss),
}


def applied_step(plan: ActivationPlan, model: nn.Module, x: torch.Tensor):
    """With ``plan`` applied: the allocator's bytes held after forward, then the report and the
    gradients of one step (``measured``); the plan is removed again."""
    plan.apply(model)
    try:
        held = allocator_held(lambda: loss_of(model, x, None))
        report, grads = measured(model, x, None)
    finally:
        plan.remove(model)
    return held, report, grads


@pytest.fixture
def free_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan with selective policies charged nothing (NOTE [Planner solve], Rule S3): the ops of
    these tiny models are so fast that the policy's real cost has every region checkpointed
    whole, and the tests that use this need regions that keep some outputs."""
    cpu = dataclasses.replace(costs_module._CPU, policy_seconds_per_op=0.0)
    monkeypatch.setattr(costs_module, "_CPU", cpu)


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("free_policies")
def test_budget_sweep_fits_measured_bytes_and_keeps_gradients(case: str) -> None:
    """For budgets 0.1..0.9: the measured activation bytes fit the budget (+2 %) and gradients
    equal the plain run bit for bit; a budget below the floor raises naming the floor."""
    build, inputs, loss_fn = CASES[case]
    torch.manual_seed(0)
    model, x = build(), inputs()
    expected = grads_of(model, x, loss_fn)
    reference = plan_checkpointing(model, x, budget=1.0, loss_fn=loss_fn)
    feasible = 0
    for budget in BUDGETS:
        if int(budget * reference.baseline_bytes) < reference.floor_bytes:
            with pytest.raises(ValueError, match=f"smallest reachable {reference.floor_bytes:,}"):
                plan_checkpointing(model, x, budget=budget, loss_fn=loss_fn)
            continue
        plan = plan_checkpointing(model, x, budget=budget, loss_fn=loss_fn)
        feasible += 1
        plan.apply(model)
        try:
            report, grads = measured(model, x, loss_fn)
        finally:
            plan.remove(model)
        assert report.activation_bytes <= plan.budget_bytes * 1.02, (budget, str(plan))
        assert plan.kept_bytes <= plan.budget_bytes
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True)), budget
    assert feasible >= 4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("free_policies")
def test_prediction_equals_report(case: str) -> None:
    """The predicted bytes are the measured ones, for the plain run and for a plan: the planner
    and ``saved_tensors_report`` count the same storages (W2's dropout masks, which do not
    require grad, and the Llama's RoPE tables included)."""
    build, inputs, loss_fn = CASES[case]
    torch.manual_seed(0)
    model, x = build(), inputs()
    plain, _ = measured(model, x, loss_fn)
    plan = plan_checkpointing(model, x, budget=0.7, loss_fn=loss_fn)
    assert plan.baseline_bytes == plain.activation_bytes
    plan.apply(model)
    report, _ = measured(model, x, loss_fn)
    plan.remove(model)
    assert report.activation_bytes == plan.kept_bytes


@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8])
@pytest.mark.usefixtures("free_policies")
def test_allocator_holds_what_the_plan_predicts_rng_states_included(budget: float) -> None:
    """Rule A3, on many small dropout regions: the bytes the CPU allocator holds after forward
    are the plan's prediction, within the budget, and the report's activation bytes (each
    checkpointed region's RNG state counted); gradients equal the plain run bit for bit."""
    torch.manual_seed(0)
    model, x = mixer(), torch.randn(4, 16, 8, requires_grad=True)
    expected = grads_of(model, x, None)
    plan = plan_checkpointing(model, x, budget=budget)
    assert sum(r.checkpoint for r in plan.regions) >= 2, str(plan)
    held, report, grads = applied_step(plan, model, x)
    assert held <= plan.budget_bytes, (held, str(plan))
    assert held == plan.kept_bytes, str(plan)
    assert report.activation_bytes == held
    # One state per frame: a run of joined regions is one (NOTE [Planner solve], Rule S9).
    assert sum(r.op == "rng state" for r in report.records) == sum(
        r.checkpoint and not r.joined for r in plan.regions
    )
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


@pytest.mark.usefixtures("free_policies")
def test_both_reports_count_the_kept_draws() -> None:
    """Rule S7: regions that keep their random draws, under a selective policy that keeps op
    outputs too: the watched report and the walk of the graph from the loss give the same rows
    ("kept draw" among them) and bytes, the plan's prediction (the walk reads the draws mode and
    the selective cache beneath it, where it once saw neither)."""
    torch.manual_seed(0)
    model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
    plan = plan_checkpointing(model, x, budget=0.3)
    kept = [r for r in plan.regions if r.keep_draws and r.save]
    assert kept, str(plan)
    plan.apply(model)
    try:
        torch.manual_seed(1)
        with checkpointing.saved_tensors_report() as watched:
            model(x).sum()
        torch.manual_seed(1)
        walked = checkpointing.saved_tensors_report(model(x).sum())
    finally:
        plan.remove(model)
    draws = [[r for r in report.records if r.op == "kept draw"] for report in (watched, walked)]
    assert len(draws[0]) == len(draws[1]) >= 4 * len(kept)
    assert sum(r.nbytes for r in draws[0]) == sum(r.nbytes for r in draws[1])
    assert watched.activation_bytes == walked.activation_bytes == plan.kept_bytes
    assert watched.kept_bytes == walked.kept_bytes


@pytest.mark.usefixtures("free_policies")
def test_tensors_received_by_keyword_are_counted() -> None:
    """Rule A3: a tensor a checkpointed region receives by keyword is kept by its frame, and
    regions that draw nothing keep no RNG state: the plan, the report ("keyword input" rows)
    and the allocator count both alike."""
    torch.manual_seed(0)
    model, x = KeywordStack(), torch.randn(64, 16, requires_grad=True)
    expected = grads_of(model, x, None)
    plan = plan_checkpointing(model, x, budget=0.7)
    held, report, grads = applied_step(plan, model, x)
    checkpointed = sum(r.checkpoint for r in plan.regions)
    assert checkpointed >= 2, str(plan)
    assert sum(r.op == "keyword input" for r in report.records) == checkpointed
    assert not any(r.op == "rng state" for r in report.records)
    assert held <= plan.budget_bytes, (held, str(plan))
    assert held == plan.kept_bytes == report.activation_bytes, str(plan)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


@pytest.mark.usefixtures("free_policies")
def test_saved_ops_are_the_plan_s_keys() -> None:
    """What selective checkpointing keeps in forward is what the plan lists (NOTE [Planner measure],
    Rule M3): the same ops, and one kept tensor at least per listed (op, index)."""
    model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
    plan = plan_checkpointing(model, x, budget=0.3)
    expected = sorted(op.split(".")[1] for r in plan.regions if r.checkpoint for op, _ in r.save)
    assert expected, str(plan)
    plan.apply(model)
    report, _ = measured(model, x, None)
    plan.remove(model)
    kept = sorted(  # what the regions' caches keep: saved in a region, not by reference
        r.op
        for r in report.records
        if r.decision == "saved"
        and r.region.startswith("TransformerEncoderLayer #")
        and r.op not in ("rng state", "keyword input", "nested input", "kept draw")
    )
    assert sorted(set(kept)) == sorted(set(expected))
    assert len(kept) >= len(expected)


def test_policy_cost_checkpoints_tiny_regions_whole() -> None:
    """Rule S3: the cost model charges a selective policy per op of a region; the tiny
    transformer's ops cost far less than that, so its regions are checkpointed whole, no policy
    installed. One plan decides it: the prices are counted, not timed."""
    model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
    regions = [(str(i), b) for i, b in enumerate(model)]
    profile = profile_step(model, regions, (x,), {}, None)
    assert profile.policy_seconds_per_op == costs_module.costs_for("cpu").policy_seconds_per_op > 0
    plan = plan_checkpointing(model, x, budget=0.3)
    assert all(r.checkpoint and not r.save for r in plan.regions), str(plan)


def test_profile_leaves_model_untouched() -> None:
    """Planning changes no parameter, buffer (BatchNorm statistics), ``.grad`` or RNG state."""
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2)) for _ in range(3))
    )
    x = torch.randn(4, 8, requires_grad=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    state = copy.deepcopy(model.state_dict())
    grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
    rng = torch.get_rng_state()
    plan_checkpointing(model, x, budget=1.0)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    for p, (grad, copy_) in zip(model.parameters(), grads, strict=True):
        assert p.grad is grad
        assert torch.equal(grad, copy_)
    assert x.grad is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_apply_keeps_names_and_state_dict_keys() -> None:
    """``apply`` uses ``checkpoint_module``: module names, types and state_dict keys stay."""
    model = TinyLlama()
    names = [(n, type(m)) for n, m in model.named_modules()]
    keys = list(model.state_dict())
    plan = plan_checkpointing(model, torch.randint(0, 64, (2, 16)), budget=0.3, loss_fn=llama_loss)
    plan.apply(model)
    assert [(n, type(m)) for n, m in model.named_modules()] == names
    assert list(model.state_dict()) == keys
    assert any(r.checkpoint for r in plan.regions)
    plan.remove(model)


def test_regions_by_predicate() -> None:
    """A predicate picks the regions (the outermost matches), named by qualified name."""
    model = TinyLlama()
    plan = plan_checkpointing(
        model,
        torch.randint(0, 64, (2, 16)),
        budget=0.5,
        loss_fn=llama_loss,
        regions=lambda m: isinstance(m, DecoderLayer | RMSNorm),
    )
    assert [r.name for r in plan.regions] == ["layers.0", "layers.1", "layers.2", "norm"]


def test_apply_twice_and_to_another_model_raise() -> None:
    """Applying a plan twice, or to a model it was not profiled on, is a clear error; removing
    a plan that is not applied too."""
    model, x = mlp(), torch.randn(16, 32, requires_grad=True)
    plan = plan_checkpointing(model, x, budget=0.8)
    with pytest.raises(ValueError, match="not applied"):
        plan.remove(model)
    plan.apply(model)
    with pytest.raises(ValueError, match="already applied"):
        plan.apply(model)
    plan.remove(model)
    with pytest.raises(ValueError, match="profiled on another model"):
        plan.apply(mlp())


@pytest.mark.usefixtures("free_policies")
def test_json_round_trip_with_readable_op_names() -> None:
    """``to_json``/``from_json`` round-trip; ops read as ``aten.<op>.<overload>``; the loaded
    plan applies to a copy of the model with the same bytes and gradients."""
    model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
    plan = plan_checkpointing(model, x, budget=0.3)
    text = plan.to_json()
    names = [op for r in json.loads(text)["regions"] for op, _ in r["save"]]
    assert names
    assert all(n.startswith("aten.") and n.count(".") == 2 for n in names)
    loaded = ActivationPlan.from_json(text)
    assert loaded.to_json() == text
    twin = copy.deepcopy(model)
    plan.apply(model)
    loaded.apply(twin)
    (a, grads_a), (b, grads_b) = measured(model, x, None), measured(twin, x, None)
    assert a.activation_bytes == b.activation_bytes
    assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_b, strict=True))
    plan.remove(model)
    loaded.remove(twin)


@pytest.mark.usefixtures("free_policies")
def test_from_json_rejects_bad_text() -> None:
    """Text that is not a plan, or names an op torch does not know, is a ``ValueError``."""
    plan = plan_checkpointing(transformer(), torch.randn(2, 16, 32), budget=0.3, loss_fn=None)
    with pytest.raises(ValueError, match="not a plan"):
        ActivationPlan.from_json("{}")
    data = json.loads(plan.to_json())
    region = next(r for r in data["regions"] if r["save"])
    region["save"][0][0] = "aten.no_such_op.default"
    with pytest.raises(ValueError, match=r"unknown op 'aten\.no_such_op\.default'"):
        ActivationPlan.from_json(json.dumps(data))


def test_other_input_shapes_warn_once() -> None:
    """Rule A2: inputs of other shapes than the profiled ones warn once per apply, saying
    re-plan; under ``no_grad`` they do not."""
    model = mlp()
    plan = plan_checkpointing(model, torch.randn(16, 32, requires_grad=True), budget=0.8)
    plan.apply(model)
    model(torch.randn(16, 32)).sum().backward()  # profiled shapes: no warning (an error here)
    with torch.no_grad():
        model(torch.randn(3, 32))  # nothing is kept under no_grad: no warning either
    with pytest.warns(UserWarning, match="re-plan"):
        model(torch.randn(8, 32)).sum().backward()
    model(torch.randn(8, 32)).sum().backward()  # once: a second warning would fail the test
    plan.remove(model)


def test_budget_below_floor_names_the_smallest_reachable_bytes() -> None:
    """A budget below the floor raises ``ValueError`` with the floor in bytes."""
    model, x = mlp(), torch.randn(16, 32, requires_grad=True)
    floor = plan_checkpointing(model, x, budget=1.0).floor_bytes
    with pytest.raises(ValueError, match=f"smallest reachable {floor:,} bytes"):
        plan_checkpointing(model, x, budget=floor - 1)
    assert plan_checkpointing(model, x, budget=floor).kept_bytes <= floor


@pytest.mark.parametrize("budget", [0.0, 1.5, -3, True, "half"])
def test_bad_budget_is_rejected(budget: object) -> None:
    """A budget that is neither a fraction in (0, 1] nor a byte count is rejected clearly."""
    with pytest.raises((TypeError, ValueError), match="budget must be a float in"):
        plan_checkpointing(mlp(), torch.randn(4, 32), budget=budget)  # type: ignore[arg-type]


def test_frontier_runs_from_keep_everything_to_checkpoint_all() -> None:
    """The frontier starts at (baseline, 0 ms), ends at the floor, bytes falling as time rises."""
    model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
    plan = plan_checkpointing(model, x, budget=0.5)
    points = plan.frontier()
    assert points[0] == (plan.baseline_bytes, 0.0)
    assert points[-1][0] == plan.floor_bytes
    for (b1, t1), (b2, t2) in itertools.pairwise(points):
        assert b2 < b1
        assert t2 >= t1


@pytest.mark.usefixtures("free_policies")
def test_table_shows_regions_decisions_and_budget() -> None:
    """``print(plan)`` lists every region with its decision, then the totals against the budget."""
    model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
    text = str(plan_checkpointing(model, x, budget=0.4))
    for name in ("0", "1", "2", "(outside regions)", "TransformerEncoderLayer", "budget"):
        assert name in text
    assert "checkpoint, " in text
    assert "recompute ms" in text


# --- solver -------------------------------------------------------------------------------------


@given(planner_problems())
def test_solver_fits_and_is_near_brute_force(problem: Problem) -> None:
    """At every budget from the floor up, answers on a fine and on a coarse byte grid fit the
    exact byte count; without storages shared between regions, the fine grid's answer is the
    brute-force optimum, and the coarse grid's costs no more than the brute-force optimum at a
    budget of one grid step per region less (NOTE [Planner solve], Rule S5)."""
    choices = list(all_choices(problem))
    plain = kept_bytes(problem, [Choice(False)] * len(problem.regions))
    floor = solve(problem, plain).floor_bytes
    assert floor >= min(kept_bytes(problem, c) for c in choices)

    def best_within(budget: int) -> float:
        fitting = [
            recompute_seconds(problem, c) for c in choices if kept_bytes(problem, c) <= budget
        ]
        return min(fitting, default=math.inf)

    for budget in range(floor, plain + 1):
        best = best_within(budget)
        for grid in (8192, 2):
            solution = solve(problem, budget, grid_points=grid)
            assert solution.kept_bytes == kept_bytes(problem, solution.choices) <= budget
            assert solution.recompute_seconds >= best - 1e-12
            if shared_storages(problem):
                continue
            if solution.method == "exact":
                assert math.isclose(solution.recompute_seconds, best, abs_tol=1e-12)
            else:
                tighter = budget - len(problem.regions) * solution.grid_bytes
                assert solution.recompute_seconds <= best_within(tighter) + 1e-12


def test_policy_cost_makes_whole_regions_win() -> None:
    """A region whose saved outputs would save less recompute than its selective policy costs
    (NOTE [Planner solve], Rule S3) is checkpointed whole, and the prediction counts the cost."""
    units = (Unit(("aten.mm.default", 0), 0.004, (1,)), Unit(("aten.mm.default", 1), 0.004, (2,)))
    region = RegionChoices(frozenset({0, 1, 2}), frozenset({0}), 0.001, units)
    problem = Problem((region,), {0: 1, 1: 1, 2: 1}, frozenset())
    cheap = solve(problem, 2)
    assert cheap.choices[0].saved
    assert math.isclose(cheap.recompute_seconds, 0.005)
    costly = Problem(
        (dataclasses.replace(region, policy_seconds=0.005),), problem.storage_bytes, problem.outside
    )
    whole = solve(costly, 2)
    assert whole.choices == (Choice(True),)
    assert math.isclose(whole.recompute_seconds, 0.009)
    assert math.isclose(recompute_seconds(costly, [Choice(True, frozenset({0}))]), 0.010)


@given(planner_problems(), st.sampled_from([0.0, 0.001, 0.004]))
def test_solver_with_policy_cost_is_near_brute_force(problem: Problem, policy: float) -> None:
    """With a policy cost per region, the exact answer is still the brute-force optimum (where no
    storage is shared) and every answer fits."""
    problem = dataclasses.replace(
        problem,
        regions=tuple(dataclasses.replace(r, policy_seconds=policy) for r in problem.regions),
    )
    for budget, best in least_per_budget(problem, recompute_seconds):
        solution = solve(problem, budget)
        assert solution.kept_bytes == kept_bytes(problem, solution.choices) <= budget
        assert solution.recompute_seconds >= best - 1e-12
        if solution.method == "exact" and not shared_storages(problem):
            assert math.isclose(solution.recompute_seconds, best, abs_tol=1e-12)
