"""The head and the tail recorded as spans (NOTE [Planner measure], Rule M11): gradients equal to
the plain run, bytes equal to the report's, hooks installed and removed, and spans not offered
where a scope could not record them exactly."""

from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from compile_support import COMPILE_MARKS, fresh_dynamo  # noqa: F401  (a fixture)
from garbage_support import gc_disabled  # noqa: F401  (a fixture)
from hf_support import tiny_llama
from planner_support import TinyLlama, grads_of, llama_loss, measured
from torch import nn

import checkpointing
from checkpointing import ActivationPlan, _compat, plan_checkpointing
from checkpointing._planning import search as search_module
from checkpointing._planning.measure.profile import profile_step, tail_regions
from checkpointing._planning.measure.recorded_spans import span_problems
from checkpointing._planning.solve.problem import recompute_cost
from checkpointing._planning.solve.solver import solve


def tokens() -> torch.Tensor:
    return torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _blocks_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spans' budgets are set from the floor with blocks checkpointed apart, the setting
    these tests pin; with joins the floor is a chain's (NOTE [Planner solve], Rule S9), a lower
    budget where the head alone pays: joins are off here."""
    monkeypatch.setattr(search_module, "JOINS", False)


def llama() -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama()


def low_plan(model: nn.Module, x: torch.Tensor) -> ActivationPlan:
    """A plan at a budget low enough that recording the spans pays (objective "flops")."""
    probe = plan_checkpointing(model, x, budget=1.0, loss_fn=llama_loss, objective="flops")
    return plan_checkpointing(
        model, x, budget=int(1.1 * probe.floor_bytes), loss_fn=llama_loss, objective="flops"
    )


def planned_step(plan: ActivationPlan, model: nn.Module, x: torch.Tensor, loss_fn: Any) -> Any:
    """(report, gradients) of one step with ``plan`` applied (``measured``); removed again."""
    plan.apply(model)
    try:
        return measured(model, x, loss_fn)
    finally:
        plan.remove(model)


def hooks_of(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


@pytest.mark.usefixtures("gc_disabled")
def test_rule22_spans_keep_gradients_and_the_predicted_bytes() -> None:
    """Both spans recorded: gradients bitwise equal to the plain run's, the report's bytes equal
    to the plan's, and the head's embedding and the tail's norm output are no longer kept."""
    model, x = llama(), tokens()
    plain = grads_of(model, x, llama_loss)
    plan = low_plan(model, x)
    assert {s.kind for s in plan.spans} == {"head", "tail"}, plan
    front = plan.frontier()  # over every variant: from keeping everything to the lowest floor
    assert front[0] == (plan.baseline_bytes, 0.0)
    assert front[-1][0] == plan.floor_bytes
    report, grads = planned_step(plan, model, x, llama_loss)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)
    assert report.activation_bytes == plan.kept_bytes
    kept = [r for r in report.records if r.decision == "saved"]
    assert not [r for r in kept if r.op == "embedding"], report
    head = next(s for s in plan.spans if s.kind == "head")
    assert (head.first, head.last) == ("", "layers.0")


def test_rule22_spans_pay_off_against_the_plan_without_them() -> None:
    """Recording lowers the floor, and at a budget both reach the chosen variant recomputes no
    more than the blocks and tail regions alone (the same profile, solved without spans)."""
    model, x = llama(), tokens()
    named = search_module.find_regions(model, None)
    tail = tail_regions(model, named, (x,), {})
    profile = profile_step(model, named + tail, (x,), {}, llama_loss, tail=len(tail))
    base = profile.problem(profile.policy_seconds_per_op, profile.objective("flops"))
    apart = tuple(dataclasses.replace(region, joinable=False) for region in base.regions)
    base = dataclasses.replace(base, regions=apart)  # blocks apart, as the fixture has them
    variants = span_problems(base, profile.spans, range(len(named), len(named) + len(tail)), 0.0)
    assert len(variants) == 4  # none, the head, the tail, both
    floors = [solve(problem, 0).floor_bytes for _, problem in variants]
    assert min(floors[1:]) < floors[0]
    budget = int(1.1 * floors[0])
    index, chosen = search_module._cheapest([problem for _, problem in variants], budget)
    spans, problem = variants[index]
    assert spans
    cost = recompute_cost(problem, chosen.choices)
    assert cost <= recompute_cost(base, solve(base, budget).choices)


