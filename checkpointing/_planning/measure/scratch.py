"""Memory a CPU kernel allocates and frees inside one op call (NOTE [Planner solve], Rule S6).

Owns ``scratch_bytes``: what the planner adds to the tensor bytes live at an op for the work
buffers the op's kernel holds while it runs, which no dispatch mode sees (``live_bytes`` counts
tensors that ops return). Only the kernels whose buffers matter are listed: the CPU attention
kernels, whose buffers grow with the intra-op threads (``torch.get_num_threads()``): a few KB per
thread on a small model, as much as its activations. Each is an upper bound worked out from the
kernel's blocking and checked against the allocator (``tests/test_planner_peak.py``); an op
not listed counts 0.

NOTE [Attention matmul scratch]
  Rule 1. On a CPU with AVX-512 or AMX, torch hands a bfloat16 (or float16) block matmul of the
          attention kernels to oneDNN, whose scratchpad comes from torch's CPU allocator: packed
          copies of the operands and a float32 block of the result, each dimension padded to
          oneDNN's blocking (at most 32). Counted per thread (one matmul runs at a time on a
          thread): float32 copies of all three operands of the blocks (queries x keys, keys x
          depth, queries x depth), each dimension rounded up to 32. The backward's only: the
          forward's matmuls write float32 blocks and take no scratchpad.
  Rule 2. torch keeps a matmul of at most 16 x 16 x 16 multiply-adds off oneDNN: none counted.
  Rule 3. The CPU a plan will run on is not known when it is made, and one without those
          instructions allocates nothing here: the scratch is counted on every CPU, so the peak
          errs high, never low.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch

__all__ = ["scratch_bytes"]


def _blocks(query_length: int, key_length: int) -> tuple[int, int]:
    """The query and key block lengths the CPU attention kernels work in."""
    query_block = 256 if query_length >= 768 else 64 if query_length >= 192 else 32
    return min(query_block, query_length), min(512, key_length)


def _sizes(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(batch x heads, query length, key length, depth, accumulator bytes, reduced bytes): the
    kernels accumulate in float32 (float64 for float64) and keep a copy of a block in a reduced
    dtype (bfloat16, float16) besides."""
    *batch, query_length, depth = query.shape
    accumulator = 8 if query.dtype == torch.float64 else 4
    reduced = 0 if query.dtype in (torch.float32, torch.float64) else query.element_size()
    rows = 1
    for size in batch:
        rows *= size
    return rows, query_length, key.shape[-2], depth, accumulator, reduced


def _attention(query: Any, key: Any, *_: Any, **__: Any) -> int:
    """Per thread: a block of scores, its row maxima and sums, and an output block."""
    _rows, length, key_length, depth, accumulator, reduced = _sizes(query, key)
    q, k = _blocks(length, key_length)
    per_thread = (q * k + 2 * q + q * depth) * accumulator + q * k * reduced
    return torch.get_num_threads() * per_thread


def _matmul_scratch(q: int, k: int, depth: int) -> int:
    """Most a reduced-dtype block matmul takes from the CPU allocator (NOTE [Attention matmul
    scratch], Rules 1-2)."""
    if q * k * depth <= 16 * 16 * 16:
        return 0
    q, k, depth = (-(-n // 32) * 32 for n in (q, k, depth))
    return 4 * (q * k + k * depth + q * depth)


def _attention_backward(_grad: Any, query: Any, key: Any, *_: Any, **__: Any) -> int:
    """The query gradient and a row sum accumulated whole; per thread, a block of scores and
    one of their gradients (each also in the reduced dtype), and in a reduced dtype the
    scratch of one block matmul (NOTE [Attention matmul scratch])."""
    rows, length, key_length, depth, accumulator, reduced = _sizes(query, key)
    q, k = _blocks(length, key_length)
    whole = rows * length * (depth + 1) * accumulator
    matmul = _matmul_scratch(q, k, depth) if reduced else 0
    return whole + torch.get_num_threads() * (2 * q * k * (accumulator + reduced) + matmul)


_SCRATCH: Final[dict[Any, Callable[..., int]]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: _attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        _attention_backward
    ),
}


def scratch_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes the kernel of ``func`` holds inside the call beyond its outputs (0: none known)."""
    formula = _SCRATCH.get(func)
    return 0 if formula is None else formula(*args, **kwargs)
