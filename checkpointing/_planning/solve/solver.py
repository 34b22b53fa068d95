"""The budget solver: which regions to checkpoint, and which op outputs inside them to keep.

Owns ``solve``: the least-cost choice (Rule S4) whose exact kept bytes fit the budget, and the
trade-off curve a ``Solution`` reports. The problem's terms and prices belong to ``problem``,
each region's options to ``options``; installing and printing to ``apply.plan``. See NOTE
[Planner solve] in ``checkpointing._planning.solve``, Rules S1, S4, S5 and S8, and Rule M9.

Method (Rule S5). Across regions it is a multiple-choice knapsack over the regions' options on
an additive upper bound of the bytes (Rule S1), solved by dynamic programming over a byte grid:
the greatest common divisor of the options' sizes (then the answer is the additive optimum,
``method == "exact"``) while that has at most ``grid_points`` points, else ``grid_points`` equal
steps with every option's bytes rounded up (``method == "grid"``: the answer fits, and costs no
more than the additive optimum at a budget of one grid step per region less), and again rounded
down, whose answers near the budget are counted exactly (``_cheaper_below``: what rounding up
hid, a choice exactly at the budget among them). Storages shared by
regions are charged once up front (``Problem.charged``). A last pass spends what the exact byte
count leaves of the budget, so the plan never predicts more than the budget. A plan keeping
nothing of the shared storages is found by the last pass, or is the plain run (zero recompute,
chosen whenever the budget holds it).

Rejected: merging Pareto sets across regions (exact, but the sets outgrow any limit on a Llama
block's 300 options, and the greedy fallback it needed lost up to a hull step per region), and
a greedy walk along each region's lower convex hull (blind to the options inside the hull,
which are most of a block's good ones under the early stop).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import reduce
from typing import Final

import torch

from .options import Fronts, Options, region_options
from .problem import (
    Choice,
    Problem,
    Solution,
    frame_seconds,
    join_breaks,
    kept_bytes,
    kept_storages,
    own_bytes,
    recompute_cost,
    recompute_flops,
    recompute_seconds,
    region_recompute,
    whole,
)

__all__ = ["baseline_bytes", "floor_bytes", "solve"]

_GRID_POINTS: Final = 8192  # the regions' knapsack: at most this many byte steps
_FRONTIER_POINTS: Final = 64  # points of the trade-off curve a solution reports
# Rule S9: a joined row weighs this share of its cost more in the table, so that at equal cost
# the regions stay apart (a chain's recompute holds all of its members' saves at once).
_JOIN_TIE: Final = 1e-9


@dataclass(frozen=True, slots=True)
class _Region:
    """One region as the regions' knapsack sees it: its Pareto set of options (``Options``),
    then, where it may be checkpointed at all, its whole option once more (row ``whole``: it
    lets the region after it join), then, where it may be joined, its joined option (row
    ``joined``; Rule S9). Columns over all of those rows; -1: no such row."""

    options: Options
    nbytes: torch.Tensor
    cost: torch.Tensor
    seconds: torch.Tensor
    count: int
    """The rows of ``options``: the ordinary ones."""
    whole: int
    joined: int

    def choice(self, row: int) -> Choice:
        if row == self.joined:
            return Choice(True, joined=True)
        return Choice(True) if row == self.whole else self.options.choice(row)


def _regions(problem: Problem) -> list[_Region]:
    """Every region's options (``_options``) with its whole and joined rows (Rule S9), priced
    exactly as ``recompute_cost`` prices them, their bytes the additive count's."""
    found = []
    regions = problem.regions
    for index, options in enumerate(_options(problem)):
        region = regions[index]
        extra = []  # without a join on either side: the rows of ``options`` alone
        if not region.plain_only and (_joins(problem, index) or _joins(problem, index + 1)):
            extra.append(Choice(True))
            if _joins(problem, index):
                extra.append(Choice(True, joined=True))
        nbytes, cost, seconds = [], [], []
        for choice in extra:
            spent, flops = region_recompute(problem, index, choice)
            charge = frame_seconds(problem, index, choice)
            nbytes.append(own_bytes(problem, kept_storages(problem, index, choice)))
            price = problem.objective.cost(spent + charge, flops)
            cost.append(price * (1 + _JOIN_TIE) if choice.joined else price)
            seconds.append(spent)
        count = len(options.nbytes)
        found.append(
            _Region(
                options,
                torch.cat([options.nbytes, torch.tensor(nbytes, dtype=torch.int64)]),
                torch.cat([options.cost, torch.tensor(cost, dtype=torch.float64)]),
                torch.cat([options.seconds, torch.tensor(seconds, dtype=torch.float64)]),
                count,
                count if extra else -1,
                count + 1 if len(extra) > 1 else -1,
            )
        )
    return found


