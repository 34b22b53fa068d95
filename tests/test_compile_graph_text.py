"""Dynamo's traced graph of our checkpoints is torch's, text for text (issue 39, NOTE [Compiled
regions], Rule 2): our entry points hand torch's checkpoint the options the caller gave and no
others, so ``checkpoint``, the wrapper and a policy each trace to the graph torch's own call
traces to. Source-line comments are left out of the comparison (they name the file that
made the call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from compile_support import COMPILE_MARKS, fresh_dynamo  # noqa: F401  (a fixture)
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

import checkpointing
from checkpointing.policies import as_context_fn, save_matmuls

pytestmark = COMPILE_MARKS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) + x


def _graph_text(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[str]:
    """The readable text of every graph dynamo captures for ``run(x)``, file comments left out."""
    texts: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        text = gm.print_readable(print_output=False)
        lines = [line for line in text.splitlines() if not line.strip().startswith("# File:")]
        texts.append("\n".join(lines))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(run, backend=backend)(x).sum().backward()
    return texts


def _torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


_TORCH_SAC = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _torch_policy)
_OUR_SAC = as_context_fn(save_matmuls())  # made before tracing, as torch's is

# name -> (ours, torch's), each run(block, x).
Run = Callable[[nn.Module, torch.Tensor], torch.Tensor]
CASES: dict[str, tuple[Run, Run]] = {
    "checkpoint": (
        lambda b, x: checkpointing.checkpoint(b, x, use_reentrant=False),
        lambda b, x: torch_checkpoint.checkpoint(b, x, use_reentrant=False),
    ),
    "checkpoint with options": (
        lambda b, x: checkpointing.checkpoint(
            b, x, use_reentrant=False, preserve_rng_state=False, determinism_check="none"
        ),
        lambda b, x: torch_checkpoint.checkpoint(
            b, x, use_reentrant=False, preserve_rng_state=False, determinism_check="none"
        ),
    ),
    "policy": (
        lambda b, x: checkpointing.checkpoint(b, x, use_reentrant=False, context_fn=_OUR_SAC),
        lambda b, x: torch_checkpoint.checkpoint(b, x, use_reentrant=False, context_fn=_TORCH_SAC),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_traces_to_torchs_graph_text(case: str) -> None:
    """``checkpoint``, with options and with a policy: dynamo's graph text is torch's."""
    ours, theirs = CASES[case]
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)
    got = _graph_text(lambda t: ours(block, t), x)
    want = _graph_text(lambda t: theirs(block, t), x)
    assert len(got) == 1
    assert got == want


@pytest.mark.parametrize(
    "spelling",
    [
        lambda lib, m: lib.checkpoint_wrapper(m),
        lambda lib, m: lib.CheckpointWrapper(m),
        lambda lib, m: lib.checkpoint_wrapper(m, checkpoint_impl=lib.CheckpointImpl.NO_REENTRANT),
    ],
    ids=["checkpoint_wrapper(m)", "CheckpointWrapper(m)", "checkpoint_impl=NO_REENTRANT"],
)
def test_wrapper_traces_to_torchs_wrapper_graph_text(spelling: Callable[..., nn.Module]) -> None:
    """Our ``checkpoint_wrapper`` traces to the graph text torch.distributed's wrapper gives."""
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)
    got = _graph_text(spelling(checkpointing, block), x)
    want = _graph_text(spelling(torch_wrappers, block), x)
    assert len(got) == 1
    assert got == want
