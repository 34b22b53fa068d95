"""Attacks on ``keep`` / ``keeping`` (issue 40, items 3, 6 and 8): a span writing its argument in
place (NOTE [Kept spans], Rule 9), a span's 3-D argument under a selective policy or a plan
(Rule 6), one ``keeping()`` instance shared by threads and nested (Rule 10). Gradients are
compared with the plain run, bitwise.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_cp
from thread_support import run_threads
from torch import nn

import checkpointing
from checkpointing import CheckpointError, keep, keeping, policies
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

    def __init__(self, width: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, dropout=p, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.out_proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(p), nn.Linear(2 * width, width)
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


def test_rule6_spans_under_a_policy_in_threads_at_once() -> None:
    """Four threads replaying spans with 3-D arguments under one policy at once (no dropout:
    threads share the CPU generator): each thread's gradients are its plain run's."""
    torch.manual_seed(0)
    block = ReadmeBlock(p=0.0)
    context_fn = as_context_fn(policies.save_matmuls())

    def work(index: int) -> None:
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(index))
        x.requires_grad_(True)
        inputs = [x, *block.parameters()]
        # A fresh thread takes the process's intra-op thread count at its first parallel op, so
        # its first step may run other kernels than the next ones (after torch.set_num_threads(1)
        # every gradient of the plain run differs from a second plain run in the last bits):
        # one plain step first, then the reference.
        torch.autograd.grad(block(x).sum(), inputs)
        plain = list(torch.autograd.grad(block(x).sum(), inputs))
        for _ in range(3):
            out = checkpointing.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
            _assert_equal(list(torch.autograd.grad(out.sum(), inputs)), plain)
        _clean_stack()

    run_threads(work, 4)


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


# --- Rule 10: one keeping() instance shared by threads, nested, re-entered ----------------------


def _shared_block_region(
    shared: keeping, w: torch.Tensor, meet: threading.Barrier | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def region(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        with shared:
            if meet is not None and not checkpointing.is_recomputing():
                meet.wait(timeout=30)  # every thread is inside the same instance's block
            with shared:  # the same instance, nested
                h = (h @ w).tanh()
        return (h @ w).cos()

    return region


def test_rule10_one_keeping_instance_used_by_threads_at_once() -> None:
    """Four threads inside one shared instance's block at once, each nested in itself: no
    ContextVar error, gradients bitwise the plain run's."""
    shared = keeping("shared")
    w = torch.randn(8, 8, requires_grad=True)
    meet = threading.Barrier(4)
    region = _shared_block_region(shared, w, meet)

    def work(index: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(index), requires_grad=True)
        plain = list(torch.autograd.grad(_shared_block_region(keeping(), w, None)(x).sum(), [x, w]))
        for _ in range(3):
            out = checkpointing.checkpoint(region, x, use_reentrant=False)
            _assert_equal(list(torch.autograd.grad(out.sum(), [x, w])), plain)
        _clean_stack()

    run_threads(work, 4)


def test_rule10_nested_instances_and_an_exception_in_the_block() -> None:
    """Two instances nested either way, and an exception leaving a block: the block ends, the
    hook stack is as found, and the instance works again."""
    w = torch.randn(8, 8, requires_grad=True)
    outer, inner = keeping("outer"), keeping("inner")

    def region(x: torch.Tensor, fail: bool) -> torch.Tensor:
        with outer, inner:
            h = (x @ w).sin()
            if fail:
                raise ValueError("boom")
            with inner, outer:
                h = h @ w
        return h.cos()

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        checkpointing.checkpoint(region, x, True, use_reentrant=False)
    _clean_stack()
    plain = _grads(lambda: region(x, False), [x, w])
    ours = _grads(lambda: checkpointing.checkpoint(region, x, False, use_reentrant=False), [x, w])
    _assert_equal(ours, plain)
    _clean_stack()


def test_rule10_a_block_ended_in_another_thread_is_a_clear_error() -> None:
    """``__exit__`` in a thread that did not enter the instance says so (not a ContextVar
    error); the thread that entered it still ends it."""
    shared = keeping("moved")
    shared.__enter__()
    errors: list[BaseException] = []

    def end_elsewhere() -> None:
        try:
            shared.__exit__(None, None, None)
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=end_elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "must end in the thread or task that began it" in str(errors[0])
    shared.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="'moved' was called"):
        shared.__exit__(None, None, None)


# --- Rule 9: a span that writes its argument in place is refused at forward time --------------


