"""The code around the blocks as spans the plan may record and recompute (Rule M11).

Owns ``SpanProfile`` (what profiling saw between the model's start and its first block, the
head, over its tail modules, the tail, and over a block's last child, a trail: Rule M13), the
problems the solver is asked with a span recorded (``span_problems``: the storages it makes
are no longer kept, what it reads from outside is, its replay is paid). Profiling the ops
belongs to ``profile``, solving to ``solve.solver``, the hooks that record a span in a planned
model to ``apply.span_hooks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ..solve.problem import Problem

__all__ = [
    "SpanCost",
    "SpanKind",
    "SpanProfile",
    "span_problems",
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
    """A trail: the child module it records (Rule M13)."""
    usable: bool = True
    """False where the span draws random numbers, or writes in place a tensor it did not make
    (a parameter, a buffer, an earlier activation): not offered."""
    created: set[int] = field(default_factory=set)
    saves: set[int] = field(default_factory=set)
    """What autograd saved while it ran (a trail's own saves: its replay serves them, Rule M13)."""

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
    trail's region and child module (Rule M13)."""

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
    """Rule M11: ``problem`` with each usable subset of ``spans`` recorded, none first. A recorded
    span's storages are kept nowhere (every save of one is a holder, however it is saved: as a
    block's positional input, by a plain region, outside every region; a block's keyword or
    nested inputs are kept by plain reference all the same); the activations it reads from
    outside are kept by its tape; its tail regions run plainly inside it; its replay and its
    recording (priced as the selective policy's modes, per op) are paid. What is saved after the
    model's forward returned (``late``: a loss computed outside it) is kept: the spans give up
    our hook at the model's end. ``always``: spans recorded in every variant (the trails of a
    problem whose regions end at them, Rule M13); ``call_seconds``: what recording one span call
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
        # A chain holds what a later member receives besides its boundary by plain reference
        # (NOTE [Checkpoint chains], Rule 2), where a frame's own inputs get the span's holders:
        # such a storage made by the span stays kept, which this count would miss. Not joined.
        constants = region.inputs - region.boundary - region.referenced
        regions.append(
            replace(
                region,
                saved=region.saved - made,
                inputs=region.inputs - (made - region.referenced),
                plain_only=region.plain_only or plain_only,
                joinable=region.joinable and not constants & made,
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
