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
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from parallel_support import gloo_world, spawn_world
from torch import nn
from torch.distributed._composable import checkpoint as torch_composable_checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import checkpointing
from checkpointing.policies import MATMUL_OPS, save_matmuls

pytestmark = [
    pytest.mark.once,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

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


def _ours_sac_context() -> Any:
    return checkpointing.create_selective_checkpoint_contexts(save_matmuls())


def _torch_sac_context() -> Any:
    return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
        sorted(MATMUL_OPS, key=str)
    )


CHECKPOINT_BLOCK: dict[str, Any] = {
    "torch_module": torch_composable_checkpoint,
    "ours_module": checkpointing.checkpoint_module,
    "torch_sac": functools.partial(torch_composable_checkpoint, context_fn=_torch_sac_context),
    "ours_sac": functools.partial(checkpointing.checkpoint_module, context_fn=_ours_sac_context),
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
    with gloo_world(rank, port, WORLD):
        results: dict[str, Any] = {}
        for case in CASES:
            try:
                results[case] = _run(case)
            except Exception:
                results[case] = {"error": traceback.format_exc()}
            dist.barrier()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("fsdp_tp")
    spawn_world(WORLD, _worker, str(out_dir))
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)]


def _grads(results: list[dict[str, Any]], case: str, rank: int) -> dict[str, torch.Tensor]:
    got = results[rank][case]
    assert "error" not in got, f"{case} failed on rank {rank}:\n{got['error']}"
    return got  # type: ignore[no-any-return]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert [n.replace("_checkpoint_wrapped_module.", "") for n in got] == list(want)
    for (name, value), mine in zip(want.items(), got.values(), strict=True):
        assert torch.equal(mine, value), f"{what}: {name}"


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
def test_gradients_equal_the_plain_2x2_run_bitwise(
    case: str, results: list[dict[str, Any]]
) -> None:
    """Full gradients equal the plain FSDP2 x TP run's, bit for bit, on all four ranks."""
    for rank in range(WORLD):
        _assert_equal(_grads(results, case, rank), _grads(results, "plain", rank), case)


@pytest.mark.parametrize("case", [c for c, twin in CASES.items() if twin])
def test_gradients_equal_torchs_bitwise(case: str, results: list[dict[str, Any]]) -> None:
    """Ours gives bit for bit the gradients of torch's equivalent."""
    twin = CASES[case]
    assert twin is not None
    for rank in range(WORLD):
        _assert_equal(_grads(results, case, rank), _grads(results, twin, rank), f"{case} vs {twin}")


def test_plain_2x2_run_matches_one_process(results: list[dict[str, Any]]) -> None:
    """The harness is sound: the plain run equals one process averaging the two dp halves'
    gradients, up to the reduction order."""
    torch.manual_seed(0)
    net = nn.Sequential(*(Block().double() for _ in range(DEPTH)))
    for step in range(STEPS):
        for dp_rank in range(DP):
            net(_global_batch(step)[dp_rank::DP]).pow(2).mean().backward()
    want = {name: p.grad / DP for name, p in net.named_parameters()}  # type: ignore[operator]
    got = _grads(results, "plain", 0)
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, msg=name)
