"""The code around the blocks as spans the plan may record and recompute (Rule 22).

Owns ``SpanProfile`` (what profiling saw between the model's start and its first block, the
head, over its tail modules, the tail, and over a block's last child, a trail: Rule 24), the
problems the solver is asked with a span recorded (``span_problems``: the storages it makes
are no longer kept, what it reads from outside is, its replay is paid) and the hooks that
record a span in a planned model (``SpanHooks``: a ``gradient_checkpoint_scope`` opened and
closed by forward hooks). Profiling the ops belongs to ``profile``, solving to ``solver``,
installing the blocks to ``plan``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from .. import _compat
from .._scope import gradient_checkpoint_scope, gradient_checkpoint_session, records_now
from .problem import Problem

__all__ = [
    "SpanCost",
    "SpanHooks",
    "SpanKind",
    "SpanProfile",
    "span_hook_mark",
    "span_problems",
    "take_off_spans",
]

SpanKind = Literal["head", "tail", "trail"]


@dataclass(slots=True)
class SpanProfile:
    """One span's ops in a profiled step: per op its time, FLOPs, the storages it made and
    the activation storages it read; whether a scope may record it (``usable``)."""

    kind: SpanKind
    calls: int = 0
    """How many times the tail started in the step (only one is recorded)."""
    start: int = -1
    """The tail: the region whose start starts it (-1: the model's start, the head)."""
    until: int = -1
    """The region whose start ends the head, or whose end ends the tail."""
    seconds: list[float] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    made: list[tuple[int, ...]] = field(default_factory=list)
    reads: list[tuple[int, ...]] = field(default_factory=list)
    module: str = ""
    """A trail: the child module it records (Rule 24)."""
    usable: bool = True
    """False where the span draws random numbers, or writes in place a tensor it did not make
    (a parameter, a buffer, an earlier activation): not offered."""
    created: set[int] = field(default_factory=set)
    saves: set[int] = field(default_factory=set)
    """What autograd saved while it ran (a trail's own saves: its replay serves them, Rule 24)."""

    def record(
        self,
        seconds: float,
        flops: int,
        fresh: Sequence[int],
        read: Sequence[int | None],
        random: bool,
        written: Sequence[int | None],
    ) -> None:
        """One op: its fresh storages, the activation storages among its arguments and among
        those it writes (None for a parameter, buffer or input), and whether it draws."""
        if random or any(s is None or s not in self.created for s in written):
            self.usable = False
        self.seconds.append(seconds)
        self.flops.append(flops)
        self.made.append(tuple(fresh))
        self.reads.append(tuple(s for s in read if s is not None))
        self.created.update(fresh)

    def outside_reads(self) -> frozenset[int]:
        """The activation storages its ops read that it did not make: its scope's tape holds
        them (the tail's input, the last block's output) until the backward."""
        created = self.created
        return frozenset(s for ops in self.reads for s in ops if s not in created)

    def replay(self, needed: frozenset[int]) -> tuple[float, int, int]:
        """(seconds, FLOPs, ops) of replaying what makes ``needed``: the scope runs only the
        ops its live holders need (NOTE [Gradient checkpoint scope], Rule 7), walked back here
        over every tensor argument (over, never under)."""
        wanted = set(needed)
        seconds, flops, ops = 0.0, 0, 0
        for position in reversed(range(len(self.made))):
            if wanted.intersection(self.made[position]):
                seconds += self.seconds[position]
                flops += self.flops[position]
                ops += 1
                wanted.update(self.reads[position])
        return seconds, flops, ops


@dataclass(frozen=True, slots=True)
class SpanCost:
    """What recording a span costs per step: its replay and its scope's dispatch mode; a
    trail's region and child module (Rule 24)."""

    kind: SpanKind
    seconds: float
    flops: int
    region: int = -1
    module: str = ""


def span_problems(
    problem: Problem,
    spans: Sequence[SpanProfile],
    tail_regions: Sequence[int],
    policy_seconds_per_op: float,
    late: frozenset[int] = frozenset(),
    always: Sequence[SpanProfile] = (),
    call_seconds: float = 0.0,
) -> list[tuple[tuple[SpanCost, ...], Problem]]:
    """Rule 22: ``problem`` with each usable subset of ``spans`` recorded, none first. A recorded
    span's storages are kept nowhere (every save of one is a holder, however it is saved: as a
    block's positional input, by a plain region, outside every region; a block's keyword or
    nested inputs are kept by plain reference all the same); the activations it reads from
    outside are kept by its tape; its tail regions run plainly inside it; its replay and its
    recording (priced as the selective policy's modes, per op) are paid. What is saved after the
    model's forward returned (``late``: a loss computed outside it) is kept: the spans give up
    our hook at the model's end. ``always``: spans recorded in every variant (the trails of a
    problem whose regions end at them, Rule 24); ``call_seconds``: what recording one span call
    costs beyond its ops (the cost model's ``span_call_seconds``)."""
    offered = [s for s in spans if s.usable and s.calls <= 1 and s.until >= 0 and s.made]
    variants: list[tuple[tuple[SpanCost, ...], Problem]] = []
    if not always:
        variants.append(((), problem))
    for count in range(0 if always else 1, 2 ** len(offered)):
        chosen = [*always, *(s for bit, s in enumerate(offered) if count >> bit & 1)]
        variant = _recorded(
            problem, chosen, tail_regions, policy_seconds_per_op, late, call_seconds
        )
        if variant is not None:
            variants.append(variant)
    return variants


def _recorded(
    problem: Problem,
    spans: Sequence[SpanProfile],
    tail_regions: Sequence[int],
    policy_seconds_per_op: float,
    late: frozenset[int],
    call_seconds: float = 0.0,
) -> tuple[tuple[SpanCost, ...], Problem] | None:
    """``problem`` with ``spans`` recorded; None where one of them frees nothing."""
    made = frozenset[int]().union(*(s.created for s in spans))
    held = frozenset[int]().union(*(s.outside_reads() for s in spans)) - made
    tail = any(s.kind == "tail" for s in spans)
    kept = set(problem.outside)
    for region in problem.regions:
        kept |= region.saved | region.inputs
    costs = []
    for span in spans:
        needed = frozenset(span.created & (kept | span.saves) - late)
        if not needed and span.kind != "trail":  # a trail's region ends at it: it is recorded
            return None
        seconds, flops, replayed = span.replay(needed)
        recording = policy_seconds_per_op / 2 * (len(span.made) + replayed) + call_seconds
        costs.append(SpanCost(span.kind, seconds + recording, flops, span.until, span.module))
    regions = []
    for index, region in enumerate(problem.regions):
        plain_only = tail and index in tail_regions
        regions.append(
            replace(
                region,
                saved=region.saved - made,
                inputs=region.inputs - (made - region.referenced),
                plain_only=region.plain_only or plain_only,
            )
        )
    variant = replace(
        problem,
        regions=tuple(regions),
        outside=(problem.outside - (made - late)) | held,
        fixed_seconds=problem.fixed_seconds + sum(c.seconds for c in costs),
        fixed_flops=problem.fixed_flops + sum(c.flops for c in costs),
    )
    return tuple(costs), variant


class _Open:
    """What one thread has open of a model call: its session, the span recording now, and the
    spans recorded so far (their claims on our hook end with the call)."""

    __slots__ = ("off", "recorded", "scope", "session")

    def __init__(self) -> None:
        self.off = False  # this call records nothing: no grad, or inside a checkpoint's frame
        self.session: gradient_checkpoint_session | None = None
        self.scope: gradient_checkpoint_scope | None = None
        self.recorded: list[gradient_checkpoint_scope] = []


class _Recorder:
    """What records a planned model's spans, per thread (a model may run in several). A session
    for the model's call keeps our saved-tensors hook on the stack to its end, whatever hook the
    caller has pushed (a report, ``save_on_cpu``): the head's tensors are saved after its scope
    closed, as the blocks' inputs (NOTE [Gradient checkpoint scope], Rules 4 and 9). At the
    call's end every span gives up its claim on the hook, so that no hook of ours stays on the
    caller's stack after the step (the tensors saved until then are holders already; those saved
    later are kept, as the profile counts them). Ending what is not open does nothing. Pickles
    as its plan's mark (between calls nothing is open; NOTE [Installed plan], Rule 1)."""

    def __init__(self, mark: str = "") -> None:
        self.mark = mark
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"mark": self.mark}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.mark = state.get("mark", "")
        self._local = threading.local()

    def _open(self) -> _Open:
        found: _Open | None = getattr(self._local, "open", None)
        if found is None:
            found = self._local.open = _Open()
        return found

    def start(self, *_hook_args: object) -> None:
        """The model's start: the session, where autograd saves and no checkpoint encloses the
        model (its frame takes what the model saves, in forward and in recompute alike)."""
        state = self._open()
        if state.session is not None:
            return
        state.off = not records_now()  # no grad, a recompute, inside a checkpoint's frame
        if not state.off:
            state.session = gradient_checkpoint_session()
            state.session.__enter__()

    def begin(self, *_hook_args: object) -> None:
        """A span's start: its scope (not in a recompute, nor inside a frame a trail's region
        did not end, Rule 24)."""
        state = self._open()
        if state.scope is None and not state.off and records_now():
            scope = gradient_checkpoint_scope()
            scope.__enter__()
            state.scope = scope

    def end(self, *_hook_args: object) -> None:
        """A span's end."""
        state = self._open()
        scope = state.scope
        if scope is not None:
            state.scope = None
            scope.__exit__(None, None, None)
            state.recorded.append(scope)

    def finish(self, *_hook_args: object) -> None:
        """The model's end (also after an exception): what is open, closed; the hook given up."""
        self.end()
        state = self._open()
        while state.recorded:
            state.recorded.pop().exit_saved_tensors_hooks_scope()
        session, state.session = state.session, None
        if session is not None:
            session.__exit__(None, None, None)


