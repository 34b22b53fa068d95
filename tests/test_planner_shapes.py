"""Planning without memory (NOTE [Planning without memory]): a model on the meta device or of
fake tensors is planned by shapes, exactly as the same model on real tensors, for a named
device; its plan's JSON applies to the real model; value-dependent ops are refused."""

from __future__ import annotations

import json
import math
import resource
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from planner_support import TinyLlama, grads_of, llama_loss, measured
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import checkpointing
from checkpointing._planning.measure.costs import DEVICE_CLASSES, DeviceCosts
from checkpointing._planning.measure.flops import FlopCount

BUDGETS = (1.0, 0.6, 0.3)


def _same_plan(real: checkpointing.ActivationPlan, shaped: checkpointing.ActivationPlan) -> None:
    """The predictions to the byte and the decisions, one by one."""
    assert (real.baseline_bytes, real.floor_bytes, real.kept_bytes, real.peak_bytes) == (
        shaped.baseline_bytes,
        shaped.floor_bytes,
        shaped.kept_bytes,
        shaped.peak_bytes,
    ), f"{real}\n{shaped}"
    assert real.regions == shaped.regions
    assert real.spans == shaped.spans


def test_a_meta_model_plans_as_the_real_one_to_the_byte() -> None:
    """Rules 1-2: the toy Llama on the meta device and on real CPU tensors: the same bytes
    (baseline, floor, kept, peak) and decisions at two budgets; the real plan's bytes are
    what the saved-tensor report measures when applied."""
    torch.manual_seed(0)
    real, tokens = TinyLlama(depth=2), torch.randint(0, 64, (2, 16))
    with torch.device("meta"):
        meta = TinyLlama(depth=2)
    for budget in BUDGETS[1:]:
        plan = checkpointing.plan_checkpointing(real, tokens, budget=budget, loss_fn=llama_loss)
        shaped = checkpointing.plan_checkpointing(
            meta, tokens.to("meta"), budget=budget, loss_fn=llama_loss
        )
        _same_plan(plan, shaped)
        plan.apply(real)
        try:
            report, _ = measured(real, tokens, llama_loss)
        finally:
            plan.remove(real)
        assert report.activation_bytes == plan.kept_bytes


def test_a_fake_tensor_model_plans_as_the_meta_one() -> None:
    """Rule 1: a model and inputs made under the caller's ``FakeTensorMode`` plan as the same
    model on the meta device; the model's tensors are its own fake ones after."""
    with torch.device("meta"):
        meta = TinyLlama()
    with FakeTensorMode() as mode:
        fake, tokens = TinyLlama(), torch.randint(0, 64, (2, 16))
    weights = list(fake.parameters())
    shaped = checkpointing.plan_checkpointing(
        meta, torch.empty(2, 16, dtype=torch.long, device="meta"), budget=0.5, loss_fn=llama_loss
    )
    faked = checkpointing.plan_checkpointing(fake, tokens, budget=0.5, loss_fn=llama_loss)
    _same_plan(shaped, faked)
    assert all(p is q for p, q in zip(fake.parameters(), weights, strict=True))
    assert all(p.fake_mode is mode for p in fake.parameters())  # type: ignore[attr-defined]


def test_the_shaped_plan_applies_to_the_real_twin_and_trains() -> None:
    """Rule 2: the meta model's plan, through JSON, on the real model: gradients equal the plain
    run bit for bit (the same CPU kernels), and the measured bytes are its prediction, within
    the budget."""
    torch.manual_seed(0)
    real, tokens = TinyLlama(), torch.randint(0, 64, (2, 16))
    with torch.device("meta"):
        meta = TinyLlama()
    expected = grads_of(real, tokens, llama_loss)
    shaped = checkpointing.plan_checkpointing(
        meta, tokens.to("meta"), budget=0.4, loss_fn=llama_loss, device="h100-80gb"
    )
    assert any(r.checkpoint for r in shaped.regions), str(shaped)
    plan = checkpointing.ActivationPlan.from_json(shaped.to_json())
    plan.apply(real)
    try:
        report, grads = measured(real, tokens, llama_loss)
    finally:
        plan.remove(real)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert report.activation_bytes == plan.kept_bytes <= plan.budget_bytes