def _joins(problem: Problem, index: int) -> bool:
    """Whether region ``index`` may be joined to the one before it (Rule S9)."""
    regions = problem.regions
    return (
        0 < index < len(regions)
        and regions[index].joinable
        and not regions[index].plain_only
        and not regions[index - 1].plain_only
    )


class _Table:
    """Rule S5: the least cost at every byte step of the additive count, region by region, with
    back-pointers to read the options back; Rule S9: in two states, the region just counted
    checkpointed whole or joined (``chained``: the next may join it) or not (``other``)."""

    _ROWS: Final = 64  # options compared at once (bounds the temporary's memory)

    def __init__(self, regions: list[_Region], grid_points: int, down: bool = False) -> None:
        sizes = torch.unique(torch.cat([r.nbytes for r in regions])).tolist()
        total = sum(int(r.nbytes.max()) for r in regions)
        step = reduce(math.gcd, sizes, 0) or 1
        self.exact = total // step <= grid_points
        if not self.exact:
            step = -(-total // grid_points)
        self.step = step
        self.regions = regions
        self.bins = [r.nbytes // step if down else -(-r.nbytes // step) for r in regions]
        width = sum(int(b.max()) for b in self.bins) + 1
        other = torch.full((width,), math.inf, dtype=torch.float64)
        other[0] = 0.0
        chained = torch.full((width,), math.inf, dtype=torch.float64)
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []  # per region: (chained, other)
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []
        low = high = 0  # the byte steps reachable so far
        for region, bins in zip(regions, self.bins, strict=True):
            before = torch.where(chained < other, chained, other)
            columns = torch.arange(low + int(bins.min()), high + int(bins.max()) + 1)
            ordinary = bins[: region.count]
            # Options come fewest bytes (costliest) first: the last on each step is its cheapest.
            last = torch.ones(len(ordinary), dtype=torch.bool)
            last[:-1] = ordinary[1:] != ordinary[:-1]
            rows = torch.nonzero(last).flatten()
            new_other, back_other = self._relax(before, bins, region.cost, rows, columns)
            new_chained = torch.full((len(columns),), math.inf, dtype=torch.float64)
            back_chained = torch.zeros(len(columns), dtype=torch.int64)
            for row, source in ((region.whole, before), (region.joined, chained)):
                if row >= 0:
                    least, _ = self._relax(source, bins, region.cost, torch.tensor([row]), columns)
                    better = least < new_chained
                    new_chained = torch.where(better, least, new_chained)
                    back_chained = torch.where(better, row, back_chained)
            low, high = int(columns[0]), int(columns[-1])
            chained = self._widen(new_chained, width, low)
            other = self._widen(new_other, width, low)
            self.back.append(
                (self._widen(back_chained, width, low), self._widen(back_other, width, low))
            )
            self.states.append((chained, other))
        self.best = torch.minimum(chained, other)

    def _relax(
        self,
        before: torch.Tensor,
        bins: torch.Tensor,
        cost: torch.Tensor,
        rows: torch.Tensor,
        columns: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The least cost at each of ``columns`` after one of ``rows``, from ``before``, and
        which row gave it."""
        shift = int(bins[rows].max())
        padded = torch.cat([torch.full((shift,), math.inf, dtype=torch.float64), before])
        new = torch.full((len(columns),), math.inf, dtype=torch.float64)
        back = torch.zeros(len(columns), dtype=torch.int64)
        for first in range(0, len(rows), self._ROWS):
            chunk = rows[first : first + self._ROWS]
            source = columns[None, :] - bins[chunk, None] + shift
            least, which = (padded[source] + cost[chunk, None]).min(dim=0)
            better = least < new
            new = torch.where(better, least, new)
            back = torch.where(better, chunk[which], back)
        return new, back

    @staticmethod
    def _widen(values: torch.Tensor, width: int, low: int) -> torch.Tensor:
        """``values`` at columns ``low`` on, in a full row (inf, or 0 for back-pointers)."""
        if values.dtype == torch.float64:
            full = torch.full((width,), math.inf, dtype=torch.float64)
        else:
            full = torch.zeros(width, dtype=values.dtype)
        full[low : low + len(values)] = values
        return full

    def read_back(self, ends: torch.Tensor) -> list[torch.Tensor]:
        """Per region, the row chosen on the way to each byte step in ``ends``: a joined row
        comes from the chained state, any other from the cheaper state (chained on a strict
        win, as the table took it)."""
        chosen = []
        position = ends.clone()
        chained, other = self.states[-1]
        in_chain = chained[position] < other[position]
        for index in range(len(self.regions) - 1, -1, -1):
            back_chained, back_other = self.back[index]
            row = torch.where(in_chain, back_chained[position], back_other[position])
            chosen.append(row)
            position = position - self.bins[index][row]
            if index:
                chained, other = self.states[index - 1]
                joined = row == self.regions[index].joined
                in_chain = joined | (chained[position] < other[position])
        chosen.reverse()
        return chosen

    def answer(self, room: int) -> list[int] | None:
        """The rows of least cost whose additive bytes stay within ``room``; None if none."""
        if room < 0:
            return None
        reach = self.best[: room // self.step + 1]
        if not bool(torch.isfinite(reach).any()):
            return None
        end = torch.argmin(reach).reshape(1)
        return [int(o[0]) for o in self.read_back(end)]

    def answers_below(self, room: int) -> list[list[int]]:
        """Rule S5 (a table rounded down): the rows of least cost within each of the byte
        steps from ``room``'s down to one step per region below it, distinct, cheapest first;
        their exact bytes may exceed ``room`` (the caller counts them)."""
        if room < 0:
            return []
        top = min(room // self.step, len(self.best) - 1)
        least, where = torch.cummin(self.best, dim=0)
        columns = torch.arange(max(0, top - len(self.back)), top + 1)
        columns = columns[torch.isfinite(least[columns])]
        if not len(columns):
            return []
        ends = torch.unique(where[columns])
        ends = ends[torch.argsort(self.best[ends], stable=True)]
        chosen = self.read_back(ends)
        return [[int(o[column]) for o in chosen] for column in range(len(ends))]

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
    """The choice of least recompute cost (Rule S4) whose exact kept bytes fit ``budget`` (the
    caller checks the budget against ``Solution.floor_bytes``: below it, the fewest-bytes
    choice is returned, over the budget). ``grid_points`` bounds the byte steps (tests)."""
    options = _regions(problem)
    rows = _lowest_rows(problem, options)
    lowest = _chosen(options, rows)
    plain = [Choice(False)] * len(options)
    baseline = baseline_bytes(problem)
    floor = min(kept_bytes(problem, lowest), baseline)  # shared storages: see the docstring
    budget = max(budget, floor)
    table = _Table(options, grid_points)
    charged = sum(problem.storage_bytes[s] for s in problem.charged)
    if baseline <= budget:
        choices = plain  # nothing to recompute: no choice is cheaper
    else:
        found = table.answer(budget - charged)
        picked = list(rows) if found is None else found
        choices = _fill(problem, options, picked, budget, rows)
        if not table.exact:  # Rule S5: what rounding the bytes up hid, counted exactly
            lower = _Table(options, grid_points, down=True)
            choices = _cheaper_below(problem, options, lower, charged, budget, choices, rows)
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


def baseline_bytes(problem: Problem) -> int:
    """The bytes the plain run keeps: no region checkpointed (Rule S1)."""
    return kept_bytes(problem, [Choice(False)] * len(problem.regions))


def floor_bytes(problem: Problem) -> int:
    """The fewest bytes ``solve`` can answer with, read off the regions' options without solving:
    each region's fewest-bytes option, joined to the one before it wherever that keeps fewer
    (``_lowest_rows``, Rule S9), counted exactly (Rule S1), or the plain run where that keeps
    fewer (storages shared by regions: see the module's docstring)."""
    options = _regions(problem)
    return min(_counted(problem, options, _lowest_rows(problem, options)), baseline_bytes(problem))


def _lowest_rows(problem: Problem, options: list[_Region]) -> list[int]:
    """Rule S9's floor: the fewer bytes, counted exactly, of two walks over the regions' rows.
    One starts from each region's fewest-bytes row and joins a region to the one before it
    (made whole for it where it is not: its own fewest bytes may be the plain run's) where that
    keeps fewer; the other starts from every join the regions allow and parts a region from
    the one before where that keeps fewer. Both walks are needed: a chain keeps one RNG state
    however long it is, so a single join may keep more than it drops and a long chain less."""
    fewest = [0] * len(options)
    joined = list(fewest)
    for index, region in enumerate(options):
        if region.joined >= 0 and options[index - 1].whole >= 0:
            if joined[index - 1] != options[index - 1].joined:
                joined[index - 1] = options[index - 1].whole
            joined[index] = region.joined
    found = []
    for rows, parting in ((fewest, False), (joined, True)):
        least = _counted(problem, options, rows)
        for index, region in enumerate(options):
            if region.joined < 0 or (rows[index] == region.joined) != parting:
                continue
            trial = list(rows)
            if parting:
                trial[index] = 0
            elif options[index - 1].whole < 0:
                continue
            else:
                if not whole(options[index - 1].choice(trial[index - 1])):
                    trial[index - 1] = options[index - 1].whole
                trial[index] = region.joined
            counted = _counted(problem, options, trial)
            if counted < least and not join_breaks(problem, _chosen(options, trial)):
                rows, least = trial, counted
        found.append((least, rows))
    return min(found, key=lambda pair: pair[0])[1]


def _chosen(options: list[_Region], rows: list[int]) -> list[Choice]:
    """The choices ``rows`` picks, a row per region."""
    return [o.choice(row) for o, row in zip(options, rows, strict=True)]


def _counted(problem: Problem, options: list[_Region], rows: list[int]) -> int:
    """The exact bytes of the choices ``rows`` picks (Rule S1)."""
    return kept_bytes(problem, _chosen(options, rows))


def _options(problem: Problem) -> list[Options]:
    """Every region's options, regions of one structure and costs sharing one set (Rule S5)."""
    fronts = Fronts()
    return [region_options(problem, i, fronts) for i in range(len(problem.regions))]


def _frontier(
    problem: Problem,
    options: list[_Region],
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


def _cheaper_below(
    problem: Problem,
    options: list[_Region],
    lower: _Table,
    charged: int,
    budget: int,
    choices: list[Choice],
    lowest: list[int],
) -> list[Choice]:
    """Rule S5: ``choices`` (the answer of the table rounded up), or the cheapest answer of the
    table rounded down (``answers_below``) whose exact bytes fit ``budget``, finished by
    ``_fill``, where that costs strictly less."""
    for picked in lower.answers_below(budget - charged):  # cheapest first
        proposed = [o.choice(p) for o, p in zip(options, picked, strict=True)]
        if _Kept(problem, proposed).total <= budget:
            found = _fill(problem, options, picked, budget, lowest)
            cheaper = _weighed(problem, found) < _weighed(problem, choices)
            return found if cheaper else choices
    return choices


def _weighed(problem: Problem, choices: list[Choice]) -> float:
    """The cost as the table weighs it: ``recompute_cost``, each join's tie share on top (Rule
    S9: at equal cost, and within rounding, the regions stay apart)."""
    joins = sum(c.joined for c in choices)
    return recompute_cost(problem, choices) * (1 + _JOIN_TIE * joins)


def _fill(
    problem: Problem, options: list[_Region], picked: list[int], budget: int, lowest: list[int]
) -> list[Choice]:
    """Spend what the exact count leaves: region by region, costliest first, the cheapest
    ordinary option whose additive bytes grow by no more than is left (the exact bytes then
    grow by no more either), the members of a chain staying as they are (Rule S9); if the
    picked options do not fit, the floor's rows (``lowest``, ``_lowest_rows``) first."""
    kept = _Kept(problem, [o.choice(p) for o, p in zip(options, picked, strict=True)])
    if kept.total > budget:
        for index, region in enumerate(options):
            kept.move(index, region.choice(lowest[index]))
            picked[index] = lowest[index]
    chained = {i for i, (o, p) in enumerate(zip(options, picked, strict=True)) if p == o.joined}
    order = sorted(range(len(options)), key=lambda i: -float(options[i].cost[picked[i]]))
    for index in order:
        if index in chained or index + 1 in chained:
            continue
        region, current = options[index], picked[index]
        grow = region.nbytes[: region.count] - region.nbytes[current]
        cost = region.cost[: region.count]
        fits = (cost < region.cost[current]) & (grow <= budget - kept.total)
        if bool(fits.any()):
            better = int(torch.argmin(torch.where(fits, cost, math.inf)))
            if kept.try_move(index, region.choice(better), budget):
                picked[index] = better
    return kept.choices
