"""Profiling a training step for the planner: what each op of each region costs and keeps.

Owns ``profile_step``: a few real forward+backward steps of the model on the example inputs,
watched by a dispatch mode (every op: time, FLOPs, outputs, in-place writes, random draws) and a
saved-tensors hook (every storage autograd keeps, and which region's op kept it), with forward
hooks on the region modules saying which region is running; then forward passes with each region
timed plainly and inside a selective policy's forward mode (what the policy costs per op, Rule
13). The result, ``StepProfile``, is plain data in the solver's terms (``problem.Problem``);
deciding belongs to ``solver``, installing to ``plan``. See NOTE [Planner model] in
``checkpointing._planning`` for the rules it follows.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

import torch
from torch import nn

from .. import _compat
from .._caches import dropping_caches
from .._scope.ops import written_tensors
from .._selective import SAC_IGNORED_OPS, draws_random, may_skip, reads_values
from .._state import ForwardState
from .._trees import StorageKey, storage_key, storage_nbytes, tensors
from .._untouched import untouched
from .flops import op_flops
from .kept import SpanWatch
from .live_bytes import step_peaks
from .problem import Objective, Problem, RegionChoices, ReplayGraph, ReplayOp, ReplayRole, Unit
from .spans import SpanProfile

__all__ = [
    "OpCall",
    "RegionProfile",
    "StepProfile",
    "default_loss",
    "input_shapes",
    "profile_step",
    "tail_regions",
]

# Measured op times below this are mostly dispatch noise; where torch knows the op's FLOPs, the
# time is estimated from them at the rate the trusted ops of the same step achieved (Rule 9).
_TRUSTED_SECONDS: Final = 20e-6
_DEFAULT_FLOP_RATE: Final = 1e10  # FLOP/s when no op of the step was slow enough to measure it
_PROFILE_STEPS: Final = 3  # measured steps, after one warm-up step
_POLICY_ROUNDS: Final = 10  # forward passes timed plainly and under a selective policy (Rule 13)
# Rule 15: the step-to-step spread of the profiled steps, clamped to this range, is the share of
# the regions' time within which FLOPs break ties under objective "time".
_TIE_SPREAD: Final = (0.01, 0.05)
# Rule 26: the ops of FSDP2 (``fsdp::``) and of process groups (``c10d::``, in place on
# buffers of the sharding's own); functional collectives (``_c10d_functional::``, tensor
# parallelism's) make activations and are recorded as any op.
_SHARDING_NAMESPACES: Final = frozenset({"fsdp", "c10d"})
_PLAIN: Final = (torch.Tensor, nn.Parameter)

ObjectiveName = Literal["time", "flops"]


@dataclass(slots=True)
class OpCall:
    """One op run inside a region, summed over the region's calls in a step."""

    op: str
    index: int
    seconds: float
    flops: int
    kind: str  # "unit" (may be saved), "view", "inplace", "random", "none" (no tensor output
    # with memory of its own or of an input's)
    storages: tuple[int, ...]  # fresh storages the op produced (ids of ``StepProfile``)
    inputs: tuple[int, ...] = ()
    """The activation storages among its tensor inputs (parameters, buffers and example inputs
    have none: they are always there), for the replay's closure (Rule 21)."""
    skippable: bool = False
    """Whether the replay may hand out blanks instead of running it (Rule 21): a "unit" whose
    every output is a plain dense tensor in a fresh storage, not a random or effect op."""


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
    referenced: set[int] = field(default_factory=set)
    """Its inputs received by keyword or inside a container: a frame keeps them by plain
    reference, a recorded span cannot free them (Rule 22)."""
    grad_bytes: int = 0
    """Bytes of the gradients of the region's own parameters (the backward allocates them)."""
    stop: int = 0
    """How many ops of one call recompute runs: those up to the last one during which autograd
    saved a tensor; early stop ends recompute there (Rule 16)."""
    trail: Trail | None = None
    """The child module the region calls last, where a scope may record it (Rule 24)."""
    backward_peak: int = 0
    """The most bytes live while the plain step's backward ran the region (Rule 18; 0: not)."""
    kept: set[int] = field(default_factory=set)
    """What its kept spans keep when it is checkpointed (Rule 25): theirs whatever it saves."""


