"""A planned model whose blocks keep a span with ``checkpointing.keep`` (issue 40, item 6; NOTE
[Planner measure], Rule M14): the profile numbers, prices and offers the ops outside spans only, as
the selective modes see them at run time, and counts what the spans keep as the regions' own.
Gradients bitwise equal to the plain run's (dropout included), the report's bytes equal to the
plan's, the op keys those of the run time."""

from __future__ import annotations

import warnings

import pytest
import torch
from garbage_support import gc_disabled  # noqa: F401  (a fixture)
from planner_support import Chooser, allocator_held, draws_and_units, draws_only, forced_plan
from torch import nn

import checkpointing
from checkpointing import plan_checkpointing
from checkpointing._planning.measure.profile import profile_step
from checkpointing._planning.solve.problem import Choice

WIDTH, SEQ, BATCH, DEPTH = 32, 16, 4, 3


class Block(nn.Module):
    """A pre-norm block: an attention-like projection kept as a span (its 3-D argument straight
    from a layer norm), then an MLP; dropout after each."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.out_proj = nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(checkpointing.keep(self.out_proj, self.norm1(x)))
        return x + self.drop(self.fc2(self.fc1(self.norm2(x)).relu()))


def blocks(span: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(DEPTH))).train()
    if not span:  # the same model with the span as a plain call
        for block in model:
            block.forward = _plain_forward.__get__(block)  # type: ignore[method-assign]
    return model


def _plain_forward(self: Block, x: torch.Tensor) -> torch.Tensor:
    x = x + self.drop(self.out_proj(self.norm1(x)))
    return x + self.drop(self.fc2(self.fc1(self.norm2(x)).relu()))


def inputs() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(1))


def two_steps(model: nn.Module, x: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The gradients of two training steps (seeds 7 and 8; the parameters do not move)."""
    grads = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        grads.append(torch.autograd.grad(model(x).sum(), list(model.parameters())))
    return grads


def trains_as_planned(
    model: nn.Module,
    x: torch.Tensor,
    plan: checkpointing.ActivationPlan,
    plain: list[tuple[torch.Tensor, ...]],
) -> checkpointing.SavedTensorsReport:
    """Apply ``plan``: two steps give ``plain``'s gradients bitwise, and the allocator holds
    after forward the plan's kept bytes, as does the report (less the parameter views it
    counts; kept draws included), which is returned; the plan is taken off again."""
    plan.apply(model)
    try:
        grads = two_steps(model, x)
        held = allocator_held(lambda: model(x).sum())
        with checkpointing.saved_tensors_report() as report:
            loss = model(x).sum()
        torch.autograd.grad(loss, list(model.parameters()))
    finally:
        plan.remove(model)
    for step, again in zip(plain, grads, strict=True):
        for a, b in zip(step, again, strict=True):
            assert torch.equal(a, b)
    assert held == plan.kept_bytes, str(plan)
    assert report.activation_bytes - span_parameter_bytes(report) == held, str(plan)
    return report


def span_parameter_bytes(report: checkpointing.SavedTensorsReport) -> int:
    """What the report counts of the parameter views a span keeps (a linear layer's transposed
    weight): no activation, since the parameter stays whatever is kept, and the plan counts
    none; the report counts every tensor a span keeps."""
    return sum(
        r.nbytes
        for r in report.records
        if r.region.startswith("keep(") and r.op == "t" and r.decision == "saved"
    )


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8])
def test_rule25_a_planned_model_with_kept_spans_keeps_gradients_and_bytes(budget: float) -> None:
    """Planned and applied, two steps: gradients bitwise equal to the plain run's; the bytes the
    allocator holds after forward, and the report's activation bytes (less the parameter views
    it counts), those the plan predicts: the spans' outputs and saves included."""
    model, x = blocks(), inputs()
    plain = two_steps(model, x)
    plan = plan_checkpointing(model, x, budget=budget, objective="flops", timing_steps=0)
    assert any(r.checkpoint for r in plan.regions), str(plan)
    plan.apply(model)
    try:
        grads = two_steps(model, x)
        held = allocator_held(lambda: model(x).sum())
        torch.manual_seed(7)
        with checkpointing.saved_tensors_report() as report:
            loss = model(x).sum()
        torch.autograd.grad(loss, list(model.parameters()))
    finally:
        plan.remove(model)
    for step, again in zip(plain, grads, strict=True):
        for a, b in zip(step, again, strict=True):
            assert torch.equal(a, b)
    assert held == plan.kept_bytes, str(plan)
    assert report.activation_bytes - span_parameter_bytes(report) == plan.kept_bytes, str(plan)


def test_rule25_the_profile_numbers_only_the_ops_outside_spans() -> None:
    """A block's ops and their keys are the same block's without the span's ops: the span's
    ``addmm`` is not ``addmm #0`` and shifts no key after it; what the span keeps (its output)
    is the region's, kept when checkpointed; its argument (the norm's output) is saved for the
    replay."""
    x = inputs()
    model, plain_model = blocks(), blocks(span=False)
    kept = profile_step(model, [(str(i), b) for i, b in enumerate(model)], (x,), {}, None)
    plain = profile_step(
        plain_model, [(str(i), b) for i, b in enumerate(plain_model)], (x,), {}, None
    )
    for with_span, without in zip(kept.regions, plain.regions, strict=True):
        keys = [(op.op, op.index) for op in with_span.ops]
        addmms = [k for k in keys if k[0] == "aten.addmm.default"]
        assert addmms == [("aten.addmm.default", 0), ("aten.addmm.default", 1)], keys
        assert len(with_span.ops) < len(without.ops)
        assert len(with_span.kept) == 1  # the span's output; its weight's view is no activation
        assert not without.kept
        assert with_span.kept <= set(kept.storage_bytes)


