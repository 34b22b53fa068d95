"""What autograd saves, kept in host memory until backward: ``offload_wrapper``'s hooks.

Owns ``SavingOnHost``, the saved-tensors hooks an ``OffloadWrapper`` call runs under (torch's
``save_on_cpu``, with our copies): device tensors go to host memory, through the offload engine
where it moves them (``_offload``, NOTE [Host copies off the critical path]: side streams, pinned
buffers from its pool, prefetch when backward reaches the call), else by a plain copy; tensors
already in host memory are kept as they are. Which modules offload is ``_wrappers``'.

NOTE [Saved on host]
  Rule 1. One call of the wrapped module is one engine group: its copies are prefetched together
          when backward unpacks the first of them, then the call's made before it.
  Rule 2. A host tensor is kept as a detached alias, not copied (torch's ``save_on_cpu`` copies
          it): it is in host memory already. Its version is recorded, and an in-place change
          before backward raises autograd's in-place error, as an unhooked save would.
  Rule 3. Restores keep the host copy (``consume=False``): a retained graph's second backward
          unpacks again.
"""

from __future__ import annotations

import torch

from . import _offload
from ._errors import internal_error
from ._selective import OffloadStats

__all__ = ["SavingOnHost"]

_MSG_CHANGED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor {what} was changed in place before backward. (checkpointing."
    "offload_wrapper keeps what its module saves in host memory. Fix: make the in-place "
    "operation after the wrapped module out of place, or clone its output first.)"
)


class _OnHost:
    """One saved tensor: its host copy (an engine transfer, or a host tensor), where it lived,
    and (Rule 2) the version a host alias had when it was saved."""

    __slots__ = ("device", "host", "transfer", "version")

    def __init__(
        self,
        host: torch.Tensor | None,
        transfer: _offload.Transfer | None,
        device: torch.device,
        version: int,
    ) -> None:
        self.host = host
        self.transfer = transfer
        self.device = device
        self.version = version


class SavingOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensors hooks that keep what is saved inside the block in host memory."""

    def __init__(self) -> None:
        self.group: _offload.Group | None = None  # Rule 1, made at the first engine copy
        super().__init__(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> _OnHost:
        if _offload.claims(tensor):
            engine = _offload.engine()
            if self.group is None:
                self.group = engine.new_group(reverse=True)
            return _OnHost(None, engine.offload(tensor, self.group), tensor.device, 0)
        if tensor.device.type == "cpu":  # Rule 2
            return _OnHost(tensor.detach(), None, tensor.device, tensor._version)
        return _OnHost(tensor.to("cpu"), None, tensor.device, 0)


def _unpack(saved: _OnHost) -> torch.Tensor:
    transfer = saved.transfer
    if transfer is not None:
        if transfer.state == _offload.HOST:
            _offload.begin(transfer.group)  # Rule 1
        try:
            return transfer.engine.take(transfer, OffloadStats(), consume=False)  # Rule 3
        except _offload.Stale:
            raise RuntimeError(_MSG_CHANGED.format(what="offloaded to host memory")) from None
    host = saved.host
    if host is None:
        internal_error("a tensor saved on host with neither a host copy nor a transfer")
    if saved.device.type == "cpu":
        if host._version != saved.version:
            raise RuntimeError(_MSG_CHANGED.format(what="saved in host memory"))
        return host
    return host.to(saved.device)
