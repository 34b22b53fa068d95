"""Split backward over one graph (zero-bubble pipelines) with selective checkpointing.

``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` backward each stage twice: an
input-gradient pass (``torch.autograd.grad(..., inputs=stage inputs, retain_graph=True)``) and
later a weight-gradient pass (``torch.autograd.grad`` w.r.t. the weights). Each pass unpacks every
saved tensor of the nodes it runs, so each recomputes the region; a selective region's kept
outputs must serve both. Here without any process group: the same two calls by hand, and torch's
own ``stage_backward_input`` / ``stage_backward_weight``. The distributed schedules run in
tests/test_parallel_pipeline.py. NOTE [Selective checkpoint cache], Rule 6 (``split_backward``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from frame_support import raised
from offload_support import FakeBackend
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.multiprocessing.reductions import StorageWeakRef

import checkpointing
from checkpointing import _offload
from checkpointing._selective.recompute import split_backward
from checkpointing.policies import MATMUL_OPS, offload_ops, save_matmuls

Grads = tuple[torch.Tensor, ...]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)
    ).double()


def _expired(ref: StorageWeakRef) -> bool:
    return bool(ref.expired())  # type: ignore[no-untyped-call]


def _input() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, dtype=torch.float64, generator=gen, requires_grad=True)


def _ours_sac() -> Any:
    return checkpointing.create_selective_checkpoint_contexts(save_matmuls())


def _torch_sac() -> Any:
    return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
        sorted(MATMUL_OPS, key=str)
    )


def _forward(net: nn.Module, x: torch.Tensor, how: str) -> torch.Tensor:
    """The loss, from the same dropout masks whatever ``how`` checkpoints."""
    torch.manual_seed(5)
    if how == "plain":
        y = net(x)
    elif how == "ours":
        y = checkpointing.checkpoint(net, x, use_reentrant=False, context_fn=_ours_sac)
    elif how == "ours_module":
        y = checkpointing.checkpoint_module(net, context_fn=_ours_sac)(x)
    elif how == "torch":
        y = torch_checkpoint.checkpoint(net, x, use_reentrant=False, context_fn=_torch_sac)
    else:
        raise AssertionError(how)
    return y.pow(2).sum()  # type: ignore[no-any-return]


def _by_hand(net: nn.Module, x: torch.Tensor, loss: torch.Tensor) -> tuple[Grads, Grads]:
    """Input gradients with the graph retained, then weight gradients: two graph tasks."""
    grads_x = torch.autograd.grad(loss, x, retain_graph=True)
    grads_w = torch.autograd.grad(loss, list(net.parameters()))
    return grads_x, grads_w


def _stages(net: nn.Module, x: torch.Tensor, loss: torch.Tensor) -> tuple[Grads, Grads]:
    """What a zero-bubble schedule calls for the last stage (torch's own functions)."""
    (grad_x,), groups = stage_backward_input([loss], None, [x], iter(list(net.parameters())))
    assert grad_x is not None
    stage_backward_weight(iter(list(net.parameters())), groups)
    grads_w = tuple(p.grad for p in net.parameters())
    assert all(g is not None for g in grads_w)
    return (grad_x,), grads_w  # type: ignore[return-value]


SPLITS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[Grads, Grads]]] = {
    "by_hand": _by_hand,
    "stages": _stages,
}


def _grads(how: str, split: str, under_split_backward: bool) -> tuple[Grads, Grads]:
    net, x = _net(), _input()
    if under_split_backward:
        with split_backward():
            loss = _forward(net, x, how)
    else:
        loss = _forward(net, x, how)
    return SPLITS[split](net, x, loss)


def _assert_bitwise(got: tuple[Grads, Grads], want: tuple[Grads, Grads]) -> None:
    for got_part, want_part in zip(got, want, strict=True):
        assert len(got_part) == len(want_part)
        for g, w in zip(got_part, want_part, strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("how", ["ours", "ours_module"])
def test_split_passes_equal_the_plain_run_bitwise(how: str, split: str) -> None:
    """Under ``split_backward()``, both passes replay from the forward's kept outputs: input and
    weight gradients equal the run without checkpointing bit for bit (dropout included)."""
    _assert_bitwise(_grads(how, split, True), _grads("plain", split, False))


@pytest.mark.parametrize("split", list(SPLITS))
def test_without_split_backward_the_error_names_it_and_torch_fails_too(split: str) -> None:
    """Outside the block, the second pass raises "backward an extra time" (as torch's SAC does,
    with or without the block), and our message names the fix for this situation."""
    ours = raised(lambda: _grads("ours", split, False))
    theirs = raised(lambda: _grads("torch", split, True))
    for error in (ours, theirs):
        assert "backward an extra time" in f"{error} {error.__cause__}"
    assert "split_backward()" in f"{ours} {ours.__cause__}"
    assert "zero-bubble" in f"{ours} {ours.__cause__}"


def test_kept_outputs_go_with_the_graph() -> None:
    """Under ``split_backward()`` the kept outputs outlive the first pass, never the graph:
    once the loss (and with it the graph) is dropped, the cache's tensors are freed."""
    net, x = _net(), _input()
    kept: list[StorageWeakRef] = []

    def remember_saves(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in MATMUL_OPS:
            kept.append(StorageWeakRef(ctx.op_output.untyped_storage()))  # type: ignore[no-untyped-call]
        return save_matmuls()(ctx, op, *args, **kwargs)

    context_fn = functools.partial(
        checkpointing.create_selective_checkpoint_contexts, remember_saves
    )
    with split_backward():
        y = checkpointing.checkpoint(net, x, use_reentrant=False, context_fn=context_fn)
    loss = y.pow(2).sum()
    del y
    torch.autograd.grad(loss, x, retain_graph=True)
    assert len(kept) == 3
    assert all(not _expired(ref) for ref in kept)  # the weight pass still needs them
    torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
    assert all(not _expired(ref) for ref in kept)  # the graph is still retained
    del loss
    assert all(_expired(ref) for ref in kept)


def test_the_block_is_read_at_forward_time() -> None:
    """What decides is where the forward ran: a backward inside the block does not change a
    region whose forward ran outside it."""
    net, x = _net(), _input()
    loss = _forward(net, x, "ours")
    with split_backward():
        torch.autograd.grad(loss, x, retain_graph=True)
        with pytest.raises(RuntimeError, match="backward an extra time"):
            torch.autograd.grad(loss, list(net.parameters()))


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(4)]
    ).double()


