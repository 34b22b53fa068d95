"""The RNG states in a plan's bytes: what the planner charges is what the frame keeps.

The frame captures the CPU RNG state when a checkpointed region starts, and shares a capture
byte-identical to the previous one (NOTE [RNG state shared when identical]). A planned region
that drew nothing when profiled is checkpointed without preserving RNG state, keeps none, and is
charged none (NOTE [Planner apply], Rule A3): a guard raises if it draws after all. A chain of
regions that draw nothing keeps no state, a chain of regions that each draw keeps one per region.
These tests hold the planner's predicted kept bytes to the CPU allocator's account of the applied
plan (``allocator_support``), exactly, for regions with and without dropout, pin how many states
each kind of chain is charged, and check the guard and the gradients.
"""

from __future__ import annotations

import io
import json
from copy import deepcopy

import pytest
import torch
from allocator_support import allocator_step
from torch import nn

import checkpointing
from checkpointing._planning import search

WIDTH = 64
HIDDEN = 256
ROWS = 32
# The CPU generator's state, as ``torch.get_rng_state()`` copies it out (5,056 bytes).
STATE_BYTES = torch.get_rng_state().untyped_storage().nbytes()
ACTIVATION_BYTES = ROWS * WIDTH * 4  # one block's input or output, float32


class Block(nn.Module):
    """``x + b(dropout(tanh(a(x))))``; ``p == 0`` draws no random numbers."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, HIDDEN)
        self.b = nn.Linear(HIDDEN, WIDTH)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.p:
            h = nn.functional.dropout(h, self.p, self.training)
        return x + self.b(h)  # type: ignore[no-any-return]


class Net(nn.Module):
    def __init__(self, drops: tuple[float, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(p) for p in drops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture(autouse=True)
def _blocks_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests pin the states of regions checkpointed apart (a draw-free region keeps none,
    under its guard); at the floor the planner would join the blocks, and a chain always keeps
    one state (NOTE [Planner solve], Rule S9): joins are off here."""
    monkeypatch.setattr(search, "JOINS", False)


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _plan(model: nn.Module, x: torch.Tensor, budget: float) -> checkpointing.ActivationPlan:
    return checkpointing.plan_checkpointing(
        model, (x,), budget=budget, loss_fn=_loss, timing_steps=0
    )


def _floor(model: nn.Module, x: torch.Tensor) -> checkpointing.ActivationPlan:
    """The plan at the fewest bytes any plan keeps: every region checkpointed whole."""
    return _plan(model, x, _plan(model, x, 0.5).floor_bytes)


def _held(plan: checkpointing.ActivationPlan, model: nn.Module, x: torch.Tensor) -> int:
    """The allocator's bytes held from forward to backward with ``plan`` applied."""
    plan.apply(model)
    try:
        return allocator_step(lambda: _loss(model(x))).held
    finally:
        plan.remove(model)


# Chains: (dropout per region, CPU states the plan keeps with every region checkpointed).
CHAINS = {
    "one region, no draws": ((0.0,), 0),
    "one region, dropout": ((0.1,), 1),
    "three regions, no draws": ((0.0, 0.0, 0.0), 0),  # no region keeps a state
    "three regions, dropout": ((0.1, 0.1, 0.1), 3),  # each region moves the stream on
    # Only the drawing regions capture; the first one's dropout moves the stream on, so the
    # third starts from another state: two states for four regions.
    "dropout, then none, alternating": ((0.1, 0.0, 0.1, 0.0), 2),
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_predicted_kept_bytes_equal_the_allocators(chain: str) -> None:
    """At budget 0.5 and at the floor (every region checkpointed whole) the plan's predicted
    kept bytes are the allocator's. At the floor they are the regions' inputs, the loss's input
    and the chain's distinct RNG states."""
    drops, states = CHAINS[chain]
    torch.manual_seed(1)
    model, x = Net(drops), torch.randn(ROWS, WIDTH)
    plan = _plan(model, x, 0.5)
    assert _held(plan, model, x) == plan.kept_bytes, str(plan)
    floor = _plan(model, x, plan.floor_bytes)
    assert all(region.checkpoint for region in floor.regions), str(floor)
    # Inputs of every region but the first (an example input is no activation), and the
    # output that the loss saves.
    activations = len(drops) * ACTIVATION_BYTES
    assert floor.kept_bytes == activations + states * STATE_BYTES, str(floor)
    assert _held(floor, model, x) == floor.kept_bytes


def test_peak_errs_high_within_six_percent() -> None:
    """The predicted peak of a step is at least the allocator's and at most 6 % above it."""
    torch.manual_seed(1)
    model, x = Net((0.1, 0.0, 0.1, 0.0)), torch.randn(ROWS, WIDTH)
    plan = _plan(model, x, 0.5)
    plan.apply(model)
    try:
        peak = allocator_step(lambda: _loss(model(x))).peak
    finally:
        plan.remove(model)
    assert peak <= plan.peak_bytes <= 1.06 * peak, (peak, plan.peak_bytes)


def test_draw_free_chain_keeps_no_rng_state() -> None:
    """A chain without dropout, every region checkpointed: the plan says no region draws, the
    predicted kept bytes are the activations alone, and the allocator agrees; with one RNG
    state charged (the old model) the prediction would be 5,056 bytes over."""
    torch.manual_seed(1)
    model, x = Net((0.0, 0.0, 0.0)), torch.randn(ROWS, WIDTH)
    floor = _floor(model, x)
    assert all(r.checkpoint and not r.draws for r in floor.regions), str(floor)
    assert floor.kept_bytes == 3 * ACTIVATION_BYTES, str(floor)
    assert _held(floor, model, x) == floor.kept_bytes


def test_draws_field_in_json() -> None:
    """The field travels through JSON; a plan written before it loads as drawing (the state
    kept: conservative)."""
    torch.manual_seed(1)
    model, x = Net((0.1, 0.0)), torch.randn(ROWS, WIDTH)
    plan = _floor(model, x)
    assert [r.draws for r in plan.regions] == [True, False]
    again = checkpointing.ActivationPlan.from_json(plan.to_json())
    assert [r.draws for r in again.regions] == [True, False]
    old = json.loads(plan.to_json())
    for region in old["regions"]:
        del region["draws"]
    assert all(r.draws for r in checkpointing.ActivationPlan.from_json(old).regions)


def _grads(model: nn.Module, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(seed)
    _loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gradients_bitwise_equal_to_the_plain_run() -> None:
    """Regions with dropout keep their RNG state, those without keep none: the gradients of
    the planned model are those of the plain run, bit for bit, also against torch's
    checkpoint of every region."""
    torch.manual_seed(1)
    model, x = Net((0.1, 0.0, 0.1, 0.0)), torch.randn(ROWS, WIDTH)
    plain = _grads(model, x, 7)
    floor = _floor(model, x)
    assert [r.draws for r in floor.regions] == [True, False, True, False]
    floor.apply(model)
    try:
        planned = _grads(model, x, 7)
    finally:
        floor.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))

    def torch_checkpointed(x: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x

    model.zero_grad()
    torch.manual_seed(7)
    _loss(torch_checkpointed(x)).backward()
    reference = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(reference, planned, strict=True))


