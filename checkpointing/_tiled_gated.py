"""A gated MLP tiled by chunks, recomputed and differentiated by hand in its backward.

Owns ``gated_mlp`` (whether a tiled region's function is a gated MLP written as Llama's is:
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) and ``GatedMLP`` (that region's backward,
chunk by chunk, with each chunk's intermediates freed as soon as their last use is done). The
tiled region itself, its forward and every other function's backward are ``_tiled_run``'s,
which calls this in place of its per-chunk autograd when the region qualifies; NOTE [Tiled
regions] (``_tiling``) holds unchanged.

NOTE [Tiled gated MLP]
  Rule 1. Recognised by its code: the module's class's ``forward`` takes one input and its body
          is ``return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))`` (or
          that value bound to a name that is then returned), read once per function from its
          source; the three projections are ``nn.Linear`` exactly (no subclass, no
          parametrization), ``act_fn`` has no parameter that requires grad, and no module hook
          would run on the module, the projections or ``act_fn`` (nor a global one): a hook
          runs per chunk in the generic path's recompute, and would not run here. Anything
          else (no source, another body, a hook) takes the generic path.
  Rule 2. Per call, also: one positional input, split, along a dimension other than its last,
          no keyword input, autocast off when the region is called (a chunk's recompute runs
          under its forward's autocast state), and, when backward runs, the input, weights and
          biases plain strided tensors of one dtype.
  Rule 3. A chunk's recompute stops at ``act * up``: its output is not remade (nothing reads
          it), which saves one of the twelve matmuls a chunk costs the generic path (three in
          forward, three recomputed, six in backward). Its shapes follow from the
          projections', so the determinism check has nothing to compare.
  Rule 4. A chunk's backward frees as it goes and writes over what it no longer reads:
          ``prod`` is freed once the down projection's weight gradient is in its sum;
          ``d_act = d_prod * up`` is written over ``up``, then the up branch's gradient
          ``d_prod * act`` over ``d_prod``, whose weight and input gradients are made before the
          activation's gradient is. At most four intermediate-wide chunk tensors live at once
          (gate, act, and two of up, prod, d_prod and their gradients), against six and the
          chunk's output under the generic path's autograd. The activation's gradient is
          autograd's own, over a graph of ``act_fn`` alone.
  Rule 5. The arithmetic is autograd's: the same kernels on the same operands (elementwise
          products commute bitwise, and so does the input gradient's sum of its two terms),
          so the input's gradient is the generic path's, bitwise, and the chunkwise plain
          run's. The weights' sums are NOTE [Tiled gradient sums], Rules 1 and 3 (``addmm_`` in
          chunk order); the biases' add each chunk's row sum in chunk order.
  Rule 6. An ``act_fn`` whose graph reaches a tensor requiring grad other than its input (one
          read from a closure) is seen in chunk 0, before anything is summed: the call then
          takes the generic path, which refuses it (NOTE [Tiled regions], Rule 5).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import nn

from . import _compat
from ._state import ForwardState
from ._tiled_grads import (
    graph_leaves,
    kept_as_is,
    linear_input_grad,
    stored_transposed,
    weight_grad_into,
)

__all__ = ["GatedMLP", "gated_mlp"]

_PROJECTIONS: Final = ("gate_proj", "up_proj", "down_proj")
_BODY: Final = "self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))"


@functools.lru_cache(maxsize=64)
def _written_gated(forward: Callable[..., Any]) -> bool:
    """Rule 1: whether ``forward``'s source is the gated MLP's body (up to its input's name)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    function = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(function, ast.FunctionDef) or function.decorator_list:
        return False
    arguments = function.args
    if arguments.vararg or arguments.kwarg or arguments.kwonlyargs or len(arguments.args) != 2:
        return False
    self_name, x_name = (a.arg for a in arguments.args)
    body = list(function.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # a docstring
    expected = ast.dump(ast.parse(_BODY.format(x=x_name), mode="eval").body)
    if self_name != "self":
        return False
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return ast.dump(body[0].value) == expected
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        targets, returned = body[0].targets, body[1].value
        return (
            len(targets) == 1
            and isinstance(targets[0], ast.Name)
            and isinstance(returned, ast.Name)
            and returned.id == targets[0].id
            and ast.dump(body[0].value) == expected
        )
    return False


def gated_mlp(
    function: object, args: tuple[Any, ...], kwargs: dict[str, Any], dim: int, split: Sequence[int]
) -> GatedMLP | None:
    """The hand-written backward for a call of ``function`` (the module, or its class's
    forward bound to it) when Rules 1 and 2 allow it, else None (the generic path)."""
    module = function if isinstance(function, nn.Module) else None
    if (
        isinstance(function, functools.partial)
        and not function.keywords
        and len(function.args) == 1
        and isinstance(function.args[0], nn.Module)
        and function.func is type(function.args[0]).forward
    ):
        module = function.args[0]
    if module is None or ("forward" in module.__dict__ and function is module):
        return None
    if len(args) != 1 or kwargs or tuple(split) != (0,) or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if x.dim() < 2 or dim % x.dim() == x.dim() - 1 or torch.is_autocast_enabled(x.device.type):
        return None
    projections = [getattr(module, name, None) for name in _PROJECTIONS]
    act_fn = getattr(module, "act_fn", None)
    if not all(type(p) is nn.Linear for p in projections) or not callable(act_fn):
        return None
    hooked = [p for p in projections if isinstance(p, nn.Module)]
    hooked += [
        m for m in (act_fn, module if function is module else None) if isinstance(m, nn.Module)
    ]
    if any(_compat.has_module_hooks(m) for m in hooked):
        return None
    if isinstance(act_fn, nn.Module) and any(p.requires_grad for p in act_fn.parameters()):
        return None
    if not _written_gated(type(module).forward):
        return None
    return GatedMLP(module, act_fn)


class GatedMLP:
    """One call's backward, chunk by chunk (Rules 3 to 6)."""

    def __init__(self, module: nn.Module, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module = module
        self.act_fn = act_fn

    def _linears(self) -> list[nn.Linear]:
        return [getattr(self.module, name) for name in _PROJECTIONS]

    def usable(self, x: torch.Tensor) -> bool:
        """Rule 2's backward-time part: plain strided tensors of one dtype."""
        tensors = [x, *(t for lin in self._linears() for t in (lin.weight, lin.bias))]
        return all(
            t is None
            or (
                type(t) in (torch.Tensor, nn.Parameter)
                and t.layout is torch.strided
                and t.dtype == x.dtype
            )
            for t in tensors
        )

    def backward(
        self,
        x: torch.Tensor,
        grad: torch.Tensor,
        bounds: Sequence[tuple[int, int]],
        dim: int,
        states: Sequence[ForwardState],
        params: Sequence[torch.Tensor],
        needed: Sequence[bool],
    ) -> list[torch.Tensor | None] | None:
        """The gradients of the input (``needed[0]``) and of ``params`` (``needed[1:]``); None
        when chunk 0 finds an undeclared tensor (Rule 6)."""
        want = {id(p): n for p, n in zip(params, needed[1:], strict=True)}
        sums: dict[int, torch.Tensor] = {}  # id(parameter): its gradient's running sum
        rows = torch.empty_like(x) if needed[0] else None
        for chunk, (start, size) in enumerate(bounds):
            with states[chunk].restored():
                done = self._chunk(
                    x.narrow(dim, start, size),
                    grad.narrow(dim, start, size),
                    None if rows is None else rows.narrow(dim, start, size),
                    want,
                    sums,
                    check=chunk == 0,
                )
            if not done:
                return None
        return [rows, *(sums.pop(id(p), None) for p in params)]

    def _chunk(
        self,
        x: torch.Tensor,
        grad: torch.Tensor,
        rows: torch.Tensor | None,
        want: dict[int, bool],
        sums: dict[int, torch.Tensor],
        check: bool,
    ) -> bool:
        """One chunk, Rule 4's order; its steps share the chunk's intermediates and free each
        at its last use, so they stay in one body. False: Rule 6 (nothing summed yet)."""
        gate_proj, up_proj, down_proj = self._linears()
        with torch.no_grad():
            gate = F.linear(x, gate_proj.weight, gate_proj.bias)
            up = F.linear(x, up_proj.weight, up_proj.bias)
        with torch.enable_grad(), kept_as_is():  # NOTE [Tiled regions], Rule 12
            gate.requires_grad_()
            act = self.act_fn(gate)
        if check and not (act.requires_grad and _reaches_only(act, gate)):
            return False
        with torch.no_grad():
            prod = act.detach() * up
            g = grad.reshape(-1, grad.shape[-1])
            flat = prod.view(-1, prod.shape[-1])
            _weight_and_bias(down_proj, g, flat, want, sums)
            transposed = stored_transposed(flat)
            del prod, flat
            d_prod = linear_input_grad(g, down_proj.weight, transposed)
            d_act = up.mul_(d_prod.view(up.shape))  # d_prod * up, in up's memory
            del up
            d_up = d_prod.mul_(act.detach().view(d_prod.shape))  # d_prod * act, in place
            del d_prod
            x_rows = x.reshape(-1, x.shape[-1])
            transposed = stored_transposed(x_rows)
            _weight_and_bias(up_proj, d_up, x_rows, want, sums)
            from_up = None if rows is None else linear_input_grad(d_up, up_proj.weight, transposed)
            del d_up
        (d_gate,) = torch.autograd.grad(act, gate, d_act)
        del d_act, act, gate
        with torch.no_grad():
            d_gate = d_gate.reshape(-1, d_gate.shape[-1])
            _weight_and_bias(gate_proj, d_gate, x_rows, want, sums)
            if rows is not None and from_up is not None:
                from_gate = linear_input_grad(d_gate, gate_proj.weight, transposed)
                torch.add(from_gate.view(x.shape), from_up.view(x.shape), out=rows)
        return True


def _weight_and_bias(
    linear: nn.Linear,
    grad: torch.Tensor,
    inputs: torch.Tensor,
    want: dict[int, bool],
    sums: dict[int, torch.Tensor],
) -> None:
    """Add one chunk's share of ``linear``'s weight and bias gradients to their sums (Rule 5)."""
    weight, bias = linear.weight, linear.bias
    if want.get(id(weight), False):
        sums[id(weight)] = weight_grad_into(sums.get(id(weight)), grad, inputs)
    if bias is not None and want.get(id(bias), False):
        total = sums.get(id(bias))
        sums[id(bias)] = grad.sum(0) if total is None else total.add_(grad.sum(0))


def _reaches_only(out: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Rule 6: every tensor requiring grad that ``out``'s graph reaches is ``leaf``."""
    return all(variable is leaf for variable in graph_leaves([out]))
