"""A kept span's tensors in host memory: ``keeping(policy=MUST_CPU_OFFLOAD)``.

Owns the copy made when a span saves a tensor it offloads (``offload_kept``) and the way back
when backward unpacks it (``restore``); the record of the copy is ``_host_copy.HostCopy``,
shared with selective checkpointing and ``offload_wrapper``. On CUDA the copies go through the
offload engine (``_offload``, NOTE [Host copies off the critical path]), joining the span's
frame's group; elsewhere they are plain copies. Which tensors a span offloads, and when, is
``_keep``'s (NOTE [Kept spans], Rule 2); counting is ``OffloadStats``'.
"""

from __future__ import annotations

import torch

from . import _offload
from ._host_copy import HostCopy
from ._offload import OffloadStats

__all__ = ["offload_kept", "restore"]

_MSG_OFFLOADED_MUTATED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor a kept span offloaded to host memory was changed in place before its "
    "copy had finished, so the copy cannot be trusted. (checkpointing.keeping(policy="
    "MUST_CPU_OFFLOAD) copies what a span saves off the compute stream. Fix: make the in-place "
    "operation after the span out of place, or clone the tensor inside the span.)"
)


def offload_kept(tensor: torch.Tensor, stats: OffloadStats | bool, owner: object) -> HostCopy:
    """Offload one tensor a span saves: through the offload engine where it moves the tensor
    (in ``owner``'s group, for prefetch), else a plain copy."""
    nbytes = tensor.nbytes
    if isinstance(stats, OffloadStats):
        stats._count_offload(nbytes)
    group = _offload.engine().group_for(owner) if _offload.claims(tensor) else None
    return HostCopy(tensor, nbytes, group)


def restore(packed: HostCopy, stats: OffloadStats | bool) -> torch.Tensor:
    """The device tensor back: the first restore of a span starts prefetching the rest of its
    group (Rule 5 of NOTE [Host copies off the critical path]); the host copy stays for another
    backward through a retained graph."""
    counter = stats if isinstance(stats, OffloadStats) else OffloadStats()
    try:
        return packed.restore(counter, consume=False, prefetch=True)
    except _offload.Stale:
        raise RuntimeError(_MSG_OFFLOADED_MUTATED) from None
