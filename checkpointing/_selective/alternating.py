"""torchtitan's "op" policy as ours: keep the dear ops, recompute every second matmul.

Owns ``TorchtitanOp`` (the policy the name ``"torchtitan:op"`` stands for, and what
``integrations.torchtitan.SelectiveAC`` checkpoints its blocks with), the op set it keeps
(``torchtitan_save_ops``) and the per-region policy rule below. Which ops torch's compiler counts
as compute-intensive is torch's; what a region does with an answer is ``forward``'s and
``recompute``'s.

NOTE [Per-region policies]
  Rule 1. A policy whose answer depends on the calls before it in the same region (here: a
          count of matmuls) defines ``for_region()``, which returns a fresh copy;
          ``create_selective_checkpoint_contexts`` asks for one each time it builds a region's
          pair of modes, so every region call counts from zero, as torchtitan's policy does (it
          makes a new counter in each ``context_fn`` call). Without it one object shared by every
          block (``as_context_fn``, a policy name) would carry its count from block to block and
          from step to step, and a block with an odd number of matmuls would keep a different
          half each time.
  Rule 2. The count is kept per pass (``ctx.is_recompute``), as torchtitan keeps it: our modes
          ask only in the forward (recompute replays its answers); torch's
          ``create_selective_checkpoint_contexts`` asks in both, and under it both passes count
          the same matmuls. Under torch's function, build the policy inside the ``context_fn``
          (``lambda: create_selective_checkpoint_contexts(TorchtitanOp())``): torch never asks
          for ``for_region``.
  Rule 3. Parity with torchtitan 0.3.0's ``SelectiveAC``: the kept set is torch's
          compute-intensive ops (the compiler's default list, one overload each), the attention
          kernels, ``aten.max``, ``aten.topk`` (MoE routing stays the forward's), ``aten.linear``
          and the collectives that move activations (``reduce_scatter_tensor``,
          ``all_to_all_single``, and the DeepEP/HybridEP ones where installed); ``aten.mm`` and
          ``aten.linear`` count, every second one recomputed; a matmul whose right-hand side has
          the shape of a forced linear (``(in, out)``) is recomputed and not counted. One
          generalization: a copy from any accelerator to the CPU is kept (torchtitan: from CUDA).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import torch

from .ops import Op
from .policy import CheckpointPolicy, SelectiveCheckpointContext

__all__ = ["TorchtitanOp", "torchtitan_save_ops"]

# torch's compiler's compute-intensive ops (its partitioner's default list, the same on torch
# 2.11-2.15), then what torchtitan adds, then the collectives it keeps. Looked up by name: the
# optional ones (a custom attention backend, DeepEP, HybridEP, inductor's region op) exist only
# where their library registered them.
_COMPUTE_INTENSIVE: Final = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.convolution",
    "aten.convolution_backward",
    "aten._scaled_mm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "aten.upsample_bilinear2d",
)
_ADDED: Final = (
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten.max",  # the amax of low-precision scaling
    "aten.linear",  # a backend that keeps linear whole
    "aten.topk",  # MoE routing: its choice must not change in the recompute
    "torch_attn._varlen_attn",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_to_all_single",
    "deepep.dispatch",
    "deepep.combine",
    "hybridep.dispatch",
    "hybridep.combine",
)
_HIGHER_ORDER: Final = ("flex_attention", "inductor_compiled_code")

_MM: Final = torch.ops.aten.mm.default
_LINEAR: Final = torch.ops.aten.linear.default
_TO_COPY: Final = torch.ops.aten._to_copy.default


def _lookup(dotted: str) -> Op | None:
    """``torch.ops.<namespace>.<op>.default``, or None where no library registered it."""
    namespace, name = dotted.split(".")
    try:
        found: Op = getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None
    return found


def torchtitan_save_ops() -> frozenset[Op]:
    """The ops whose outputs torchtitan's "op" policy keeps (Rule 3), as registered in this
    process now: looked up at each call, since a library may register one later (torchtitan's
    attention registers ``torch_attn._varlen_attn`` when imported)."""
    found = [_lookup(name) for name in (*_COMPUTE_INTENSIVE, *_ADDED)]
    found += [getattr(torch.ops.higher_order, name, None) for name in _HIGHER_ORDER]
    return frozenset(op for op in found if op is not None)


class TorchtitanOp:
    """torchtitan's "op" selective policy: keep the compute-intensive and communication ops'
    outputs, recompute every second matmul and everything else (NOTE [Per-region policies]).

    Args:
        recompute_shapes: right-hand-side shapes ``(in, out)`` of matmuls always recomputed (and
            not counted): torchtitan's ``force_recompute_mm_shapes_by_fqns``, by shape.
        save_ops: the ops to keep; default ``torchtitan_save_ops()``.
    """

    __slots__ = ("_asked", "_counts", "_save_ops", "_shapes")

    def __init__(
        self,
        recompute_shapes: Iterable[tuple[int, int]] = (),
        save_ops: Iterable[Op] | None = None,
    ) -> None:
        self._shapes = frozenset((int(i), int(o)) for i, o in recompute_shapes)
        self._asked = None if save_ops is None else frozenset(save_ops)
        self._save_ops = torchtitan_save_ops() if self._asked is None else self._asked
        self._counts = [0, 0]  # matmuls met in the forward, in the recompute (Rule 2)

    def for_region(self) -> TorchtitanOp:
        """A fresh copy, its counts at zero: one per region call (Rule 1); the default op set
        looked up again (ops registered since count)."""
        return TorchtitanOp(self._shapes, self._asked)

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy:
        if op is _TO_COPY and _to_host(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        counted = op is _MM or op is _LINEAR
        if counted:
            rows, columns = args[1].shape[-2:]
            shape = (columns, rows) if op is _LINEAR else (rows, columns)  # linear: (out, in)
            if shape in self._shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            self._counts[ctx.is_recompute] += 1
        if op not in self._save_ops:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if counted and self._counts[ctx.is_recompute] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    def __repr__(self) -> str:
        shapes = f"recompute_shapes={sorted(self._shapes)}" if self._shapes else ""
        return f"TorchtitanOp({shapes})"


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an ``aten._to_copy`` call copies an accelerator's tensor to the CPU."""
    device = kwargs.get("device")
    source = args[0] if args else None
    return (
        isinstance(source, torch.Tensor)
        and source.device.type != "cpu"
        and device is not None
        and torch.device(device).type == "cpu"
    )
