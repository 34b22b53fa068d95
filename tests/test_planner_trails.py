"""A post-norm block's final norm recorded as a trail (NOTE [Planner measure], Rule M13): the
block's frame ends where the norm starts, a scope records the norm, and the next block's input
is recomputed from the residual sum instead of kept. Gradients equal to the plain run's, bytes
and FLOPs equal to the plan's, and trails found only where they exist."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from compile_support import COMPILE_MARKS, fresh_dynamo  # noqa: F401  (a fixture)
from garbage_support import gc_disabled  # noqa: F401  (a fixture)
from planner_support import encoder, encoder_inputs, grads_of, measured
from torch import nn

import checkpointing
from checkpointing import ActivationPlan, _compat, plan_checkpointing
from checkpointing._module import checkpoint_module, end_at, remove_checkpoint_module
from checkpointing._planning import search as search_module
from checkpointing._planning.measure.flops import FlopCount
from checkpointing._planning.measure.profile import profile_step


@pytest.fixture(autouse=True)
def _no_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Joined blocks (NOTE [Planner solve], Rule S9) outbid the trails on this encoder at these
    budgets (a chain keeps no block input between its members either); these tests pin the
    trails' mechanics, ``test_planner_chains.py`` the joins'."""
    monkeypatch.setattr(search_module, "JOINS", False)


def flops_plan(model: nn.Module, x: torch.Tensor, share: float) -> ActivationPlan:
    """A plan with objective "flops" at ``share`` of the way from its floor to keeping all."""
    probe = plan_checkpointing(model, x, budget=1.0, objective="flops")
    budget = int(probe.floor_bytes + share * (probe.baseline_bytes - probe.floor_bytes))
    return plan_checkpointing(model, x, budget=budget, objective="flops")


def recomputed_flops(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one step's backward (recompute included)."""
    loss = model(x).sum()
    with FlopCount() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.flops


def test_rule24_the_profile_finds_post_norm_trails_and_no_pre_norm_one() -> None:
    """Each post-norm block but the last (whose norm makes the model's output, kept by nobody)
    has its ``norm2`` as a trail; pre-norm blocks end in a residual add, no child call."""
    model, x = encoder(), encoder_inputs()
    named = [(str(i), m) for i, m in enumerate(model)]
    profile = profile_step(model, named, (x,), {}, None)
    trailed = profile.trailed()
    assert trailed is not None
    step, trails = trailed
    assert [t.module for t in trails] == [f"{i}.norm2" for i in range(len(model) - 1)]
    for region, cut in zip(profile.regions, step.regions, strict=True):
        if region.trail is None or region is cut:
            continue
        assert len(cut.ops) == region.trail.start < len(region.ops)
        assert cut.stop <= region.trail.start
        assert cut.saved <= region.saved
    pre = encoder(norm_first=True)
    named = [(str(i), m) for i, m in enumerate(pre)]
    assert profile_step(pre, named, (x,), {}, None).trailed() is None


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("share", [0.0, 0.1, 0.5])
def test_rule24_trails_keep_gradients_bytes_and_flops_as_planned(share: float) -> None:
    """With trails recorded: gradients bitwise equal to the plain run's (dropout included), the
    report's bytes and the backward's recomputed FLOPs equal to the plan's, and the block
    inputs the trails remake are not kept."""
    model, x = encoder(), encoder_inputs()
    plain = grads_of(model, x, None)
    plain_flops = recomputed_flops(model, x)
    plan = flops_plan(model, x, share)
    trails = [s for s in plan.spans if s.kind == "trail"]
    assert [(s.first, s.last) for s in trails] == [(str(i), f"{i}.norm2") for i in range(2)]
    plan.apply(model)
    try:
        report, grads = measured(model, x, None)
        flops = recomputed_flops(model, x) - plain_flops
    finally:
        plan.remove(model)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)
    assert report.activation_bytes == plan.kept_bytes
    assert flops == plan.recompute_flops
    norms = [r for r in report.records if r.op == "native_layer_norm"]
    assert not [r for r in norms if r.decision == "saved" and r.region.startswith("inputs")]
    assert [r for r in norms if r.decision == "recomputed" and r.region == "scope"], report


@pytest.mark.parametrize("share", [0.0, 0.2])
def test_rule24_trails_recompute_fewer_flops_at_the_same_bytes(share: float) -> None:
    """Against the same model planned without spans (a ``regions`` predicate), at the same
    budget: the residual sum a trail's scope holds stands for the next block's input, which is
    no longer kept, so the sum's producers need not be recomputed: fewer FLOPs, no more bytes."""
    model, x = encoder(), encoder_inputs()
    blocks = lambda m: isinstance(m, nn.TransformerEncoderLayer)  # noqa: E731
    probe = plan_checkpointing(model, x, budget=1.0, objective="flops", regions=blocks)
    budget = int(probe.floor_bytes + share * (probe.baseline_bytes - probe.floor_bytes))
    trailed = plan_checkpointing(model, x, budget=budget, objective="flops")
    without = plan_checkpointing(model, x, budget=budget, objective="flops", regions=blocks)
    assert [s.kind for s in trailed.spans] == ["trail", "trail"]
    assert not without.spans
    assert trailed.kept_bytes <= budget
    assert trailed.recompute_flops < without.recompute_flops


