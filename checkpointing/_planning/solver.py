"""The budget solver: which regions to checkpoint and which op outputs inside them to keep.

Owns ``Problem`` (a profiled step in the solver's terms: storages, and per region what it keeps
plainly, what it keeps checkpointed, and its ops that may be saved), ``Objective`` (what a
second and a FLOP of recompute weigh), ``solve``, the exact byte count of a choice, and which
outputs to offload instead of recomputing (``offloads``). Knows nothing about torch's ops:
profiling belongs to ``profile``, installing and printing to ``plan``. See NOTE [Planner model]
in ``checkpointing._planning``, Rules 7, 10, 15-17 and 21.

Method (Rule 17). Each region offers options: run plainly (keeps what autograd saves in it, costs
nothing) or checkpoint it keeping some of its ops' outputs (keeps its inputs and those outputs,
recomputes the other ops up to its early stop but those the replay skips, Rule 21, and pays the
selective policy's cost, Rule 13, unless it keeps and skips none), each also keeping the outputs of
all of its random ops where it has some (Rule 19). A region's checkpointed options are the Pareto
set of a 0/1 knapsack over its units, solved by dynamic programming over bytes: on the grid of the
greatest common divisor of the units' sizes (exact) while that has at most ``_UNIT_POINTS`` points,
else on ``_UNIT_POINTS`` equal steps, sizes rounded up. Where a region's replay may skip ops (Rule
21: ``ReplayGraph``), the knapsack values each unit with the skippable ops it alone keeps computing,
takes at most one of the units that free one another (groups of alternatives), and its sets are
only proposals: each is settled and priced exactly by the replay's closure. Regions
of one structure and costs (the blocks of a model) share one such front, and one set of options:
computed once. Across regions it is a multiple-choice knapsack on an additive upper bound of the
bytes (Rule 7), solved by dynamic programming over a byte grid: the greatest common divisor of the
options' sizes (then the answer is the additive optimum, ``method == "exact"``) while that has at
most ``grid_points`` points, else ``grid_points`` equal steps with every option's bytes rounded up
(``method == "grid"``: the answer fits, and costs no more than the additive optimum at a budget of
one grid step per region less). A last pass spends what the exact byte count leaves of the budget,
so the plan never predicts more than the budget.

Rejected: merging Pareto sets across regions (exact, but the sets outgrow any limit on a Llama
block's 300 options, and the greedy fallback it needed lost up to a hull step per region), and
a greedy walk along each region's lower convex hull (blind to the options inside the hull,
which are most of a block's good ones under the early stop).

Storages that two regions or more keep when checkpointed (an RNG state they share, an input
they all receive: Rule 14) are charged once, up front, in the additive count, not once per
region: still an upper bound, and a chain of tiny regions sharing a ~5 KB state is not priced
as if each kept its own. A plan keeping nothing of theirs is found by the last pass, or is the
plain run (zero recompute, chosen whenever the budget holds it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Final, Literal

import torch

__all__ = [
    "Choice",
    "Objective",
    "Problem",
    "RegionChoices",
    "ReplayGraph",
    "ReplayOp",
    "ReplayRole",
    "Solution",
    "Unit",
    "offloads",
    "region_recompute",
    "skipped",
    "solve",
]

# Host<->device bandwidth assumed for offload, each way (PCIe 4 x16 in practice reaches ~12-25
# GB/s; the lower end keeps offload from looking cheaper than it is).
_HOST_BYTES_PER_SECOND: Final = 10e9
_UNIT_POINTS: Final = 1 << 15  # a region's unit knapsack: at most this many byte steps
_GRID_POINTS: Final = 8192  # the regions' knapsack: at most this many byte steps
_FRONTIER_POINTS: Final = 64  # points of the trade-off curve a solution reports

Method = Literal["exact", "grid"]


@dataclass(frozen=True, slots=True)
class Unit:
    """An op of a region whose output may be saved: its key, its time, its fresh storages, and
    its FLOPs (Rule 15)."""

    key: tuple[str, int]
    seconds: float
    storages: tuple[int, ...]
    flops: int = 0


ReplayRole = Literal["skippable", "root", "random", "view"]


@dataclass(frozen=True, slots=True)
class ReplayOp:
    """One op a region's recompute runs (up to its early stop), for the replay's closure (Rule
    21): its key, cost, the region's storages it reads and writes (numbered within the region),
    its role, and its position among the region's units (-1: not a unit).

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
    """A region's replay as plain data (Rule 21): its ops in order and which of its storages
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
        """Rule 21: which ops compute in the replay, and which storages' values it needs, with
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
                continue  # answered from the forward's draws (Rule 19)
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
        (keeping them costs bytes and saves nothing, Rule 21)."""
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
    """The region's random ops as one group (Rule 19): kept all together or none; its seconds
    and FLOPs are in ``forced_seconds``/``forced_flops`` unless kept."""
    replay: ReplayGraph | None = None
    """The ops recompute runs, as a graph (Rule 21); where given, a choice's recompute is worked
    out on it (the forced and unit costs are its sums), and the replay may skip ops. None: no
    op is skipped."""
    plain_only: bool = False
    """The region runs plainly whatever the budget: a recorded tail's module (Rule 22)."""
    referenced: frozenset[int] = frozenset()
    """The inputs a checkpoint keeps by plain reference (keyword, nested; Rule 22)."""
    frame_seconds: float = 0.0
    """A charge for checkpointing the region at all, weighed into the cost the solver minimizes
    but not into the predicted seconds: how the planner draws candidate plans that checkpoint
    fewer regions (Rule 23)."""
    backward_peak: int = 0
    """The most bytes live while the plain step's backward ran the region (Rule 18; 0: not
    measured)."""


