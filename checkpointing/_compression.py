"""Compressed saves: the ``Compress`` decision, and how a kept tensor is packed small and restored.

Owns ``Compress`` (the fourth decision beside keep, recompute and offload: what a policy, a tag's
policy or ``keep(..., compress=...)`` answers to keep a tensor in fewer bytes), the formats it
names, ``Packed`` (one compressed tensor: its payload, its scale, what it is restored to) with
``pack`` and ``unpack``, and the refusals: tensors and ops whose exact values backward needs.
Where a packed tensor lives until backward (the selective cache, a kept span, host memory) is
their owners' business (``_selective.cache``, ``_keep``); this module imports neither.

NOTE [Compressed saves]
  Rule 1. Formats: ``bf16`` and ``fp16`` (a plain cast; fp16 divides by a power-of-two scale,
          1 whenever the tensor fits fp16's range, so nothing overflows), ``fp8``
          (``torch.float8_e4m3fn`` with a float32 scale beside it, per tensor or per row, the
          largest magnitude mapped to 448) and ``int8`` (row-wise: each row's largest magnitude
          mapped to 127). A row is the last dimension. Only floating-point tensors of the plain
          strided kind are compressed.
  Rule 2. Sign and zero are kept exactly: a value that is not zero never comes back zero (one
          that would round to zero becomes the format's smallest magnitude, same sign), and a
          zero comes back zero. Masks that backward reads from a kept float tensor (``relu``'s
          backward reads ``result > 0``, ``elu``'s ``result <= 0``) are therefore the
          forward's own, in every format; the values themselves carry the format's rounding.
  Rule 3. A tensor already in the target dtype (bf16 to ``bf16``) is kept as it is, exactly:
          compressing to a tensor's own dtype changes nothing, gradients included.
  Rule 4. Never compressed: integer and boolean tensors (indices, masks, counts) and the
          outputs of ops whose backward compares them exactly with their input
          (``EXACT_OPS``: ``max``/``min``/``amax``/``amin``/``median``, whose backward finds
          the winners by ``input == result``; ``sort``/``topk``/``kthvalue``/``mode``/
          ``cummax``, which return indices; ``native_dropout``, which returns its mask).
          Naming one is an error naming the op and the fix; so is a tensor of such a dtype
          reaching a compressed decision at run time. Such an op kept exactly while its input
          (or a view of it) is kept compressed is refused too (the forward mode checks, in
          regions that compress something): backward would compare the restored input with
          the forward's result. Recomputed, it runs on the restored input, consistently. Ops
          recomputed from a restored tensor see the restored values (a comparison on them may
          flip where values are close): keep routing exactly with ``save_routing()``.
  Rule 5. A packed tensor is a snapshot made when the op ran, in stream order: the restore is
          a fresh tensor with the original dtype, shape and (dense) strides, so an in-place
          change of the original after packing is not seen, and recompute replays it.
  Rule 6. With ``offload=True`` the packed tensor (not the original) goes to host memory, its
          scale with it: ``pack`` writes the float32 scale and the payload into one byte buffer
          (the scale first, so both views of it stay aligned), one transfer that leaves nothing
          of the tensor on the device. The link moves the packed bytes, payload and scale (half
          of float32 for bf16, a quarter plus 4 bytes per tensor or row for fp8 and int8), and
          ``OffloadStats`` counts exactly the bytes the report calls offloaded.
  Rule 7. Under ``torch.compile`` nothing is compressed: the compiler's partitioner decides
          what its graph keeps, and keeps a compressed answer's output as a save (said once).

Rejected: a scale per block of a row (the MX formats): more bytes for scales and no accuracy need
shown by the benchmark (``benchmarks/compression.py``); keeping the original's version counter to
raise on in-place changes (it keeps the original alive, the memory compression frees).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final, Literal, TypeAlias

import torch

from ._compat import OpOverload
from ._errors import CheckpointError, internal_error

__all__ = [
    "COMPARING_OPS",
    "EXACT_OPS",
    "Compress",
    "Format",
    "Packed",
    "Scale",
    "check_packable",
    "exact_value_ops",
    "pack",
    "refuse_exact_op",
    "unpack",
]

Format: TypeAlias = Literal["bf16", "fp16", "fp8", "int8"]
Scale: TypeAlias = Literal["tensor", "row"]

_DTYPE_OF: Final[dict[str, torch.dtype]] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
_FORMAT_OF: Final[dict[torch.dtype, Format]] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.int8: "int8",
}
# The largest magnitude a format holds after scaling (Rule 1), and its smallest non-zero one
# (Rule 2: what a non-zero value that would round to zero becomes).
_LARGEST: Final[dict[Format, float]] = {"fp16": 65504.0, "fp8": 448.0, "int8": 127.0}
_SMALLEST: Final[dict[Format, float]] = {
    "bf16": 2.0**-133,
    "fp16": 2.0**-24,
    "fp8": 2.0**-9,
    "int8": 1.0,
}
# Finer formats rank higher where ``either``/``both`` compare two compressed answers.
_PRECISION: Final[dict[tuple[Format, Scale | None], int]] = {
    ("fp8", "tensor"): 0,
    ("fp8", "row"): 1,
    ("int8", "row"): 2,
    ("bf16", None): 3,
    ("fp16", "tensor"): 4,
}

_MSG_FORMAT = (
    "checkpointing.{api}: expected a compressed format: 'bf16', 'fp16', 'fp8' or 'int8' (or "
    "torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8), got {got!r}. Fix: e.g. "
    "Compress('bf16'), or Compress('fp8', scale='row')."
)
_MSG_SCALE = (
    "checkpointing.{api}: format {format!r} takes scale {allowed}, got scale={got!r}. Fix: {fix}."
)
_MSG_OFFLOAD = (
    "checkpointing.{api}: expected offload to be a bool, got {got!r} of type {type}. Fix: "
    "offload=True to move the compressed tensor to host memory."
)


class Compress:
    """Keep a tensor compressed until backward, and restore it there: a policy's answer, the
    decision of ``compress_ops`` and its siblings, and ``keep(..., compress=...)``'s option.

    Args:
        to: the format: ``"bf16"`` (or ``torch.bfloat16``), ``"fp16"`` (``torch.float16``),
            ``"fp8"`` (``torch.float8_e4m3fn``, with a float32 scale) or ``"int8"``
            (``torch.int8``, row-wise scales).
        scale: for ``"fp8"``, ``"tensor"`` (one scale, the default) or ``"row"`` (one per row
            of the last dimension); ``"int8"`` is always ``"row"``; ``"fp16"`` uses a
            power-of-two tensor scale, 1 unless the tensor exceeds fp16's range; ``"bf16"``
            needs none.
        offload: also move the compressed tensor to host memory (the link carries the
            compressed bytes).

    Sign and zero survive exactly in every format (NOTE [Compressed saves], Rule 2); integer
    and boolean tensors and exact-value ops are refused (Rule 4).

    Example:
        >>> import torch
        >>> from checkpointing import Compress
        >>> Compress("fp8", scale="row")
        Compress('fp8', scale='row')
        >>> Compress(torch.bfloat16) == Compress("bf16")
        True
    """

    __slots__ = ("dtype", "format", "offload", "scale")

    format: Format
    scale: Scale | None
    offload: bool
    dtype: torch.dtype

    def __init__(
        self,
        to: Format | torch.dtype = "bf16",
        *,
        scale: Scale | None = None,
        offload: bool = False,
        api: str = "Compress",
    ) -> None:
        found = _FORMAT_OF.get(to) if isinstance(to, torch.dtype) else to
        if found not in _DTYPE_OF:
            raise ValueError(_MSG_FORMAT.format(api=api, got=to))
        self.format = found
        self.scale = _scale_of(api, found, scale)
        if not isinstance(offload, bool):
            raise TypeError(_MSG_OFFLOAD.format(api=api, got=offload, type=type(offload).__name__))
        self.offload = offload
        self.dtype = _DTYPE_OF[found]

    @property
    def rank(self) -> int:
        """Where the format sits among compressed answers: a finer one ranks higher."""
        return _PRECISION[(self.format, self.scale)]

    def _key(self) -> tuple[str, str | None, bool]:
        return (self.format, self.scale, self.offload)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compress) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = f", scale={self.scale!r}" if self.format == "fp8" else ""
        if self.offload:
            extra += ", offload=True"
        return f"Compress({self.format!r}{extra})"


def _scale_of(api: str, format: Format, scale: object) -> Scale | None:
    """Rule 1: the scale each format takes; None means its default."""
    if format == "fp8":
        if scale is None or scale in ("tensor", "row"):
            return "row" if scale == "row" else "tensor"
        allowed, fix = "'tensor' or 'row'", "scale='tensor' (the default) or scale='row'"
    elif format == "int8":
        if scale is None or scale == "row":
            return "row"
        allowed, fix = "'row' only", "leave scale out: int8 is always row-wise"
    elif format == "fp16":
        if scale is None or scale == "tensor":
            return "tensor"
        allowed, fix = "'tensor' only (a power of two)", "leave scale out"
    else:
        if scale is None:
            return None
        allowed, fix = "none", "leave scale out: bf16 holds float32's range"
    raise ValueError(_MSG_SCALE.format(api=api, format=format, allowed=allowed, got=scale, fix=fix))


# --- Exact values (Rule 4) ---------------------------------------------------------------------

_EXACT_NAMES: Final = (
    "max",
    "min",
    "amax",
    "amin",
    "aminmax",
    "median",
    "nanmedian",
    "kthvalue",
    "mode",
    "sort",
    "topk",
    "cummax",
    "cummin",
    "argmax",
    "argmin",
    "argsort",
    "native_dropout",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
)


def exact_value_ops(names: Iterable[str]) -> frozenset[OpOverload]:
    """Every overload this torch build has of the aten ops ``names``."""
    aten = torch.ops.aten
    found: set[OpOverload] = set()
    for name in names:
        if hasattr(aten, name):
            packet = getattr(aten, name)
            found.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


EXACT_OPS: Final[frozenset[OpOverload]] = exact_value_ops(_EXACT_NAMES)
"""Ops whose outputs are never compressed (NOTE [Compressed saves], Rule 4)."""

COMPARING_OPS: Final[frozenset[OpOverload]] = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("max", "min", "amax", "amin", "aminmax", "median", "nanmedian")
    if hasattr(torch.ops.aten, name)
)
"""The ops of ``EXACT_OPS`` whose backward compares their saved input with their saved result
(``input == result``); the others' backward reads integer outputs, which stay exact."""