def _guards(model: nn.Module) -> list[object]:
    return [
        hook
        for module in model.modules()
        for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        if "DrawGuard" in type(getattr(hook, "__self__", None)).__name__
    ]


def test_guard_raises_where_a_region_planned_without_draws_draws() -> None:
    """Planned in eval mode (dropout off, nothing drawn), trained in train mode: the region
    keeps no RNG state, so its recompute would draw other masks; the recompute raises at the
    first random op it runs, naming the region and the fix; the plan still comes off
    completely."""
    torch.manual_seed(1)
    model, x = Net((0.1, 0.0)), torch.randn(ROWS, WIDTH)
    model.eval()
    plan = _floor(model, x)
    assert not any(r.draws for r in plan.regions)
    assert all(r.checkpoint for r in plan.regions)
    model.train()
    plan.apply(model)
    assert len(_guards(model)) == 4  # a pre-hook and a hook per region
    loss = _loss(model(x))
    with pytest.raises(
        checkpointing.CheckpointError, match=r"'blocks\.0'.*(bernoulli|dropout).*train"
    ):
        loss.backward()
    with torch.no_grad():  # evaluation keeps nothing: nothing to guard
        model(x)
    model.eval()
    _loss(model(x)).backward()  # the mode it was planned in trains
    plan.remove(model)
    assert not _guards(model)
    _loss(model.train()(x)).backward()  # plain again: dropout draws freely


def test_guard_removed_from_a_copy() -> None:
    """A deep copy of the applied model carries the guards; ``remove`` takes them off it, and
    the applied model pickles (``torch.save``) with them."""
    torch.manual_seed(1)
    model, x = Net((0.0, 0.0)), torch.randn(ROWS, WIDTH)
    plan = _floor(model, x)
    plan.apply(model)
    copy = deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    plan.remove(model)
    assert not _guards(model)
    for other in (copy, loaded):
        assert len(_guards(other)) == 4
        _loss(other(x)).backward()
        plan.remove(other)
        assert not _guards(other)


def test_guard_under_debug_mode() -> None:
    """Under ``set_checkpoint_debug_enabled(True)`` the debug report's loggers are the regions'
    contexts: a draw-free planned region still runs (gradients bitwise the plain run's), and one
    planned in eval mode and trained in train mode raises in forward, from its hooks."""
    torch.manual_seed(1)
    model, x = Net((0.1, 0.0)), torch.randn(ROWS, WIDTH)
    model.eval()
    plain = _grads(model, x, 7)
    plan = _floor(model, x)
    assert not any(r.draws for r in plan.regions)
    plan.apply(model)
    try:
        with checkpointing.set_checkpoint_debug_enabled(True):
            planned = _grads(model, x, 7)
            model.train()
            with pytest.raises(checkpointing.CheckpointError, match=r"'blocks\.0'.*debug mode"):
                model(x)
    finally:
        plan.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
