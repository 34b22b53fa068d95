"""Policies that keep outputs compressed: ``compress_ops`` and ``compress_these_names``.

Owns the two factories (re-exported by ``checkpointing.policies``, the public door) and their
policy classes. What compressing does to a tensor is ``_compression``'s (NOTE [Compressed
saves]); where a ``Compress`` answer sits in the keep order, ``readable``'s (``keep_rank``); what
the forward mode does with one, ``forward``'s and ``cache``'s.
"""

from __future__ import annotations

from typing import Any

from .._compat import OpOverloadPacket
from .._compression import Compress, Format, Scale, refuse_exact_op
from .ops import Op
from .policy import (
    TAG_OP,
    CheckpointPolicy,
    OpPolicyBase,
    Policy,
    SelectiveCheckpointContext,
    policy_factory,
)
from .unkept import Asked, overloads_of

__all__ = ["compress_ops", "compress_these_names"]


class _CompressByOp(OpPolicyBase):
    """A ``Compress`` answer for the ops in a set, PREFER_RECOMPUTE for every other op."""

    __slots__ = ("_asked_to_keep", "_how", "_ops", "_repr")

    def __init__(self, ops: frozenset[Op], how: Compress, description: str) -> None:
        super().__init__()
        self._ops = ops
        self._how = how
        self._repr = description
        self._asked_to_keep = Asked(ops, frozenset())

    def answer_for_op(self, op: Op, /) -> CheckpointPolicy | Compress:
        return self._how if op in self._ops else CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return self._repr


class _CompressByName:
    """A ``Compress`` answer for ``tag`` ops whose name is in a set, PREFER_RECOMPUTE for every
    other op (asked for every op: the answer depends on the tag's name argument)."""

    __slots__ = ("_asked_to_keep", "_how", "_names", "_repr")

    def __init__(self, names: frozenset[str], how: Compress, description: str) -> None:
        self._names = names
        self._how = how
        self._repr = description
        self._asked_to_keep = Asked(frozenset(), names)

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | Compress:
        if op is TAG_OP and len(args) > 1 and args[1] in self._names:
            return self._how
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return self._repr


_MSG_NOT_A_NAME = (
    "checkpointing.policies.compress_these_names: expected tensor names (str), got {got!r} of "
    "type {type}. Fix: pass the names given to tag(tensor, name)."
)


def _described(how: Compress) -> str:
    """The keyword arguments of a factory's repr: ``to='fp8', scale='row'``."""
    text = f"to={how.format!r}"
    if how.format == "fp8" and how.scale == "row":
        text += ", scale='row'"
    return text + (", offload=True" if how.offload else "")


@policy_factory
def compress_ops(
    *ops: Op | OpOverloadPacket,
    to: Format | Any = "bf16",
    scale: Scale | None = None,
    offload: bool = False,
) -> Policy:
    """Keep the outputs of these ops compressed (``Compress(to, scale=..., offload=...)``),
    recompute every other op.

    Formats: ``"bf16"``, ``"fp16"``, ``"fp8"`` (``torch.float8_e4m3fn`` with a per-tensor or,
    ``scale="row"``, per-row scale) and ``"int8"`` (row-wise); ``offload=True`` also moves the
    compressed tensor to host memory. Sign and zero are kept exactly. Ops whose backward needs
    their outputs' exact values (``max``, ``topk``, ``sort``, ...) are refused
    here; an integer or boolean output is refused at the forward. Default: the ``Compress``
    answer for them (it sits just below the exact keep in the keep order, so
    ``either(save_ops(op), compress_ops(op))`` keeps ``op`` exactly), PREFER_RECOMPUTE for the
    rest. ``compress_ops(*MATMUL_OPS, to="fp8")`` compresses what ``save_matmuls()`` keeps.

    Example:
        >>> import torch
        >>> from checkpointing.policies import compress_ops
        >>> policy = compress_ops(torch.ops.aten.mm, to="fp8", scale="row")
        >>> policy(None, torch.ops.aten.mm.default)
        Compress('fp8', scale='row')
    """
    how = Compress(to, scale=scale, offload=offload, api="policies.compress_ops")
    found = overloads_of("compress_ops", ops)
    for op in found:
        refuse_exact_op("policies.compress_ops", op)
    described = ", ".join(str(op) for op in ops)
    return _CompressByOp(found, how, f"compress_ops({described}, {_described(how)})")


@policy_factory
def compress_these_names(
    *names: str,
    to: Format | Any = "bf16",
    scale: Scale | None = None,
    offload: bool = False,
) -> Policy:
    """Keep the tensors named with ``tag(tensor, name)`` for these names compressed, recompute
    the rest.

    As ``compress_ops`` for the tensors a tag names (the op that produced a named tensor takes
    the decision, as with ``save_only_these_names``). Default: the ``Compress`` answer for the
    named tensors, PREFER_RECOMPUTE for every other op.

    Example:
        >>> import torch
        >>> from checkpointing.policies import compress_these_names
        >>> tag_op = torch.ops.checkpointing.tag.default
        >>> compress_these_names("kv", to="int8")(None, tag_op, torch.ones(1), "kv")
        Compress('int8')
    """
    how = Compress(to, scale=scale, offload=offload, api="policies.compress_these_names")
    found: set[str] = set()
    for name in names:
        if not isinstance(name, str):
            raise TypeError(_MSG_NOT_A_NAME.format(got=name, type=type(name).__name__))
        found.add(name)
    described = ", ".join(map(repr, names))
    return _CompressByName(
        frozenset(found), how, f"compress_these_names({described}, {_described(how)})"
    )
