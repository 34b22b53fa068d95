"""Profiling a training step for the planner: what each op of each region costs and keeps.

Owns ``profile_step``: a few real forward+backward steps of the model on the example inputs,
watched by a dispatch mode (every op: time, FLOPs, outputs, in-place writes, random draws) and a
saved-tensors hook (every storage autograd keeps, and which region's op kept it), with forward
hooks on the region modules saying which region is running; then forward passes with each region
timed plainly and inside a selective policy's forward mode (what the policy costs per op, Rule
13). The result, ``StepProfile``, is plain data in the solver's terms (``solver.Problem``);
deciding belongs to ``solver``, installing to ``plan``. See NOTE [Planner model] in
``checkpointing._planning`` for the rules it follows.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from .. import _compat
from .._selective import SAC_IGNORED_OPS, draws_random
from .._state import ForwardState
from .solver import Problem, RegionChoices, Unit

__all__ = [
    "OpCall",
    "RegionProfile",
    "StepProfile",
    "default_loss",
    "input_shapes",
    "profile_step",
    "tensors",
    "untouched",
]

# Measured op times below this are mostly dispatch noise; where torch knows the op's FLOPs, the
# time is estimated from them at the rate the trusted ops of the same step achieved (Rule 9).
_TRUSTED_SECONDS: Final = 20e-6
_DEFAULT_FLOP_RATE: Final = 1e10  # FLOP/s when no op of the step was slow enough to measure it
_PROFILE_STEPS: Final = 3  # measured steps, after one warm-up step
_POLICY_ROUNDS: Final = 10  # forward passes timed plainly and under a selective policy (Rule 13)

StorageKey = tuple[torch.device, int]


@dataclass(slots=True)
class OpCall:
    """One op run inside a region, summed over the region's calls in a step."""

    op: str
    index: int
    seconds: float
    flops: int
    kind: str  # "unit" (may be saved), "view", "inplace", "random", "none" (no tensor output)
    storages: tuple[int, ...]  # fresh storages the op produced (ids of ``StepProfile``)


@dataclass(slots=True)
class RegionProfile:
    """One region: its ops in order, what autograd saved inside it, and its inputs."""

    name: str
    type_name: str
    calls: int = 0
    ops: list[OpCall] = field(default_factory=list)
    saved: set[int] = field(default_factory=set)
    inputs: set[int] = field(default_factory=set)
    states: set[int] = field(default_factory=set)
    """The RNG states a checkpoint of the region would keep (Rule 14)."""


@dataclass(slots=True)
class StepProfile:
    """A profiled step: regions, the bytes of every activation storage, and what is saved
    outside every region."""

    regions: list[RegionProfile]
    storage_bytes: dict[int, int]
    outside: set[int]
    input_shapes: list[list[int]]
    device: str
    step_seconds: float
    policy_seconds_per_op: float = 0.0
    """What a selective policy adds per op of a region call, forward and recompute (Rule 13)."""

    def problem(self, policy_seconds_per_op: float) -> Problem:
        """The solver's view of this step (Rules 4-6 decide which ops are units); a selective
        policy costs ``policy_seconds_per_op`` per op of a region call (Rule 13)."""
        regions = []
        for region in self.regions:
            written = {s for c in region.ops if c.kind in ("inplace", "random") for s in c.storages}
            units: list[Unit] = []
            forced = 0.0
            for call in region.ops:
                if call.kind == "unit" and not written.intersection(call.storages):
                    units.append(Unit((call.op, call.index), call.seconds, call.storages))
                else:
                    forced += call.seconds
            regions.append(
                RegionChoices(
                    frozenset(region.saved),
                    frozenset(region.inputs | region.states),
                    forced,
                    tuple(units),
                    policy_seconds_per_op * len(region.ops) * region.calls,
                )
            )
        return Problem(tuple(regions), dict(self.storage_bytes), frozenset(self.outside))


