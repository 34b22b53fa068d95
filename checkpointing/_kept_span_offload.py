"""A kept span's tensors in host memory: ``keeping(policy=MUST_CPU_OFFLOAD)``.

Owns the record of one tensor a span keeps in host memory (``Offloaded``), the copy made when
the span saves it (``offload_kept``) and the way back when backward unpacks it (``restore``).
On CUDA the copies go through the offload engine (``_offload``, NOTE [Host copies off the
critical path]); elsewhere they are plain copies. Which tensors a span offloads, and when, is
``_keep``'s (NOTE [Kept spans], Rule 2); counting is ``OffloadStats``'.
"""

from __future__ import annotations

import torch

from . import _offload
from ._errors import internal_error
from ._offload import OffloadStats

__all__ = ["Offloaded", "offload_kept", "restore"]


class Offloaded:
    """A tensor a span keeps in host memory (``MUST_CPU_OFFLOAD``): the copy (a transfer of the
    offload engine on CUDA, NOTE [Host copies off the critical path], else a host tensor) and
    where it lived."""

    __slots__ = ("device", "host", "nbytes", "transfer")

    def __init__(
        self,
        host: torch.Tensor | None,
        transfer: _offload.Transfer | None,
        device: torch.device,
        nbytes: int,
    ) -> None:
        self.host = host
        self.transfer = transfer
        self.device = device
        self.nbytes = nbytes


_MSG_OFFLOADED_MUTATED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor a kept span offloaded to host memory was changed in place before its "
    "copy had finished, so the copy cannot be trusted. (checkpointing.keeping(policy="
    "MUST_CPU_OFFLOAD) copies what a span saves off the compute stream. Fix: make the in-place "
    "operation after the span out of place, or clone the tensor inside the span.)"
)


def offload_kept(tensor: torch.Tensor, stats: OffloadStats | bool, owner: object) -> Offloaded:
    """Offload one tensor a span saves: through the offload engine where it moves the tensor
    (in ``owner``'s group, for prefetch), else a plain copy."""
    nbytes = tensor.nbytes
    if isinstance(stats, OffloadStats):
        stats._count_offload(nbytes)
    if _offload.claims(tensor):
        engine = _offload.engine()
        transfer = engine.offload(tensor, engine.group_for(owner))
        return Offloaded(None, transfer, tensor.device, nbytes)
    return Offloaded(tensor.to("cpu"), None, tensor.device, nbytes)


def restore(packed: Offloaded, stats: OffloadStats | bool) -> torch.Tensor:
    """The device tensor back: the first restore of a span starts prefetching the rest of its
    group (Rule 5 of NOTE [Host copies off the critical path]); the host copy stays for another
    backward through a retained graph."""
    transfer = packed.transfer
    counter = stats if isinstance(stats, OffloadStats) else OffloadStats()
    if transfer is not None:
        if transfer.state == _offload.HOST:
            _offload.begin(transfer.group)
        try:
            return transfer.engine.take(transfer, counter, consume=False)
        except _offload.Stale:
            raise RuntimeError(_MSG_OFFLOADED_MUTATED) from None
    counter._count_restore(packed.nbytes)
    host = packed.host
    if host is None:
        internal_error("an offloaded span tensor with neither a host copy nor a transfer")
    return host.to(packed.device)