def test_tied_weights_and_a_real_model_given_a_meta_input() -> None:
    """Rule 1: tied weights (the LM head's the embedding's) are swapped as one, and a real model
    given a meta input is planned on shapes too: both as the real model's plan; the tie and
    the meta weights are as found after. Fake tensors of two modes are refused."""
    torch.manual_seed(0)
    real, tokens = TinyLlama(depth=2), torch.randint(0, 64, (2, 16))
    real.head.weight = real.embed.weight
    with torch.device("meta"):
        meta = TinyLlama(depth=2)
    meta.head.weight = meta.embed.weight
    plan = checkpointing.plan_checkpointing(real, tokens, budget=0.5, loss_fn=llama_loss)
    shaped = checkpointing.plan_checkpointing(
        meta, tokens.to("meta"), budget=0.5, loss_fn=llama_loss
    )
    _same_plan(plan, shaped)
    assert meta.head.weight is meta.embed.weight
    assert meta.head.weight.is_meta
    given_meta = checkpointing.plan_checkpointing(
        real, tokens.to("meta"), budget=0.5, loss_fn=llama_loss
    )
    _same_plan(plan, given_meta)
    assert not any(p.is_meta for p in real.parameters())
    with FakeTensorMode():
        fake_tokens = torch.empty(2, 16, dtype=torch.long)
    with FakeTensorMode():
        fake = TinyLlama(depth=2)
    with pytest.raises(ValueError, match="more than one FakeTensorMode"):
        checkpointing.plan_checkpointing(fake, fake_tokens, budget=0.5, loss_fn=llama_loss)


class _Routed(nn.Module):
    """A block whose step reads values: ``nonzero`` picks rows, or ``.item()`` scales."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.how == "nonzero":
            return h[torch.nonzero(h[:, 0] > 0).flatten()].sum(0, keepdim=True) + h
        return h * float(h.abs().max().item())


@pytest.mark.parametrize(("how", "op"), [("nonzero", "aten.nonzero"), ("item", "aten._local")])
def test_a_value_dependent_op_is_refused_by_name(how: str, op: str) -> None:
    """Rule 3: no values, no plan: the error names the op and says to plan on real tensors."""
    with torch.device("meta"):
        model = nn.Sequential(_Routed(how), _Routed(how))
    with pytest.raises(ValueError, match="depends on tensor values") as raised:
        checkpointing.plan_checkpointing(model, torch.randn(4, 8, device="meta"), budget=0.5)
    assert op in str(raised.value)
    assert "plan on real tensors" in str(raised.value)
    assert all(p.is_meta for p in model.parameters())  # left as found


def test_the_plan_names_the_device_it_is_priced_for() -> None:
    """Each named class prices the plan, and the plan names it (table, JSON, ``costs``); a
    ``DeviceCosts`` of the caller's own is taken as given; an unknown name is refused."""
    with torch.device("meta"):
        model = TinyLlama()
    tokens = torch.empty(2, 16, dtype=torch.long, device="meta")
    assert {"cpu", "a100-80gb", "h100-80gb", "h200"} <= set(DEVICE_CLASSES)
    for name in DEVICE_CLASSES:
        plan = checkpointing.plan_checkpointing(
            model, tokens, budget=0.5, loss_fn=llama_loss, device=name
        )
        assert plan.costs is not None
        assert plan.costs.name == name
        assert f"priced for {name}: " in str(plan)
        again = checkpointing.ActivationPlan.from_json(plan.to_json())
        assert again.costs == plan.costs
        assert again == plan
        older = json.loads(plan.to_json())  # written before draws had a price of their own
        del older["costs"]["random_seconds_per_element"]
        read = checkpointing.ActivationPlan.from_json(json.dumps(older)).costs
        assert read is not None
        assert read.random_seconds_per_element == 0.0
    own = DeviceCosts(1e15, 3e12, 5e-6, 2e-5, 1.5e-5, 3e-4, name="mine")
    plan = checkpointing.plan_checkpointing(model, tokens, budget=0.5, device=own)
    assert plan.costs is own
    assert json.loads(plan.to_json())["costs"]["name"] == "mine"
    with pytest.raises(ValueError, match=r"device must be None \(the cost model"):
        checkpointing.plan_checkpointing(model, tokens, budget=0.5, device="h100")
    with pytest.raises(ValueError, match=r"timing_steps=3 .* nothing to time"):
        checkpointing.plan_checkpointing(model, tokens, budget=0.5, timing_steps=3)


