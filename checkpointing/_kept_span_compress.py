"""A kept span's tensors kept compressed: ``keeping(compress=Compress(...))``.

Owns the record of one tensor a span keeps compressed (``KeptCompressed``), the packing made when
the span saves it (``compress_kept``), the way back when backward unpacks it
(``restore_compressed``), and ``RefusingExactOps``, the dispatch mode a compressing span runs
under in forward. The formats and refusals are ``_compression``'s (NOTE [Compressed saves]);
which tensors a span keeps, and when, is ``_keep``'s; host copies are ``_kept_span_offload``'s.

NOTE [Compressed spans]
  Rule 1. A compressing span compresses the floating-point tensors it keeps (never its
          arguments, which are recomputed, NOTE [Kept spans], Rule 2, nor parameters); an
          integer or boolean tensor it saves (an index, a dropout mask) is kept exactly:
          naming a span names no tensor, so none is refused.
  Rule 2. An op whose backward compares its saved input with its saved result (``max``,
          ``amax``, ``median``, ...: ``COMPARING_OPS``) cannot run inside a compressing span: both
          would come back rounded, no longer equal, and its gradient would vanish. The span
          runs its forward under ``RefusingExactOps``, which raises at such an op, naming it.
          The mode costs a Python call per op, in compressing spans only.
  Rule 3. A packed tensor is restored afresh at every unpack (a retained graph's second
          backward unpacks again); with ``offload`` its host copy stays for that.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ._compat import TorchDispatchMode
from ._compression import COMPARING_OPS, Compress, Packed, pack, unpack
from ._errors import CheckpointError
from ._host_copy import HostCopy
from ._kept_span_offload import offload_kept, restore
from ._offload import OffloadStats

__all__ = ["KeptCompressed", "RefusingExactOps", "compress_kept", "restore_compressed"]

_packing = threading.local()  # set while a tensor is packed, in the thread that packs it


class KeptCompressed:
    """A tensor a span keeps compressed: the packed tensor, and with ``offload`` the host copy
    of its payload and scale (one buffer, Rule 6 of NOTE [Compressed saves])."""

    __slots__ = ("host", "packed")

    def __init__(self, packed: Packed, host: HostCopy | None) -> None:
        self.packed = packed
        self.host = host


def compress_kept(
    tensor: torch.Tensor, how: Compress, stats: OffloadStats | bool, owner: object
) -> KeptCompressed | None:
    """``tensor`` packed as ``how`` says (payload and scale offloaded in ``owner``'s group with
    ``how.offload``), or None where it is kept as it is (Rule 1; Rule 3 of NOTE [Compressed
    saves]: already in the target dtype)."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout is not torch.strided
        or not tensor.dtype.is_floating_point
    ):
        return None
    _packing.active = True  # the codec's own ops (amax) pass ``RefusingExactOps``
    try:
        packed = pack(tensor, how)
    finally:
        _packing.active = False
    if packed is None or not how.offload:
        return None if packed is None else KeptCompressed(packed, None)
    payload = packed.payload
    packed.payload = None
    if payload is None:
        return None
    return KeptCompressed(packed, offload_kept(payload, stats, owner))


def restore_compressed(kept: KeptCompressed, stats: OffloadStats | bool) -> torch.Tensor:
    """The tensor back, afresh (Rule 3)."""
    host = kept.host
    return unpack(kept.packed, None if host is None else restore(host, stats))


_MSG_EXACT_IN_SPAN = (
    "checkpointing.keeping(compress=...): the span {name!r} runs {op}, whose backward compares "
    "its saved input with its saved result; kept compressed, both come back rounded and its "
    "gradient would be lost. Fix: move {op} out of the compressed span (keep it in a span of "
    "its own without compress=), or drop compress= for this span."
)


class RefusingExactOps(TorchDispatchMode):
    """Rule 2: the forward of a compressing span raises at an exact-value op."""

    def __init__(self, name: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.name = name

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in COMPARING_OPS and not getattr(_packing, "active", False):
            raise CheckpointError(_MSG_EXACT_IN_SPAN.format(name=self.name, op=func))
        return func(*args, **(kwargs or {}))
