"""Collectives inside planned regions are kept, never re-run (NOTE [Planner measure], Rule M15).

A tensor-parallel stack of blocks (the first Linear column-wise, the second row-wise: one
all-reduce per block in forward) is planned at its floor, where every block is checkpointed and
recomputed, on two gloo processes. What must hold on each rank:

- backward launches exactly the collectives the plain run's backward launches (a recompute that
  re-ran the blocks' all-reduces would launch one more per block);
- the gradients equal the plain run's, bit for bit;
- the plan's predicted kept bytes are the CPU allocator's account of the step (the all-reduces'
  outputs, kept by the policy the plan gives each block, counted);
- both ranks get one plan, and each checkpointed block's plan names its collectives as kept.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from allocator_support import allocator_step
from dist_support import (
    SPAWNED_ONCE,
    WORLD_SIZE,
    CollectiveLaunches,
    case_result,
    run_cases,
    spawned_results,
)
from parallel_support import BlockStack
from torch import nn

import checkpointing

WIDTH = 16
HIDDEN = 64
DEPTH = 3
BATCH = 8
RUN_TIMEOUT = 240.0  # seconds for the whole pair

pytestmark = SPAWNED_ONCE


class Block(nn.Module):
    """``tanh(x + down(tanh(up(x))))``: the outer tanh saves what the all-reduce feeds, so a
    recompute must reach it (early stop would end a block's recompute before it otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.down(torch.tanh(self.up(x))))


def _model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = BlockStack(Block, DEPTH, WIDTH)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _input() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(7)).double()


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """One step: the collectives its backward launches, and the full gradients."""
    model.zero_grad(set_to_none=True)
    loss = _loss(model(x))
    counter = CollectiveLaunches()
    with counter:
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        full = getattr(p.grad, "full_tensor", None)
        grads[name] = (full() if full is not None else p.grad).detach().clone()
    return {"launched": counter.launched, "grads": grads}


def _case() -> dict[str, Any]:
    x = _input()
    plain = _step(_model(), x)
    model = _model()
    floor = checkpointing.plan_checkpointing(model, (x,), budget=1.0, loss_fn=_loss).floor_bytes
    plan = checkpointing.plan_checkpointing(model, (x,), budget=floor, loss_fn=_loss)
    plan.apply(model)
    planned = _step(model, x)
    held = allocator_step(lambda: _loss(model(x))).held
    return {
        "json": json.loads(plan.to_json()),
        "kept": plan.kept_bytes,
        "held": held,
        "plain": plain,
        "planned": planned,
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    run_cases(rank, port, out_dir, {"tp": _case})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results, from one pair of spawned processes, in bounded time."""
    return spawned_results(tmp_path_factory, "planner_collectives", _worker, limit=RUN_TIMEOUT)


def test_rule26_ranks_get_one_plan_that_keeps_the_collectives(
    results: list[dict[str, Any]],
) -> None:
    """One plan on both ranks; every block checkpointed, its all-reduce among what it keeps."""
    plans = [case_result(results, "tp", rank)["json"] for rank in range(WORLD_SIZE)]
    assert plans[0] == plans[1]
    blocks = [r for r in plans[0]["regions"] if r["name"].startswith("blocks.")]
    assert len(blocks) == DEPTH
    for region in blocks:
        assert region["checkpoint"], region
        assert any("_c10d_functional" in op for op, _ in region["save"]), region


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_rule26_backward_launches_the_plain_runs_collectives(
    results: list[dict[str, Any]], rank: int
) -> None:
    """The planned backward launches what the plain one does: no block's all-reduce again."""
    got = case_result(results, "tp", rank)
    assert got["plain"]["launched"], "the plain backward must launch collectives"
    assert got["planned"]["launched"] == got["plain"]["launched"]


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_rule26_gradients_bitwise_equal_to_the_plain_run(
    results: list[dict[str, Any]], rank: int
) -> None:
    got = case_result(results, "tp", rank)
    plain, planned = got["plain"]["grads"], got["planned"]["grads"]
    assert list(plain) == list(planned)
    for name, value in plain.items():
        assert torch.equal(planned[name], value), name


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_rule26_predicted_kept_bytes_are_the_allocators(
    results: list[dict[str, Any]], rank: int
) -> None:
    """The kept collectives' outputs are counted: the prediction is the allocator's account."""
    got = case_result(results, "tp", rank)
    assert got["held"] == got["kept"], got
