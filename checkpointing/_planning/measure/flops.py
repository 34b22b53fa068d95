"""FLOPs of one op call, as the planner counts them (NOTE [Planner solve], Rule S4).

Owns ``op_flops``: ``torch.utils.flop_counter``'s formulas where it has one, and our own for the
matrix ops it misses (the CPU attention kernel, matrix-vector products, fused addmm with an
activation). Elementwise ops, reductions and copies count 0, as in torch's counter and in the
compiler's own accounting: the FLOPs are the matrix-multiply work, the rest is charged by time.
Reading the FLOPs of a step, and what they are used for, belongs to ``profile`` and ``solver``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

import torch
from torch.utils.flop_counter import flop_registry

from ..._compat import TorchDispatchMode

__all__ = ["EXTRA_FLOPS", "FlopCount", "op_flops"]

_Formula = Callable[..., int]


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _attention_pairs(query: Any, key: Any, value: Any) -> tuple[int, int, int, int] | None:
    """(batch x heads, query-key pairs, query depth, value depth) of an attention call, or
    None when the shapes are not an attention's."""
    q, k, v = _shape(query), _shape(key), _shape(value)
    if len(q) < 2 or len(k) < 2 or len(v) < 1:
        return None
    return math.prod(q[:-2]), q[-2] * k[-2], q[-1], v[-1]


def _attention(query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    """Scores (query x key) and their weighting of the values: two batched matmuls over every
    (query, key) pair; a causal mask is not discounted (torch's formulas do not either)."""
    found = _attention_pairs(query, key, value)
    if found is None:
        return 0
    batch_heads, pairs, depth, value_depth = found
    return 2 * batch_heads * pairs * (depth + value_depth)


def _attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    """The scores again, then the gradients of values, weights, queries and keys: five matmuls
    over every (query, key) pair."""
    found = _attention_pairs(query, key, value)
    if found is None:
        return 0
    batch_heads, pairs, depth, value_depth = found
    return 2 * batch_heads * pairs * (3 * depth + 2 * value_depth)


def _matrix_vector(matrix: Any, vector: Any, *_: Any, **__: Any) -> int:
    rows_cols = _shape(matrix)
    return 2 * math.prod(rows_cols) if len(rows_cols) == 2 else 0


def _add_matrix_vector(_bias: Any, matrix: Any, vector: Any, *_: Any, **__: Any) -> int:
    return _matrix_vector(matrix, vector)


def _dot(first: Any, *_: Any, **__: Any) -> int:
    return 2 * math.prod(_shape(first))


def _addmm_activation(_bias: Any, first: Any, second: Any, *_: Any, **__: Any) -> int:
    a, b = _shape(first), _shape(second)
    return 2 * a[0] * a[1] * b[1] if len(a) == 2 and len(b) == 2 else 0


EXTRA_FLOPS: Final[dict[Any, _Formula]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
    torch.ops.aten.mv: _matrix_vector,
    torch.ops.aten.addmv: _add_matrix_vector,
    torch.ops.aten.dot: _dot,
    torch.ops.aten.vdot: _dot,
    torch.ops.aten._addmm_activation: _addmm_activation,
}
"""Our formulas, by op packet, for matrix ops ``torch.utils.flop_counter`` does not count; also
usable as its ``custom_mapping`` (the benchmarks count the compiler's FLOPs with them)."""


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The FLOPs of one call of ``func`` (an ``OpOverload``) on ``args``/``kwargs`` giving
    ``out``; 0 for ops that are not matrix work."""
    packet = getattr(func, "overloadpacket", func)
    count = flop_registry.get(packet)
    if count is not None:
        return int(count(*args, **kwargs, out_val=out))
    extra = EXTRA_FLOPS.get(packet)
    if extra is not None:
        return int(extra(*args, **kwargs))
    return 0


class FlopCount(TorchDispatchMode):
    """The FLOPs of every op run inside it, by ``op_flops``. A plain mode: unlike torch's
    ``FlopCounterMode`` it tracks no modules, so a selective checkpoint's recompute runs the same
    op sequence under it (the planner's tests and benchmark count recomputed FLOPs with it)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.flops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += op_flops(func, args, kwargs, out)
        return out