@dataclass(slots=True)
class Trail:
    """A child module a region calls last, once, its output the region's (a post-norm block's
    final norm): where the region's frame may end and a scope record the child (Rule 24)."""

    name: str
    """The child's qualified name."""
    start: int
    """The position of its first op among the region's."""
    saved: frozenset[int]
    """What autograd had saved in the region when the child started."""
    stop: int
    """The region's early stop at that moment (Rule 16)."""
    span: SpanProfile


@dataclass(slots=True)
class _ChildCall:
    """A child call of a running region, while profiling (Rule 24)."""

    name: str
    start: int
    saved: frozenset[int]
    stop: int
    span: SpanProfile
    output: Any = None
    end: int = -1


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
    peak_bytes: int = 0
    """The allocator's peak over one plain step, above what it held before (Rule 18; 0: not
    measured)."""

    step_spread: float = 0.0
    """How far the measured steps' times spread: (slowest - fastest) / fastest."""
    spans: list[SpanProfile] = field(default_factory=list)
    """The head and the tail, as a scope would record them (Rule 22)."""
    late: set[int] = field(default_factory=set)
    """Storages saved after the model's forward returned (by the loss; Rule 22)."""

    def objective(self, name: ObjectiveName) -> Objective:
        """Rule 15: the weights of a second and of a FLOP of recompute. ``"time"``: seconds,
        with FLOPs breaking ties within the profile's noise (recomputing every FLOP of the
        regions' forward weighs as much as that share of its time); ``"flops"``: FLOPs, with
        seconds breaking ties (all of the regions' time weighs less than half a FLOP)."""
        seconds = sum(op.seconds for r in self.regions for op in r.ops)
        flops = sum(op.flops for r in self.regions for op in r.ops)
        if name == "flops":
            ops = sum(len(r.ops) * r.calls for r in self.regions)
            most = 2 * seconds + self.policy_seconds_per_op * ops  # no plan recomputes more
            return Objective(seconds=0.5 / max(most, 1e-12), flops=1.0)
        noise = min(max(self.step_spread, _TIE_SPREAD[0]), _TIE_SPREAD[1])
        return Objective(seconds=1.0, flops=noise * seconds / max(flops, 1))

    def problem(self, policy_seconds_per_op: float, objective: Objective | None = None) -> Problem:
        """The solver's view of this step (Rules 4-6 decide which ops are units; ops after a
        region's early stop cost nothing and are no units, Rule 16; the ops before it are the
        region's replay graph, Rule 21); a selective policy costs ``policy_seconds_per_op`` per
        op of a region call, forward and replay (Rule 13)."""
        regions = []
        for region in self.regions:
            written = {s for c in region.ops if c.kind in ("inplace", "random") for s in c.storages}
            units: list[Unit] = []
            forced_seconds, forced_flops = 0.0, 0
            needed = region.ops[: region.stop]
            positions: dict[int, int] = {}  # op position -> unit position
            for position, call in enumerate(needed):
                if call.kind == "unit" and not written.intersection(call.storages):
                    positions[position] = len(units)
                    units.append(
                        Unit((call.op, call.index), call.seconds, call.storages, call.flops)
                    )
                else:
                    forced_seconds += call.seconds
                    forced_flops += call.flops
            # Half the per-op cost in forward (every op), half in the replay (the ops it runs).
            policy = policy_seconds_per_op / 2 * (len(region.ops) + len(needed)) * region.calls
            draws = _draws(region, needed)
            regions.append(
                RegionChoices(
                    frozenset(region.saved),
                    frozenset(region.inputs | region.states | region.kept),
                    forced_seconds,
                    tuple(units),
                    policy,
                    forced_flops,
                    region.grad_bytes,
                    draws,
                    _replay_graph(region, positions),
                    referenced=frozenset(region.referenced),
                    backward_peak=region.backward_peak,
                )
            )
        return Problem(
            tuple(regions),
            dict(self.storage_bytes),
            frozenset(self.outside),
            objective or Objective(),
            self.peak_bytes,
        )

    def trailed(self) -> tuple[StepProfile, list[SpanProfile]] | None:
        """Rule 24: this step with every region that has a trail cut at its start (its ops,
        saves and early stop as they were when the child started), and the trails as spans;
        None where no region has one. A trail none of whose storages another region or the
        code outside them keeps (the last block's, making the model's output) is left out."""
        trails: list[SpanProfile] = []
        regions = []
        for region in self.regions:
            trail = region.trail
            others = set(self.outside).union(
                *(r.saved | r.inputs for r in self.regions if r is not region)
            )
            if trail is None or not others & trail.span.created:  # it would free nothing
                regions.append(region)
                continue
            trails.append(trail.span)
            regions.append(
                replace(
                    region,
                    ops=region.ops[: trail.start],
                    saved=set(trail.saved),
                    stop=trail.stop,
                    trail=None,
                )
            )
        if not trails:
            return None
        return replace(self, regions=regions), trails


