"""A tensor copied to host memory in forward and back to its device in backward: ``HostCopy``.

Owns the one record of a host copy, used by the three places that offload: selective
checkpointing's cache (an op output a policy offloads, ``_selective.cache``), kept spans
(``keeping(policy=MUST_CPU_OFFLOAD)``, ``_kept_span_offload``) and ``offload_wrapper``'s hooks
(``_host_saves``). Where the offload engine moves the tensor (CUDA), the copy is one of its
transfers (``_offload``, NOTE [Host copies off the critical path]: side streams, pinned buffers,
prefetch by group); elsewhere it is a plain host tensor. What to offload, which group a copy
joins, and what a copy that cannot be trusted means to the user stay with each user.
"""

from __future__ import annotations

import torch

from . import _offload
from ._errors import internal_error
from ._offload import OffloadStats

__all__ = ["HostCopy"]


class HostCopy:
    """One device tensor kept in host memory: an engine transfer in ``group``, or a plain host
    copy when ``group`` is None (the engine does not move this tensor)."""

    __slots__ = ("_plain", "device", "nbytes", "transfer")

    def __init__(self, tensor: torch.Tensor, nbytes: int, group: _offload.Group | None) -> None:
        self.device = tensor.device
        self.nbytes = nbytes
        self.transfer: _offload.Transfer | None = None
        self._plain: torch.Tensor | None = None
        if group is not None:
            self.transfer = _offload.engine().offload(tensor, group)
        else:
            self._plain = tensor.to("cpu")

    @property
    def host(self) -> torch.Tensor:
        """The host copy (reports read it; an engine copy may still be being filled)."""
        transfer = self.transfer
        if transfer is not None:
            return transfer.host
        plain = self._plain
        if plain is None:
            internal_error("a host copy with neither a transfer nor a plain copy")
        return plain

    def restore(
        self, stats: OffloadStats, *, consume: bool, prefetch: bool = False
    ) -> torch.Tensor:
        """The tensor back on its device, counted in ``stats``. ``consume=False`` keeps the host
        copy for another backward through a retained graph; ``prefetch`` has the first restore of
        a group start restoring the rest of it (NOTE [Host copies off the critical path], Rule
        5). Raises ``_offload.Stale`` when the engine's copy cannot be trusted (Rule 3 there)."""
        transfer = self.transfer
        if transfer is not None:
            if prefetch and transfer.state == _offload.HOST:
                _offload.begin(transfer.group)
            return transfer.engine.take(transfer, stats, consume=consume)
        stats._count_restore(self.nbytes)
        return self.host.to(self.device)
