"""Ground floor: run a block and leave the modules as they were found.

Owns ``untouched``, the one mechanism by which the planner's profile and trials and
``checkpoint_sequential``'s measuring pass run real forward and backward passes of a user's
modules without leaving a trace on them (NOTE [Planner measure], Rule M7). It imports nothing of
the package, so any floor may use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["untouched"]


@contextlib.contextmanager
def untouched(
    modules: Sequence[nn.Module], inputs: Sequence[torch.Tensor] = (), values: bool = True
) -> Iterator[None]:
    """Rule 8: after the block, the modules' buffers and their parameters' ``.grad`` are as they
    were, and so are the CPU RNG state and that of every accelerator the modules or ``inputs``
    are on. A buffer is copied back only where its values changed, so that one a live graph
    saved is not bumped for nothing (its version cannot tell: BatchNorm's kernel writes its
    statistics without moving it). A ``DistributedDataParallel`` among the modules runs the
    block under its ``no_sync()``, its switches put back after: its reducer neither counts the
    block's forwards as iterations nor prepares a reduction for them (a static graph's first
    iteration would otherwise be one whose backward never reduces). Shared by the planner's
    profile and ``checkpoint_sequential``'s measuring pass. ``values=False``: the modules hold
    fake tensors (the planner's step of shapes), which have no values to compare or put back."""
    parameters = list({id(p): p for m in modules for p in m.parameters()}.values())
    buffers = list({id(b): b for m in modules for b in m.buffers()}.values())
    devices = sorted({t.device.index or 0 for t in (*parameters, *buffers, *inputs) if t.is_cuda})
    replicas = list({id(r): r for m in modules for r in _replicas(m)}.values())
    switches = [(r, r.require_forward_param_sync) for r in replicas]
    copies = [(b, b.detach().clone()) for b in buffers] if values else []
    grads = [(p, p.grad) for p in parameters]
    with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as quiet:
        for replica in replicas:
            quiet.enter_context(replica.no_sync())
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, copy in copies:
                    if not torch.equal(buffer, copy):
                        buffer.copy_(copy)
            for parameter, grad in grads:
                parameter.grad = grad
            for replica, forward_sync in switches:
                replica.require_forward_param_sync = forward_sync


def _replicas(module: nn.Module) -> Iterator[nn.parallel.DistributedDataParallel]:
    """The ``DistributedDataParallel`` wrappers in ``module``, itself included."""
    for inner in module.modules():
        if isinstance(inner, nn.parallel.DistributedDataParallel):
            yield inner