_MSG_EXACT_OP = (
    "checkpointing.{api}: {op} cannot be kept compressed: backward needs its outputs' exact "
    "values (it returns indices or a mask, or its backward finds the winners by comparing the "
    "input with the result). Fix: leave it out of what is compressed, and keep it exactly "
    "(save_ops({op}), CheckpointPolicy.MUST_SAVE) or let it be recomputed."
)
_MSG_EXACT_DTYPE = (
    "checkpointing.{api}: the output{which} of {op} is a {dtype} tensor; only floating-point "
    "tensors can be kept compressed (integer and boolean tensors are indices, masks and counts "
    "that backward needs exactly). Fix: do not name this op for compression: answer "
    "CheckpointPolicy.MUST_SAVE for it (keep it exactly) or PREFER_RECOMPUTE."
)
_MSG_NOT_PLAIN = (
    "checkpointing.{api}: the output{which} of {op} is a {kind}; only plain strided tensors can "
    "be kept compressed. Fix: keep this op exactly (MUST_SAVE) or recompute it."
)


def refuse_exact_op(api: str, op: object) -> None:
    """Rule 4: the error for naming an exact-value op for compression."""
    if op in EXACT_OPS:
        raise CheckpointError(_MSG_EXACT_OP.format(api=api, op=op))


