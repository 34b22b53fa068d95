"""How a tiled region's parameter gradients are summed over its chunks: the stand-ins.

Owns ``StandIns``: the torch function mode a tiled region's recompute runs under, which hands
every torch function a stand-in for each declared parameter, and the running sums of the
gradients of the parameters used as a linear layer's weight, into which each chunk's share is
multiplied straight in (``addmm_``). The chunk loop that runs the mode, and the rules it keeps,
are ``_tiled_run``'s (NOTE [Tiled regions], Rules 4 and 11, in ``_tiling``).

NOTE [Tiled gradient sums]
  Rule 1. A declared parameter that requires grad and is given to ``torch.nn.functional.linear``
          as its weight (every ``nn.Linear``) gets its chunks' gradients written into one
          running sum per parameter: chunk 0's by ``mm``, each later chunk's by ``addmm_`` into
          the sum, in chunk order. No chunk's gradient of that weight exists on its own, so
          backward holds the sums and one chunk's activations, nothing weight-sized beside them.
  Rule 2. The linear is run as torch runs it (``F.linear`` on the same tensors), so the chunk's
          output and everything recomputed after it are the plain run's, bitwise; its input's
          gradient is ``grad @ weight``, the same ``mm`` autograd's linear makes (the transposed
          form where the input is stored transposed, as autograd does), so split inputs'
          gradients stay bitwise the chunkwise run's (NOTE [Tiled regions], Rule 4). A bias's
          gradient is the gradient's sum over the rows.
  Rule 3. The weight's sum is ``addmm``'s accumulation, not autograd's ``mm`` then ``add``:
          the same terms in the same chunk order, rounded once per chunk instead of twice, so
          it agrees with the untiled run (and with the chunkwise autograd sums) to the
          reduction-order tolerance of NOTE [Tiled regions], Rule 4, not bitwise.
  Rule 4. Only plain strided tensors of one dtype, outside autocast, are summed this way: a
          tensor subclass (a DTensor), a sparse weight, or autocast's cast copies take
          autograd's own linear, and their gradients reach the stand-in's ``.grad`` as before.
          A weight used by both (a linear and another op) has the two added: sum, then ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "StandIns",
    "graph_leaves",
    "kept_as_is",
    "linear_input_grad",
    "stored_transposed",
    "take_grad",
    "weight_grad_into",
]


class StandIns(TorchFunctionMode):
    """While a chunk is recomputed, every torch function given a declared parameter gets its
    stand-in instead: a leaf sharing the parameter's memory, into whose ``.grad`` backward adds
    each chunk's gradient as soon as it is made, or, for a linear layer's weight, into whose
    running sum it is multiplied (NOTE [Tiled gradient sums]). A mode, so per thread: another
    thread's use of the module is untouched."""

    def __init__(self, params: tuple[torch.Tensor, ...], needed: Sequence[bool]) -> None:
        super().__init__()
        self.tensors = tuple(
            p.detach().requires_grad_(n) for p, n in zip(params, needed, strict=True)
        )
        self._by_id = {id(p): s for p, s in zip(params, self.tensors, strict=True)}
        self._summed = {id(s) for s, n in zip(self.tensors, needed, strict=True) if n}
        self.sums: dict[int, torch.Tensor] = {}  # id(stand-in): its linear gradients' sum

    def _swap(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._by_id.get(id(value), value)
        if isinstance(value, list | tuple):
            return type(value)(self._swap(v) for v in value)
        return value

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args = [self._swap(a) for a in args]
        kwargs = {k: self._swap(v) for k, v in (kwargs or {}).items()}
        if func is F.linear and not kwargs and 2 <= len(args) <= 3:
            weight = args[1]
            bias = args[2] if len(args) == 3 else None
            if id(weight) in self._summed and _plain(args[0], weight, bias):
                return _SummedLinear.apply(self, args[0], weight, bias)  # type: ignore[no-untyped-call]  # untyped
        return func(*args, **kwargs)

    def add(self, key: int, grad: torch.Tensor, inputs: torch.Tensor) -> None:
        """Multiply one chunk's gradient of a weight (the stand-in whose ``id`` is ``key``)
        into its sum (Rules 1 and 3)."""
        self.sums[key] = weight_grad_into(self.sums.get(key), grad, inputs)

    def take(self, stand_in: torch.Tensor) -> torch.Tensor | None:
        """A stand-in's gradient: its sum, plus what reached its ``.grad`` (Rule 4); neither
        is kept here afterwards (the engine may then adopt it as the parameter's ``.grad``)."""
        total = self.sums.pop(id(stand_in), None)
        grad = take_grad(stand_in)
        if total is None:
            return grad
        if grad is not None:
            total.add_(grad)
        return total


def _plain(x: Any, weight: torch.Tensor, bias: Any) -> bool:
    """Rule 4: plain strided tensors of one dtype, autocast off."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        all(type(t) is torch.Tensor and t.layout is torch.strided for t in tensors)
        and all(t.dtype == weight.dtype for t in tensors)
        and x.dim() >= 1
        and not torch.is_autocast_enabled(x.device.type)
    )


class _SummedLinear(torch.autograd.Function):
    """``F.linear`` whose weight's gradient goes into the stand-ins' sum (Rules 1 and 2)."""

    @staticmethod
    def forward(
        ctx: Any,
        stand_ins: StandIns,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.stand_ins = stand_ins
        ctx.key = id(weight)  # the saved weight unpacks as another tensor object
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        d_x = d_bias = None
        if ctx.needs_input_grad[1]:
            transposed = stored_transposed(x.reshape(-1, x.shape[-1]))
            d_x = linear_input_grad(rows, weight, transposed).reshape(x.shape)
        if ctx.needs_input_grad[2]:
            ctx.stand_ins.add(ctx.key, rows, x.reshape(-1, x.shape[-1]))
        if ctx.needs_input_grad[3]:
            d_bias = rows.sum(0)
        return None, d_x, None, d_bias


def weight_grad_into(
    total: torch.Tensor | None, grad: torch.Tensor, inputs: torch.Tensor
) -> torch.Tensor:
    """A linear's weight gradient for one chunk, ``grad.t() @ inputs`` (rows of the output's
    gradient and of the input), made by ``mm`` for chunk 0 and added into ``total`` by
    ``addmm_`` for each later one (Rules 1 and 3)."""
    if total is None:
        return grad.t().mm(inputs)
    return total.addmm_(grad.t(), inputs)


def stored_transposed(inputs: torch.Tensor) -> bool:
    """Whether a linear's input rows (2-d) are stored transposed (column-major), where
    autograd's linear makes the input gradient in its transposed form (Rule 2)."""
    return inputs.stride(0) == 1 and inputs.stride(1) == inputs.shape[0]


def linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A linear's input gradient from the rows of its output's gradient, as autograd makes it
    (Rule 2): ``grad @ weight``, or its transposed form for an input stored transposed."""
    if transposed:
        return weight.t().mm(grad.t()).t()
    return grad.mm(weight)


def take_grad(leaf: torch.Tensor) -> torch.Tensor | None:
    """A leaf's accumulated gradient, which the leaf lets go of (no second reference: the
    engine may then keep it as the parameter's ``.grad`` without a copy)."""
    grad, leaf.grad = leaf.grad, None
    return grad


def kept_as_is() -> torch.autograd.graph.saved_tensors_hooks:
    """The saved-tensors hooks a chunk's recompute saves under (NOTE [Tiled regions], Rule 12):
    each tensor kept as it is, unseen by outer hooks (that graph lives and dies inside the
    region's backward)."""
    return torch.autograd.graph.saved_tensors_hooks(_saved_as_is, _unpacked_as_is)


def _saved_as_is(tensor: torch.Tensor) -> torch.Tensor:
    """A chunk's save, kept as it is (detached: the tensor itself would be a reference cycle
    through its ``grad_fn``)."""
    return tensor.detach()


def _unpacked_as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def graph_leaves(outs: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors requiring grad that ``outs``' graph reaches (its accumulating nodes'
    variables), each node visited once; lazily, so a caller can stop at the first it rejects.
    Each node visited is held until the walk ends: a node's Python object lives only while
    referenced, and a freed one's id could be reused by the next node's (the walk would then
    skip it)."""
    seen: dict[int, Any] = {}
    stack = [out.grad_fn for out in outs if out.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            yield variable
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