class SpanHooks:
    """The forward hooks that record a plan's spans (Rule 22): the head from the model's start
    to the first block's (prepended, so that it ends before the block's checkpoint starts), the
    tail from its first module's start to its last module's end, each trail over its module
    (Rule 24); the model's end closes what an exception left open."""

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module | None,
        tail: tuple[nn.Module, nn.Module] | None,
        trails: Sequence[nn.Module] = (),
        mark: str = "",
    ) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        if head is None and tail is None and not trails:
            return
        recorder = _Recorder(mark)
        self.handles.append(model.register_forward_pre_hook(recorder.start))
        if head is not None:
            self.handles.append(model.register_forward_pre_hook(recorder.begin))
            self.handles.append(head.register_forward_pre_hook(recorder.end, prepend=True))
        if tail is not None:
            first, last = tail
            self.handles.append(first.register_forward_pre_hook(recorder.begin, prepend=True))
            self.handles.append(last.register_forward_hook(recorder.end, always_call=True))
        for child in trails:  # Rule 24: after the hook that ends its region's frame
            self.handles.append(child.register_forward_pre_hook(recorder.begin))
            self.handles.append(child.register_forward_hook(recorder.end, always_call=True))
        self.handles.append(model.register_forward_hook(recorder.finish, always_call=True))

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()


def span_hook_mark(hook: object) -> str | None:
    """The mark of the plan whose span recorder ``hook`` belongs to; None: not a span hook."""
    owner = getattr(hook, "__self__", None)
    return owner.mark if isinstance(owner, _Recorder) else None


def take_off_spans(model: nn.Module, mark: str) -> None:
    """Every span hook of the plan marked ``mark`` off every module of ``model`` (a copy of a
    planned model, whose hooks no handle reaches: NOTE [Installed plan], Rule 1)."""
    modules = list(model.modules())
    recorders = {
        id(owner): owner
        for module in modules
        for hook in _compat.forward_pre_hooks(module)
        if isinstance(owner := getattr(hook, "__self__", None), _Recorder) and owner.mark == mark
    }
    for recorder in recorders.values():
        for module in modules:  # each method may sit as a pre-hook or a hook: both are looked at
            for method in (recorder.start, recorder.begin, recorder.end, recorder.finish):
                _compat.remove_forward_hooks(module, method, method)
