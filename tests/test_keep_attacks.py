"""Attacks on ``keep`` / ``keeping`` (issue 40): a span's 3-D argument under a selective policy
or a plan (NOTE [Kept spans], Rule 6). Gradients are compared with the plain run, bitwise.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import checkpointing
from checkpointing import CheckpointError, keep, policies
from checkpointing._compat import top_saved_tensors_hooks
from checkpointing._state import span_depth
from checkpointing.policies import as_context_fn


def _grads(step: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of one step, its RNG seeded the same way every time."""
    torch.manual_seed(7)
    return list(torch.autograd.grad(step().sum(), inputs))


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _clean_stack() -> None:
    """No hook or span marker of ours is left behind."""
    assert top_saved_tensors_hooks() is None
    assert span_depth() == 0


# --- Rule 6: the replay's work for a span is the span's, invisible to selective policies -------


class ReadmeBlock(nn.Module):
    """README "Keep by code"'s block, ``keep(out_proj, h)``, with a contiguous 3-D ``h`` (the
    attention's own output is a transposed view; a norm's is contiguous, so ``nn.Linear`` saves
    a view of the span's argument)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.out_proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.attention(x, x, x, need_weights=False)
        x = x + keep(self.out_proj, self.norm(h))
        return x + self.mlp(x)


_ADDMM, _NORM = "aten.addmm.default", "aten.native_layer_norm.default"
_POLICIES: dict[str, Callable[[], Any]] = {
    "save_nothing": policies.save_nothing,
    "save_matmuls": policies.save_matmuls,
    "save_ops(mm)": lambda: policies.save_ops(torch.ops.aten.mm.default),
}


@pytest.mark.parametrize("policy", list(_POLICIES))
def test_rule6_readme_keep_with_a_3d_argument_under_a_policy(policy: str) -> None:
    """The README's ``keep(out_proj, h)`` with a 3-D ``h`` under any selective policy: backward
    runs (it raised "as_strided ... not found in storage") and gradients are bitwise the plain
    run's, dropout on."""
    torch.manual_seed(0)
    block = ReadmeBlock()
    x = torch.randn(2, 5, 16, requires_grad=True)
    inputs = [x, *block.parameters()]
    context_fn = as_context_fn(_POLICIES[policy]())
    plain = _grads(lambda: block(x), inputs)
    ours = _grads(
        lambda: checkpointing.checkpoint(block, x, use_reentrant=False, context_fn=context_fn),
        inputs,
    )
    _assert_equal(ours, plain)
    _clean_stack()


def test_rule6_readme_keep_with_a_3d_argument_in_a_planned_model() -> None:
    """A planned model whose blocks keep ``out_proj`` (every block checkpointed under the plan's
    selective policy, saving a matmul and the norm): backward runs and gradients are bitwise the
    unplanned copy's. The decisions are fixed through the plan's JSON: measured plans vary."""
    torch.manual_seed(0)
    model = nn.Sequential(*(ReadmeBlock() for _ in range(3)))
    plain_model = copy.deepcopy(model)
    x = torch.randn(2, 5, 16, requires_grad=True)
    data = json.loads(checkpointing.plan_checkpointing(model, x, budget=0.8).to_json())
    blocks = [region for region in data["regions"] if region["type_name"] == "ReadmeBlock"]
    assert blocks
    for region in blocks:
        region.update(checkpoint=True, save=[[_ADDMM, 0], [_NORM, 0]], offload=[], skip=[])
    plan = checkpointing.ActivationPlan.from_json(json.dumps(data))
    plan.apply(model)
    plain = _grads(lambda: plain_model(x), [x, *plain_model.parameters()])
    ours = _grads(lambda: model(x), [x, *model.parameters()])
    _assert_equal(ours, plain)
    _clean_stack()


def test_rule6_an_error_in_the_replay_of_a_span_leaves_no_span_marker() -> None:
    """An error raised while the replay serves a span (its output changed after it) ends the
    span's marker: a following selective checkpoint still keeps what its policy says."""
    w = torch.randn(8, 8, requires_grad=True)

    def region(x: torch.Tensor) -> torch.Tensor:
        y = keep(torch.matmul, x.sin(), w)
        y.mul_(2)
        return y.cos()

    x = torch.randn(4, 8, requires_grad=True)
    out = checkpointing.checkpoint(
        region, x, use_reentrant=False, context_fn=as_context_fn(policies.save_nothing())
    )
    with pytest.raises(CheckpointError, match="modified in place after the span"):
        out.sum().backward()
    _clean_stack()
    block = ReadmeBlock()
    y = torch.randn(2, 3, 16, requires_grad=True)
    context_fn = as_context_fn(policies.save_matmuls())
    checkpointing.checkpoint(block, y, use_reentrant=False, context_fn=context_fn).sum().backward()


def test_rule6_early_stop_inside_a_span_replay_leaves_no_span_marker() -> None:
    """Early stop ending the replay while it fills a span's argument holders ends the span's
    marker too (the recompute's next ops are counted by the policy again)."""
    w = torch.randn(16, 16, requires_grad=True)

    def region(x: torch.Tensor) -> torch.Tensor:
        return keep(F.linear, x.sin(), w)  # its 3-D argument is the region's last saved tensor

    x = torch.randn(2, 3, 16, requires_grad=True)
    context_fn = as_context_fn(policies.save_nothing())
    plain = _grads(lambda: region(x), [x, w])
    ours = _grads(
        lambda: checkpointing.checkpoint(region, x, use_reentrant=False, context_fn=context_fn),
        [x, w],
    )
    _assert_equal(ours, plain)
    _clean_stack()