@dataclass(frozen=True, slots=True)
class Objective:
    """Rule 15: what one second and one FLOP of recompute weigh; the solver minimizes the sum."""

    seconds: float = 1.0
    flops: float = 0.0

    def cost(self, seconds: float, flops: int) -> float:
        return self.seconds * seconds + self.flops * flops


@dataclass(frozen=True, slots=True)
class Problem:
    """A profiled step: regions, bytes per storage id, storages kept outside every region, and
    the objective."""

    regions: tuple[RegionChoices, ...]
    storage_bytes: dict[int, int]
    outside: frozenset[int]
    objective: Objective = Objective()
    plain_peak: int = 0
    """The allocator's peak over the plain step (Rule 18; 0: unknown)."""
    fixed_seconds: float = 0.0
    """Recompute every choice pays: the replay of the recorded spans (Rule 22)."""
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
    """Keep the outputs of all of the region's random ops (Rule 19)."""
    skip: bool = False
    """Skip in the replay the ops whose outputs nothing needs (Rule 21; a selective policy)."""


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
    """The storages region ``index`` keeps under ``choice`` (Rule 7)."""
    region = problem.regions[index]
    if not choice.checkpoint:
        return region.saved
    kept = set(region.inputs)
    for position in choice.saved:
        kept.update(region.units[position].storages)
    if choice.draws and region.draws is not None:
        kept.update(region.draws.storages)
    return frozenset(kept)


def kept_bytes(problem: Problem, choices: Sequence[Choice]) -> int:
    """Exact bytes kept by ``choices``: every storage once (Rule 1)."""
    kept = set(problem.outside)
    for index, choice in enumerate(choices):
        kept.update(kept_storages(problem, index, choice))
    return sum(problem.storage_bytes[s] for s in kept)


def region_recompute(problem: Problem, index: int, choice: Choice) -> tuple[float, int]:
    """(seconds, FLOPs) recompute costs in region ``index`` under ``choice``."""
    return _region_recompute(problem.regions[index], choice)


def skipped(problem: Problem, index: int, choice: Choice) -> tuple[tuple[str, int], ...]:
    """The keys of the ops region ``index``'s replay skips under ``choice`` (Rule 21)."""
    region = problem.regions[index]
    if region.replay is None or not choice.checkpoint or not choice.skip:
        return ()
    draws = choice.draws and region.draws is not None
    positions = region.replay.replay(choice.saved, draws, True)[2]
    return tuple(region.replay.ops[p].key for p in positions)


def _region_recompute(region: RegionChoices, choice: Choice) -> tuple[float, int]:
    """(seconds, FLOPs) recompute costs in one region under ``choice``: on its replay graph
    where it has one (Rule 21), else its forced cost and its units not kept."""
    if not choice.checkpoint:
        return 0.0, 0
    if region.replay is not None:
        draws = choice.draws and region.draws is not None
        seconds, flops, skips = region.replay.replay(choice.saved, draws, choice.skip)
        return seconds + _modes_seconds(region, bool(choice.saved or skips), draws), flops
    seconds, flops = region.forced_seconds, region.forced_flops
    for position, unit in enumerate(region.units):
        if position not in choice.saved:
            seconds += unit.seconds
            flops += unit.flops
    if choice.draws and region.draws is not None:
        seconds -= region.draws.seconds
        flops -= region.draws.flops
    draws = choice.draws and region.draws is not None
    return seconds + _modes_seconds(region, bool(choice.saved), draws), flops


def _modes_seconds(region: RegionChoices, selective: bool, draws: bool) -> float:
    """Rule 13: what the dispatch modes a choice installs cost per step: the selective modes
    where it keeps outputs or skips ops, the draws modes where it keeps its draws (Rule 19),
    each priced as the measured selective policy (the draws modes do less per op: over, never
    under)."""
    return region.policy_seconds * (int(selective) + int(draws))


def recompute_seconds(problem: Problem, choices: Sequence[Choice]) -> float:
    """Predicted recompute time: every op of a checkpointed region up to its early stop that is
    not saved, plus the selective policy's cost in the regions that save some (Rule 13), plus
    the recorded spans' replay (Rule 22)."""
    return problem.fixed_seconds + sum(
        _region_recompute(r, c)[0] for r, c in zip(problem.regions, choices, strict=True)
    )


def recompute_flops(problem: Problem, choices: Sequence[Choice]) -> int:
    """Predicted recompute FLOPs (Rule 15), the recorded spans' included (Rule 22)."""
    return problem.fixed_flops + sum(
        _region_recompute(r, c)[1] for r, c in zip(problem.regions, choices, strict=True)
    )


