"""FSDP2 x TP on a 2x2 mesh (gloo, 4 CPU processes) with our checkpointing, side by side with
torch's: the torchtitan order, tensor parallelism first, then checkpointing, then ``fully_shard``.

Mesh ``("dp", "tp") = (2, 2)``: each block's up projection is ``ColwiseParallel`` and its down
projection ``RowwiseParallel`` over ``tp``; the block is checkpointed (``checkpoint_module``,
alone or with a selective policy, ``save_matmuls``; torch's composable ``checkpoint`` alike) and
sharded with ``fully_shard`` over ``dp``, as is the root. The two ``dp`` groups feed their halves
of the global batch; two steps, float64, no dropout (DTensor's own RNG tracker is not what this
tests). Each worker writes the full gradients (``full_tensor()``).

Compared bitwise: every checkpointed case with the plain 2x2 run and with torch's equivalent.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from dist_support import SPAWNED_ONCE, case_result, run_cases, spawned_results
from parallel_support import (
    assert_grads_close,
    assert_grads_equal,
    ours_sac_context,
    torch_sac_context,
)
from torch import nn
from torch.distributed._composable import checkpoint as torch_composable_checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import checkpointing

pytestmark = SPAWNED_ONCE

DP, TP = 2, 2
WORLD = DP * TP
WIDTH = 8
HIDDEN = 16
DEPTH = 2
BATCH = 4  # rows per dp group
STEPS = 2
CASES: dict[str, str | None] = {
    "plain": None,
    "torch_module": None,
    "ours_module": "torch_module",
    "torch_sac": None,
    "ours_sac": "torch_sac",
}


class Block(nn.Module):
    """``x + down(tanh(up(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))  # type: ignore[no-any-return]


CHECKPOINT_BLOCK: dict[str, Any] = {
    "torch_module": torch_composable_checkpoint,
    "ours_module": checkpointing.checkpoint_module,
    "torch_sac": functools.partial(torch_composable_checkpoint, context_fn=torch_sac_context),
    "ours_sac": functools.partial(checkpointing.checkpoint_module, context_fn=ours_sac_context),
}


def _global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + step)
    return torch.randn(DP * BATCH, WIDTH, generator=gen, dtype=torch.float64)


def _run(case: str) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block().double() for _ in range(DEPTH))
    apply = CHECKPOINT_BLOCK.get(case)
    for i, block in enumerate(list(blocks)):
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if apply is not None:
            blocks[i] = apply(block)
        fully_shard(blocks[i], mesh=mesh["dp"])
    net = nn.Sequential(*blocks)
    fully_shard(net, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(STEPS):
        net(_global_batch(step)[dp_rank::DP]).pow(2).mean().backward()
    return {
        name: p.grad.full_tensor()  # type: ignore[union-attr]
        for name, p in net.named_parameters()
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    cases = {case: functools.partial(_run, case) for case in CASES}
    run_cases(rank, port, out_dir, cases, WORLD)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawned_results(tmp_path_factory, "fsdp_tp", _worker, WORLD)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Bitwise equal, torch's module checkpoint naming its wrapped module in the names."""
    assert_grads_equal(got, want, what, strip="_checkpoint_wrapped_module.")


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
def test_gradients_equal_the_plain_2x2_run_bitwise(
    case: str, results: list[dict[str, Any]]
) -> None:
    """Full gradients equal the plain FSDP2 x TP run's, bit for bit, on all four ranks."""
    for rank in range(WORLD):
        _assert_equal(case_result(results, case, rank), case_result(results, "plain", rank), case)


@pytest.mark.parametrize("case", [c for c, twin in CASES.items() if twin])
def test_gradients_equal_torchs_bitwise(case: str, results: list[dict[str, Any]]) -> None:
    """Ours gives bit for bit the gradients of torch's equivalent."""
    twin = CASES[case]
    assert twin is not None
    for rank in range(WORLD):
        _assert_equal(
            case_result(results, case, rank), case_result(results, twin, rank), f"{case} vs {twin}"
        )


def test_plain_2x2_run_matches_one_process(results: list[dict[str, Any]]) -> None:
    """The harness is sound: the plain run equals one process averaging the two dp halves'
    gradients, up to the reduction order."""
    torch.manual_seed(0)
    net = nn.Sequential(*(Block().double() for _ in range(DEPTH)))
    for step in range(STEPS):
        for dp_rank in range(DP):
            net(_global_batch(step)[dp_rank::DP]).pow(2).mean().backward()
    want = {name: p.grad / DP for name, p in net.named_parameters()}  # type: ignore[operator]
    assert_grads_close(case_result(results, "plain", 0), want)