def _stack_grads(model: nn.Module, under_split_backward: bool) -> tuple[Grads, Grads]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    if under_split_backward:
        with split_backward():
            loss = model(x).pow(2).sum()
    else:
        loss = model(x).pow(2).sum()
    return _by_hand(model, x, loss)


def test_a_plan_serves_both_passes() -> None:
    """A planner's plan applied to a model (on this tiny stack the planner chooses trails,
    recorded and recomputed, for three blocks): under ``split_backward()`` both passes equal
    the plain model's gradients bitwise."""
    model = _stack()
    want = _stack_grads(model, False)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    plan = checkpointing.plan_checkpointing(model, x, budget=0.85)
    plan.apply(model)
    try:
        _assert_bitwise(_stack_grads(model, True), want)
    finally:
        plan.remove(model)


@pytest.mark.parametrize("policy", ["offload", "keep_span"])
def test_offload_and_kept_spans_serve_both_passes(policy: str) -> None:
    """Offloaded outputs (host tensors: kept as aliases) and ``keep()`` spans in a selective
    region serve both passes too."""
    net, x = _net(), _input()

    def region(t: torch.Tensor) -> torch.Tensor:
        if policy == "keep_span":
            return checkpointing.keep(net, t)  # type: ignore[no-any-return]
        return net(t)  # type: ignore[no-any-return]

    context_fn = functools.partial(
        checkpointing.create_selective_checkpoint_contexts,
        offload_ops(torch.ops.aten.addmm.default) if policy == "offload" else save_matmuls(),
    )
    torch.manual_seed(5)
    with split_backward():
        y = checkpointing.checkpoint(region, x, use_reentrant=False, context_fn=context_fn)
    got = _by_hand(net, x, y.pow(2).sum())
    _assert_bitwise(got, _grads("plain", "by_hand", False))


def test_retained_full_backwards_accumulate_as_without_checkpointing() -> None:
    """Two full backwards through a retained graph (``loss.backward(retain_graph=True)``
    twice) under ``split_backward()``: ``.grad`` equals the plain model's after the same two
    backwards, bitwise (each backward recomputes from the same kept outputs)."""
    grads = []
    for how in ("plain", "ours"):
        net, x = _net(), _input()
        with split_backward():
            loss = _forward(net, x, how)
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([x.grad, *(p.grad for p in net.parameters())])
    for got, want in zip(grads[1], grads[0], strict=True):
        assert got is not None
        assert want is not None
        assert torch.equal(got, want)


def test_host_copies_serve_both_passes_and_go_with_the_graph() -> None:
    """Device outputs offloaded through the offload engine (its CUDA logic on a fake backend,
    ``offload_support.FakeBackend``): under ``split_backward()`` each pass restores the host
    copy (none is given up), both passes equal the plain run bitwise, and once the graph is
    freed the engine holds nothing."""
    engine = _offload.Engine(FakeBackend(), prefetch_bytes=1 << 30, pool_bytes=1 << 20)
    with _offload.installed(engine):
        stats = checkpointing.OffloadStats()
        context_fn = functools.partial(
            checkpointing.create_selective_checkpoint_contexts,
            offload_ops(torch.ops.aten.addmm.default),
            offload_stats=stats,
        )
        net, x = _net(), _input()
        torch.manual_seed(5)
        with split_backward():
            y = checkpointing.checkpoint(net, x, use_reentrant=False, context_fn=context_fn)
        got = _by_hand(net, x, y.pow(2).sum())
        del y
        assert stats.offloaded_tensors == 3
        # Two restores per pass: the last addmm's output (the region's) is saved by nothing,
        # so early stop ends each replay before it. A host copy given up in the first pass
        # would leave the second pass to run the op again, restoring nothing.
        assert stats.restored_tensors == 4
        engine.backend.run_all()  # type: ignore[attr-defined]
        engine.poll()
        assert engine.pending() == {"in_flight": 0, "retiring": 0, "held_bytes": 0, "timings": 0}
    _assert_bitwise(got, _grads("plain", "by_hand", False))
