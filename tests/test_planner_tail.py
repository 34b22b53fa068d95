"""What runs after the blocks as regions of its own (issue 28; NOTE [Planner measure], Rule M10).

By default the modules a model calls after its last block (a final norm, an LM head) are
regions too. Every applied plan is checked against the plain run (gradients bit-identical),
against ``saved_tensors_report`` and the CPU allocator (bytes).
"""

from __future__ import annotations

import copy

import torch
from planner_support import (
    RMSNorm,
    TinyLlama,
    allocator_held,
    grads_of,
    llama_loss,
    loss_of,
    measured,
    run_layers,
)
from torch import nn

from checkpointing import ActivationPlan, plan_checkpointing
from checkpointing._chain import is_module_chained
from checkpointing._module import is_module_checkpointed
from checkpointing._planning import search as search_module
from checkpointing._planning.measure.profile import tail_regions


class Inner(nn.Module):
    """A Hugging Face style decoder: embedding, the blocks and the final norm, one level down
    (``TinyLlama``'s modules)."""

    def __init__(self, llama: TinyLlama) -> None:
        super().__init__()
        self.embed, self.layers, self.norm = llama.embed, llama.layers, llama.norm
        self.head_dim = llama.head_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(run_layers(self.embed, self.layers, tokens, self.head_dim))


class ForCausalLM(nn.Module):
    """``model.layers``, ``model.norm`` inside ``model``, then ``lm_head``: LlamaForCausalLM's
    layout."""

    def __init__(self) -> None:
        super().__init__()
        llama = TinyLlama()
        self.model = Inner(llama)
        self.lm_head = llama.head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


class SharedNorm(nn.Module):
    """One norm module called before the blocks and after them: not a tail region."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(self.norm(x))


def test_tail_regions_are_the_modules_called_after_the_last_block() -> None:
    """Rule M10: the outermost modules whose every call starts after the last block's ended, in
    call order, at any depth; a module also called before the blocks is not one."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 8))
    llama = TinyLlama()
    blocks = search_module.find_regions(llama, None)
    assert [n for n, _ in tail_regions(llama, blocks, (tokens,), {})] == ["norm", "head"]
    nested = ForCausalLM()
    blocks = search_module.find_regions(nested, None)
    names = [n for n, _ in tail_regions(nested, blocks, (tokens,), {})]
    assert names == ["model.norm", "lm_head"]
    shared = SharedNorm()
    blocks = search_module.find_regions(shared, None)
    assert [n for n, _ in tail_regions(shared, blocks, (torch.randn(4, 16),), {})] == ["head"]


def test_planned_tail_keeps_gradients_and_the_predicted_bytes() -> None:
    """Rule M10 end to end: at the floor the final norm is checkpointed like a block, or the tail
    is recorded whole (Rule M11); the report and the CPU allocator count the plan's bytes, and
    gradients equal the plain run bit for bit. A predicate names the regions alone (no tail
    added)."""
    torch.manual_seed(0)
    model, x = ForCausalLM(), torch.randint(0, 64, (2, 16))
    expected = grads_of(model, x, llama_loss)
    floor = plan_checkpointing(model, x, budget=1.0, loss_fn=llama_loss).floor_bytes
    plan = plan_checkpointing(model, x, budget=floor, loss_fn=llama_loss)
    names = [r.name for r in plan.regions]
    assert names[-2:] == ["model.norm", "lm_head"]
    recorded = "tail" in [s.kind for s in plan.spans]
    assert plan.regions[-2].checkpoint != recorded, str(plan)
    plan.apply(model)
    try:
        norm = model.model.norm  # at the floor it may end a chain of the blocks (Rule S9)
        assert (is_module_checkpointed(norm) or is_module_chained(norm)) != recorded
        held = allocator_held(lambda: loss_of(model, x, llama_loss))
        report, grads = measured(model, x, llama_loss)
    finally:
        plan.remove(model)
    assert not is_module_checkpointed(model.model.norm)
    assert not is_module_chained(model.model.norm)
    assert held == report.activation_bytes == plan.kept_bytes <= plan.budget_bytes, str(plan)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    chosen = plan_checkpointing(
        model,
        x,
        budget=0.5,
        loss_fn=llama_loss,
        regions=lambda m: type(m).__name__ == "DecoderLayer",
    )
    assert "model.norm" not in [r.name for r in chosen.regions]


def test_tail_regions_round_trip_through_json() -> None:
    """A plan with tail regions round-trips through JSON and applies to a copy of the model,
    with the same bytes and gradients."""
    torch.manual_seed(0)
    model, x = ForCausalLM(), torch.randint(0, 64, (2, 16))
    plan = plan_checkpointing(model, x, budget=0.3, loss_fn=llama_loss)
    text = plan.to_json()
    loaded = ActivationPlan.from_json(text)
    assert loaded.to_json() == text
    assert [r.name for r in loaded.regions][-2:] == ["model.norm", "lm_head"]
    twin = copy.deepcopy(model)
    plan.apply(model)
    loaded.apply(twin)
    try:
        (a, grads_a), (b, grads_b) = measured(model, x, llama_loss), measured(twin, x, llama_loss)
    finally:
        plan.remove(model)
        loaded.remove(twin)
    assert a.activation_bytes == b.activation_bytes == plan.kept_bytes
    assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_b, strict=True))
