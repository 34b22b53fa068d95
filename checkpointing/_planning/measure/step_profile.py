"""A profiled step as data: per region its ops, saves and inputs, in the solver's terms.

Owns ``OpCall``, ``RegionProfile``, ``Trail`` and ``StepProfile`` (what ``profile_step`` returns),
the objective's weights (Rule S4), the solver's view of a step (``StepProfile.problem``: units,
draws, the replay graph, Rules M4-M6, M9, S7 and S8) and a step cut at its trails (Rule M13); and
``structure``, what makes two regions one problem (Rule S5). Recording a step belongs to
``recorder``, running it to ``profile``, deciding to ``solver``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..solve.problem import (
    Objective,
    ObjectiveName,
    Problem,
    RegionChoices,
    ReplayGraph,
    ReplayOp,
    ReplayRole,
    Unit,
    objective_weights,
)
from .recorded_spans import SpanProfile

__all__ = ["OpCall", "RegionProfile", "StepProfile", "Trail", "structure"]


@dataclass(slots=True)
class OpCall:
    """One op run inside a region, summed over the region's calls in a step."""

    op: str
    index: int
    seconds: float
    """Its predicted seconds by the cost model (Rule M8), summed over the region's calls."""
    flops: int
    kind: str  # "unit" (may be saved), "view", "inplace", "random", "none" (no tensor output
    # with memory of its own or of an input's), "kept" (a collective: kept whenever the region
    # is checkpointed, its outputs in ``RegionProfile.kept``, never re-run: Rule M15)
    storages: tuple[int, ...]  # fresh storages the op produced (ids of ``StepProfile``)
    inputs: tuple[int, ...] = ()
    """The activation storages among its tensor inputs (parameters, buffers and example inputs
    have none: they are always there), for the replay's closure (Rule S8)."""
    skippable: bool = False
    """Whether the replay may hand out blanks instead of running it (Rule S8): a "unit" whose
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
    """The RNG states a checkpoint of the region would keep (Rule A3): none where it draws
    nothing."""
    draws: bool = False
    """Whether a call of the region ran a random op (Rule A3)."""
    captured: set[int] = field(default_factory=set)
    """The RNG states a frame entered at the region captures, whether it draws or not: a chain
    keeps them (Rule S9)."""
    referenced: set[int] = field(default_factory=set)
    """Its inputs received by keyword or inside a container: a frame keeps them by plain
    reference, a recorded span cannot free them (Rule M11)."""
    grad_bytes: int = 0
    """Bytes of the gradients of the region's own parameters (the backward allocates them)."""
    stop: int = 0
    """How many ops of one call recompute runs: those up to the last one during which autograd
    saved a tensor; early stop ends recompute there (Rule M9)."""
    trail: Trail | None = None
    """The child module the region calls last, where a scope may record it (Rule M13)."""
    backward_peak: int = 0
    """The most bytes live while the plain step's backward ran the region (Rule S6; 0: not)."""
    kept: set[int] = field(default_factory=set)
    """What its kept spans keep when it is checkpointed (Rule M14): theirs whatever it saves."""
    kept_blocks: bool = False
    """It runs a ``with keeping():`` block: planned without recompute (Rule M14)."""
    outputs: set[int] = field(default_factory=set)
    """The activation storages its (last) call returned (Rule S9)."""
    follows: bool = False
    """It ran once, right after the region before it, on the same thread, outside every other
    region, no op between them (Rule S9)."""
    ends_at_trail: bool = False
    """Its frame ends where its trail starts (a step cut at its trails, Rule M13)."""


