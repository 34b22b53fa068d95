"""One call of a tiled region: the autograd node, its forward and its recompute, chunk by chunk.

Owns ``TiledRun`` (what one call keeps: the saved inputs, each chunk's forward state, what the
outputs looked like) and ``TiledNode`` (its autograd node): slicing the split inputs, writing
the chunks' outputs into full-length buffers, the per-chunk recompute and backward with the
gradients put together, the debug probe, the check of undeclared tensors and of what the
recompute made. The rules are NOTE [Tiled regions] (``_tiling``, which owns the declaration
``Tiling`` and the entry points and builds one ``TiledRun`` per call); the parameters'
stand-ins and their gradients' sums are ``_tiled_grads``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _compat
from ._determinism import metadata_of
from ._errors import CheckpointError, describe_value, internal_error
from ._events import announce_kept, listener
from ._regions import region_label
from ._state import ForwardState, enter_span, exit_span, get_device_states
from ._tiled_gated import GatedMLP
from ._tiled_grads import StandIns, graph_leaves, kept_as_is, take_grad

__all__ = ["TiledNode", "TiledRun"]

_MSG_SPLIT_MISSING = (
    "{api}: Tiling.split names positional input {index}, but the call passed {count} positional "
    "input(s). Fix: pass the tensor to split positionally, or set split= to the inputs that "
    "hold one row per position."
)
_MSG_SPLIT_NOT_TENSOR = (
    "{api}: Tiling.split names positional input {index}, which must be a tensor with a "
    "dimension {dim}; got {got}. Fix: set split= to the tensor inputs that hold one row per "
    "position."
)
_MSG_SPLIT_LENGTHS = (
    "{api}: the split inputs differ in length along dim {dim}: {lengths}. A tiled region "
    "slices them together, so each must hold one row per position. Fix: leave tensors that "
    "every position shares out of split= (they reach every chunk whole)."
)
_MSG_KWARG_GRAD = (
    "{api}: keyword input {name!r} requires grad. A tiled region differentiates its "
    "positional inputs (and a module's parameters) only. Fix: pass it positionally."
)
_MSG_OUTPUT = (
    "{api}: output {index} of chunk {chunk} is {got}, but a tiled region's outputs must be "
    "position-wise: tensors of the chunk's length {length} along dim {dim} (one row per "
    "position). A reduction over positions (a loss, a mean) belongs outside the region: return "
    "per-position values and reduce them after it (for the LM head and its loss, use "
    "checkpointing.tiled_lm_head_loss)."
)
_MSG_OUTPUT_TYPE = (
    "{api}: the region returned {got}; a tiled region returns a tensor, or a tuple or list of "
    "tensors. Fix: return the position-wise tensors only."
)
_MSG_MIXING_DETECTED = (
    "{api}: the region is not position-wise along dim {dim}: output {index} of chunks 0 and 1 "
    "computed together differs from the same chunks computed alone (largest difference "
    "{diff:.3g}, tolerance {tol:.3g}). It mixes positions (attention, a norm or a softmax over "
    "that dimension, a cumulative op), so tiling it would change its result. Fix: tile only "
    "the position-wise part, or tile along another dimension."
)
_MSG_UNDECLARED = (
    "{api}: the recomputed chunk's graph reaches a tensor that requires grad and is neither an "
    "input of the region nor a declared parameter ({got}). Its gradient would be lost. Fix: "
    "pass it to the function as a positional input, or tile a module (checkpoint_module("
    "module, tile=...), whose parameters are declared)."
)
_MSG_PARAM_HOOKS = (
    "{api}: a parameter of the region ({got}) has gradient hooks (Tensor.register_hook). A "
    "tiled region computes each parameter's gradient chunk by chunk, and those hooks would run "
    "on every chunk's share and again on the sum, so a hook that changes the gradient would "
    "change it several times. Fix: register the hook elsewhere (e.g. "
    "register_post_accumulate_grad_hook, which runs once), or do not tile this module."
)
_MSG_RECOMPUTED = (
    "{api}: chunk {chunk}'s output {index} was recomputed as {got}, but the forward made "
    "{expected}. The region does not compute the same thing when re-run (a condition on "
    "global state, a random shape). Fix: make it deterministic, or pass "
    'determinism_check="none" to skip the check.'
)


class TiledNode(torch.autograd.Function):
    """The autograd node of one tiled call: forward by chunks, backward recomputes by chunks."""

    @staticmethod
    def forward(ctx: Any, run: TiledRun, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.run = run
        outs = run.forward(run.args, capture=run.preserve)
        run.args = ()  # only the saved inputs stay (Rule 1)
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        run: TiledRun = ctx.run
        return (None, *run.backward(grads, ctx.needs_input_grad[1:]))


class TiledRun:
    """One tiled call: the function, its inputs (saved), each chunk's forward state."""

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dim: int,
        split: tuple[int, ...],
        chunking: Callable[[int], list[tuple[int, int]]],
        params: tuple[torch.Tensor, ...],
        api: str,
    ) -> None:
        self.function = function
        self.kwargs = kwargs
        self.dim = dim
        self.split = split
        self.params = params
        self.api = api
        self.args = args
        for name, value in kwargs.items():
            for leaf in _compat.tree_leaves(value):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    raise ValueError(_MSG_KWARG_GRAD.format(api=api, name=name))  # Rule 8
        for param in params:
            if _compat.has_gradient_hooks(param):  # NOTE [Tiled regions], Rule 5
                raise ValueError(_MSG_PARAM_HOOKS.format(api=api, got=describe_value(param)))
        self.length = self._split_length(args)
        self.bounds = chunking(self.length)
        self.check_values = True
        self.probe = False
        self.preserve: bool | None = None
        self.grad_args: list[int] = []
        self.saved: list[Any] = []
        self.states: list[ForwardState] = []
        self.metadata: list[list[Any]] = []
        self.kind: type | None = None  # Tensor, tuple or list: what the function returned
        self.out_dims: list[int] = []
        self.gated: GatedMLP | None = None  # a gated MLP's hand-written backward

    def _split_length(self, args: tuple[Any, ...]) -> int:
        """The number of positions: every split input's length along ``dim`` (Rule 3)."""
        dim, lengths = self.dim, {}
        for index in self.split:
            if index >= len(args):
                raise ValueError(
                    _MSG_SPLIT_MISSING.format(api=self.api, index=index, count=len(args))
                )
            arg = args[index]
            if not isinstance(arg, torch.Tensor) or not -arg.dim() <= dim < arg.dim():
                raise ValueError(
                    _MSG_SPLIT_NOT_TENSOR.format(
                        api=self.api, index=index, dim=dim, got=describe_value(arg)
                    )
                )
            lengths[index] = arg.shape[dim]
        if len(set(lengths.values())) > 1:
            raise ValueError(_MSG_SPLIT_LENGTHS.format(api=self.api, dim=dim, lengths=lengths))
        return next(iter(lengths.values()))

    def chunk_args(self, args: Sequence[Any], start: int, size: int) -> list[Any]:
        """The arguments of one chunk: split inputs sliced, the others whole (Rule 3)."""
        out = list(args)
        for index in self.split:
            out[index] = args[index].narrow(self.dim, start, size)
        return out

    def flatten(self, out: Any, chunk: int, size: int) -> list[torch.Tensor]:
        """The chunk's output tensors, checked position-wise (Rules 3 and 8)."""
        kind = type(out) if isinstance(out, tuple | list) else torch.Tensor
        tensors = list(out) if kind is not torch.Tensor else [out]
        if self.kind is None:
            self.kind = kind
        dim = self.dim
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(_MSG_OUTPUT_TYPE.format(api=self.api, got=describe_value(out)))
            if not -tensor.dim() <= dim < tensor.dim() or tensor.shape[dim] != size:
                raise ValueError(
                    _MSG_OUTPUT.format(
                        api=self.api,
                        index=index,
                        chunk=chunk,
                        got=describe_value(tensor),
                        length=size,
                        dim=dim,
                    )
                )
        return tensors

    def forward(self, args: tuple[Any, ...], capture: bool | None) -> tuple[torch.Tensor, ...]:
        """Run every chunk (no graph), writing each output into its full-length buffer;
        ``capture``: record each chunk's forward state for its recompute (Rule 6). The chunks
        run as a kept span does, unseen by an outer region's selective policy (Rule 10)."""
        token = enter_span()
        try:
            return self._forward(args, capture)
        finally:
            exit_span(token)

    def _forward(self, args: tuple[Any, ...], capture: bool | None) -> tuple[torch.Tensor, ...]:
        buffers: list[torch.Tensor] = []
        dim = self.dim
        for chunk, (start, size) in enumerate(self.bounds):
            part = self.chunk_args(args, start, size)
            if capture is not None:
                self.states.append(ForwardState(tuple(part), capture))
                if listener.get() is not None:  # a report watches: the RNG states we keep
                    _announce_rng(self.states[-1], region_label(self.function, part))
            rng = _rng_now(part) if self.probe and chunk == 0 else None
            outs = self.flatten(self.function(*part, **self.kwargs), chunk, size)
            if self.check_values:
                self.metadata.append([metadata_of(o) for o in outs])
            if chunk == 0:
                shapes = [_with_length(o, dim, self.length) for o in outs]
                buffers = [
                    torch.empty(s, dtype=o.dtype, device=o.device)
                    for s, o in zip(shapes, outs, strict=True)
                ]
            for buffer, out in zip(buffers, outs, strict=True):
                target = buffer.narrow(dim, start, size)
                if target.shape != out.shape:
                    raise ValueError(
                        _MSG_OUTPUT.format(
                            api=self.api,
                            index=0,
                            chunk=chunk,
                            got=describe_value(out),
                            length=size,
                            dim=dim,
                        )
                    )
                target.copy_(out)
            del outs
            if rng is not None and _rng_now(part) != rng:
                self.probe = False  # it draws: not probed (Rule 7)
            if chunk == 1 and self.probe:
                self._probe(args, buffers)
        return tuple(buffers)

    def _probe(self, args: tuple[Any, ...], buffers: list[torch.Tensor]) -> None:
        """Rule 7: chunks 0 and 1 run together must give the rows they gave alone."""
        dim = self.dim
        both = self.bounds[0][1] + self.bounds[1][1]
        outs = self.flatten(self.function(*self.chunk_args(args, 0, both), **self.kwargs), 0, both)
        for index, (out, buffer) in enumerate(zip(outs, buffers, strict=True)):
            alone = buffer.narrow(dim, 0, both)
            if not out.is_floating_point():
                diff, tol = float((out != alone).sum()), 0.0
            else:
                tol = _tolerance(out.dtype)
                diff = float((out.float() - alone.float()).abs().max()) if out.numel() else 0.0
                scale = float(alone.float().abs().max()) if alone.numel() else 0.0
                tol = tol * max(1.0, scale)
            if diff > tol or diff != diff:
                raise CheckpointError(
                    _MSG_MIXING_DETECTED.format(
                        api=self.api, dim=dim, index=index, diff=diff, tol=tol
                    )
                )

    def backward(
        self, grads: tuple[torch.Tensor, ...], needed: tuple[bool, ...]
    ) -> list[torch.Tensor | None]:
        """Recompute chunk by chunk and backpropagate each chunk at once (Rules 1, 4, 5, 11)."""
        inputs = _compat.unpack_inputs(self.saved)
        if self.gated is not None and self.kind is torch.Tensor and self.gated.usable(inputs[0]):
            got = self.gated.backward(  # NOTE [Tiled gated MLP]
                inputs[0],
                grads[0],
                self.bounds,
                self.dim,
                self.states,
                self.params,
                (bool(self.grad_args) and needed[0], *needed[len(self.grad_args) :]),
            )
            if got is not None:
                return got if self.grad_args else got[1:]
        if self.params:
            stand_ins = StandIns(self.params, needed[len(self.grad_args) :])
            try:
                return self._backward(inputs, grads, needed, stand_ins)
            except _Bypassed:
                pass  # Rule 11: a parameter reached past the stand-ins; chunk 0 is redone
        return self._backward(inputs, grads, needed, None)

    def _backward(
        self,
        inputs: Sequence[Any],
        grads: tuple[torch.Tensor, ...],
        needed: tuple[bool, ...],
        stand_ins: StandIns | None,
    ) -> list[torch.Tensor | None]:
        dim = self.dim
        n_args = len(self.grad_args)
        split = set(self.split)
        # Whole-length gradient buffers of split inputs; sums for the others (Rule 4).
        results: list[torch.Tensor | None] = [None] * (n_args + len(self.params))
        shared: dict[int, torch.Tensor] = {}  # inputs reaching every chunk, as leaves
        for slot, index in enumerate(self.grad_args):
            if needed[slot] and index in split:
                results[slot] = torch.zeros_like(inputs[index])
            elif index not in split:
                shared[index] = inputs[index].detach().requires_grad_(needed[slot])
        declared = self.params if stand_ins is None else stand_ins.tensors
        for chunk, (start, size) in enumerate(self.bounds):
            part = self.chunk_args(inputs, start, size)
            leaves: list[torch.Tensor] = []
            for slot, index in enumerate(self.grad_args):
                if index in split:
                    part[index] = part[index].detach().requires_grad_(needed[slot])
                else:
                    part[index] = shared[index]
                leaves.append(part[index])
            hooks = kept_as_is()
            modes = stand_ins if stand_ins is not None else contextlib.nullcontext()
            with torch.enable_grad(), self.states[chunk].restored(), hooks, modes:  # Rule 12
                outs = self.flatten(self.function(*part, **self.kwargs), chunk, size)
            if self.check_values:
                self._check_recomputed(chunk, outs)
            if chunk == 0:  # Rules 5 and 11
                _refuse_undeclared(outs, (*leaves, *declared), self.params, self.api)
            pairs = [
                (out, grad.narrow(dim, start, size))
                for out, grad in zip(outs, grads, strict=True)
                if out.requires_grad and grad is not None
            ]
            targets = [t for t, n in zip((*leaves, *declared), needed, strict=True) if n]
            if not pairs or not targets:
                continue
            if stand_ins is None:
                got = torch.autograd.grad(
                    [p[0] for p in pairs], targets, [p[1] for p in pairs], allow_unused=True
                )
                del outs, pairs
                self._accumulate(results, got, needed, start, size, grads)
                del got  # else this chunk's gradients live on through the next chunk's backward
                continue
            # Rule 11: each gradient is added to its leaf's as soon as it is made.
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs], inputs=targets)
            del outs, pairs
            for slot, index in enumerate(self.grad_args):
                rows, leaf = results[slot], leaves[slot]
                if index in split and rows is not None and leaf.grad is not None:
                    rows.narrow(dim, start, size).copy_(leaf.grad)
                    leaf.grad = None
        if stand_ins is not None:
            for slot, index in enumerate(self.grad_args):
                if index not in split:
                    results[slot] = take_grad(shared[index])
            for k, stand_in in enumerate(stand_ins.tensors):
                results[n_args + k] = stand_ins.take(stand_in)
        return results

    def _accumulate(
        self,
        results: list[torch.Tensor | None],
        got: Sequence[torch.Tensor | None],
        needed: tuple[bool, ...],
        start: int,
        size: int,
        grads_in: tuple[torch.Tensor, ...],
    ) -> None:
        """Add one chunk's gradients (captured, Rule 11's fallback): split inputs into their
        rows, the rest summed in chunk order (Rule 4)."""
        split = set(self.split)
        slots = [s for s, n in enumerate(needed) if n]
        for slot, grad in zip(slots, got, strict=True):
            if grad is None:
                continue
            if slot < len(self.grad_args) and self.grad_args[slot] in split:
                rows = results[slot]
                if rows is None:
                    internal_error("no gradient buffer for a split input")
                rows.narrow(self.dim, start, size).copy_(grad)
            elif results[slot] is None:
                results[slot] = grad if _owns_memory(grad, grads_in) else grad.clone()
            else:
                results[slot].add_(grad)  # type: ignore[union-attr]  # not None: the branch above

    def _check_recomputed(self, chunk: int, outs: list[torch.Tensor]) -> None:
        expected = self.metadata[chunk]
        for index, out in enumerate(outs):
            got = metadata_of(out)
            if index >= len(expected) or got != expected[index]:
                raise CheckpointError(
                    _MSG_RECOMPUTED.format(
                        api=self.api,
                        chunk=chunk,
                        index=index,
                        got=got,
                        expected=expected[index] if index < len(expected) else "no such output",
                    )
                )

    def rebuild(self, outs: tuple[torch.Tensor, ...]) -> Any:
        """The outputs in the form the function returned them."""
        if self.kind is torch.Tensor:
            return outs[0]
        if self.kind is list:
            return list(outs)
        return tuple(outs)


