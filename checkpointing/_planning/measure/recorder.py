"""The recorder: one training step watched op by op and save by save (Rules M1-M6, A3, M9, S8, M11,
M13 and M14).

Owns ``record_step``: one forward+backward of the model under a dispatch mode (every op: FLOPs,
bytes moved, outputs, in-place writes, random draws; its predicted seconds by the cost model,
Rule M8) and a saved-tensors hook (every storage autograd keeps, and which region's op kept it),
with forward hooks on the regions (which one runs) and their children (where a trail may
start), and the head and tail spans as a scope would record them. What it returns, ``_Step``,
is raw; ``profile`` turns it into a ``StepProfile``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from ... import _compat
from ..._scope.ops import written_tensors
from ..._selective import SAC_IGNORED_OPS, draws_random, is_collective, may_skip, reads_values
from ..._state import ForwardState
from ..._trees import (
    StorageKey,
    shape_storage_key,
    shape_storage_nbytes,
    storage_key,
    storage_nbytes,
    tensors,
)
from .costs import DeviceCosts
from .flops import op_flops
from .kept_span_watch import SpanWatch
from .recorded_spans import SpanProfile
from .step_profile import OpCall, RegionProfile, Trail
from .steps import default_loss, differentiate

__all__ = ["record_step"]

# Rule M15: the ops of FSDP2 (``fsdp::``) and of process groups (``c10d::``, in place on
# buffers of the sharding's own); functional collectives (``_c10d_functional::``, tensor
# parallelism's) make activations and are recorded as any op.
_SHARDING_NAMESPACES: Final = frozenset({"fsdp", "c10d"})


@dataclass(slots=True)
class _ChildCall:
    """A child call of a running region, while profiling (Rule M13)."""

    name: str
    start: int
    saved: frozenset[int]
    stop: int
    span: SpanProfile
    output: Any = None
    end: int = -1


class _Step:
    """What one step records: storage ids, the running region, per-region op sequences."""

    def __init__(
        self,
        regions: Sequence[tuple[str, nn.Module]],
        leaves: set[StorageKey],
        costs: DeviceCosts,
        tail: int = 0,
        shapes: bool = False,
    ):
        # NOTE [Storage keys], Rule 4: a step of shapes names storages by their objects.
        self.key = shape_storage_key if shapes else storage_key
        self.nbytes = shape_storage_nbytes if shapes else storage_nbytes
        self.leaves = leaves
        self.costs = costs
        self.forward_seconds = 0.0  # every op's predicted seconds, in the regions or not
        self.ids: dict[StorageKey, int] = {}
        self.storage_bytes: dict[int, int] = {}
        self.profiles = [RegionProfile(name, type(m).__qualname__) for name, m in regions]
        # Per running region call: its profile, op occurrence counts, ops, and (a one-element
        # list, updated in place) how many ops had run when autograd last saved a tensor.
        self.stack: list[tuple[RegionProfile, dict[object, int], list[OpCall], list[int]]] = []
        self.calls: dict[int, list[tuple[list[OpCall], int, Trail | None]]] = {}
        self.outside: set[int] = set()
        # Rule A3: the id of the CPU state the last capture kept (None: none yet), and whether
        # a random op ran on this thread since (never another thread's: its draws are not ours).
        self.cpu_state: int | None = None
        self.drawn = False
        # Rule M11: the head records until the first region call; the tail from the first call
        # of a tail region (the last ``tail`` regions) to the end of the last one's.
        self.head = SpanProfile("head")
        self.tail = SpanProfile("tail")
        self.span: SpanProfile | None = self.head
        self.tail_first = len(regions) - tail if tail else -1
        self.tail_last = len(regions) - 1 if tail else -1
        self.tail.start, self.tail.until = self.tail_first, self.tail_last
        self.returned = False  # the model's forward has returned: the loss runs now
        self.late: set[int] = set()  # storages saved after it (Rule M11)
        self.children: list[list[_ChildCall]] = []  # per running region call (Rule M13)
        self.in_kept_span = 0  # Rule M14: a kept span's ops are not the region's
        # Rule S9: every op dispatched so far (ignored and sharding ones too), the region that
        # last ended outside every other (its index, that count, its thread), and per region
        # whether each of its calls started right after the region before it ended.
        self.ops_seen = 0
        self.left: tuple[int, int, int] | None = None
        self.follows: dict[int, list[bool]] = {}

    def activation(self, tensor: torch.Tensor) -> int | None:
        """The id of ``tensor``'s storage if it is an activation of this step (Rule M2)."""
        key = self.key(tensor)
        return None if key is None else self.ids.get(key)

    def forget(self, memory: Iterator[torch.Tensor]) -> None:
        """Rule M15: what a sharding op made or filled is a parameter or a buffer of the
        sharding's, never an activation, whatever id its address had."""
        for tensor in memory:
            key = self.key(tensor)
            if key is not None:
                self.ids.pop(key, None)

    def enter(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.span is self.head:
            self.span = None
            self.head.until = index
        if index == self.tail_first:
            self.tail.calls += 1
            self.span = self.tail
        profile = self.profiles[index]
        here = (index - 1, self.ops_seen, threading.get_ident())
        self.follows.setdefault(index, []).append(not self.stack and self.left == here)
        for tensor in tensors((args, kwargs)):  # keyword and nested ones included (Rule A3)
            storage = self.activation(tensor)
            if storage is not None:
                profile.inputs.add(storage)
        # Rule M11: a frame keeps these by plain reference, no holder can stand for them.
        for tensor in tensors(([a for a in args if not isinstance(a, torch.Tensor)], kwargs)):
            storage = self.activation(tensor)
            if storage is not None:
                profile.referenced.add(storage)
        if torch.is_grad_enabled():  # a frame captures nothing under no_grad
            captured = set(self.capture_rng(args))
            profile.states |= captured
            profile.captured |= captured  # Rule S9: a chain starting here keeps them
        self.stack.append((profile, {}, [], [0]))
        self.children.append([])

    def capture_rng(self, args: tuple[Any, ...]) -> Iterator[int]:
        """Rule A3: the ids of the RNG states a frame entered here would keep: the CPU state
        is the previous capture's where no random op of this step ran since (the frame shares
        a state identical to its previous capture; another thread's draws are not the
        model's), each device state one of its own."""
        with warnings.catch_warnings():  # mixed devices: the frame itself warns when applied
            warnings.simplefilter("ignore")
            state = ForwardState(args, preserve_rng_state=True)
        if state.cpu_rng is not None:
            if self.cpu_state is None or self.drawn:
                self.cpu_state = self.new_storage(state.cpu_rng)
            self.drawn = False
            yield self.cpu_state
        for tensor in state.device_rng:
            yield self.new_storage(tensor)

    def new_storage(self, tensor: torch.Tensor) -> int:
        """A storage of the step that no op made (an RNG state): its id."""
        storage = len(self.storage_bytes)
        self.storage_bytes[storage] = tensor.untyped_storage().nbytes()
        return storage

    def settle_states(self) -> None:
        """Rule A3: a region that drew nothing in any call keeps no RNG state (``apply``
        checkpoints it without preserving one); the others keep theirs, each shared as the
        frame shares it with its previous capture."""
        for profile in self.profiles:
            if not profile.draws:
                profile.states.clear()

    def leave(self, index: int, output: Any = None) -> None:
        if index == self.tail_last and self.span is self.tail:
            self.span = None
        profile, _counts, ops, stop = self.stack.pop()
        calls = self.children.pop()
        self.left = None if self.stack else (index, self.ops_seen, threading.get_ident())
        if output is not None:  # Rule S9: what a region joined after it may receive from it
            found = (self.activation(t) for t in tensors(output))
            profile.outputs = {s for s in found if s is not None}
        trail = None
        if calls and output is not None:  # Rule M13: its last child, called once, ends it
            last = calls[-1]
            if (
                last.end == len(ops) > last.start
                and last.output is output
                and sum(c.name == last.name for c in calls) == 1
                and last.span.usable
            ):
                last.span.start = last.span.until = index
                last.span.module = last.name
                trail = Trail(last.name, last.start, last.saved, last.stop, last.span)
        self.calls.setdefault(index, []).append((ops, stop[0], trail))

    def child_enter(self, index: int, name: str) -> None:
        """Rule M13: a child of region ``index`` starts (recorded as a span where the region is
        the one running and no head or tail span records)."""
        if not self.stack or self.stack[-1][0] is not self.profiles[index] or self.span is not None:
            return
        profile, _counts, ops, stop = self.stack[-1]
        call = _ChildCall(name, len(ops), frozenset(profile.saved), stop[0], SpanProfile("trail"))
        self.children[-1].append(call)
        self.span = call.span

    def child_leave(self, output: Any) -> None:
        calls = self.children[-1] if self.children else None
        if calls and self.span is not None and self.span is calls[-1].span:
            calls[-1].output = output
            calls[-1].end = len(self.stack[-1][2])
            self.span = None

    def on_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Record one op: its fresh storages get ids (Rule M1); its kind (Rules M4-M6); its
        predicted seconds (Rule M8); what it reads and whether the replay may skip it (Rule S8)."""
        arguments = list(tensors((args, kwargs)))
        inputs = {self.key(t) for t in arguments}
        fresh: list[int] = []
        every_fresh = True  # every output in a storage of its own
        for tensor in tensors(out):
            key = self.key(tensor)
            if key is None or key in inputs or key in self.leaves:
                every_fresh = False
                continue
            storage = self.ids[key] = len(self.storage_bytes)  # a reused address: a new id
            self.storage_bytes[storage] = self.nbytes(tensor)
            fresh.append(storage)
        flops = op_flops(func, args, kwargs, out)
        random = draws_random(func, args, kwargs)
        mutates = _compat.op_mutates_inputs(func)
        writes = not random and mutates
        moved = _moved_bytes(func, arguments, inputs, out, mutates, self.key)
        drawn = _drawn(func, arguments, out) if random else 0
        seconds = self.costs.op(flops, moved, _float32(arguments), drawn)
        self.forward_seconds += seconds
        if self.span is not None:
            # Every argument of an op without a schema (a higher-order one) counts as written.
            written = (
                written_tensors(func, args, kwargs)
                if isinstance(func, _compat.OpOverload)
                else arguments
            )
            activations = [self.activation(t) for t in arguments]
            self.span.record(
                seconds, flops, fresh, activations, random, [self.activation(t) for t in written]
            )
        if random:  # Rule A3: every running region draws, a kept span's draws included
            self.drawn = True
            for running in self.stack:
                running[0].draws = True
        if not self.stack or self.in_kept_span:  # Rule M14: numbered as the selective modes do
            return
        profile, counts, ops, _stop = self.stack[-1]
        read = (
            tuple(dict.fromkeys(s for t in arguments if (s := self.activation(t)) is not None))
            if reads_values(func)  # Rule S8: dropout's empty_like(x) needs no x
            else ()
        )  # an input's storage is not an output's: its id is still the input's
        index = counts.get(func, 0)
        counts[func] = index + 1
        if is_collective(func):  # Rule M15: kept whenever the region is checkpointed
            outputs = [s for t in tensors(out) if (s := self.activation(t)) is not None]
            profile.kept.update(outputs)
            ops.append(OpCall(str(func), index, 0.0, 0, "kept", tuple(outputs)))
            return
        if random or writes:
            kind = "random" if random else "inplace"
            fresh = [s for t in tensors(out) if (s := self.activation(t)) is not None]
        elif fresh:
            kind = "unit"
        else:  # Rule S8: a view only where every output shares an input's storage
            outs = [self.key(t) for t in tensors(out)]
            kind = "view" if outs and all(k is not None and k in inputs for k in outs) else "none"
        # Rule S8: where the replay's blanks may stand for the outputs, as its mode decides
        # (NOTE [Selective checkpoint cache], Rule 14), effect ops (which it keeps) aside.
        skippable = (
            kind == "unit"
            and every_fresh
            and may_skip(func, args, kwargs, out)
            and not _compat.has_ordered_effect(func)
        )
        ops.append(OpCall(str(func), index, seconds, flops, kind, tuple(fresh), read, skippable))

    def on_saved(self, tensor: torch.Tensor, kept: bool = False) -> None:
        """Rule M9: a frame has a holder for every tensor saved in its region, parameters
        included, so recompute runs up to the op during which the last one is saved. An op's
        inputs are saved before it runs (the recorder has not seen it yet), its outputs after; what
        a kept span keeps is no holder (Rule M14)."""
        if self.stack and not kept:
            self.stack[-1][3][0] = len(self.stack[-1][2])
        storage = self.activation(tensor)
        if storage is None:
            return
        if self.span is not None:
            self.span.saves.add(storage)
        if self.stack:
            self.stack[-1][0].saved.add(storage)
        else:
            self.outside.add(storage)
            if self.returned:
                self.late.add(storage)


class _Recorder(_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Hands every op to the step (no clock: its seconds are the cost model's, Rule M8)."""

    def __init__(self, step: _Step) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.step = step

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        self.step.ops_seen += 1  # Rule S9: any op between two regions breaks a chain there
        if func in SAC_IGNORED_OPS:  # Rule M3: counted as selective checkpointing counts
            return func(*args, **kwargs)
        if getattr(func, "namespace", None) in _SHARDING_NAMESPACES:  # Rule M15
            out = func(*args, **kwargs)
            self.step.forget(tensors((args, kwargs, out)))
            return out
        out = func(*args, **kwargs)
        self.step.on_op(func, args, kwargs, out)
        return out


def _moved_bytes(
    func: Any,
    arguments: list[torch.Tensor],
    inputs: set[StorageKey | None],
    out: Any,
    mutates: bool,
    key: Callable[[torch.Tensor], StorageKey | None],
) -> int:
    """Rule M8: the bytes an op reads and writes: its tensor arguments' elements (none for the
    ops that read only metadata, ``empty_like``) and its outputs' (those in storages of their
    own, or, in place, those it writes); none for a view or an op without a tensor output."""
    outputs = list(tensors(out))
    written = [t for t in outputs if mutates or key(t) not in inputs]
    if not written:
        return 0
    read = sum(_nbytes(t) for t in arguments) if reads_values(func) else 0
    return read + sum(_nbytes(t) for t in written)


def _drawn(func: Any, arguments: list[torch.Tensor], out: Any) -> int:
    """Rule M8: the random numbers a drawing op draws: a fused attention with dropout (a
    ``dropout_p`` argument) one per score, query rows times key rows; any other op one per element
    of its first output (``bernoulli_``'s tensor, ``native_dropout``'s result, ``rand``'s)."""
    if (
        isinstance(func, _compat.OpOverload)
        and _compat.argument_index(func, "dropout_p") is not None
    ):
        if len(arguments) < 2 or arguments[0].dim() < 2 or arguments[1].dim() < 2:
            return 0
        query, key = arguments[0], arguments[1]
        return query.numel() // max(1, query.shape[-1]) * key.shape[-2]
    first = next(iter(tensors(out)), None)
    return 0 if first is None else first.numel()


def _float32(arguments: list[torch.Tensor]) -> bool:
    """Whether an op's matrix work runs at the device's float32 rate (Rule M8): its first
    floating-point argument is 32- or 64-bit."""
    first = next((t for t in arguments if t.is_floating_point()), None)
    return first is not None and first.element_size() >= 4


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def record_step(
    model: nn.Module,
    regions: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    leaves: set[StorageKey],
    wrt: list[torch.Tensor],
    costs: DeviceCosts,
    tail: int = 0,
    shapes: bool = False,
) -> _Step:
    """One forward+backward under the recorder; gradients go nowhere (``autograd.grad``).
    ``shapes``: the tensors are fake (NOTE [Planning without memory])."""
    step = _Step(regions, leaves, costs, tail, shapes)
    handles = []
    for index, (name, module) in enumerate(regions):
        handles.append(
            module.register_forward_pre_hook(
                lambda _m, a, k, i=index: step.enter(i, a, k), with_kwargs=True
            )
        )
        handles.append(
            module.register_forward_hook(
                lambda _m, _a, o, i=index: step.leave(i, o), always_call=True
            )
        )
        if index >= len(regions) - tail:
            continue  # Rule M13: blocks only; the tail is a span of its own (Rule M11)
        for child_name, child in module.named_children():
            handles.append(
                child.register_forward_pre_hook(
                    lambda _m, _a, i=index, n=f"{name}.{child_name}": step.child_enter(i, n)
                )
            )
            handles.append(
                child.register_forward_hook(lambda _m, _a, o: step.child_leave(o), always_call=True)
            )
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(SpanWatch(step), _unpack),
            _Recorder(step),
        ):
            output = model(*args, **kwargs)
            step.returned = True
            loss = default_loss(output) if loss_fn is None else loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(_MSG_LOSS.format(got=_describe(loss)))
        differentiate(loss, wrt)
        step.settle_states()
    finally:
        for handle in handles:
            handle.remove()
    return step


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} (requires_grad={value.requires_grad})"
    return f"{type(value).__name__}"


_MSG_LOSS = (
    "checkpointing.plan_checkpointing: loss_fn must return a scalar tensor that requires grad, "
    "got {got}. Fix: return e.g. output.logits.float().mean()."
)