class _Step:
    """What one step records: storage ids, the running region, per-region op sequences."""

    def __init__(self, regions: Sequence[tuple[str, nn.Module]], leaves: set[StorageKey]):
        self.leaves = leaves
        self.ids: dict[StorageKey, int] = {}
        self.storage_bytes: dict[int, int] = {}
        self.profiles = [RegionProfile(name, type(m).__qualname__) for name, m in regions]
        self.stack: list[tuple[RegionProfile, dict[object, int], list[OpCall]]] = []
        self.calls: dict[int, list[list[OpCall]]] = {}
        self.outside: set[int] = set()
        self.flop_samples: list[tuple[int, float]] = []
        # Rule 14: the captured RNG states, alive for the step (no address reused), by identity.
        self.rng_states: dict[int, tuple[torch.Tensor, int]] = {}

    def activation(self, tensor: torch.Tensor) -> int | None:
        """The id of ``tensor``'s storage if it is an activation of this step (Rule 2)."""
        key = _storage_key(tensor)
        return None if key is None else self.ids.get(key)

    def enter(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        profile = self.profiles[index]
        for tensor in tensors((args, kwargs)):  # keyword and nested ones included (Rule 14)
            storage = self.activation(tensor)
            if storage is not None:
                profile.inputs.add(storage)
        if torch.is_grad_enabled():  # a frame captures nothing under no_grad
            profile.states.update(self.capture_rng(args))
        self.stack.append((profile, {}, []))

    def capture_rng(self, args: tuple[Any, ...]) -> Iterator[int]:
        """Rule 14: the ids of the RNG states a frame entered here would keep, captured as the
        frame captures them: a CPU state identical to the previous capture is the same tensor,
        the same storage."""
        with warnings.catch_warnings():  # mixed devices: the frame itself warns when applied
            warnings.simplefilter("ignore")
            state = ForwardState(args, preserve_rng_state=True)
        for tensor in (state.cpu_rng, *state.device_rng):
            if tensor is None:
                continue
            known = self.rng_states.get(id(tensor))
            if known is None:
                known = self.rng_states[id(tensor)] = (tensor, len(self.storage_bytes))
                self.storage_bytes[known[1]] = tensor.untyped_storage().nbytes()
            yield known[1]

    def leave(self, index: int) -> None:
        _profile, _counts, ops = self.stack.pop()
        self.calls.setdefault(index, []).append(ops)

    def on_op(self, func: Any, args: Any, kwargs: Any, out: Any, seconds: float) -> None:
        """Record one op: its fresh storages get ids (Rule 1); its kind (Rules 4-6)."""
        inputs = {_storage_key(t) for t in tensors((args, kwargs))}
        fresh: list[int] = []
        for tensor in tensors(out):
            key = _storage_key(tensor)
            if key is None or key in inputs or key in self.leaves:
                continue
            storage = self.ids[key] = len(self.storage_bytes)  # a reused address: a new id
            self.storage_bytes[storage] = tensor.untyped_storage().nbytes()
            fresh.append(storage)
        count = flop_registry.get(func.overloadpacket)
        flops = int(count(*args, **kwargs, out_val=out)) if count is not None else 0
        if flops and seconds >= _TRUSTED_SECONDS:
            self.flop_samples.append((flops, seconds))
        if not self.stack:
            return
        _profile, counts, ops = self.stack[-1]
        index = counts.get(func, 0)
        counts[func] = index + 1
        if draws_random(func, args, kwargs) or _compat.op_mutates_inputs(func):
            kind = "random" if draws_random(func, args, kwargs) else "inplace"
            fresh = [s for t in tensors(out) if (s := self.activation(t)) is not None]
        elif fresh:
            kind = "unit"
        else:
            kind = "view" if any(True for _ in tensors(out)) else "none"
        ops.append(OpCall(str(func), index, seconds, flops, kind, tuple(fresh)))

    def on_saved(self, tensor: torch.Tensor) -> None:
        storage = self.activation(tensor)
        if storage is None:
            return
        if self.stack:
            self.stack[-1][0].saved.add(storage)
        else:
            self.outside.add(storage)


class _Recorder(_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Times every op (synchronizing an accelerator around it) and hands it to the step."""

    def __init__(self, step: _Step, synchronize: Callable[[], None] | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.step = step
        self.synchronize = synchronize

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:  # Rule 3: counted as selective checkpointing counts
            return func(*args, **kwargs)
        sync = self.synchronize
        if sync is not None:
            sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if sync is not None:
            sync()
        self.step.on_op(func, args, kwargs, out, time.perf_counter() - start)
        return out


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors among the leaves of a pytree."""
    for leaf in _compat.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def _storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Where ``tensor``'s memory lives; None for tensors without memory (meta, empty)."""
    if tensor.device.type == "meta" or tensor.is_sparse:
        return None
    pointer = tensor.untyped_storage().data_ptr()
    return None if pointer == 0 else (tensor.device, pointer)


def default_loss(output: Any) -> torch.Tensor:
    """The sum of every floating-point tensor in the output that requires grad."""
    terms = [t.float().sum() for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms:
        raise ValueError(_MSG_NO_GRAD)
    return torch.stack(terms).sum()


_MSG_NO_GRAD = (
    "checkpointing.plan_checkpointing: the model's output has no floating-point tensor that "
    "requires grad, so there is nothing to backward and no activation is kept. Fix: pass "
    "inputs or parameters that require grad, or a loss_fn(output) -> scalar tensor."
)
_MSG_LOSS = (
    "checkpointing.plan_checkpointing: loss_fn must return a scalar tensor that requires grad, "
    "got {got}. Fix: return e.g. output.logits.float().mean()."
)


@contextlib.contextmanager
def untouched(modules: Sequence[nn.Module], inputs: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Rule 8: after the block, the modules' buffers and their parameters' ``.grad`` are as they
    were, and so are the CPU RNG state and that of every accelerator the modules or ``inputs``
    are on. A buffer is copied back only where its values changed, so that one a live graph
    saved is not bumped for nothing (its version cannot tell: BatchNorm's kernel writes its
    statistics without moving it). Shared by the planner's profile and
    ``checkpoint_sequential``'s measuring pass."""
    parameters = list({id(p): p for m in modules for p in m.parameters()}.values())
    buffers = list({id(b): b for m in modules for b in m.buffers()}.values())
    devices = sorted({t.device.index or 0 for t in (*parameters, *buffers, *inputs) if t.is_cuda})
    copies = [(b, b.detach().clone()) for b in buffers]
    grads = [(p, p.grad) for p in parameters]
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, copy in copies:
                    if not torch.equal(buffer, copy):
                        buffer.copy_(copy)
            for parameter, grad in grads:
                parameter.grad = grad


def input_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[int]]:
    """Rule 12: the shapes a plan compares, positional inputs first, then keyword ones by name
    (not in call order), 0-d tensors (a scalar such as a loss's token count) left out."""
    named = tuple(kwargs[name] for name in sorted(kwargs))
    return [list(t.shape) for t in tensors((args, named)) if t.dim() > 0]


ModesFactory = Callable[[], tuple[Any, Any]]


def profile_step(
    model: nn.Module,
    regions: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    policy_modes: ModesFactory | None = None,
) -> StepProfile:
    """Run one warm-up and ``_PROFILE_STEPS`` measured steps; return the last one's structure
    with each op's fastest time (Rule 9). With ``policy_modes`` (the selective modes ``apply``
    would install), also measure what they add per op (Rule 13). The model is left as found
    (Rule 8)."""
    inputs = list(tensors((args, kwargs)))
    leaves = {
        key
        for t in (*model.parameters(), *model.buffers(), *inputs)
        if (key := _storage_key(t)) is not None
    }
    wrt = [p for p in model.parameters() if p.requires_grad] + [
        t for t in inputs if t.requires_grad
    ]
    device = next((t.device for t in (*model.parameters(), *inputs)), torch.device("cpu"))
    synchronize = torch.cuda.synchronize if device.type == "cuda" else None
    steps = []
    # Rule 8: the profiled steps train, so grad is on whatever the caller's mode (restored after).
    with untouched([model], inputs), torch.enable_grad(), torch.inference_mode(False):
        for _ in range(1 + _PROFILE_STEPS):
            steps.append(_one_step(model, regions, args, kwargs, loss_fn, leaves, wrt, synchronize))
        profile = _combine(steps[1:], input_shapes(args, kwargs), str(device))
        if policy_modes is not None:
            profile.policy_seconds_per_op = _policy_seconds_per_op(
                model, regions, args, kwargs, profile, policy_modes, synchronize
            )
    return profile


def _policy_seconds_per_op(
    model: nn.Module,
    regions: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    profile: StepProfile,
    policy_modes: ModesFactory,
    synchronize: Callable[[], None] | None,
) -> float:
    """Rule 13, on the model's own regions: each region's forward timed plainly and inside the
    policy's forward mode, ``_POLICY_ROUNDS`` times each in turn (the fastest counts); the
    difference per op, doubled for the recompute mode's replay of every op."""
    plain = [math.inf] * len(regions)
    selective = [math.inf] * len(regions)
    for round_ in range(_POLICY_ROUNDS):
        for under_policy in (False, True) if round_ % 2 == 0 else (True, False):
            seconds = _region_forwards(
                model, regions, args, kwargs, policy_modes if under_policy else None, synchronize
            )
            best = selective if under_policy else plain
            for index, taken in enumerate(seconds):
                best[index] = min(best[index], taken)
    ops = sum(len(r.ops) * r.calls for r in profile.regions)
    added = sum(s - p for s, p in zip(selective, plain, strict=True) if p < math.inf)
    return 2 * max(0.0, added) / max(ops, 1)


def _region_forwards(
    model: nn.Module,
    regions: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy_modes: ModesFactory | None,
    synchronize: Callable[[], None] | None,
) -> list[float]:
    """One forward (grad enabled, the graph dropped); per region, the seconds of its calls, each
    call inside a fresh forward mode of ``policy_modes`` when given."""
    seconds = [0.0] * len(regions)
    running: list[tuple[Any, float]] = []

    def enter() -> None:
        mode = None if policy_modes is None else policy_modes()[0]
        if mode is not None:
            mode.__enter__()
        if synchronize is not None:
            synchronize()
        running.append((mode, time.perf_counter()))

    def leave(index: int) -> None:
        if synchronize is not None:
            synchronize()
        mode, start = running.pop()
        seconds[index] += time.perf_counter() - start
        if mode is not None:
            mode.__exit__(None, None, None)

    handles = []
    for index, (_name, module) in enumerate(regions):
        handles.append(module.register_forward_pre_hook(lambda _m, _a: enter()))
        handles.append(
            module.register_forward_hook(lambda _m, _a, _o, i=index: leave(i), always_call=True)
        )
    try:
        with torch.enable_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seconds


def _one_step(
    model: nn.Module,
    regions: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    leaves: set[StorageKey],
    wrt: list[torch.Tensor],
    synchronize: Callable[[], None] | None,
) -> tuple[_Step, float]:
    """One forward+backward under the recorder; gradients go nowhere (``autograd.grad``)."""
    step = _Step(regions, leaves)
    handles = []
    for index, (_name, module) in enumerate(regions):
        handles.append(
            module.register_forward_pre_hook(
                lambda _m, a, k, i=index: step.enter(i, a, k), with_kwargs=True
            )
        )
        handles.append(
            module.register_forward_hook(
                lambda _m, _a, _o, i=index: step.leave(i), always_call=True
            )
        )
    start = time.perf_counter()
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(_packer(step), _unpack),
            _Recorder(step, synchronize),
        ):
            output = model(*args, **kwargs)
            loss = default_loss(output) if loss_fn is None else loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(_MSG_LOSS.format(got=_describe(loss)))
        torch.autograd.grad(loss, wrt, allow_unused=True)
        if synchronize is not None:
            synchronize()
    finally:
        for handle in handles:
            handle.remove()
    return step, time.perf_counter() - start


def _packer(step: _Step) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        step.on_saved(tensor)
        return tensor.detach()  # never the tensor itself: a cycle through its grad_fn

    return pack


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} (requires_grad={value.requires_grad})"
    return f"{type(value).__name__}"


_MSG_CALLS_DIFFER = (
    "checkpointing.plan_checkpointing: region {name!r} ran different op sequences in its {calls} "
    "calls of one step (call 0: {first} ops, call {index}: {other} ops), so one selective "
    "policy cannot describe it. Fix: choose regions that run the same ops on every call "
    "(regions=...)."
)


def _combine(steps: list[tuple[_Step, float]], shapes: list[list[int]], device: str) -> StepProfile:
    """The last step's structure with each op's fastest time over the steps, the calls of a
    region summed op by op."""
    last, _ = steps[-1]
    for index, profile in enumerate(last.profiles):
        calls = last.calls.get(index, [])
        profile.calls = len(calls)
        if not calls:
            continue
        for number, ops in enumerate(calls[1:], start=1):
            if [(c.op, c.index) for c in ops] != [(c.op, c.index) for c in calls[0]]:
                raise ValueError(
                    _MSG_CALLS_DIFFER.format(
                        name=profile.name,
                        calls=len(calls),
                        first=len(calls[0]),
                        index=number,
                        other=len(ops),
                    )
                )
        # Each op's time: its fastest over the steps, summed over the region's calls.
        seconds = [0.0] * len(calls[0])
        for call in range(len(calls)):
            for position in range(len(seconds)):
                seconds[position] += min(s.calls[index][call][position].seconds for s, _ in steps)
        profile.ops = [
            OpCall(
                first.op,
                first.index,
                0.0,
                sum(c.flops for c in column),
                first.kind,
                tuple(s for c in column for s in c.storages),
            )
            for first, column in zip(calls[0], zip(*calls, strict=True), strict=True)
        ]
        for op, total in zip(profile.ops, seconds, strict=True):
            op.seconds = total
    _estimate_small_times(last)
    return StepProfile(
        regions=last.profiles,
        storage_bytes=last.storage_bytes,
        outside=last.outside,
        input_shapes=shapes,
        device=device,
        step_seconds=min(seconds for _, seconds in steps),
    )


def _estimate_small_times(step: _Step) -> None:
    """Rule 9: ops too fast to time get their FLOPs at the rate the trusted ops achieved."""
    rates = [flops / seconds for flops, seconds in step.flop_samples]
    rate = statistics.median(rates) if rates else _DEFAULT_FLOP_RATE
    for profile in step.profiles:
        for op in profile.ops:
            if op.flops and op.seconds < _TRUSTED_SECONDS:
                op.seconds = op.flops / rate