def _announce_rng(state: ForwardState, region: str) -> None:
    """Tell a watching report of the RNG states a chunk keeps by plain reference (as NOTE
    [Nestable checkpoint], Rule 11, does for a frame's)."""
    for rng_state in (state.cpu_rng, *state.device_rng):
        if rng_state is not None:
            announce_kept(rng_state, region, "rng state")


def _owns_memory(grad: torch.Tensor, grads_in: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``grad`` may become the running sum (added to in place): dense, and not
    sharing memory with an incoming gradient (``x + w`` hands ``w`` the output's gradient)."""
    if not grad.is_contiguous():
        return False
    pointer = grad.untyped_storage().data_ptr()
    return all(g is None or g.untyped_storage().data_ptr() != pointer for g in grads_in)


def _with_length(tensor: torch.Tensor, dim: int, length: int) -> list[int]:
    shape = list(tensor.shape)
    shape[dim] = length
    return shape


def _rng_now(args: Sequence[Any]) -> tuple[bytes, ...]:
    """The CPU and accelerator RNG states, to tell whether a chunk drew (debug probe only)."""
    _, device_states = get_device_states(*args)
    return tuple(
        bytes(s.numpy()) for s in (torch.get_rng_state(), *[d.cpu() for d in device_states])
    )


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the probe (Rule 7): rounding of a kernel run on another row
    count, far below what mixing positions changes."""
    return {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float64: 1e-10}.get(dtype, 1e-4)


def _refuse_undeclared(
    outs: list[torch.Tensor],
    declared: tuple[torch.Tensor, ...],
    params: tuple[torch.Tensor, ...],
    api: str,
) -> None:
    """Rule 5: every leaf the chunk's graph reaches is a declared input or parameter; a
    declared parameter reached itself where stand-ins were declared raises ``_Bypassed``
    (Rule 11)."""
    known = {id(t) for t in declared}
    own = {id(p) for p in params}
    for variable in graph_leaves(outs):
        if id(variable) not in known:
            if id(variable) in own:
                raise _Bypassed
            raise CheckpointError(_MSG_UNDECLARED.format(api=api, got=describe_value(variable)))


class _Bypassed(Exception):
    """A recomputed chunk reached a declared parameter itself, not its stand-in (Rule 11)."""
