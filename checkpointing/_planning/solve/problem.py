"""The planner's problem in the solver's terms, and the exact price of a choice.

Owns the plain data a profiled step becomes (``Unit``; ``ReplayOp`` and ``ReplayGraph``, a
region's replay and its closure, Rule S8; ``RegionChoices``; ``Objective``; ``Problem``), the
answer's terms (``Choice``, ``Solution``), and the prices every later floor shares: the exact
bytes a choice keeps (every storage once, Rules M1 and S1), its recompute seconds and FLOPs (Rules
S3, S4, S7, S8 and M11) and the cost the solver minimizes (Rule M12). Knows nothing about torch's
ops: profiling belongs to ``profile``; a region's options to ``options`` (its unit knapsacks to
``fronts``), the choice across regions to ``solver``, offload to ``offload_choice``. See NOTE
[Planner solve] in ``checkpointing._planning.solve``.

Storages that two regions or more keep when checkpointed (an RNG state they share, an input
they all receive: Rule A3) are charged once, up front, in the additive count (``Problem.shared``,
``Problem.charged``, ``own_bytes``), not once per region: still an upper bound, and a chain of
tiny regions sharing a ~5 KB state is not priced as if each kept its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = [
    "Choice",
    "Method",
    "Objective",
    "Problem",
    "RegionChoices",
    "ReplayGraph",
    "ReplayOp",
    "ReplayRole",
    "Solution",
    "Unit",
    "frame_seconds",
    "join_breaks",
    "kept_bytes",
    "kept_storages",
    "modes_seconds",
    "own_bytes",
    "recompute_cost",
    "recompute_flops",
    "recompute_seconds",
    "region_recompute",
    "skipped",
    "whole",
]

Method = Literal["exact", "grid"]


@dataclass(frozen=True, slots=True)
class Unit:
    """An op of a region whose output may be saved: its key, its time, its fresh storages, and
    its FLOPs (Rule S4)."""

    key: tuple[str, int]
    seconds: float
    storages: tuple[int, ...]
    flops: int = 0


ReplayRole = Literal["skippable", "root", "random", "view"]


@dataclass(frozen=True, slots=True)
class ReplayOp:
    """One op a region's recompute runs (up to its early stop), for the replay's closure (Rule S8):
    its key, cost, the region's storages it reads and writes (numbered within the region), its role,
    and its position among the region's units (-1: not a unit).

    Roles: ``"skippable"`` runs only where an output's values are needed; ``"root"`` runs
    whatever is kept around it and needs what it reads (in-place writes, ops without a tensor
    output, ops whose outputs blanks cannot stand for); ``"random"`` is a root unless the region
    keeps its draws (then it is answered from the forward and needs nothing); ``"view"`` always
    runs and needs no values (its output shares its input's storage)."""

    key: tuple[str, int]
    seconds: float
    flops: int
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    role: ReplayRole
    unit: int = -1


@dataclass(frozen=True, slots=True)
class ReplayGraph:
    """A region's replay as plain data (Rule S8): its ops in order and which of its storages
    autograd saves. Identical blocks give equal graphs (their storages are numbered alike)."""

    ops: tuple[ReplayOp, ...]
    saved: frozenset[int]
    writers: tuple[tuple[int, ...], ...] = field(init=False, compare=False, repr=False)
    """Per storage, the ops that write it (its producer, then in-place writers)."""

    def __post_init__(self) -> None:
        count = 1 + max((s for op in self.ops for s in (*op.reads, *op.writes)), default=-1)
        writers: list[list[int]] = [[] for _ in range(count)]
        for position, op in enumerate(self.ops):
            for storage in op.writes:
                writers[storage].append(position)
        object.__setattr__(self, "writers", tuple(map(tuple, writers)))

    def running(self, kept: frozenset[int], draws: bool) -> tuple[bytearray, bytearray]:
        """Rule S8: which ops compute in the replay, and which storages' values it needs, with
        the units ``kept`` served from the forward (they run not, and need nothing) and, with
        ``draws``, the random ops too. Roots compute, and so does every writer of a needed
        storage; a storage is needed if autograd saves it or a computing op reads it."""
        ops, writers = self.ops, self.writers
        running = bytearray(len(ops))
        needed = bytearray(len(writers))
        stack = []
        for position, op in enumerate(ops):
            if op.unit in kept:
                continue
            if op.role == "root" or (op.role == "random" and not draws):
                running[position] = 1
                stack.append(position)
        for storage in self.saved:
            needed[storage] = 1
            for writer in writers[storage]:
                if not running[writer] and ops[writer].unit not in kept:
                    running[writer] = 1
                    stack.append(writer)
        while stack:
            op = ops[stack.pop()]
            if op.role == "random" and draws:
                continue  # answered from the forward's draws (Rule S7)
            for storage in op.reads:
                if needed[storage]:
                    continue
                needed[storage] = 1
                for writer in writers[storage]:
                    if not running[writer] and ops[writer].unit not in kept:
                        running[writer] = 1
                        stack.append(writer)
        return running, needed

    def replay(
        self, kept: frozenset[int], draws: bool, skip: bool
    ) -> tuple[float, int, tuple[int, ...]]:
        """(seconds, FLOPs, positions of the skipped ops) of the replay keeping units ``kept``
        (and the draws): every op runs but the kept units, the kept draws and, with ``skip``,
        the skippable ops whose outputs nothing needs."""
        running = self.running(kept, draws)[0] if skip else None
        seconds, flops = 0.0, 0
        skipped = []
        for position, op in enumerate(self.ops):
            if op.unit in kept or (draws and op.role == "random"):
                continue
            if running is not None and op.role == "skippable" and not running[position]:
                skipped.append(position)
                continue
            seconds += op.seconds
            flops += op.flops
        return seconds, flops, tuple(skipped)

    def useless(self, kept: frozenset[int], draws: bool) -> frozenset[int]:
        """The kept units the replay would skip anyway: skippable, none of their outputs needed
        (keeping them costs bytes and saves nothing, Rule S8)."""
        needed = self.running(kept, draws)[1]
        return frozenset(
            op.unit
            for op in self.ops
            if op.unit in kept and op.role == "skippable" and not any(needed[s] for s in op.writes)
        )


@dataclass(frozen=True, slots=True)
class RegionChoices:
    """What one region keeps plainly (``saved``) and checkpointed (``inputs`` plus the saved
    units' storages), what recompute costs beyond the units (``forced_seconds``,
    ``forced_flops``), and what a selective policy adds to a step of the region when it keeps a
    unit (``policy_seconds``)."""

    saved: frozenset[int]
    inputs: frozenset[int]
    forced_seconds: float
    units: tuple[Unit, ...]
    policy_seconds: float = 0.0
    forced_flops: int = 0
    grad_bytes: int = 0
    draws: Unit | None = None
    """The region's random ops as one group (Rule S7): kept all together or none; its seconds
    and FLOPs are in ``forced_seconds``/``forced_flops`` unless kept."""
    replay: ReplayGraph | None = None
    """The ops recompute runs, as a graph (Rule S8); where given, a choice's recompute is worked
    out on it (the forced and unit costs are its sums), and the replay may skip ops. None: no
    op is skipped."""
    plain_only: bool = False
    """The region runs plainly whatever the budget: a recorded tail's module (Rule M11), or one
    that runs a ``with keeping():`` block (Rule M14)."""
    referenced: frozenset[int] = frozenset()
    """The inputs a checkpoint keeps by plain reference (keyword, nested; Rule M11)."""
    frame_seconds: float = 0.0
    """A charge for checkpointing the region at all, weighed into the cost the solver minimizes
    but not into the predicted seconds: how the planner draws candidate plans that checkpoint
    fewer regions (Rule M12)."""
    backward_peak: int = 0
    """The most bytes live while the plain step's backward ran the region (Rule S6; 0: not
    measured)."""
    joinable: bool = False
    """It may be checkpointed in one frame with the region before it (Rule S9): it ran right
    after that one, once, no op between them, and what it received from it is its output."""
    boundary: frozenset[int] = frozenset()
    """Its inputs the region before it returned: kept nowhere when joined (Rule S9)."""
    states: frozenset[int] = frozenset()
    """The RNG states a frame entered at the region captures (Rule A3), among ``inputs`` where
    it draws: a chain keeps its states whether it draws or not (Rule S9)."""
    drew: bool = False
    """Whether the region drew random numbers when profiled (Rule A3)."""
    rest_seconds: float = 0.0
    """What recompute costs past its early stop (Rule M9): paid where the region after it is
    joined to it, since that one needs its output (Rule S9)."""
    rest_flops: int = 0
    rest_frame_seconds: float = 0.0
    """The frame's charge for those ops (Rule M12)."""


@dataclass(frozen=True, slots=True)
class Objective:
    """Rule S4: what one second and one FLOP of recompute weigh; the solver minimizes the sum."""

    seconds: float = 1.0
    flops: float = 0.0

    def cost(self, seconds: float, flops: int) -> float:
        return self.seconds * seconds + self.flops * flops


# The names ``plan_checkpointing(objective=...)`` takes (Rule S4).
ObjectiveName = Literal["time", "flops"]
# Rule S4: under objective "time", recomputing all of the regions' FLOPs weighs this share of
# their predicted time: plans whose predicted times are within it are told apart by FLOPs.
_TIE_SHARE: Final = 0.01


def objective_weights(name: ObjectiveName, seconds: float, flops: int, most: float) -> Objective:
    """Rule S4: the weights of a second and of a FLOP of recompute, given the regions' predicted
    ``seconds`` and ``flops`` (all of their ops) and the ``most`` seconds any plan could
    recompute. ``"time"``: seconds, with FLOPs breaking near-ties (recomputing every FLOP weighs
    ``_TIE_SHARE`` of the predicted time); ``"flops"``: FLOPs, with seconds breaking ties (the
    most seconds weigh less than half a FLOP)."""
    if name == "flops":
        return Objective(seconds=0.5 / max(most, 1e-12), flops=1.0)
    return Objective(seconds=1.0, flops=_TIE_SHARE * seconds / max(flops, 1))


@dataclass(frozen=True, slots=True)
class Problem:
    """A profiled step: regions, bytes per storage id, storages kept outside every region, and
    the objective."""

    regions: tuple[RegionChoices, ...]
    storage_bytes: dict[int, int]
    outside: frozenset[int]
    objective: Objective = Objective()
    plain_peak: int = 0
    """The allocator's peak over the plain step (Rule S6; 0: unknown)."""
    fixed_seconds: float = 0.0
    """Recompute every choice pays: the replay of the recorded spans (Rule M11)."""
    fixed_flops: int = 0
    shared: frozenset[int] = field(init=False)
    """Storages two regions or more keep when checkpointed, charged once up front."""
    charged: frozenset[int] = field(init=False)
    """What the additive count charges up front: ``outside`` and ``shared``."""

    def __post_init__(self) -> None:
        seen: set[int] = set()
        shared: set[int] = set()
        for region in self.regions:
            shared |= seen & region.inputs
            seen |= region.inputs
        object.__setattr__(self, "shared", frozenset(shared - self.outside))
        object.__setattr__(self, "charged", self.outside | self.shared)


@dataclass(frozen=True, slots=True)
class Choice:
    """One region's decision: checkpoint it or not; if so, which units (by position) to save."""

    checkpoint: bool
    saved: frozenset[int] = frozenset()
    draws: bool = False
    """Keep the outputs of all of the region's random ops (Rule S7)."""
    skip: bool = False
    """Skip in the replay the ops whose outputs nothing needs (Rule S8; a selective policy)."""
    joined: bool = False
    """Checkpointed whole in one frame with the region before it, which is checkpointed whole
    or joined itself (Rule S9)."""


@dataclass(frozen=True, slots=True)
class Solution:
    """The solver's answer, with the exact bytes it keeps and what it predicts recompute costs.

    ``grid_bytes``: the byte step of the regions' knapsack (``method == "grid"``: the answer
    costs no more than the best one at a budget of ``grid_bytes`` per region less)."""

    choices: tuple[Choice, ...]
    kept_bytes: int
    recompute_seconds: float
    recompute_flops: int
    method: Method
    grid_bytes: int
    floor_bytes: int
    baseline_bytes: int
    frontier: tuple[tuple[int, float], ...]


def kept_storages(problem: Problem, index: int, choice: Choice) -> frozenset[int]:
    """The storages region ``index`` keeps under ``choice`` (Rule S1)."""
    region = problem.regions[index]
    if not choice.checkpoint:
        return region.saved
    if choice.joined:  # Rule S9: the chain keeps its first member's inputs and one RNG state
        own = region.inputs - region.boundary - region.states
        return own if problem.regions[index - 1].drew else own | region.states
    kept = set(region.inputs)
    for position in choice.saved:
        kept.update(region.units[position].storages)
    if choice.draws and region.draws is not None:
        kept.update(region.draws.storages)
    return frozenset(kept)


def whole(choice: Choice) -> bool:
    """Checkpointed keeping nothing, with no mode of the planner's: what a chain's member is
    (Rule S9)."""
    return choice.checkpoint and not (choice.saved or choice.draws or choice.skip)


def join_breaks(problem: Problem, choices: Sequence[Choice]) -> list[int]:
    """The regions ``choices`` join that cannot be joined (Rule S9): not ``joinable``, not
    whole, or after a region that is not whole; empty for a choice the run can hold."""
    return [
        index
        for index, choice in enumerate(choices)
        if choice.joined
        and not (
            index > 0
            and problem.regions[index].joinable
            and whole(choice)
            and whole(choices[index - 1])
        )
    ]


def kept_bytes(problem: Problem, choices: Sequence[Choice]) -> int:
    """Exact bytes kept by ``choices``: every storage once (Rule M1)."""
    kept = set(problem.outside)
    for index, choice in enumerate(choices):
        kept.update(kept_storages(problem, index, choice))
    return sum(problem.storage_bytes[s] for s in kept)


def region_recompute(problem: Problem, index: int, choice: Choice) -> tuple[float, int]:
    """(seconds, FLOPs) recompute costs in region ``index`` under ``choice``; a joined region's
    include the region before it past its early stop (Rule S9)."""
    seconds, flops = _region_recompute(problem.regions[index], choice)
    if choice.joined:
        before = problem.regions[index - 1]
        return seconds + before.rest_seconds, flops + before.rest_flops
    return seconds, flops


def frame_seconds(problem: Problem, index: int, choice: Choice) -> float:
    """The charge for checkpointing region ``index`` under ``choice`` (Rule M12): its frame's,
    and a joined region's for the ops the region before it then recomputes (Rule S9)."""
    if not choice.checkpoint:
        return 0.0
    if choice.joined:
        return problem.regions[index].frame_seconds + problem.regions[index - 1].rest_frame_seconds
    return problem.regions[index].frame_seconds


def skipped(problem: Problem, index: int, choice: Choice) -> tuple[tuple[str, int], ...]:
    """The keys of the ops region ``index``'s replay skips under ``choice`` (Rule S8)."""
    region = problem.regions[index]
    if region.replay is None or not choice.checkpoint or not choice.skip:
        return ()
    draws = choice.draws and region.draws is not None
    positions = region.replay.replay(choice.saved, draws, True)[2]
    return tuple(region.replay.ops[p].key for p in positions)


def _region_recompute(region: RegionChoices, choice: Choice) -> tuple[float, int]:
    """(seconds, FLOPs) recompute costs in one region under ``choice``: on its replay graph
    where it has one (Rule S8), else its forced cost and its units not kept."""
    if not choice.checkpoint:
        return 0.0, 0
    if region.replay is not None:
        draws = choice.draws and region.draws is not None
        seconds, flops, skips = region.replay.replay(choice.saved, draws, choice.skip)
        return seconds + modes_seconds(region, bool(choice.saved or skips), draws), flops
    seconds, flops = region.forced_seconds, region.forced_flops
    for position, unit in enumerate(region.units):
        if position not in choice.saved:
            seconds += unit.seconds
            flops += unit.flops
    if choice.draws and region.draws is not None:
        seconds -= region.draws.seconds
        flops -= region.draws.flops
    draws = choice.draws and region.draws is not None
    return seconds + modes_seconds(region, bool(choice.saved), draws), flops


def modes_seconds(region: RegionChoices, selective: bool, draws: bool) -> float:
    """Rule S3: what the dispatch modes a choice installs cost per step: the selective modes
    where it keeps outputs or skips ops, the draws modes where it keeps its draws (Rule S7),
    each priced as the measured selective policy (the draws modes do less per op: over, never
    under)."""
    return region.policy_seconds * (int(selective) + int(draws))


def recompute_seconds(problem: Problem, choices: Sequence[Choice]) -> float:
    """Predicted recompute time: every op of a checkpointed region up to its early stop that is
    not saved, plus the selective policy's cost in the regions that save some (Rule S3), plus
    the recorded spans' replay (Rule M11)."""
    return problem.fixed_seconds + sum(
        region_recompute(problem, i, c)[0] for i, c in enumerate(choices)
    )


def recompute_flops(problem: Problem, choices: Sequence[Choice]) -> int:
    """Predicted recompute FLOPs (Rule S4), the recorded spans' included (Rule M11)."""
    return problem.fixed_flops + sum(
        region_recompute(problem, i, c)[1] for i, c in enumerate(choices)
    )


def recompute_cost(problem: Problem, choices: Sequence[Choice]) -> float:
    """What the solver minimizes: the objective's weighing of seconds and FLOPs, with each
    checkpointed region's charge (Rule M12)."""
    frames = sum(frame_seconds(problem, i, c) for i, c in enumerate(choices))
    return problem.objective.cost(
        recompute_seconds(problem, choices) + frames, recompute_flops(problem, choices)
    )


def own_bytes(problem: Problem, storages: Iterable[int]) -> int:
    return sum(problem.storage_bytes[s] for s in storages if s not in problem.charged)
