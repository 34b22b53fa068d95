"""The budget solver: which regions to checkpoint and which op outputs inside them to keep.

Owns ``Problem`` (a profiled step in the solver's terms: storages, and per region what it keeps
plainly, what it keeps checkpointed, and its ops that may be saved), ``solve``, the exact byte
count of a choice, and which outputs to offload instead of recomputing (``offloads``). Knows
nothing about torch: profiling belongs to ``profile``, installing and printing to ``plan``. See
NOTE [Planner model] in ``checkpointing._planning``, Rules 7 and 10.

Method. Each region offers a few options: run plainly (keeps what autograd saves in it, costs no
recompute) or checkpoint it keeping some of its ops' outputs (keeps its inputs and those outputs,
recomputes the other ops, and pays the selective policy's per-op cost, Rule 13, unless it keeps
none). A region's options are the Pareto set of a 0/1 knapsack over its ops,
computed exactly while it stays small (``_REGION_POINTS``), else from the ops in order of time
saved per byte. Across regions it is a multiple-choice knapsack on an additive upper bound of the
bytes (Rule 7): solved exactly by merging Pareto sets while they stay small (``_FRONT_POINTS``),
else greedily along each region's lower convex hull, which is within the largest single hull step
of the additive optimum (the LP-relaxation bound). Either way a last pass spends what the exact
byte count leaves of the budget, so the plan never predicts more than the budget.

Storages that two regions or more keep when checkpointed (an RNG state they share, an input
they all receive: Rule 14) are charged once, up front, in the additive count, not once per
region: still an upper bound, and a chain of tiny regions sharing a ~5 KB state is not priced
as if each kept its own. A plan keeping nothing of theirs is found by the last pass, or is the
plain run (zero recompute, chosen whenever the budget holds it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import torch

__all__ = ["Choice", "Problem", "RegionChoices", "Solution", "Unit", "offloads", "solve"]

# Host<->device bandwidth assumed for offload, each way (PCIe 4 x16 in practice reaches ~12-25
# GB/s; the lower end keeps offload from looking cheaper than it is).
_HOST_BYTES_PER_SECOND: Final = 10e9
_REGION_POINTS: Final = 512  # a region's exact Pareto set may have this many points
_FRONT_POINTS: Final = 4096  # the merged Pareto set across regions may have this many
_MERGE_PAIRS: Final = 400_000  # candidate pairs per merge step before the greedy takes over

Method = Literal["exact", "greedy"]


@dataclass(frozen=True, slots=True)
class Unit:
    """An op of a region whose output may be saved: its key, its time, its fresh storages."""

    key: tuple[str, int]
    seconds: float
    storages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RegionChoices:
    """What one region keeps plainly (``saved``) and checkpointed (``inputs`` plus the saved
    units' storages), what recompute costs beyond the units (``forced_seconds``), and what a
    selective policy adds to a step of the region when it keeps a unit (``policy_seconds``)."""

    saved: frozenset[int]
    inputs: frozenset[int]
    forced_seconds: float
    units: tuple[Unit, ...]
    policy_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Problem:
    """A profiled step: regions, bytes per storage id, storages kept outside every region."""

    regions: tuple[RegionChoices, ...]
    storage_bytes: dict[int, int]
    outside: frozenset[int]
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


@dataclass(frozen=True, slots=True)
class Solution:
    """The solver's answer, with the exact bytes it keeps and what it predicts recompute costs.

    ``bound_seconds`` is 0 for an exact solve; for a greedy one, how much more recompute time
    than the best plan under the additive byte bound the answer may predict at most."""

    choices: tuple[Choice, ...]
    kept_bytes: int
    recompute_seconds: float
    method: Method
    bound_seconds: float
    floor_bytes: int
    baseline_bytes: int
    frontier: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class _Option:
    nbytes: int  # additive: the region's own bytes, storages kept outside every region excluded
    seconds: float
    choice: Choice


def kept_storages(problem: Problem, index: int, choice: Choice) -> frozenset[int]:
    """The storages region ``index`` keeps under ``choice`` (Rule 7)."""
    region = problem.regions[index]
    if not choice.checkpoint:
        return region.saved
    kept = set(region.inputs)
    for position in choice.saved:
        kept.update(region.units[position].storages)
    return frozenset(kept)


def kept_bytes(problem: Problem, choices: Sequence[Choice]) -> int:
    """Exact bytes kept by ``choices``: every storage once (Rule 1)."""
    kept = set(problem.outside)
    for index, choice in enumerate(choices):
        kept.update(kept_storages(problem, index, choice))
    return sum(problem.storage_bytes[s] for s in kept)


def recompute_seconds(problem: Problem, choices: Sequence[Choice]) -> float:
    """Predicted recompute time: every op of a checkpointed region that is not saved, plus the
    selective policy's cost in the regions that save some (Rule 13)."""
    total = 0.0
    for region, choice in zip(problem.regions, choices, strict=True):
        if choice.checkpoint:
            total += region.forced_seconds + sum(
                u.seconds for i, u in enumerate(region.units) if i not in choice.saved
            )
            if choice.saved:
                total += region.policy_seconds
    return total


def _bytes(problem: Problem, storages: Iterable[int]) -> int:
    return sum(problem.storage_bytes[s] for s in storages if s not in problem.charged)


def region_options(problem: Problem, index: int) -> list[_Option]:
    """Region ``index``'s Pareto set of options, fewest bytes first (costliest first)."""
    region = problem.regions[index]
    inputs = _bytes(problem, region.inputs)
    everything = region.forced_seconds + sum(u.seconds for u in region.units)
    options = [_Option(_bytes(problem, region.saved), 0.0, Choice(False))]
    for nbytes, gain, saved in _unit_front(problem, region):
        policy = region.policy_seconds if saved else 0.0
        options.append(_Option(inputs + nbytes, everything - gain + policy, Choice(True, saved)))
    return _pareto(options)


def _unit_front(problem: Problem, region: RegionChoices) -> list[tuple[int, float, frozenset[int]]]:
    """(bytes, time saved, units) of the 0/1 knapsack's Pareto set over the region's units;
    exact while small, else prefixes of the units in order of time saved per byte."""
    sizes = [_bytes(problem, u.storages) for u in region.units]
    front: list[tuple[int, float, frozenset[int]]] = [(0, 0.0, frozenset())]
    for position, (unit, size) in enumerate(zip(region.units, sizes, strict=True)):
        if unit.seconds <= 0:
            continue
        grown = [(b + size, g + unit.seconds, s | {position}) for b, g, s in front]
        front = _pareto_points(front + grown)
        if len(front) > _REGION_POINTS:
            return _prefix_front(region, sizes)
    return front


def _prefix_front(
    region: RegionChoices, sizes: list[int]
) -> list[tuple[int, float, frozenset[int]]]:
    order = sorted(
        range(len(region.units)),
        key=lambda i: -region.units[i].seconds / max(sizes[i], 1),
    )
    front = [(0, 0.0, frozenset[int]())]
    for position in order:
        b, g, s = front[-1]
        front.append((b + sizes[position], g + region.units[position].seconds, s | {position}))
    return _pareto_points(front)


def _pareto_points(
    points: list[tuple[int, float, frozenset[int]]],
) -> list[tuple[int, float, frozenset[int]]]:
    """Keep the points no other point beats on both bytes (fewer) and time saved (more)."""
    points.sort(key=lambda p: (p[0], -p[1]))
    kept: list[tuple[int, float, frozenset[int]]] = []
    for point in points:
        if not kept or point[1] > kept[-1][1]:
            kept.append(point)
    return kept


def _pareto(options: list[_Option]) -> list[_Option]:
    """Options no other option beats on both bytes and recompute time, fewest bytes first."""
    options.sort(key=lambda o: (o.nbytes, o.seconds))
    kept: list[_Option] = []
    for option in options:
        if not kept or option.seconds < kept[-1].seconds:
            kept.append(option)
    return kept


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


def solve(problem: Problem, budget: int, *, allow_exact: bool = True) -> Solution:
    """The choice of least predicted recompute time whose exact kept bytes fit ``budget``
    (the caller checks the budget against ``Solution.floor_bytes``: below it, the fewest-bytes
    choice is returned, over the budget). ``allow_exact=False`` forces the greedy (tests)."""
    options = [region_options(problem, i) for i in range(len(problem.regions))]
    lowest = [o[0].choice for o in options]
    plain = [Choice(False)] * len(options)
    baseline = kept_bytes(problem, plain)
    floor = min(kept_bytes(problem, lowest), baseline)  # shared storages: see the docstring
    if budget < floor:
        budget = floor
    path, bound = _hull_path(problem, options)
    frontier = _pareto_frontier(
        (kept_bytes(problem, c), recompute_seconds(problem, c)) for c in [*path, plain]
    )
    method: Method = "exact"
    if baseline <= budget:
        choices, bound = plain, 0.0  # nothing to recompute: no choice is cheaper
    else:
        found = _exact(problem, options, budget) if allow_exact else None
        if found is None:
            method = "greedy"
            found = _greedy(problem, options, budget)
        else:
            bound = 0.0
        choices = _fill(problem, options, found, budget)
    return Solution(
        choices=tuple(choices),
        kept_bytes=kept_bytes(problem, choices),
        recompute_seconds=recompute_seconds(problem, choices),
        method=method,
        bound_seconds=bound,
        floor_bytes=floor,
        baseline_bytes=baseline,
        frontier=frontier,
    )


def _pareto_frontier(points: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """The points no other beats on both bytes and time, most bytes first. (A shared storage,
    charged up front, can make a step that adds bytes additively drop some exactly.)"""
    kept: list[tuple[int, float]] = []
    for point in sorted(set(points)):
        if not kept or point[1] < kept[-1][1]:
            kept.append(point)
    return tuple(reversed(kept))


def _exact(problem: Problem, options: list[list[_Option]], budget: int) -> list[Choice] | None:
    """The additive multiple-choice knapsack, exactly, by merging Pareto sets with
    back-pointers; None when the sets grow past the limits (or nothing fits additively)."""
    room = budget - sum(problem.storage_bytes[s] for s in problem.charged)
    front_bytes = torch.zeros(1, dtype=torch.int64)
    front_cost = torch.zeros(1, dtype=torch.float64)
    pointers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for region_options_ in options:
        count = len(region_options_)
        if len(front_bytes) * count > _MERGE_PAIRS:
            return None
        option_bytes = torch.tensor([o.nbytes for o in region_options_], dtype=torch.int64)
        option_cost = torch.tensor([o.seconds for o in region_options_], dtype=torch.float64)
        all_bytes = (front_bytes[:, None] + option_bytes[None, :]).flatten()
        all_cost = (front_cost[:, None] + option_cost[None, :]).flatten()
        # Sort by cost, then stably by bytes: fewest bytes first, cheapest first among equals.
        by_cost = torch.argsort(all_cost, stable=True)
        order = by_cost[torch.argsort(all_bytes[by_cost], stable=True)]
        sorted_cost = all_cost[order]
        best_before = torch.cummin(sorted_cost, dim=0).values
        keep = torch.ones(len(order), dtype=torch.bool)
        keep[1:] = sorted_cost[1:] < best_before[:-1]
        chosen = order[keep]
        if len(chosen) > _FRONT_POINTS:
            return None
        pointers.append((chosen // count, chosen % count))
        front_bytes, front_cost = all_bytes[chosen], all_cost[chosen]
    fits = torch.nonzero(front_bytes <= room).flatten()
    if len(fits) == 0:
        return None
    point = int(fits[torch.argmin(front_cost[fits])])
    choices: list[Choice] = []
    for (previous, option), region_options_ in zip(
        reversed(pointers), reversed(options), strict=True
    ):
        choices.append(region_options_[int(option[point])].choice)
        point = int(previous[point])
    choices.reverse()
    return choices


def _hull(region_options_: list[_Option]) -> list[int]:
    """Positions of the options on the lower convex hull of (bytes, seconds)."""
    hull: list[int] = []
    for position, option in enumerate(region_options_):
        while len(hull) >= 2:
            a, b = region_options_[hull[-2]], region_options_[hull[-1]]
            # b is above the segment a -> option: drop it
            cross = (b.nbytes - a.nbytes) * (option.seconds - a.seconds) - (
                b.seconds - a.seconds
            ) * (option.nbytes - a.nbytes)
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(position)
    return hull


def _steps(options: list[list[_Option]]) -> list[tuple[float, int, int]]:
    """Every hull step of every region, best time saved per byte first:
    (-efficiency, region, hull position to move to)."""
    steps = []
    for index, region_options_ in enumerate(options):
        hull = _hull(region_options_)
        for before, after in itertools.pairwise(hull):
            a, b = region_options_[before], region_options_[after]
            steps.append(((b.seconds - a.seconds) / (b.nbytes - a.nbytes), index, after))
    steps.sort()
    return steps


def _hull_path(problem: Problem, options: list[list[_Option]]) -> tuple[list[list[Choice]], float]:
    """Choices along the greedy path from the fewest bytes to the least time, and the largest
    single step's time (the greedy's bound)."""
    choices = [o[0].choice for o in options]
    path = [list(choices)]
    bound = 0.0
    for _, index, position in _steps(options):
        previous = _seconds_of(options[index], choices[index])
        choices[index] = options[index][position].choice
        bound = max(bound, previous - options[index][position].seconds)
        path.append(list(choices))
    return path, bound


def _seconds_of(region_options_: list[_Option], choice: Choice) -> float:
    """The predicted recompute time of a region's option ``choice``."""
    return next(o.seconds for o in region_options_ if o.choice == choice)


def _greedy(problem: Problem, options: list[list[_Option]], budget: int) -> list[Choice]:
    """Hull steps in order of time saved per byte, each taken while the exact bytes fit; a
    region whose step does not fit takes no further step."""
    kept = _Kept(problem, [o[0].choice for o in options])
    blocked: set[int] = set()
    for _, index, position in _steps(options):
        if index in blocked:
            continue
        if not kept.try_move(index, options[index][position].choice, budget):
            blocked.add(index)
    return kept.choices


def _fill(
    problem: Problem, options: list[list[_Option]], choices: list[Choice], budget: int
) -> list[Choice]:
    """Spend what the exact count leaves: per region, the cheapest option that still fits."""
    kept = _Kept(problem, list(choices))
    current = [_seconds_of(o, c) for o, c in zip(options, choices, strict=True)]
    order = sorted(range(len(options)), key=lambda i: -current[i])
    for index in order:
        for option in reversed(options[index]):  # least time first
            if option.seconds >= current[index]:
                break
            if kept.try_move(index, option.choice, budget):
                break
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
        for position, unit in enumerate(region.units):
            nbytes = sum(problem.storage_bytes[s] for s in unit.storages)
            gain = unit.seconds - 2 * nbytes / _HOST_BYTES_PER_SECOND
            if position not in choice.saved and gain > 0 and nbytes > 0:
                candidates.append((-gain / nbytes, index, position, nbytes))
    used = 0
    gains = [0.0] * len(problem.regions)
    for _, index, position, nbytes in sorted(candidates):
        if used + nbytes <= host_budget:
            used += nbytes
            chosen[index].add(position)
            gains[index] += problem.regions[index].units[position].seconds
    for index, choice in enumerate(solution.choices):
        # A region that saves nothing runs without a policy; offloading would install one.
        if not choice.saved and gains[index] <= problem.regions[index].policy_seconds:
            chosen[index].clear()
    return [frozenset(c) for c in chosen]