# --- Packing -----------------------------------------------------------------------------------


class Packed:
    """One compressed tensor (Rules 1, 5): the payload, its scale (or None), and what the
    restore makes: the original dtype, shape, strides where they were dense, and device. With
    ``joined`` (Rule 6) ``payload`` is one byte buffer holding the scale, then the payload, and
    ``scale`` is None; ``split`` reads them back out of it."""

    __slots__ = (
        "device",
        "dtype",
        "joined",
        "nbytes",
        "payload",
        "payload_dtype",
        "payload_shape",
        "scale",
        "scale_shape",
        "shape",
        "stride",
    )

    def __init__(
        self,
        payload: torch.Tensor,
        scale: torch.Tensor | None,
        original: torch.Tensor,
        *,
        joined: bool = False,
        payload_dtype: torch.dtype | None = None,
        payload_shape: tuple[int, ...] = (),
        scale_shape: tuple[int, ...] = (),
    ) -> None:
        # None once the payload went to host memory (Rule 6): its holder hands it back.
        self.payload: torch.Tensor | None = payload
        self.scale = scale
        self.joined = joined
        self.payload_dtype = payload.dtype if payload_dtype is None else payload_dtype
        self.payload_shape = tuple(payload.shape) if not joined else payload_shape
        self.scale_shape = scale_shape if joined or scale is None else tuple(scale.shape)
        self.dtype = original.dtype
        self.shape = original.shape
        self.device = original.device
        self.stride = _dense_stride(original)
        extra = 0 if scale is None else scale.numel() * scale.element_size()
        self.nbytes = payload.numel() * payload.element_size() + extra
        """The bytes it keeps: payload and scale."""

    def split(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The payload and scale of a joined ``buffer`` (Rule 6), as views of it; a buffer that
        is not joined is the payload, with the scale kept here."""
        if not self.joined:
            return buffer, self.scale
        scale_bytes = 4 * math.prod(self.scale_shape)
        scale = buffer[:scale_bytes].view(torch.float32).view(self.scale_shape)
        payload = buffer[scale_bytes:].view(self.payload_dtype).view(self.payload_shape)
        return payload, scale


def _dense_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides a fresh tensor like ``tensor`` gets: its own where it covers its memory
    without gaps or overlaps, else contiguous (as ``empty_like`` chooses; on the meta device,
    so no memory)."""
    if tensor.is_contiguous():
        return tensor.stride()
    return torch.empty_like(tensor, device="meta").stride()


def check_packable(tensor: torch.Tensor, api: str, op: object, which: str = "") -> None:
    """Rule 4 at run time: only a plain strided floating-point tensor is compressed."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        kind = f"{type(tensor).__name__} with layout {tensor.layout}"
        raise CheckpointError(_MSG_NOT_PLAIN.format(api=api, op=op, which=which, kind=kind))
    if not tensor.dtype.is_floating_point:
        raise CheckpointError(
            _MSG_EXACT_DTYPE.format(api=api, op=op, which=which, dtype=tensor.dtype)
        )


def pack(tensor: torch.Tensor, how: Compress) -> Packed | None:
    """``tensor`` compressed as ``how`` says, or None where it is in that dtype already (Rule 3:
    the caller keeps it as it is). Check it with ``check_packable`` first."""
    if tensor.dtype == how.dtype:
        return None
    source = tensor.detach()
    fmt = how.format
    if fmt == "bf16":
        return Packed(_keep_sign(source, fmt).to(torch.bfloat16), None, tensor)
    rows = how.scale == "row"
    values = source.float()
    if rows:
        values = values.reshape(-1, values.shape[-1]) if values.dim() else values.reshape(1, 1)
        largest = values.abs().amax(dim=-1, keepdim=True)
    else:
        largest = values.abs().amax()
    scale = _scale(largest, fmt)
    scaled = _keep_sign(values / scale, fmt)
    if fmt == "int8":
        scaled = scaled.round_().clamp_(-127, 127)
    if how.offload:  # Rule 6: scale and payload in one buffer, cast into it
        scale_bytes = 4 * scale.numel()
        width = torch.empty((), dtype=how.dtype).element_size()
        buffer = torch.empty(
            scale_bytes + scaled.numel() * width, dtype=torch.uint8, device=scaled.device
        )
        buffer[:scale_bytes].view(torch.float32).copy_(scale.reshape(-1))
        buffer[scale_bytes:].view(how.dtype).copy_(scaled.reshape(-1))
        return Packed(
            buffer,
            None,
            tensor,
            joined=True,
            payload_dtype=how.dtype,
            payload_shape=tuple(scaled.shape),
            scale_shape=tuple(scale.shape),
        )
    return Packed(scaled.to(how.dtype), scale, tensor)


def _scale(largest: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Rule 1: the float32 scale mapping ``largest`` to the format's largest value (fp16: the
    power of two at or above that ratio, at least 1); 1 where ``largest`` is zero. Computed on
    the tensor's device: no synchronisation."""
    ratio = largest / _LARGEST[fmt]
    if fmt == "fp16":
        return torch.exp2(torch.ceil(torch.log2(ratio))).clamp_(min=1.0)
    return torch.where(largest > 0, ratio, torch.ones_like(ratio))


def _keep_sign(values: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Rule 2: non-zero values too small for the format become its smallest, same sign."""
    smallest = _SMALLEST[fmt]
    tiny = (values.abs() < smallest) & (values != 0)
    return torch.where(tiny, values.sign() * smallest, values)


def unpack(packed: Packed, payload: torch.Tensor | None = None) -> torch.Tensor:
    """A fresh tensor with the original's dtype, shape, device and dense strides (Rule 5).
    ``payload``: the packed payload brought back from host memory (Rule 6)."""
    held = packed.payload if payload is None else payload
    if held is None:
        internal_error("a compressed tensor restored with neither its payload nor a host copy")
    data, scale = packed.split(held)
    values = data if scale is None else data.float() * scale
    restored = values.to(packed.dtype).reshape(packed.shape)
    stride = packed.stride
    if restored.stride() != stride and restored.numel() > 1:
        strided = torch.empty_strided(packed.shape, stride, dtype=packed.dtype, device=data.device)
        strided.copy_(restored)
        return strided
    return restored