@pytest.mark.usefixtures("gc_disabled")
def test_rule25_the_same_model_without_the_span_plans_and_runs_as_before() -> None:
    """The span as a plain call: the plan applies, gradients bitwise equal to the plain run's,
    bytes as planned (nothing of Rule M14 in play)."""
    model, x = blocks(span=False), inputs()
    plain = two_steps(model, x)
    plan = plan_checkpointing(model, x, budget=0.5, objective="flops", timing_steps=0)
    plan.apply(model)
    try:
        grads = two_steps(model, x)
        torch.manual_seed(7)
        with checkpointing.saved_tensors_report() as report:
            loss = model(x).sum()
        torch.autograd.grad(loss, list(model.parameters()))
    finally:
        plan.remove(model)
    for step, again in zip(plain, grads, strict=True):
        for a, b in zip(step, again, strict=True):
            assert torch.equal(a, b)
    assert report.activation_bytes == plan.kept_bytes


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("choose", [draws_only, draws_and_units])
def test_rule25_regions_that_keep_their_draws_keep_spans_too(choose: Chooser) -> None:
    """Rule S7's draws modes (alone, or under the selective ones) honour a kept span as the
    selective modes do: the span is skipped in the replay (no warning that it runs as a plain
    call), gradients bitwise equal to the plain run's, the allocator's bytes after forward and
    the report's the plan's (the report counts the kept draws: rows "kept draw")."""
    model, x = blocks(), inputs()
    plain = two_steps(model, x)
    plan = forced_plan(model, x, choose)
    assert all(r.keep_draws for r in plan.regions), str(plan)
    report = trains_as_planned(model, x, plan, plain)
    assert sum(r.op == "kept draw" for r in report.records) >= len(plan.regions)


class Ending(nn.Module):
    """A linear layer, then a span that saves nothing (``neg``), then a ``tanh`` (which saves
    its output: a holder after the span) or nothing: the span is last to reach."""

    def __init__(self, after: bool) -> None:
        super().__init__()
        self.linear, self.after = nn.Linear(WIDTH, WIDTH), after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpointing.keep(torch.neg, self.linear(x))
        return h.tanh() if self.after else h


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("after", [True, False])
def test_rule25_a_span_the_replay_cannot_reach_keeps_nothing(after: bool) -> None:
    """A span's output is kept only where a holder is made at or after its start (NOTE [Kept
    spans], Rule 3: early stop releases it otherwise); the profile counts it so, and every
    block checkpointed holds after forward what the plan predicts."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Ending(after) for _ in range(DEPTH)))
    x = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    named = [(str(i), b) for i, b in enumerate(model)]
    profile = profile_step(model, named, (x,), {}, None)
    assert [len(r.kept) for r in profile.regions] == [1 if after else 0] * DEPTH
    plain = two_steps(model, x)
    plan = forced_plan(model, x, lambda _problem, _index: Choice(True))
    trains_as_planned(model, x, plan, plain)


class BlockOfKeeping(Block):
    """The MLP, its dropout included, in a ``with keeping():`` block: the replay runs it again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(checkpointing.keep(self.out_proj, self.norm1(x)))
        with checkpointing.keeping():
            h = self.drop(self.fc1(self.norm2(x)).relu())
        return x + self.drop(self.fc2(h))


@pytest.mark.usefixtures("gc_disabled")
def test_rule25_a_region_that_keeps_its_draws_runs_keeping_blocks_plainly() -> None:
    """Rule S7's modes answer the region's draws without drawing, so a ``with keeping():``
    block that the replay runs again would draw from another RNG state there: under them a
    block is a plain call (as the profile sees it), gradients bitwise equal to the plain run's."""
    torch.manual_seed(0)
    model = nn.Sequential(*(BlockOfKeeping() for _ in range(DEPTH))).train()
    x = inputs()
    plain = two_steps(model, x)
    plan = forced_plan(model, x, draws_only)
    assert all(r.keep_draws for r in plan.regions), str(plan)
    report = trains_as_planned(model, x, plan, plain)
    assert sum(r.op == "kept draw" for r in report.records) >= len(plan.regions)


@pytest.mark.usefixtures("gc_disabled")
def test_rule25_a_region_running_a_keeping_block_is_planned_without_recompute() -> None:
    """A region that runs a ``with keeping():`` block is planned plainly, whatever the budget:
    at the floor the other blocks are checkpointed and it is not, nothing warns, the allocator
    holds the predicted bytes and gradients are the plain run's; a block around the whole
    model (outside every region) leaves the regions to the plan."""

    class Outside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(DEPTH)))
            self.head = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with checkpointing.keeping("head"):
                return self.head(self.blocks(x))

    def floor(model: nn.Module) -> checkpointing.ActivationPlan:
        first = plan_checkpointing(model, (x,), budget=1.0, timing_steps=0)
        return plan_checkpointing(model, (x,), budget=first.floor_bytes, timing_steps=0)

    torch.manual_seed(0)
    x = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is said: the block is planned, not warned of
        outside = floor(Outside().train())
        model = nn.Sequential(Block(), BlockOfKeeping(), Block()).train()
        plan = floor(model)
    assert [r.checkpoint for r in outside.regions if r.name.startswith("blocks.")] == [True] * 3
    assert [r.checkpoint for r in plan.regions] == [True, False, True], str(plan)
    trains_as_planned(model, x, plan, two_steps(model, x))