def test_rule9_issue_example_inplace_relu_span_is_refused_at_forward() -> None:
    """The issue's span (ReLU(inplace=True) then Linear) gave wrong gradients; now forward says
    what, why and the fix, and leaves no hook behind."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    span = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8))

    def region(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        return keep(span, h) * h

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(CheckpointError) as caught:
        checkpointing.checkpoint(region, x, use_reentrant=False)
    message = str(caught.value)
    assert "span Sequential in checkpoint(" in message
    assert "wrote its tensor argument #0 (shape (4, 8), dtype torch.float32) in place" in message
    assert "wrong gradients" in message
    assert "nn.ReLU(inplace=True)" in message
    assert "clone the argument inside the span" in message
    _clean_stack()


def _write_out(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # out= does not differentiate
        torch.mul(t, 2, out=t)
    return t


_WRITES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "in-place op": lambda t, w: t.mul_(2) @ w,
    "through a view made in the span": lambda t, w: (t[0].zero_(), t @ w)[1],
    "through a detached alias": lambda t, w: (t.detach().add_(1), t @ w)[1],
    "metadata only": lambda t, w: t.t_() @ w,
    "out= argument": lambda t, w: _write_out(t) @ w,
}


@pytest.mark.parametrize("how", list(_WRITES))
def test_rule9_every_way_of_writing_an_argument_is_refused(how: str) -> None:
    """A write through the argument, a view of it, a detached alias, or its metadata moves its
    version counter: each is refused, and the hook stack is left as found."""
    w = torch.randn(8, 8, requires_grad=True)
    write = _WRITES[how]

    def region(x: torch.Tensor) -> torch.Tensor:
        return keep(write, x.sin(), w).cos()

    x = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"wrote its tensor argument #0 .* in place"):
        checkpointing.checkpoint(region, x, use_reentrant=False)
    _clean_stack()
    out = checkpointing.checkpoint(
        lambda t: keep(torch.matmul, t.sin(), w).cos(), x, use_reentrant=False
    )
    out.sum().backward()  # a following checkpoint is unaffected


def test_rule9_written_argument_in_a_container_or_keyword_is_named_by_position() -> None:
    """Tensor arguments are counted positional first, containers opened, then keywords."""
    w = torch.randn(8, 8, requires_grad=True)

    def span(pair: list[torch.Tensor], *, scale: torch.Tensor) -> torch.Tensor:
        scale.add_(1)
        return pair[0] @ pair[1] * scale

    def region(x: torch.Tensor) -> torch.Tensor:
        return keep(span, [x.sin(), w], scale=x.cos()).sum(-1)

    x = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"tensor argument #2 \(shape \(8, 8\)"):
        checkpointing.checkpoint(region, x, use_reentrant=False)
    _clean_stack()


def test_rule9_the_fixes_the_error_names_give_the_plain_runs_gradients() -> None:
    """Cloning inside the span or an out-of-place ReLU: gradients bitwise the plain run's, with
    dropout, beside torch's checkpoint."""
    torch.manual_seed(0)
    lin, out_lin = nn.Linear(8, 8), nn.Linear(8, 8)
    inplace = nn.Sequential(nn.ReLU(inplace=True), nn.Dropout(0.3), out_lin)
    outofplace = nn.Sequential(nn.ReLU(), nn.Dropout(0.3), out_lin)

    def region(x: torch.Tensor, fix: str) -> torch.Tensor:
        h = F.dropout(lin(x), 0.2, True)
        y = keep(lambda t: inplace(t.clone()), h) if fix == "clone" else keep(outofplace, h)
        return (y * h).tanh()

    x = torch.randn(4, 8, requires_grad=True)
    inputs = [x, lin.weight, out_lin.weight]
    for fix in ("clone", "out of place"):
        plain = _grads(lambda fix=fix: region(x, fix), inputs)
        ours = _grads(
            lambda fix=fix: checkpointing.checkpoint(region, x, fix, use_reentrant=False), inputs
        )
        theirs = _grads(
            lambda fix=fix: torch_cp.checkpoint(region, x, fix, use_reentrant=False), inputs
        )
        _assert_equal(ours, plain)
        _assert_equal(theirs, plain)


def test_rule9_state_the_span_updates_by_closure_is_not_refused() -> None:
    """A span's module writing its own buffers (batch norm's running statistics) is allowed:
    gradients and the statistics are the plain run's (updated once, not again in backward)."""
    torch.manual_seed(0)
    norm, plain_norm = nn.BatchNorm1d(8), nn.BatchNorm1d(8)
    w = torch.randn(8, 8, requires_grad=True)

    def region(x: torch.Tensor, bn: nn.Module) -> torch.Tensor:
        return keep(bn, x @ w).relu()

    x = torch.randn(4, 8, requires_grad=True)
    plain = _grads(lambda: region(x, plain_norm), [x, w])
    ours = _grads(lambda: checkpointing.checkpoint(region, x, norm, use_reentrant=False), [x, w])
    _assert_equal(ours, plain)
    assert torch.equal(norm.running_mean, plain_norm.running_mean)
    assert norm.num_batches_tracked.item() == 1


def test_rule9_a_with_block_writing_in_place_is_replayed_not_refused() -> None:
    """``with keeping():`` runs its body again in the replay (Rule 7), so its writes happen
    again: an in-place ReLU there gives the plain run's gradients."""
    w = torch.randn(8, 8, requires_grad=True)

    def region(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        with keeping():
            y = F.relu(h, inplace=True) @ w
        return y * h

    x = torch.randn(4, 8, requires_grad=True)
    plain = _grads(lambda: region(x), [x, w])
    ours = _grads(lambda: checkpointing.checkpoint(region, x, use_reentrant=False), [x, w])
    _assert_equal(ours, plain)
