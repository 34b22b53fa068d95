"""What autograd saves, kept in host memory until backward: ``offload_wrapper``'s hooks.

Owns ``SavingOnHost``, the saved-tensors hooks an ``OffloadWrapper`` call runs under (torch's
``save_on_cpu``, with our copies): device tensors go to host memory, through the offload engine
where it moves them (``_offload``, NOTE [Host copies off the critical path]: side streams, pinned
buffers from its pool, prefetch when backward reaches the call), else by a plain copy, each one
a ``_host_copy.HostCopy``; tensors already in host memory are kept as they are. Which modules
offload is ``_wrappers``'.

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
from ._host_copy import HostCopy
from ._selective import OffloadStats

__all__ = ["SavingOnHost"]

_MSG_CHANGED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor {what} was changed in place before backward. (checkpointing."
    "offload_wrapper keeps what its module saves in host memory. Fix: make the in-place "
    "operation after the wrapped module out of place, or clone its output first.)"
)


class _HostAlias:
    """A saved tensor already in host memory, kept in place (Rule 2), with its version."""

    __slots__ = ("alias", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.alias = tensor.detach()
        self.version = tensor._version


class SavingOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensors hooks that keep what is saved inside the block in host memory."""

    def __init__(self) -> None:
        self.group: _offload.Group | None = None  # Rule 1, made at the first engine copy
        super().__init__(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> HostCopy | _HostAlias:
        if _offload.claims(tensor):
            if self.group is None:
                self.group = _offload.engine().new_group(reverse=True)
            return HostCopy(tensor, tensor.nbytes, self.group)
        if tensor.device.type == "cpu":  # Rule 2
            return _HostAlias(tensor)
        return HostCopy(tensor, tensor.nbytes, None)


def _unpack(saved: HostCopy | _HostAlias) -> torch.Tensor:
    if isinstance(saved, _HostAlias):
        if saved.alias._version != saved.version:
            raise RuntimeError(_MSG_CHANGED.format(what="saved in host memory"))
        return saved.alias
    try:  # Rules 1 and 3
        return saved.restore(OffloadStats(), consume=False, prefetch=True)
    except _offload.Stale:
        raise RuntimeError(_MSG_CHANGED.format(what="offloaded to host memory")) from None