class DroppedEmbedding(TinyLlama):
    """A head that draws: dropout on the embedding, as GPT-2 does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Embedding(64, 32), nn.Dropout(0.1))


def test_rule22_a_head_that_draws_is_not_recorded() -> None:
    """A scope would keep an RNG state per draw, which the model does not count: no head."""
    torch.manual_seed(0)
    model, x = DroppedEmbedding().train(), tokens()
    plan = low_plan(model, x)
    assert "head" not in {s.kind for s in plan.spans}


class ScaledEmbedding(TinyLlama):
    """The head scales its embedding in place by a parameter (``mul_`` writes only the
    embedding, which the head made, and reads the parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((32,), 1.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(tokens.shape[1]).float(), inv).repeat(1, 2)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens).mul_(self.scale)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


class CountedEmbedding(TinyLlama):
    """The head writes a buffer in place (a call counter): not a tensor it made."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(tokens)


class NormedEmbedding(TinyLlama):
    """The head batch-normalizes its embedding with running statistics: in training, batch norm
    writes them (buffers) though its schema does not mark them as written. (``nn.BatchNorm1d``
    would also bump ``num_batches_tracked`` with a marked ``add_``; this does not.)"""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(32))
        self.register_buffer("var", torch.ones(32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(tokens.shape[1]).float(), inv).repeat(1, 2)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens).transpose(1, 2)
        x = F.batch_norm(x, self.mean, self.var, training=self.training).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


@pytest.mark.usefixtures("gc_disabled")
def test_rule22_a_head_writing_its_own_tensor_is_recorded_one_writing_a_buffer_is_not() -> None:
    """An in-place op refuses the head only where what it writes is not the head's own: a
    parameter read by ``mul_`` does not (the head is recorded, gradients bitwise equal to the
    plain run's, bytes as predicted); a buffer written by ``add_`` does, and so do batch norm's
    running statistics, which its schema does not mark as written."""
    torch.manual_seed(0)
    model, x = ScaledEmbedding(), tokens()
    plain = grads_of(model, x, llama_loss)
    plan = low_plan(model, x)
    assert "head" in {s.kind for s in plan.spans}, plan
    report, grads = planned_step(plan, model, x, llama_loss)
    assert report.activation_bytes == plan.kept_bytes, plan
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    counted = CountedEmbedding()
    assert "head" not in {s.kind for s in low_plan(counted, x).spans}
    torch.manual_seed(0)
    normed = NormedEmbedding()
    assert "head" in {s.kind for s in low_plan(normed.eval(), x).spans}  # reads its statistics
    assert "head" not in {s.kind for s in low_plan(normed.train(), x).spans}  # writes them


class KeywordAngles(TinyLlama):
    """The head's rotary angles reach the layers by keyword: a frame keeps them by plain
    reference, so recording the head cannot free them."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(tokens.shape[1]).float(), inv).repeat(1, 2)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos=angles.cos(), sin=angles.sin())
        return self.head(self.norm(x))


@pytest.mark.usefixtures("gc_disabled")
def test_rule22_keyword_inputs_made_in_the_head_stay_counted() -> None:
    """Prediction equals the report with inputs received by keyword."""
    torch.manual_seed(0)
    model, x = KeywordAngles(), tokens()
    plan = low_plan(model, x)
    assert plan.spans
    report, _ = planned_step(plan, model, x, llama_loss)
    assert report.activation_bytes == plan.kept_bytes


def test_rule22_spans_survive_json_and_pickle_and_remove_their_hooks() -> None:
    """The spans round-trip through JSON; a pickled applied model gives the same gradients;
    ``remove`` leaves the model's hooks as they were."""
    model, x = llama(), tokens()
    before = hooks_of(model)
    plan = low_plan(model, x)
    again = ActivationPlan.from_json(plan.to_json())
    assert again.spans == plan.spans
    plain = grads_of(model, x, llama_loss)
    again.apply(model)
    try:
        twin = pickle.loads(pickle.dumps(model))
        assert hooks_of(model) != before
    finally:
        again.remove(model)
    assert hooks_of(model) == before
    for a, b in zip(plain, grads_of(twin, x, llama_loss), strict=True):
        assert torch.equal(a, b)


def test_rule22_a_span_the_model_lacks_is_refused_on_apply() -> None:
    """A plan whose span names a module the model lacks raises, naming it, and installs
    nothing."""
    model, x = llama(), tokens()
    data = json.loads(low_plan(model, x).to_json())
    data["spans"][0]["last"] = "nowhere"
    before = hooks_of(model)
    with pytest.raises(ValueError, match="'nowhere'"):
        ActivationPlan.from_json(data).apply(model)
    assert hooks_of(model) == before


class Failing(TinyLlama):
    fail = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.embed(tokens)
            raise RuntimeError("boom")
        return super().forward(tokens)


def test_rule22_an_exception_closes_the_spans_and_no_grad_runs_plainly() -> None:
    """A forward that raises inside the head leaves nothing open: the next step's gradients
    are the plain run's; under ``no_grad`` the model runs and records nothing."""
    torch.manual_seed(0)
    model, x = Failing(), tokens()
    plain = grads_of(model, x, llama_loss)
    plan = low_plan(model, x)
    assert plan.spans
    plan.apply(model)
    try:
        model.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            model(x)
        model.fail = False
        with torch.no_grad():
            expected = model(x)
        grads = grads_of(model, x, llama_loss)
        torch.testing.assert_close(model(x), expected)
    finally:
        plan.remove(model)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("gc_disabled")
def test_rule22_hugging_face_llama_records_its_head_and_tail() -> None:
    """A Hugging Face Llama (its loss computed inside ``forward``, its rotary angles and mask
    made before the first layer): spans recorded, gradients bitwise equal to the plain run's,
    the report's bytes equal to the plan's."""
    torch.manual_seed(0)
    model = tiny_llama()
    ids = tokens()

    def loss_fn(output: object) -> torch.Tensor:
        return output.loss  # type: ignore[attr-defined, no-any-return]

    def grads() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(loss_fn(model(ids, labels=ids)), list(model.parameters()))

    plain = grads()
    probe = plan_checkpointing(
        model, ids, budget=1.0, example_kwargs={"labels": ids}, loss_fn=loss_fn, objective="flops"
    )
    plan = plan_checkpointing(
        model,
        ids,
        budget=int(1.1 * probe.floor_bytes),
        example_kwargs={"labels": ids},
        loss_fn=loss_fn,
        objective="flops",
    )
    assert {s.kind for s in plan.spans} == {"head", "tail"}, plan
    plan.apply(model)
    try:
        with checkpointing.saved_tensors_report() as report:
            loss = loss_fn(model(ids, labels=ids))
        del loss
        planned = grads()
    finally:
        plan.remove(model)
    assert report.activation_bytes == plan.kept_bytes, plan
    for a, b in zip(plain, planned, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("gc_disabled")
def test_rule22_what_the_loss_saves_after_the_model_stays_counted() -> None:
    """A loss outside the model that saves the tail's output (``pow`` saves its input): the
    spans give up our hook at the model's end, so that output is kept, and the prediction
    counts it; no hook of ours is left on the stack after the step."""

    def squares(logits: torch.Tensor) -> torch.Tensor:
        return logits.pow(2).mean()

    model, x = llama(), tokens()
    probe = plan_checkpointing(model, x, budget=1.0, loss_fn=squares, objective="flops")
    plan = plan_checkpointing(
        model, x, budget=int(1.1 * probe.floor_bytes), loss_fn=squares, objective="flops"
    )
    assert "tail" in {s.kind for s in plan.spans}, plan
    plain = grads_of(model, x, squares)
    report, grads = planned_step(plan, model, x, squares)
    assert report.activation_bytes == plan.kept_bytes, plan
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("outer", ["ours", "torch"])
def test_rule22_a_planned_model_inside_a_checkpoint_keeps_gradients(outer: str) -> None:
    """The whole planned model checkpointed again (ours or torch's, non-reentrant): the spans
    record nothing inside the outer frame, and gradients equal the plain run's."""
    model, x = llama(), tokens()
    plain = grads_of(model, x, llama_loss)
    plan = low_plan(model, x)
    assert plan.spans
    wrap = checkpointing.checkpoint if outer == "ours" else torch.utils.checkpoint.checkpoint
    plan.apply(model)
    try:
        torch.manual_seed(7)
        loss = llama_loss(wrap(model, x, use_reentrant=False))
        grads = torch.autograd.grad(loss, list(model.parameters()))
    finally:
        plan.remove(model)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning")
@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=COMPILE_MARKS) for b in ("aot_eager", "inductor")]
)
def test_rule22_a_compiled_planned_model_keeps_gradients(backend: str) -> None:
    """``torch.compile`` of a planned model with both spans (dynamo breaks the graph at our
    entry points): gradients equal the plain run's (bitwise with the eager kernels of
    ``aot_eager``, to float rounding with inductor's), and no hook of ours is left on the
    saved-tensors stack after the forward."""
    model, x = llama(), tokens()
    plain = grads_of(model, x, llama_loss)
    plan = low_plan(model, x)
    assert {s.kind for s in plan.spans} == {"head", "tail"}, plan
    plan.apply(model)
    try:
        torch.manual_seed(7)
        loss = llama_loss(torch.compile(model, backend=backend)(x))
        assert _compat.top_saved_tensors_hooks() is None
        grads = torch.autograd.grad(loss, list(model.parameters()))
    finally:
        plan.remove(model)
    for a, b in zip(plain, grads, strict=True):
        if backend == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)