@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "repeated_kv"])
def test_grouped_query_attention_flops_are_the_analytic_count(gqa: bool) -> None:
    """The counter's FLOPs of attention with fewer key/value heads than query heads: forward
    4 * B * Hq * Lq * Lk * d, backward 2.5 times that, as the analytic formula (every query head
    scores every key of its group's head), whether SDPA gets the groups or repeated heads."""
    batch, heads, groups, length, depth = 2, 8, 2, 32, 16
    q = torch.randn(batch, heads, length, depth, requires_grad=True)
    k, v = (torch.randn(batch, groups, length, depth, requires_grad=True) for _ in range(2))
    with FlopCount() as forward:
        if gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            repeat = heads // groups
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=True
            )
    with FlopCount() as backward:
        out.sum().backward()
    analytic = 4 * batch * heads * length * length * depth
    assert forward.flops == analytic
    assert backward.flops == analytic * 5 // 2


@pytest.mark.once
def test_a_meta_hugging_face_llama_plans_as_the_real_one() -> None:
    """Rules 1-2 and 5 on transformers' Llama with grouped-query attention (4 query heads, 2
    key/value heads): the meta model and the real one give the same bytes and decisions at
    three budgets, also priced for another device where the decisions agree; the real plan's
    bytes are the report's. ``use_cache=True``: transformers then skips the causal mask without
    reading values, with fake tensors as with real ones (Rule 5)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=True,
    )
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config).train()
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config).train()
    tokens = torch.randint(0, 64, (2, 16))

    def loss_fn(output: Any) -> torch.Tensor:
        loss: torch.Tensor = output.logits.float().mean()
        return loss

    for budget in BUDGETS:
        plan = checkpointing.plan_checkpointing(real, tokens, budget=budget, loss_fn=loss_fn)
        shaped = checkpointing.plan_checkpointing(
            meta, tokens.to("meta"), budget=budget, loss_fn=loss_fn
        )
        _same_plan(plan, shaped)
        for_h100 = checkpointing.plan_checkpointing(
            meta, tokens.to("meta"), budget=budget, loss_fn=loss_fn, device="h100-80gb"
        )
        assert for_h100.costs is not None
        assert for_h100.costs.name == "h100-80gb"
        # Other prices may choose otherwise; the bytes at both ends are the shapes' alone.
        assert (for_h100.baseline_bytes, for_h100.floor_bytes) == (
            plan.baseline_bytes,
            plan.floor_bytes,
        )
        plan.apply(real)
        try:
            with checkpointing.saved_tensors_report() as report:
                loss_fn(real(tokens)).backward()
        finally:
            plan.remove(real)
            real.zero_grad(set_to_none=True)
        assert report.activation_bytes == plan.kept_bytes


def test_planning_by_shapes_allocates_nothing_of_the_model() -> None:
    """Rule 1: a meta model of 4.3 GB in float32 is planned while the process's peak resident
    memory grows by a small share of it (what the first plan's imports take)."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(8192, 8192) for _ in range(16)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    x = torch.empty(64, 8192, device="meta", requires_grad=True)
    plan = checkpointing.plan_checkpointing(model, x, budget=1.0)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert grown < weights / 16, (grown, weights)
    assert plan.baseline_bytes == 15 * 64 * 8192 * 4  # each later layer keeps its input
    assert math.isfinite(plan.recompute_ms)
