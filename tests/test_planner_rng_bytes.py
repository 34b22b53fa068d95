"""The RNG states in a plan's bytes: what the planner charges is what the frame keeps.

The frame captures the CPU RNG state when a checkpointed region starts, whether or not the
region draws (it cannot know in advance), and shares a capture byte-identical to the previous
one (NOTE [RNG state shared when identical]): a chain of regions that draw nothing keeps one
state in all, a chain of regions that each draw keeps one per region. The planner charges those
states by identity (NOTE [Planner model], Rule 14). These tests hold its predicted kept bytes to
the CPU allocator's account of the applied plan (``allocator_support``), exactly, for regions
with and without dropout, and pin how many states each kind of chain is charged.
"""

from __future__ import annotations

import pytest
import torch
from allocator_support import allocator_step
from torch import nn

import checkpointing

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
            h = nn.functional.dropout(h, self.p)
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


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _plan(model: nn.Module, x: torch.Tensor, budget: float) -> checkpointing.ActivationPlan:
    return checkpointing.plan_checkpointing(
        model, (x,), budget=budget, loss_fn=_loss, timing_steps=0
    )


def _held(plan: checkpointing.ActivationPlan, model: nn.Module, x: torch.Tensor) -> int:
    """The allocator's bytes held from forward to backward with ``plan`` applied."""
    plan.apply(model)
    try:
        return allocator_step(lambda: _loss(model(x))).held
    finally:
        plan.remove(model)


# Chains: (dropout per region, CPU states the plan keeps with every region checkpointed).
CHAINS = {
    "one region, no draws": ((0.0,), 1),
    "one region, dropout": ((0.1,), 1),
    "three regions, no draws": ((0.0, 0.0, 0.0), 1),  # one capture, shared by all three
    "three regions, dropout": ((0.1, 0.1, 0.1), 3),  # each region moves the stream on
    # The second region draws nothing, so the third starts from the state the second captured
    # and shares it: three states for four regions.
    "dropout, then none, alternating": ((0.1, 0.0, 0.1, 0.0), 3),
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
