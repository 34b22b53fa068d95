"""Tensor parallelism (``parallelize_module``, gloo, 2 CPU processes) with our checkpointing,
side by side with torch's.

One pair of spawned workers runs every (layout, case). Layouts: ``tp``, an MLP block with its up
projection ``ColwiseParallel`` and its down projection ``RowwiseParallel`` (replicated input and
output); ``sp``, the torchtitan sequence-parallel block, a ``SequenceParallel`` LayerNorm, then
``ColwiseParallel(input_layouts=Shard(1))`` and ``RowwiseParallel(output_layouts=Shard(1))``
(an all-gather before the block's matmuls, a reduce-scatter after), fed this rank's half of the
sequence. Cases: the block parallelized first, then checkpointed (the torchtitan order) by
``checkpointing.checkpoint`` in the parent's forward, ``checkpoint_wrapper``,
``checkpoint_module``, and ``checkpoint_module`` with a selective policy (``save_matmuls``); and
torch's equivalents. Two blocks, two steps (gradients accumulate), float64, no dropout (DTensor
draws random numbers through its own RNG tracker, which is not what this file tests).

Gradients (``full_tensor()``) are compared bitwise: ours with the plain TP run and with torch's
equivalent (same ops, same collectives, same reduction order).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from dist_support import SPAWNED_ONCE, WORLD_SIZE, case_result, run_cases, spawned_results
from parallel_support import (
    ByFunction,
    assert_grads_close,
    assert_grads_equal,
    ours_sac_context,
    torch_sac_context,
)
from torch import nn
from torch.distributed._composable import checkpoint as torch_composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as torch_checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import checkpointing

pytestmark = SPAWNED_ONCE

WIDTH = 8
HIDDEN = 16
SEQ = 6  # split in halves along dim 1 by the sp layout
BATCH = 2
DEPTH = 2
STEPS = 2
LAYOUTS = ("tp", "sp")
# case -> the torch case it must equal bitwise (all must equal "plain")
CASES: dict[str, str | None] = {
    "plain": None,
    "torch_function": None,
    "ours_function": "torch_function",
    "torch_wrapper": None,
    "ours_wrapper": "torch_wrapper",
    "torch_module": None,
    "ours_module": "torch_module",
    "torch_sac": None,
    "ours_sac": "torch_sac",
}


class Block(nn.Module):
    """``x + down(tanh(up(norm(x))))`` (``norm`` only in the sp layout)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH) if layout == "sp" else nn.Identity()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))  # type: ignore[no-any-return]


def _plan(layout: str) -> dict[str, Any]:
    if layout == "tp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }


CHECKPOINT_BLOCK: dict[str, Any] = {
    "torch_function": functools.partial(ByFunction, checkpoint=torch_checkpoint.checkpoint),
    "ours_function": functools.partial(ByFunction, checkpoint=checkpointing.checkpoint),
    "torch_wrapper": torch_checkpoint_wrapper,
    "ours_wrapper": checkpointing.checkpoint_wrapper,
    "torch_module": torch_composable_checkpoint,
    "ours_module": checkpointing.checkpoint_module,
    "torch_sac": functools.partial(torch_composable_checkpoint, context_fn=torch_sac_context),
    "ours_sac": functools.partial(checkpointing.checkpoint_module, context_fn=ours_sac_context),
}


def _model(layout: str, case: str) -> tuple[nn.Sequential, list[nn.Module]]:
    """The checkpointed model and its (parallelized) blocks, the same weights everywhere."""
    torch.manual_seed(0)
    blocks = [Block(layout).double() for _ in range(DEPTH)]
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in blocks:
        parallelize_module(block, mesh, _plan(layout))
    apply = CHECKPOINT_BLOCK.get(case)
    layers = [apply(block) if apply is not None else block for block in blocks]
    return nn.Sequential(*layers), blocks


def _input(layout: str, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + step)
    x = torch.randn(BATCH, SEQ, WIDTH, generator=gen, dtype=torch.float64)
    return x.chunk(WORLD_SIZE, dim=1)[rank] if layout == "sp" else x


def _run(rank: int, layout: str, case: str) -> dict[str, torch.Tensor]:
    net, blocks = _model(layout, case)
    for step in range(STEPS):
        net(_input(layout, rank, step)).pow(2).mean().backward()
    return {
        f"{i}.{name}": p.grad.full_tensor()  # type: ignore[union-attr]
        for i, block in enumerate(blocks)
        for name, p in block.named_parameters()
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    runs = {
        f"{layout}/{case}": functools.partial(_run, rank, layout, case)
        for layout in LAYOUTS
        for case in CASES
    }
    run_cases(rank, port, out_dir, runs)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawned_results(tmp_path_factory, "tp", _worker)


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_equal_the_plain_tp_run_bitwise(
    layout: str, case: str, results: list[dict[str, Any]]
) -> None:
    """Every checkpointed TP model's full gradients equal the plain TP run's, on both ranks."""
    for rank in range(WORLD_SIZE):
        got = case_result(results, f"{layout}/{case}", rank)
        assert_grads_equal(got, case_result(results, f"{layout}/plain", rank), f"{layout}/{case}")


@pytest.mark.parametrize("case", [c for c, twin in CASES.items() if twin])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_equal_torchs_bitwise(
    layout: str, case: str, results: list[dict[str, Any]]
) -> None:
    """Ours gives bit for bit the gradients of torch's equivalent."""
    twin = CASES[case]
    assert twin is not None
    for rank in range(WORLD_SIZE):
        got = case_result(results, f"{layout}/{case}", rank)
        assert_grads_equal(got, case_result(results, f"{layout}/{twin}", rank), f"{case} vs {twin}")


def test_plain_tp_run_matches_one_process(results: list[dict[str, Any]]) -> None:
    """The harness is sound: the plain TP run's gradients equal one process without TP, up
    to the reduction order (the sp layout's loss is a mean per rank's half: half the sum)."""
    for layout in LAYOUTS:
        torch.manual_seed(0)
        blocks = [Block(layout).double() for _ in range(DEPTH)]
        net = nn.Sequential(*blocks)
        for step in range(STEPS):
            for rank in range(WORLD_SIZE if layout == "sp" else 1):
                x = _input(layout, rank, step)
                net(x).pow(2).mean().backward()
        want = {
            f"{i}.{name}": p.grad
            for i, block in enumerate(blocks)
            for name, p in block.named_parameters()
        }
        got = case_result(results, f"{layout}/plain", 0)
        assert_grads_close(got, want)