@dataclass(slots=True)
class Trail:
    """A child module a region calls last, once, its output the region's (a post-norm block's
    final norm): where the region's frame may end and a scope record the child (Rule M13)."""

    name: str
    """The child's qualified name."""
    start: int
    """The position of its first op among the region's."""
    saved: frozenset[int]
    """What autograd had saved in the region when the child started."""
    stop: int
    """The region's early stop at that moment (Rule M9)."""
    span: SpanProfile


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
    """The step's predicted seconds: its forward's ops by the cost model, thrice (a backward
    costs about twice its forward); for the table only, never in the objective."""
    policy_seconds_per_op: float = 0.0
    """What a selective policy adds per op of a region call, forward and recompute (Rule S3):
    the cost model's constant for the device class."""
    peak_bytes: int = 0
    """The allocator's peak over one plain step, above what it held before (Rule S6; 0: not
    measured)."""
    spans: list[SpanProfile] = field(default_factory=list)
    """The head and the tail, as a scope would record them (Rule M11)."""
    late: set[int] = field(default_factory=set)
    """Storages saved after the model's forward returned (by the loss; Rule M11)."""

    def objective(self, name: ObjectiveName) -> Objective:
        """Rule S4: the weights of a second and of a FLOP of recompute (``objective_weights``),
        from this step's regions: their ops' seconds and FLOPs, and the most seconds a plan
        could recompute."""
        seconds = sum(op.seconds for r in self.regions for op in r.ops)
        flops = sum(op.flops for r in self.regions for op in r.ops)
        ops = sum(len(r.ops) * r.calls for r in self.regions)
        most = 2 * seconds + self.policy_seconds_per_op * ops  # no plan recomputes more
        return objective_weights(name, seconds, flops, most)

    def problem(self, policy_seconds_per_op: float, objective: Objective | None = None) -> Problem:
        """The solver's view of this step (Rules M4-M6 decide which ops are units; ops after a
        region's early stop cost nothing and are no units, Rule M9; the ops before it are the
        region's replay graph, Rule S8); a selective policy costs ``policy_seconds_per_op`` per
        op of a region call, forward and replay (Rule S3)."""
        regions = []
        for position, region in enumerate(self.regions):
            before = self.regions[position - 1] if position else None
            joinable = _joinable(before, region)
            rest = region.ops[region.stop :]  # Rule S9: run where the region after it joins
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
                    plain_only=region.kept_blocks,
                    joinable=joinable,
                    boundary=frozenset(region.inputs & before.outputs)
                    if joinable and before is not None
                    else frozenset(),
                    states=frozenset(region.captured),
                    drew=region.draws,
                    rest_seconds=sum(c.seconds for c in rest),
                    rest_flops=sum(c.flops for c in rest),
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
        """Rule M13: this step with every region that has a trail cut at its start (its ops,
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
                    ends_at_trail=True,
                )
            )
        if not trails:
            return None
        return replace(self, regions=regions), trails


def _joinable(before: RegionProfile | None, region: RegionProfile) -> bool:
    """Rule S9: whether ``region`` may be checkpointed in one frame with ``before``, the region
    before it: each ran once, it right after ``before`` (no op between them, the same thread,
    outside every other region), what it received that ``before`` made is ``before``'s output,
    and neither keeps anything whatever it saves (a collective, a kept span: Rules M14 and
    M15), runs planned without recompute or ends at its trail (Rule M13)."""
    if before is None or not region.follows or before.calls != 1 or region.calls != 1:
        return False
    if before.kept or region.kept or before.kept_blocks or region.kept_blocks:
        return False
    if before.ends_at_trail or region.ends_at_trail:  # Rule M13: a frame ends before its end
        return False
    made = {s for call in before.ops for s in call.storages}
    return (region.inputs & made) <= before.outputs


def _draws(region: RegionProfile, needed: list[OpCall]) -> Unit | None:
    """Rule S7: the region's random ops as one group, or None where keeping them cannot help
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


def structure(region: RegionProfile, storage_bytes: dict[int, int]) -> tuple[object, ...]:
    """Rule M8: what makes two regions identical for the planner: the type, the calls, the early
    stop, and per op its key, kind, FLOPs, the sizes of its fresh storages, whether the replay
    may skip it and which of the region's storages it reads (Rule S8); and which of them
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
    """Rule S8: the ops recompute runs (up to the early stop, Rule M9) as the solver's plain
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
        elif call.kind in ("view", "kept"):  # a kept collective runs not and needs nothing
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
