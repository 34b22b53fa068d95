"""What the parallelism tests (``tests/test_parallel_*``, ``test_fsdp2.py``,
``test_planner_sharded.py``) share: the selective policies of both sides, a module that
checkpoints its inner module with a checkpoint function, a seeded stack of blocks, and the
comparisons of two runs' gradients. Processes, groups and results: ``dist_support``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import checkpointing
from checkpointing.policies import MATMUL_OPS, save_matmuls


def ours_sac_context() -> Any:
    """Our selective checkpointing that saves the matmuls."""
    return checkpointing.create_selective_checkpoint_contexts(save_matmuls())


def torch_sac_context() -> Any:
    """torch's selective checkpointing that saves the same matmuls."""
    return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
        sorted(MATMUL_OPS, key=str)
    )


class ByFunction(nn.Module):
    """Checkpoints ``inner`` with ``checkpoint`` (ours or torch's function) in its forward."""

    def __init__(self, inner: nn.Module, checkpoint: Any) -> None:
        super().__init__()
        self.inner = inner
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpoint(self.inner, x, use_reentrant=False)  # type: ignore[no-any-return]


def assert_grads_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, strip: str = ""
) -> None:
    """``got`` has ``want``'s names in order (once ``strip`` is taken out of each of its
    names) and bitwise its values."""
    assert [name.replace(strip, "") if strip else name for name in got] == list(want)
    for (name, value), mine in zip(want.items(), got.values(), strict=True):
        assert torch.equal(mine, value), f"{what}: {name}"


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """``got`` has ``want``'s names in order and its values up to the reduction order."""
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, msg=name)


class BlockStack(nn.Module):
    """``depth`` blocks from ``block()`` and a linear head from ``width`` to one output, in
    float64, the weights drawn right after ``torch.manual_seed(0)``: the same on every rank and
    for every case."""

    def __init__(self, block: Callable[[], nn.Module], depth: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]