def _draws(region: RegionProfile, needed: list[OpCall]) -> Unit | None:
    """Rule 19: the region's random ops as one group, or None where keeping them cannot help
    (none runs before the early stop) or cannot be exact: an output of an out-of-place draw
    written in place later (the replay hands out the forward's tensor, which must be unchanged),
    or a draw into a region input (its snapshot would be a storage the count does not see)."""
    random = [c for c in region.ops if c.kind == "random"]
    useful = [c for c in needed if c.kind == "random"]
    if not useful:
        return None
    made: set[int] = set()
    drawn: set[int] = set()  # storages an out-of-place draw made
    for call in region.ops:
        if call.kind == "random":
            drawn.update(s for s in call.storages if s not in made)
        elif call.kind == "inplace" and drawn.intersection(call.storages):
            return None
        made.update(call.storages)
    storages = tuple(dict.fromkeys(s for c in random for s in c.storages))
    if region.inputs.intersection(storages):
        return None
    return Unit(
        ("random", 0),
        sum(c.seconds for c in useful),
        storages,
        sum(c.flops for c in useful),
    )


class _Step:
    """What one step records: storage ids, the running region, per-region op sequences."""

    def __init__(
        self, regions: Sequence[tuple[str, nn.Module]], leaves: set[StorageKey], tail: int = 0
    ):
        self.leaves = leaves
        self.ids: dict[StorageKey, int] = {}
        self.storage_bytes: dict[int, int] = {}
        self.profiles = [RegionProfile(name, type(m).__qualname__) for name, m in regions]
        # Per running region call: its profile, op occurrence counts, ops, and (a one-element
        # list, updated in place) how many ops had run when autograd last saved a tensor.
        self.stack: list[tuple[RegionProfile, dict[object, int], list[OpCall], list[int]]] = []
        self.calls: dict[int, list[tuple[list[OpCall], int, Trail | None]]] = {}
        self.outside: set[int] = set()
        self.flop_samples: list[tuple[int, float]] = []
        # Rule 14: the captured RNG states, alive for the step (no address reused), by identity.
        self.rng_states: dict[int, tuple[torch.Tensor, int]] = {}
        # Rule 22: the head records until the first region call; the tail from the first call
        # of a tail region (the last ``tail`` regions) to the end of the last one's.
        self.head = SpanProfile("head")
        self.tail = SpanProfile("tail")
        self.span: SpanProfile | None = self.head
        self.tail_first = len(regions) - tail if tail else -1
        self.tail_last = len(regions) - 1 if tail else -1
        self.tail.start, self.tail.until = self.tail_first, self.tail_last
        self.returned = False  # the model's forward has returned: the loss runs now
        self.late: set[int] = set()  # storages saved after it (Rule 22)
        self.children: list[list[_ChildCall]] = []  # per running region call (Rule 24)
        self.in_kept_span = 0  # Rule 25: a kept span's ops are not the region's

    def activation(self, tensor: torch.Tensor) -> int | None:
        """The id of ``tensor``'s storage if it is an activation of this step (Rule 2)."""
        key = storage_key(tensor)
        return None if key is None else self.ids.get(key)

    def forget(self, memory: Iterator[torch.Tensor]) -> None:
        """Rule 26: what a sharding op made or filled is a parameter or a buffer of the
        sharding's, never an activation, whatever id its address had."""
        for tensor in memory:
            key = storage_key(tensor)
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
        for tensor in tensors((args, kwargs)):  # keyword and nested ones included (Rule 14)
            storage = self.activation(tensor)
            if storage is not None:
                profile.inputs.add(storage)
        # Rule 22: a frame keeps these by plain reference, no holder can stand for them.
        for tensor in tensors(([a for a in args if not isinstance(a, torch.Tensor)], kwargs)):
            storage = self.activation(tensor)
            if storage is not None:
                profile.referenced.add(storage)
        if torch.is_grad_enabled():  # a frame captures nothing under no_grad
            profile.states.update(self.capture_rng(args))
        self.stack.append((profile, {}, [], [0]))
        self.children.append([])

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

    def leave(self, index: int, output: Any = None) -> None:
        if index == self.tail_last and self.span is self.tail:
            self.span = None
        _profile, _counts, ops, stop = self.stack.pop()
        calls = self.children.pop()
        trail = None
        if calls and output is not None:  # Rule 24: its last child, called once, ends it
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
        """Rule 24: a child of region ``index`` starts (recorded as a span where the region is
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

    def on_op(self, func: Any, args: Any, kwargs: Any, out: Any, seconds: float) -> None:
        """Record one op: its fresh storages get ids (Rule 1); its kind (Rules 4-6); what it
        reads and whether the replay may skip it (Rule 21)."""
        arguments = list(tensors((args, kwargs)))
        inputs = {storage_key(t) for t in arguments}
        fresh: list[int] = []
        every_fresh = True  # every output in a storage of its own
        for tensor in tensors(out):
            key = storage_key(tensor)
            if key is None or key in inputs or key in self.leaves:
                every_fresh = False
                continue
            storage = self.ids[key] = len(self.storage_bytes)  # a reused address: a new id
            self.storage_bytes[storage] = storage_nbytes(tensor)
            fresh.append(storage)
        flops = op_flops(func, args, kwargs, out)
        if flops and seconds >= _TRUSTED_SECONDS:
            self.flop_samples.append((flops, seconds))
        random = draws_random(func, args, kwargs)
        writes = not random and _compat.op_mutates_inputs(func)
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
        if not self.stack or self.in_kept_span:  # Rule 25: numbered as the selective modes do
            return
        _profile, counts, ops, _stop = self.stack[-1]
        read = (
            tuple(dict.fromkeys(s for t in arguments if (s := self.activation(t)) is not None))
            if reads_values(func)  # Rule 21: dropout's empty_like(x) needs no x
            else ()
        )  # an input's storage is not an output's: its id is still the input's
        index = counts.get(func, 0)
        counts[func] = index + 1
        if random or writes:
            kind = "random" if random else "inplace"
            fresh = [s for t in tensors(out) if (s := self.activation(t)) is not None]
        elif fresh:
            kind = "unit"
        else:  # Rule 21: a view only where every output shares an input's storage
            outs = [storage_key(t) for t in tensors(out)]
            kind = "view" if outs and all(k is not None and k in inputs for k in outs) else "none"
        # Rule 21: where the replay's blanks may stand for the outputs, as its mode decides
        # (NOTE [Selective checkpoint cache], Rule 14), effect ops (which it keeps) aside.
        skippable = (
            kind == "unit"
            and every_fresh
            and may_skip(func, args, kwargs, out)
            and not _compat.has_ordered_effect(func)
        )
        ops.append(OpCall(str(func), index, seconds, flops, kind, tuple(fresh), read, skippable))

    def on_saved(self, tensor: torch.Tensor, kept: bool = False) -> None:
        """Rule 16: a frame has a holder for every tensor saved in its region, parameters
        included, so recompute runs up to the op during which the last one is saved. An op's
        inputs are saved before it runs (the recorder has not seen it yet), its outputs after; what
        a kept span keeps is no holder (Rule 25)."""
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
        if getattr(func, "namespace", None) in _SHARDING_NAMESPACES:  # Rule 26
            out = func(*args, **kwargs)
            self.step.forget(tensors((args, kwargs, out)))
            return out
        sync = self.synchronize
        if sync is not None:
            sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if sync is not None:
            sync()
        self.step.on_op(func, args, kwargs, out, time.perf_counter() - start)
        return out


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


def input_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[int]]:
    """Rule 12: the shapes a plan compares, positional inputs first, then keyword ones by name
    (not in call order), 0-d tensors (a scalar such as a loss's token count) left out."""
    named = tuple(kwargs[name] for name in sorted(kwargs))
    return [list(t.shape) for t in tensors((args, named)) if t.dim() > 0]


def tail_regions(
    model: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[tuple[str, nn.Module]]:
    """Rule 20: the modules the model calls after its last block (a Llama's final norm and LM
    head), outermost first in call order: every call of one starts after the blocks' last call
    ended, so it is none of the blocks, inside none, and encloses none. Found by one forward
    with grad enabled (the graph dropped), the model left as found (Rule 8)."""
    starts: dict[int, int] = {}  # a module's first call, by the count of calls before it
    ends = [-1]
    count = [0]
    block_ids = {id(m) for _name, m in blocks}

    def enter(module: nn.Module, _args: Any) -> None:
        starts.setdefault(id(module), count[0])
        count[0] += 1

    def leave(module: nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in block_ids:
            ends[0] = count[0]

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    inputs = list(tensors((args, kwargs)))
    try:
        # NOTE [Key/value caches], Rule 2: the blocks run as the profile and the plan run them.
        with (
            untouched([model], inputs),
            torch.enable_grad(),
            torch.inference_mode(False),
            dropping_caches(m for _, m in blocks),
        ):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    after = [
        (starts[id(m)], name, m)
        for name, m in model.named_modules()
        if name and starts.get(id(m), -1) >= ends[0] >= 0 and id(m) not in block_ids
    ]
    found: list[tuple[str, nn.Module]] = []
    for _start, name, module in sorted(after, key=lambda c: c[0]):
        if not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


ModesFactory = Callable[[], tuple[Any, Any]]


def profile_step(
    model: nn.Module,
    regions: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    policy_modes: ModesFactory | None = None,
    tail: int = 0,
) -> StepProfile:
    """Run one warm-up and ``_PROFILE_STEPS`` measured steps; return the last one's structure
    with each op's fastest time (Rule 9). With ``policy_modes`` (the selective modes ``apply``
    would install), also measure what they add per op (Rule 13). The model is left as found
    (Rule 8)."""
    inputs = list(tensors((args, kwargs)))
    leaves = {
        key
        for t in (*model.parameters(), *model.buffers(), *inputs)
        if (key := storage_key(t)) is not None
    }
    wrt, device, synchronize = step_setting(model, inputs)
    steps = []
    # Rule 8: the profiled steps train, so grad is on whatever the caller's mode (restored after).
    # NOTE [Key/value caches], Rule 2: every region runs without the caches it is handed.
    with (
        untouched([model], inputs),
        torch.enable_grad(),
        torch.inference_mode(False),
        dropping_caches(m for _, m in regions),
    ):
        for _ in range(1 + _PROFILE_STEPS):
            steps.append(
                _one_step(model, regions, args, kwargs, loss_fn, leaves, wrt, synchronize, tail)
            )
        profile = _combine(steps[1:], input_shapes(args, kwargs), str(device))
        for region, (_name, module) in zip(profile.regions, regions, strict=True):
            region.grad_bytes = sum(p.nbytes for p in module.parameters() if p.requires_grad)
        peaks = step_peaks(  # Rule 18
            lambda: plain_step(model, args, kwargs, loss_fn, wrt), device, [m for _, m in regions]
        )
        profile.peak_bytes = peaks.step
        for region, peak in zip(profile.regions, peaks.regions, strict=False):
            region.backward_peak = peak
        if policy_modes is not None:
            profile.policy_seconds_per_op = _policy_seconds_per_op(
                model, regions, args, kwargs, profile, policy_modes, synchronize
            )
    return profile


def step_setting(
    model: nn.Module, inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.device, Callable[[], None] | None]:
    """What a measured step of ``model`` on ``inputs`` differentiates (the parameters and the
    inputs that require grad), its device, and how to wait for that device (None on CPU)."""
    wrt = [p for p in model.parameters() if p.requires_grad] + [
        t for t in inputs if t.requires_grad
    ]
    device = next((t.device for t in (*model.parameters(), *inputs)), torch.device("cpu"))
    return wrt, device, torch.cuda.synchronize if device.type == "cuda" else None


def plain_step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    wrt: list[torch.Tensor],
) -> None:
    """One forward, loss and backward; the gradients go nowhere (``autograd.grad``) and are
    dropped at the step's end."""
    output = model(*args, **kwargs)
    loss = default_loss(output) if loss_fn is None else loss_fn(output)
    del output
    differentiate(loss, wrt)


def differentiate(loss: torch.Tensor, wrt: list[torch.Tensor]) -> None:
    """A measured step's backward; its gradients go nowhere. Plainly ``autograd.grad``; where a
    parameter is a tensor subclass (FSDP2's and tensor parallelism's ``DTensor``s) a backward
    that accumulates, with every ``.grad`` of ``wrt`` put back after it (Rule 26)."""
    if all(type(t) in _PLAIN for t in wrt):
        torch.autograd.grad(loss, wrt, allow_unused=True)
        return
    grads = [(t, t.grad) for t in wrt]
    try:
        torch.autograd.backward(loss)
    finally:
        for tensor, grad in grads:
            tensor.grad = grad


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
    difference per op (the median over the regions), doubled for the recompute mode's replay."""
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
    # Per region, what the mode added per op of its calls; the median over the regions, so that
    # one region's unlucky rounds (a context switch on a shared machine) do not set the price.
    per_op = [
        (s - p) / (len(r.ops) * r.calls)
        for s, p, r in zip(selective, plain, profile.regions, strict=True)
        if p < math.inf and r.ops and r.calls
    ]
    return 2 * max(0.0, statistics.median(per_op)) if per_op else 0.0


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
    tail: int = 0,
) -> tuple[_Step, float]:
    """One forward+backward under the recorder; gradients go nowhere (``autograd.grad``)."""
    step = _Step(regions, leaves, tail)
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
            continue  # Rule 24: blocks only; the tail is a span of its own (Rule 22)
        for child_name, child in module.named_children():
            handles.append(
                child.register_forward_pre_hook(
                    lambda _m, _a, i=index, n=f"{name}.{child_name}": step.child_enter(i, n)
                )
            )
            handles.append(
                child.register_forward_hook(lambda _m, _a, o: step.child_leave(o), always_call=True)
            )
    start = time.perf_counter()
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(SpanWatch(step), _unpack),
            _Recorder(step, synchronize),
        ):
            output = model(*args, **kwargs)
            step.returned = True
            loss = default_loss(output) if loss_fn is None else loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(_MSG_LOSS.format(got=_describe(loss)))
        differentiate(loss, wrt)
        if synchronize is not None:
            synchronize()
    finally:
        for handle in handles:
            handle.remove()
    return step, time.perf_counter() - start


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
    region summed op by op; identical regions then share their ops' median times (Rule 9)."""
    last, _ = steps[-1]
    for index, profile in enumerate(last.profiles):
        calls = [ops for ops, _stop, _trail in last.calls.get(index, [])]
        profile.calls = len(calls)
        if not calls:
            continue
        _check_calls_agree(profile.name, calls)
        profile.stop = max(stop for _ops, stop, _trail in last.calls[index])
        if len(calls) == 1:  # Rule 24: one call, one place to end the frame
            profile.trail = last.calls[index][0][2]
        # Each op's time: its fastest over the steps, summed over the region's calls.
        seconds = [0.0] * len(calls[0])
        for call in range(len(calls)):
            for position in range(len(seconds)):
                seconds[position] += min(
                    s.calls[index][call][0][position].seconds for s, _ in steps
                )
        profile.ops = [
            OpCall(
                first.op,
                first.index,
                0.0,
                sum(c.flops for c in column),
                first.kind,
                tuple(s for c in column for s in c.storages),
                tuple(s for c in column for s in c.inputs),
                all(c.skippable for c in column),
            )
            for first, column in zip(calls[0], zip(*calls, strict=True), strict=True)
        ]
        for op, total in zip(profile.ops, seconds, strict=True):
            op.seconds = total
    for span in (last.head, last.tail):  # each op's fastest time over the steps that agree
        for other in (s for s, _ in steps):
            mine = other.head if span.kind == "head" else other.tail
            if len(mine.seconds) == len(span.seconds):
                span.seconds = [min(a, b) for a, b in zip(span.seconds, mine.seconds, strict=True)]
    _estimate_small_times(last)
    _share_identical_times(last.profiles, last.storage_bytes)
    for profile in last.profiles:  # Rule 24: the trail's ops' times as the region's
        if profile.trail is not None:
            profile.trail.span.seconds = [op.seconds for op in profile.ops[profile.trail.start :]]
    step_seconds = [seconds for _, seconds in steps]
    return StepProfile(
        regions=last.profiles,
        storage_bytes=last.storage_bytes,
        outside=last.outside,
        input_shapes=shapes,
        device=device,
        step_seconds=min(step_seconds),
        step_spread=(max(step_seconds) - min(step_seconds)) / max(min(step_seconds), 1e-12),
        spans=[last.head, last.tail],
        late=last.late,
    )