def recompute_cost(problem: Problem, choices: Sequence[Choice]) -> float:
    """What the solver minimizes: the objective's weighing of seconds and FLOPs, with each
    checkpointed region's charge (Rule 23)."""
    frames = sum(
        r.frame_seconds for r, c in zip(problem.regions, choices, strict=True) if c.checkpoint
    )
    return problem.objective.cost(
        recompute_seconds(problem, choices) + frames, recompute_flops(problem, choices)
    )


def _bytes(problem: Problem, storages: Iterable[int]) -> int:
    return sum(problem.storage_bytes[s] for s in storages if s not in problem.charged)


# -- one region: the Pareto set of its options -----------------------------------------------


class _Front:
    """The 0/1 knapsack over a region's units by dynamic programming over bytes: for every
    byte step, the most cost a set of units saves, with what it saves in seconds and FLOPs,
    its real bytes, and a table to read the set back. Shared by regions of equal unit sizes
    and costs (Rule 17): computed once for all the blocks of a model."""

    def __init__(self, units: tuple[Unit, ...], sizes: tuple[int, ...], gains: tuple[float, ...]):
        useful = [s for s, g in zip(sizes, gains, strict=True) if g > 0 and s > 0]
        total = sum(useful)
        step = reduce(math.gcd, useful, 0) or 1
        if total // step > _UNIT_POINTS:
            step = -(-total // _UNIT_POINTS)
        self.weights = [-(-s // step) for s in sizes]
        width = sum(w for w, g in zip(self.weights, gains, strict=True) if g > 0) + 1
        best = torch.zeros(width, dtype=torch.float64)
        saved_seconds = torch.zeros(width, dtype=torch.float64)
        saved_flops = torch.zeros(width, dtype=torch.int64)
        real = torch.zeros(width, dtype=torch.int64)
        self.take = torch.zeros((len(sizes), width), dtype=torch.bool)
        for position, unit in enumerate(units):
            weight, gain, size = self.weights[position], gains[position], sizes[position]
            if gain <= 0:
                continue
            if weight == 0:  # its storages are charged anyway: kept for free, always
                self.take[position] = True
                best += gain
                saved_seconds += unit.seconds
                saved_flops += unit.flops
                continue
            better = best[:-weight] + gain > best[weight:]
            for column, added in (
                (best, gain),
                (saved_seconds, unit.seconds),
                (saved_flops, unit.flops),
                (real, size),
            ):
                column[weight:] = torch.where(better, column[:-weight] + added, column[weight:])
            self.take[position, weight:] = better
        # Pareto points: the steps where the best saving grows (a set weighing exactly that).
        grows = torch.ones(width, dtype=torch.bool)
        grows[1:] = best[1:] > best[:-1]
        grows &= best > 0  # the empty set is the region's option without a policy
        self.points = torch.nonzero(grows).flatten()
        self.gains = best[self.points]
        self.saved_seconds = saved_seconds[self.points]
        self.saved_flops = saved_flops[self.points]
        self.real_bytes = real[self.points]
        self._sets: dict[int, frozenset[int]] = {}

    def units_at(self, point: int) -> frozenset[int]:
        """The units of the best set weighing ``point`` steps (read back once, then kept)."""
        known = self._sets.get(point)
        if known is None:
            chosen = []
            remaining = point
            for position in range(len(self.weights) - 1, -1, -1):
                if bool(self.take[position, remaining]):
                    chosen.append(position)
                    remaining -= self.weights[position]
            known = self._sets[point] = frozenset(chosen)
        return known


class _Fronts:
    """The unit fronts of a problem's regions, one per distinct (sizes, costs), or per distinct
    groups of units (Rule 21)."""

    def __init__(self) -> None:
        self.known: dict[tuple[object, ...], _Front | _GroupFront] = {}
        self.replayed: dict[tuple[object, ...], _Settled] = {}
        """The settled options of regions with a replay graph, per (graph, unit and draws
        bytes, policy): identical blocks are evaluated once (Rule 21)."""

    def get(
        self, units: tuple[Unit, ...], sizes: tuple[int, ...], gains: tuple[float, ...]
    ) -> _Front:
        key = (sizes, gains)
        front = self.known.get(key)
        if not isinstance(front, _Front):
            front = self.known[key] = _Front(units, sizes, gains)
        return front

    def groups(self, groups: tuple[tuple[_Alternative, ...], ...]) -> _GroupFront:
        """Rule 21: the knapsack over these groups of units, once per distinct groups."""
        key = ("groups", groups)
        front = self.known.get(key)
        if not isinstance(front, _GroupFront):
            front = self.known[key] = _GroupFront(groups)
        return front


_PLAIN: Final = -2  # an option's ``point``: run the region plainly
_NOTHING: Final = -1  # checkpoint it keeping nothing (no policy); >= 0: a point of its front


@dataclass(frozen=True, slots=True)
class _Options:
    """One region's Pareto set of options as columns, fewest bytes (costliest) first."""

    nbytes: torch.Tensor  # additive: the region's own bytes, storages charged up front excluded
    cost: torch.Tensor
    seconds: torch.Tensor
    flops: torch.Tensor
    point: torch.Tensor
    front: _Front | None
    draws: torch.Tensor  # bool: the option keeps the region's random draws (Rule 19)
    sets: tuple[frozenset[int], ...] | None = None
    """With a replay graph (Rule 21): the units each point keeps; its options but the one
    keeping nothing without a policy skip in the replay."""

    def choice(self, option: int) -> Choice:
        point = int(self.point[option])
        draws = bool(self.draws[option])
        if point == _PLAIN:
            return Choice(False)
        if point == _NOTHING:
            return Choice(True, draws=draws)
        if self.sets is not None:
            return Choice(True, self.sets[point], draws, skip=True)
        if self.front is None:
            return Choice(True, draws=draws)
        return Choice(True, self.front.units_at(point), draws)


def region_options(problem: Problem, index: int, fronts: _Fronts | None = None) -> _Options:
    """Region ``index``'s Pareto set of options, fewest bytes first (costliest first): plain,
    checkpointed keeping nothing or a point of its units' front, each of those also with its
    random draws kept where it has some (Rule 19)."""
    region = problem.regions[index]
    if region.plain_only:
        return _Options(
            torch.tensor([_bytes(problem, region.saved)]),
            torch.tensor([0.0], dtype=torch.float64),
            torch.tensor([0.0], dtype=torch.float64),
            torch.tensor([0]),
            torch.tensor([_PLAIN]),
            None,
            torch.tensor([False]),
        )
    if region.replay is not None:
        return _replay_options(problem, region, region.replay, fronts or _Fronts())
    objective = problem.objective
    inputs = _bytes(problem, region.inputs)
    all_seconds = region.forced_seconds + sum(u.seconds for u in region.units)
    all_flops = region.forced_flops + sum(u.flops for u in region.units)
    all_cost = objective.cost(all_seconds, all_flops)
    nbytes = torch.tensor([inputs], dtype=torch.int64)
    cost = torch.tensor([all_cost], dtype=torch.float64)
    seconds = torch.tensor([all_seconds], dtype=torch.float64)
    flops = torch.tensor([all_flops], dtype=torch.int64)
    point = torch.tensor([_NOTHING], dtype=torch.int64)
    front = None
    if region.units:
        sizes = tuple(_bytes(problem, u.storages) for u in region.units)
        gains = tuple(objective.cost(u.seconds, u.flops) for u in region.units)
        front = (fronts or _Fronts()).get(region.units, sizes, gains)
        policy = objective.cost(region.policy_seconds, 0)
        nbytes = torch.cat([nbytes, inputs + front.real_bytes])
        cost = torch.cat([cost, all_cost - front.gains + policy])
        seconds = torch.cat([seconds, all_seconds - front.saved_seconds + region.policy_seconds])
        flops = torch.cat([flops, all_flops - front.saved_flops])
        point = torch.cat([point, front.points])
    columns = _with_draws(problem, region, (nbytes, cost, seconds, flops, point))
    nbytes, cost, seconds, flops, point, draws = columns
    nbytes = torch.cat([torch.tensor([_bytes(problem, region.saved)]), nbytes])
    charge = objective.cost(region.frame_seconds, 0)  # Rule 23
    cost = torch.cat([torch.tensor([0.0], dtype=torch.float64), cost + charge])
    seconds = torch.cat([torch.tensor([0.0], dtype=torch.float64), seconds])
    flops = torch.cat([torch.tensor([0]), flops])
    point = torch.cat([torch.tensor([_PLAIN]), point])
    draws = torch.cat([torch.tensor([False]), draws])
    keep = _pareto(nbytes, cost)
    return _Options(
        nbytes[keep], cost[keep], seconds[keep], flops[keep], point[keep], front, draws[keep]
    )


def _replay_options(
    problem: Problem, region: RegionChoices, graph: ReplayGraph, fronts: _Fronts
) -> _Options:
    """Rule 21: the options of a region with a replay graph: plain, or checkpointed as its
    settled sets (``_settle``, once per distinct graph, sizes and policy) say, its inputs'
    bytes added; the Pareto set of them."""
    sizes = tuple(_bytes(problem, u.storages) for u in region.units)
    group = -1 if region.draws is None else _bytes(problem, region.draws.storages)
    key = (graph, sizes, group, region.policy_seconds)
    settled = fronts.replayed.get(key)
    if settled is None:
        settled = fronts.replayed[key] = _settle(problem, region, graph, sizes, group, fronts)
    nbytes = torch.cat(
        [
            torch.tensor([_bytes(problem, region.saved)]),
            settled.nbytes + _bytes(problem, region.inputs),
        ]
    )
    charge = problem.objective.cost(region.frame_seconds, 0)  # Rule 23
    cost = torch.cat([torch.tensor([0.0], dtype=torch.float64), settled.cost + charge])
    seconds = torch.cat([torch.tensor([0.0], dtype=torch.float64), settled.seconds])
    flops = torch.cat([torch.tensor([0]), settled.flops])
    point = torch.cat([torch.tensor([_PLAIN]), settled.point])
    draws = torch.cat([torch.tensor([False]), settled.draws])
    keep = _pareto(nbytes, cost)
    return _Options(
        nbytes[keep],
        cost[keep],
        seconds[keep],
        flops[keep],
        point[keep],
        None,
        draws[keep],
        settled.sets,
    )


@dataclass(frozen=True, slots=True)
class _Settled:
    """A replay graph's checkpointed options, priced exactly (Rule 21), as columns: bytes (the
    region's inputs not included), cost, seconds, FLOPs, point (``_NOTHING`` or a position in
    ``sets``), whether it keeps the draws."""

    nbytes: torch.Tensor
    cost: torch.Tensor
    seconds: torch.Tensor
    flops: torch.Tensor
    point: torch.Tensor
    draws: torch.Tensor
    sets: tuple[frozenset[int], ...]


def _settle(
    problem: Problem,
    region: RegionChoices,
    graph: ReplayGraph,
    sizes: tuple[int, ...],
    group: int,
    fronts: _Fronts,
) -> _Settled:
    """Rule 21: the knapsack over the units' groups (``_unit_groups``) proposes the sets; each
    is settled (the units the replay would skip anyway dropped: bytes for nothing) and priced
    exactly by the closure, with and without the draws (``group``: their bytes, -1: none),
    beside keeping nothing (or only the draws) without a selective policy."""
    objective = problem.objective
    proposed = [frozenset[int]()]
    if region.units:
        proposed += fronts.groups(_unit_groups(graph, sizes, objective)).sets()
    all_seconds, all_flops, _ = graph.replay(frozenset(), False, False)
    rows = [(0, all_seconds, all_flops, _NOTHING, False)]
    if group >= 0:  # the draws kept and nothing else, no selective policy: the draws modes only
        seconds, flops, _ = graph.replay(frozenset(), True, False)
        rows.append((group, seconds + _modes_seconds(region, False, True), flops, _NOTHING, True))
    sets: dict[frozenset[int], int] = {}
    for units in dict.fromkeys(proposed):
        for draws in (False, True) if group >= 0 else (False,):
            kept = units - graph.useless(units, draws)
            seconds, flops, skips = graph.replay(kept, draws, True)
            seconds += _modes_seconds(region, bool(kept or skips), draws)
            size = sum(sizes[u] for u in kept) + (group if draws else 0)
            rows.append((size, seconds, flops, sets.setdefault(kept, len(sets)), draws))
    return _Settled(
        torch.tensor([r[0] for r in rows], dtype=torch.int64),
        torch.tensor([objective.cost(r[1], r[2]) for r in rows], dtype=torch.float64),
        torch.tensor([r[1] for r in rows], dtype=torch.float64),
        torch.tensor([r[2] for r in rows], dtype=torch.int64),
        torch.tensor([r[3] for r in rows], dtype=torch.int64),
        torch.tensor([r[4] for r in rows], dtype=torch.bool),
        tuple(sets),
    )


# One alternative of a group of units (Rule 21): the units kept, their bytes, what they save.
_Alternative = tuple[frozenset[int], int, float]
_ALTERNATIVES: Final = 64  # a group's alternatives at most: the best per bytes, evenly spread


def _unit_groups(
    graph: ReplayGraph, sizes: tuple[int, ...], objective: Objective
) -> tuple[tuple[_Alternative, ...], ...]:
    """Rule 21: the region's units as knapsack groups. A unit that frees another
    (``_unit_values``) makes keeping both a waste, so units form a forest (a unit's parent: the
    nearest one that frees it) and each tree is one group whose alternatives are its
    antichains, each worth the sum of its members' values, the best per bytes kept. The values
    add up exactly where each op is freed by one unit alone; every set is priced exactly
    afterwards anyway."""
    value, frees = _unit_values(graph, objective)
    parent: dict[int, int] = {}
    for unit, freed in frees.items():
        for child in freed & value.keys():
            if child not in parent or len(frees[parent[child]]) > len(freed):
                parent[child] = unit
    children: dict[int, list[int]] = {unit: [] for unit in value}
    for child, unit in parent.items():
        children[unit].append(child)
    found: dict[int, list[_Alternative]] = {}
    for unit in value:  # in op order, children first: a unit frees only ops before it
        combos: list[_Alternative] = [(frozenset(), 0, 0.0)]
        for child in children[unit]:
            below = [(frozenset[int](), 0, 0.0), *found.pop(child)]
            combos = _best_per_bytes(
                [
                    (a | b, size + more, gain + extra)
                    for a, size, gain in combos
                    for b, more, extra in below
                ]
            )
        alone = (frozenset({unit}), sizes[unit], value[unit])
        found[unit] = _best_per_bytes([*(c for c in combos if c[0]), alone])
    return tuple(tuple(found[unit]) for unit in value if unit not in parent)


def _unit_values(
    graph: ReplayGraph, objective: Objective
) -> tuple[dict[int, float], dict[int, frozenset[int]]]:
    """Rule 21: per unit worth keeping, in op order, its value with nothing else kept (its own
    cost and that of the skippable ops that then compute no more: those it alone needs; none
    for a unit the replay skips anyway) and the units among those ops."""
    running = graph.running(frozenset(), False)[0]
    cost = [objective.cost(op.seconds, op.flops) for op in graph.ops]
    # Skippable ops that compute only because an op reads them (autograd saves none of theirs).
    weak = [
        op.role == "skippable" and bool(running[p]) and graph.saved.isdisjoint(op.writes)
        for p, op in enumerate(graph.ops)
    ]
    value: dict[int, float] = {}
    frees: dict[int, frozenset[int]] = {}
    for position, op in enumerate(graph.ops):
        if op.unit < 0 or not running[position]:
            continue
        gain, freed = cost[position], frozenset[int]()
        if any(weak[w] for s in op.reads for w in graph.writers[s]):
            alone = graph.running(frozenset({op.unit}), False)[0]
            lost = [p for p in range(len(graph.ops)) if weak[p] and p != position and not alone[p]]
            gain += sum(cost[p] for p in lost)
            freed = frozenset(graph.ops[p].unit for p in lost if graph.ops[p].unit >= 0)
        if gain > 0:
            value[op.unit], frees[op.unit] = gain, freed
    return value, frees


def _best_per_bytes(alternatives: list[_Alternative]) -> list[_Alternative]:
    """The alternatives no other beats on both bytes and value, fewest bytes first; at most
    ``_ALTERNATIVES`` of them, evenly spread."""
    ordered = sorted(alternatives, key=lambda a: (a[1], -a[2]))
    kept: list[_Alternative] = []
    for alternative in ordered:
        if not kept or alternative[2] > kept[-1][2]:
            kept.append(alternative)
    if len(kept) > _ALTERNATIVES:
        picks = torch.linspace(0, len(kept) - 1, _ALTERNATIVES).round().long().tolist()
        kept = [kept[i] for i in dict.fromkeys(picks)]
    return kept


class _GroupFront:
    """Rule 21: the knapsack over a region's groups of units (``_unit_groups``), at most one
    alternative per group, by dynamic programming over bytes as ``_Front``; for every byte step
    where the most value grows, the units of the best choice (proposals, priced exactly after).
    Shared by regions of equal groups: computed once for all the blocks of a model."""

    def __init__(self, groups: tuple[tuple[_Alternative, ...], ...]) -> None:
        sizes = [size for group in groups for _, size, _ in group if size > 0]
        total = sum(max((size for _, size, _ in group), default=0) for group in groups)
        step = reduce(math.gcd, sizes, 0) or 1
        if total // step > _UNIT_POINTS:
            step = -(-total // _UNIT_POINTS)
        weights = [[-(-size // step) for _, size, _ in group] for group in groups]
        width = sum(max(w, default=0) for w in weights) + 1
        best = torch.zeros(width, dtype=torch.float64)
        self.picks = torch.full((len(groups), width), -1, dtype=torch.int16)
        for index, group in enumerate(groups):
            new = best.clone()
            for choice, ((_, _, gain), weight) in enumerate(
                zip(group, weights[index], strict=True)
            ):
                shifted = best[: width - weight] + gain
                better = shifted > new[weight:]
                new[weight:] = torch.where(better, shifted, new[weight:])
                self.picks[index, weight:][better] = choice
            best = new
        grows = torch.ones(width, dtype=torch.bool)
        grows[1:] = best[1:] > best[:-1]
        grows &= best > 0
        self.points = torch.nonzero(grows).flatten()
        self.groups = groups
        self.weights = [torch.tensor(w, dtype=torch.int64) for w in weights]

    def sets(self) -> list[frozenset[int]]:
        """The units of the best choice at every point where the most value grows."""
        remaining = self.points.clone()
        chosen: list[set[int]] = [set() for _ in range(len(remaining))]
        for index in range(len(self.groups) - 1, -1, -1):
            picks = self.picks[index, remaining].long()
            for column in torch.nonzero(picks >= 0).flatten().tolist():
                chosen[column] |= self.groups[index][int(picks[column])][0]
            if len(self.weights[index]):
                taken = self.weights[index][picks.clamp(min=0)]
                remaining = remaining - torch.where(picks >= 0, taken, 0)
        return [frozenset(c) for c in chosen]


_Columns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _with_draws(
    problem: Problem, region: RegionChoices, columns: _Columns
) -> tuple[torch.Tensor, ...]:
    """Rule 19: the checkpointed options (bytes, cost, seconds, FLOPs, point) and, where the
    region draws, each of them again with its draws kept (their bytes added, their seconds and
    FLOPs saved, the draws modes' cost paid, Rule 13); and which keep them."""
    nbytes, cost, seconds, flops, point = columns
    group = region.draws
    if group is None:
        return (*columns, torch.zeros(len(point), dtype=torch.bool))
    objective = problem.objective
    # The draws modes cost a policy's time on top of any selective modes (``_modes_seconds``).
    policy_cost = objective.cost(region.policy_seconds, 0)
    return (
        torch.cat([nbytes, nbytes + _bytes(problem, group.storages)]),
        torch.cat([cost, cost - objective.cost(group.seconds, group.flops) + policy_cost]),
        torch.cat([seconds, seconds - group.seconds + region.policy_seconds]),
        torch.cat([flops, flops - group.flops]),
        torch.cat([point, point]),
        torch.arange(2 * len(point)) >= len(point),
    )


def _pareto(nbytes: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """Positions of the options no other beats on both bytes and cost, fewest bytes first."""
    by_cost = torch.argsort(cost, stable=True)
    order = by_cost[torch.argsort(nbytes[by_cost], stable=True)]
    sorted_cost = cost[order]
    keep = torch.ones(len(order), dtype=torch.bool)
    if len(order) > 1:
        keep[1:] = sorted_cost[1:] < torch.cummin(sorted_cost, dim=0).values[:-1]
    return order[keep]


# -- across regions: the multiple-choice knapsack --------------------------------------------


class _Table:
    """Rule 17: the least cost at every byte step of the additive count, region by region, with
    back-pointers to read the options back."""

    _ROWS: Final = 64  # options compared at once (bounds the temporary's memory)

    def __init__(self, options: list[_Options], grid_points: int) -> None:
        sizes = torch.unique(torch.cat([o.nbytes for o in options])).tolist()
        total = sum(int(o.nbytes.max()) for o in options)
        step = reduce(math.gcd, sizes, 0) or 1
        self.exact = total // step <= grid_points
        if not self.exact:
            step = -(-total // grid_points)
        self.step = step
        self.bins: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []  # per region, the options on distinct byte steps
        for region in options:
            bins = -(-region.nbytes // step)
            # Options come fewest bytes (costliest) first: the last on each step is its cheapest.
            last = torch.ones(len(bins), dtype=torch.bool)
            last[:-1] = bins[1:] != bins[:-1]
            self.rows.append(torch.nonzero(last).flatten())
            self.bins.append(bins)
        width = sum(int(b.max()) for b in self.bins) + 1
        best = torch.full((width,), math.inf, dtype=torch.float64)
        best[0] = 0.0
        self.back: list[torch.Tensor] = []
        low = high = 0  # the byte steps reachable so far
        for bins, rows, region in zip(self.bins, self.rows, options, strict=True):
            shift = int(bins[rows].max())
            padded = torch.cat([torch.full((shift,), math.inf, dtype=torch.float64), best])
            columns = torch.arange(low + int(bins[rows].min()), high + shift + 1)
            new = torch.full((len(columns),), math.inf, dtype=torch.float64)
            back = torch.zeros(len(columns), dtype=torch.int64)
            for first in range(0, len(rows), self._ROWS):
                chunk = rows[first : first + self._ROWS]
                source = columns[None, :] - bins[chunk, None] + shift
                least, which = (padded[source] + region.cost[chunk, None]).min(dim=0)
                better = least < new
                new = torch.where(better, least, new)
                back = torch.where(better, chunk[which], back)
            low, high = int(columns[0]), int(columns[-1])
            best = torch.full((width,), math.inf, dtype=torch.float64)
            best[low : high + 1] = new
            full_back = torch.zeros(width, dtype=torch.int64)
            full_back[low : high + 1] = back
            self.back.append(full_back)
        self.best = best

    def read_back(self, ends: torch.Tensor) -> list[torch.Tensor]:
        """Per region, the option chosen on the way to each byte step in ``ends``."""
        chosen = []
        position = ends.clone()
        for back, bins in zip(reversed(self.back), reversed(self.bins), strict=True):
            option = back[position]
            chosen.append(option)
            position = position - bins[option]
        chosen.reverse()
        return chosen

    def answer(self, room: int) -> list[int] | None:
        """The options of least cost whose additive bytes stay within ``room``; None if none."""
        if room < 0:
            return None
        reach = self.best[: room // self.step + 1]
        if not bool(torch.isfinite(reach).any()):
            return None
        end = torch.argmin(reach).reshape(1)
        return [int(o[0]) for o in self.read_back(end)]

    def frontier_ends(self) -> torch.Tensor:
        """Up to ``_FRONTIER_POINTS`` byte steps where the least cost falls, evenly spread."""
        running = torch.cummin(self.best, dim=0).values
        falls = torch.ones(len(self.best), dtype=torch.bool)
        falls[1:] = self.best[1:] < running[:-1]
        falls &= torch.isfinite(self.best)
        ends = torch.nonzero(falls).flatten()
        if len(ends) > _FRONTIER_POINTS:
            picks = torch.linspace(0, len(ends) - 1, _FRONTIER_POINTS).round().long()
            ends = ends[picks]
        return ends


def solve(problem: Problem, budget: int, *, grid_points: int = _GRID_POINTS) -> Solution:
    """The choice of least recompute cost (Rule 15) whose exact kept bytes fit ``budget`` (the
    caller checks the budget against ``Solution.floor_bytes``: below it, the fewest-bytes
    choice is returned, over the budget). ``grid_points`` bounds the byte steps (tests)."""
    fronts = _Fronts()
    options = [region_options(problem, i, fronts) for i in range(len(problem.regions))]
    lowest = [o.choice(0) for o in options]
    plain = [Choice(False)] * len(options)
    baseline = kept_bytes(problem, plain)
    floor = min(kept_bytes(problem, lowest), baseline)  # shared storages: see the docstring
    budget = max(budget, floor)
    table = _Table(options, grid_points)
    charged = sum(problem.storage_bytes[s] for s in problem.charged)
    if baseline <= budget:
        choices = plain  # nothing to recompute: no choice is cheaper
    else:
        found = table.answer(budget - charged)
        picked = [0] * len(options) if found is None else found
        choices = _fill(problem, options, picked, budget)
    frontier = _frontier(problem, options, table, charged, baseline, floor, lowest)
    return Solution(
        choices=tuple(choices),
        kept_bytes=kept_bytes(problem, choices),
        recompute_seconds=recompute_seconds(problem, choices),
        recompute_flops=recompute_flops(problem, choices),
        method="exact" if table.exact else "grid",
        grid_bytes=table.step,
        floor_bytes=floor,
        baseline_bytes=baseline,
        frontier=frontier,
    )


def _frontier(
    problem: Problem,
    options: list[_Options],
    table: _Table,
    charged: int,
    baseline: int,
    floor: int,
    lowest: list[Choice],
) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) along the least-cost curve, most bytes first: the plain run and the
    floor exactly, the points between by the additive count (an upper bound), the points no
    other beats on both kept."""
    points = {(baseline, problem.fixed_seconds), (floor, recompute_seconds(problem, lowest))}
    ends = table.frontier_ends()
    if len(ends):
        chosen = table.read_back(ends)
        pairs = list(zip(options, chosen, strict=True))
        nbytes = charged + torch.stack([o.nbytes[c] for o, c in pairs]).sum(dim=0)
        seconds = problem.fixed_seconds + torch.stack([o.seconds[c] for o, c in pairs]).sum(dim=0)
        for b, t in zip(nbytes.tolist(), seconds.tolist(), strict=True):
            points.add((min(max(int(b), floor), baseline), float(t)))
    kept: list[tuple[int, float]] = []
    for point in sorted(points):
        if not kept or point[1] < kept[-1][1]:
            kept.append(point)
    return tuple(reversed(kept))


class _Kept:
    """The exact byte count of a changing choice, by reference counts per storage."""

    def __init__(self, problem: Problem, choices: list[Choice]) -> None:
        self.problem = problem
        self.choices = choices
        self.counts: dict[int, int] = dict.fromkeys(problem.outside, 1)
        self.total = sum(problem.storage_bytes[s] for s in problem.outside)
        for index, choice in enumerate(choices):
            self._add(kept_storages(problem, index, choice), 1)

    def _add(self, storages: Iterable[int], step: int) -> None:
        for storage in storages:
            count = self.counts.get(storage, 0) + step
            self.counts[storage] = count
            if (step > 0 and count == 1) or (step < 0 and count == 0):
                self.total += step * self.problem.storage_bytes[storage]

    def move(self, index: int, choice: Choice) -> None:
        self._add(kept_storages(self.problem, index, self.choices[index]), -1)
        self.choices[index] = choice
        self._add(kept_storages(self.problem, index, choice), 1)

    def try_move(self, index: int, choice: Choice, budget: int) -> bool:
        """Move region ``index`` to ``choice`` if the exact total stays within ``budget``."""
        before = self.choices[index]
        self.move(index, choice)
        if self.total <= budget:
            return True
        self.move(index, before)
        return False


def _fill(
    problem: Problem, options: list[_Options], picked: list[int], budget: int
) -> list[Choice]:
    """Spend what the exact count leaves: region by region, costliest first, the cheapest
    option whose additive bytes grow by no more than is left (the exact bytes then grow by no
    more either); if the picked options do not fit, the fewest-bytes ones first."""
    kept = _Kept(problem, [o.choice(p) for o, p in zip(options, picked, strict=True)])
    if kept.total > budget:
        for index, region in enumerate(options):
            kept.move(index, region.choice(0))
            picked[index] = 0
    order = sorted(range(len(options)), key=lambda i: -float(options[i].cost[picked[i]]))
    for index in order:
        region, current = options[index], picked[index]
        grow = region.nbytes - region.nbytes[current]
        fits = (region.cost < region.cost[current]) & (grow <= budget - kept.total)
        if bool(fits.any()):
            better = int(torch.argmin(torch.where(fits, region.cost, math.inf)))
            if kept.try_move(index, region.choice(better), budget):
                picked[index] = better
    return kept.choices


def offloads(problem: Problem, solution: Solution, host_budget: int) -> list[frozenset[int]]:
    """Per region, the units to offload instead of recomputing: where moving the output to host
    and back is predicted cheaper than recomputing it, best gain per host byte first, within
    ``host_budget`` (Rule 10; the caller asks only on an accelerator)."""
    chosen: list[set[int]] = [set() for _ in problem.regions]
    candidates = []
    for index, (region, choice) in enumerate(zip(problem.regions, solution.choices, strict=True)):
        if not choice.checkpoint:
            continue
        skips = set(skipped(problem, index, choice))  # Rule 21: nothing to serve
        for position, unit in enumerate(region.units):
            nbytes = sum(problem.storage_bytes[s] for s in unit.storages)
            gain = unit.seconds - 2 * nbytes / _HOST_BYTES_PER_SECOND
            if position in choice.saved or unit.key in skips:
                continue
            if gain > 0 and nbytes > 0:
                candidates.append((-gain / nbytes, index, position, nbytes))
    used = 0
    gains = [0.0] * len(problem.regions)
    for _, index, position, nbytes in sorted(candidates):
        if used + nbytes <= host_budget:
            used += nbytes
            chosen[index].add(position)
            gains[index] += problem.regions[index].units[position].seconds
    for index, choice in enumerate(solution.choices):
        # A region that saves and skips nothing runs without a policy; offloading installs one.
        if (
            not choice.saved
            and not choice.draws
            and not skipped(problem, index, choice)
            and gains[index] <= problem.regions[index].policy_seconds
        ):
            chosen[index].clear()
    return [frozenset(c) for c in chosen]