@pytest.mark.usefixtures("gc_disabled")
def test_rule24_trails_hold_with_early_stop_off_and_after_json() -> None:
    """With early stop off the block's re-run ends at its trail's start all the same; a plan read
    back from JSON records the same trails and gives the same gradients."""
    model, x = encoder(), encoder_inputs()
    plain = grads_of(model, x, None)
    plan = flops_plan(model, x, 0.1)
    again = ActivationPlan.from_json(json.loads(plan.to_json()))
    assert again.spans == plan.spans
    for applied in (plan, again):
        applied.apply(model)
        try:
            with checkpointing.set_checkpoint_early_stop(False):
                grads = grads_of(model, x, None)
        finally:
            applied.remove(model)
        for a, b in zip(plain, grads, strict=True):
            assert torch.equal(a, b)
    assert "trail: 0.norm2, recorded and recomputed (0 ends before it)" in str(plan)


def test_rule24_the_plan_without_trails_races_only_where_it_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``timing_steps`` the cheapest plan without trails is timed beside the others,
    but not where the budget lies below the floor without trails: blocks ending in an expanding
    linear layer keep their narrow inputs only through the trails. Every plan the race sees fits,
    and so does the one returned."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 32)) for _ in range(4))
    )
    x = torch.randn(64, 32, requires_grad=True)
    blocks = lambda m: isinstance(m, nn.Sequential) and len(m) == 3  # noqa: E731
    trailed = plan_checkpointing(model, x, budget=1.0, objective="flops")
    without = plan_checkpointing(model, x, budget=1.0, objective="flops", regions=blocks)
    assert trailed.floor_bytes < without.floor_bytes
    budget = (trailed.floor_bytes + without.floor_bytes) // 2
    raced: list[ActivationPlan] = []

    def spy(model: nn.Module, plans: list[ActivationPlan], *args: object) -> list[float]:
        raced.extend(plans)
        return [1.0] * (len(plans) - 1) + [0.5]  # the last drawn wins: the one without trails

    monkeypatch.setattr(search_module, "time_plans", spy)
    chosen = plan_checkpointing(model, x, budget=budget, timing_steps=3)
    assert all(p.kept_bytes <= budget for p in raced), [p.kept_bytes for p in raced]
    assert chosen.kept_bytes <= budget
    assert any(s.kind == "trail" for s in chosen.spans)
    above = plan_checkpointing(model, x, budget=without.floor_bytes + 2048, timing_steps=3)
    assert above.kept_bytes <= without.floor_bytes + 2048


@pytest.mark.usefixtures("gc_disabled")
def test_rule24_a_pickled_planned_model_keeps_its_trails() -> None:
    """``torch.save`` of a model with a trailed plan applied: the copy's frames still end at the
    norms and its scopes still record them (its bytes are the plan's), gradients bitwise equal."""
    model, x = encoder(), encoder_inputs()
    plain = grads_of(model, x, None)
    plan = flops_plan(model, x, 0.1)
    plan.apply(model)
    try:
        twin = pickle.loads(pickle.dumps(model))
    finally:
        plan.remove(model)
    report, grads = measured(twin, x, None)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)
    assert report.activation_bytes == plan.kept_bytes


class Gated(nn.Module):
    """Calls ``last`` at its end, or first, or not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.last = nn.LayerNorm(6)
        self.where = "end"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "first":
            x = self.last(x)
        x = torch.tanh(self.body(x)) * x
        return self.last(x) if self.where == "end" else x.sin()


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("where", ["end", "first", "never"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_rule24_end_at_keeps_gradients_wherever_the_child_runs(
    where: str, early_stop: bool
) -> None:
    """``end_at`` ends the frame at the child's start, whether the child runs last, first (the
    rest runs outside the frame and keeps what it saves) or never (the frame ends at the
    module's end): gradients bitwise equal to the plain run's; removed, nothing stays."""
    torch.manual_seed(0)
    module = Gated()
    module.where = where
    x = torch.randn(3, 6, requires_grad=True)
    wrt = [x, *(module.body if where == "never" else module).parameters()]
    plain = torch.autograd.grad(module(x).square().sum(), wrt)
    checkpoint_module(module)
    handle = end_at(module, module.last)
    try:
        with checkpointing.set_checkpoint_early_stop(early_stop):
            out = module(x)
        assert _compat.top_saved_tensors_hooks() is None
        grads = torch.autograd.grad(out.square().sum(), wrt)
    finally:
        handle.remove()
        remove_checkpoint_module(module)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)
    assert not module.last._forward_pre_hooks


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning")
@pytest.mark.parametrize("backend", [pytest.param("aot_eager", marks=COMPILE_MARKS)])
def test_rule24_a_compiled_planned_model_with_trails_keeps_gradients(backend: str) -> None:
    """Under ``torch.compile`` the blocks are torch's regions (whole: the hook that would end
    them at the norm does nothing while dynamo traces): gradients equal the plain run's, no hook
    of ours left on the saved-tensors stack."""
    model, x = encoder(), encoder_inputs()
    plain = grads_of(model, x, None)
    plan = flops_plan(model, x, 0.1)
    assert any(s.kind == "trail" for s in plan.spans)
    plan.apply(model)
    try:
        torch.manual_seed(7)
        loss = torch.compile(model, backend=backend)(x).sum()
        assert _compat.top_saved_tensors_hooks() is None
        grads = torch.autograd.grad(loss, list(model.parameters()))
    finally:
        plan.remove(model)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)