def _check_calls_agree(name: str, calls: list[list[OpCall]]) -> None:
    for number, ops in enumerate(calls[1:], start=1):
        if [(c.op, c.index) for c in ops] != [(c.op, c.index) for c in calls[0]]:
            raise ValueError(
                _MSG_CALLS_DIFFER.format(
                    name=name, calls=len(calls), first=len(calls[0]), index=number, other=len(ops)
                )
            )


def structure(region: RegionProfile, storage_bytes: dict[int, int]) -> tuple[object, ...]:
    """Rule 9: what makes two regions identical for the planner: the type, the calls, the early
    stop, and per op its key, kind, FLOPs, the sizes of its fresh storages, whether the replay
    may skip it and which of the region's storages it reads (Rule 21); and which of them
    autograd saves. Storages are numbered within the region (``_local_storages``): the ids
    differ between blocks, the pattern does not; what a block reads from outside it (its
    input, a block's or the example input) is left out, so the first block matches the others."""
    local = _local_storages(region.ops)
    return (
        region.type_name,
        region.calls,
        region.stop,
        tuple(
            (
                op.op,
                op.index,
                op.kind,
                op.flops,
                tuple(storage_bytes[s] for s in op.storages),
                op.skippable,
                _reads(op, local),
            )
            for op in region.ops
        ),
        tuple(sorted(local[s] for s in region.saved if s in local)),
    )


def _local_storages(ops: Sequence[OpCall]) -> dict[int, int]:
    """The storages ``ops`` make or write, numbered in the order they first appear."""
    local: dict[int, int] = {}
    for op in ops:
        for storage in op.storages:
            local.setdefault(storage, len(local))
    return local


def _reads(op: OpCall, local: dict[int, int]) -> tuple[int, ...]:
    """The region's own storages ``op`` reads, by their numbers in ``local``."""
    return tuple(sorted({local[s] for s in op.inputs if s in local}))


def _replay_graph(region: RegionProfile, units: dict[int, int]) -> ReplayGraph:
    """Rule 21: the ops recompute runs (up to the early stop, Rule 16) as the solver's plain
    data: per op what it reads and writes among the region's own storages (numbered within the
    region, so identical blocks give equal graphs), its role, and its unit (by position in
    ``units``, op position -> unit); and which of those storages autograd saves."""
    needed = region.ops[: region.stop]
    local = _local_storages(needed)
    ops = []
    for position, call in enumerate(needed):
        role: ReplayRole
        if call.kind == "random":
            role = "random"
        elif call.skippable:
            role = "skippable"
        elif call.kind == "view":
            role = "view"
        else:  # in place, no tensor output, or outputs torch's placeholders cannot stand for
            role = "root"
        ops.append(
            ReplayOp(
                (call.op, call.index),
                call.seconds,
                call.flops,
                _reads(call, local),
                tuple(dict.fromkeys(local[s] for s in call.storages)),
                role,
                units.get(position, -1),
            )
        )
    return ReplayGraph(tuple(ops), frozenset(local[s] for s in region.saved if s in local))


def _share_identical_times(regions: list[RegionProfile], storage_bytes: dict[int, int]) -> None:
    """Rule 9: regions of one structure (the blocks of a model, as a rule) run the same work, so
    each op gets the median of its times over them: one block's noisy sample does not decide
    its plan, and identical blocks pose the solver one problem (solved once)."""
    groups: dict[tuple[object, ...], list[RegionProfile]] = {}
    for region in regions:
        groups.setdefault(structure(region, storage_bytes), []).append(region)
    for group in groups.values():
        if len(group) < 2:
            continue
        for position in range(len(group[0].ops)):
            median = statistics.median(r.ops[position].seconds for r in group)
            for region in group:
                region.ops[position].seconds = median


def _estimate_small_times(step: _Step) -> None:
    """Rule 9: ops too fast to time get their FLOPs at the rate the trusted ops achieved."""
    rates = [flops / seconds for flops, seconds in step.flop_samples]
    rate = statistics.median(rates) if rates else _DEFAULT_FLOP_RATE
    for profile in step.profiles:
        for op in profile.ops:
            if op.flops and op.seconds < _TRUSTED_SECONDS:
                op.seconds = op.flops / rate
