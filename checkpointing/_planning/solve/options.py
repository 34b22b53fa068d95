"""One region's options: the Pareto set of what it may keep and what each costs (Rule S5).

Each region offers options: run plainly (keeps what autograd saves in it, costs nothing) or
checkpoint it keeping some of its ops' outputs (keeps its inputs and those outputs, recomputes
the other ops up to its early stop but those the replay skips, Rule S8, and pays the selective
policy's cost, Rule S3, unless it keeps and skips none), each also keeping the outputs of all of
its random ops where it has some (Rule S7), each checkpointed one carrying the region's charge
(Rule M12). The sets of units come from ``fronts``; with a replay graph each proposed set is
settled (the units the replay would skip anyway dropped) and priced exactly. Regions of one
structure and costs share one set of options (``Fronts``): computed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from .fronts import Alternative, GroupFront, UnitFront, unit_groups
from .problem import Choice, Problem, RegionChoices, ReplayGraph, Unit, modes_seconds, own_bytes

__all__ = ["Fronts", "Options", "region_options"]


class Fronts:
    """The unit fronts of a problem's regions, one per distinct (sizes, costs), or per distinct
    groups of units (Rule S8)."""

    def __init__(self) -> None:
        self.known: dict[tuple[object, ...], UnitFront | GroupFront] = {}
        self.replayed: dict[tuple[object, ...], _Settled] = {}
        """The settled options of regions with a replay graph, per (graph, unit and draws
        bytes, policy): identical blocks are evaluated once (Rule S8)."""

    def get(
        self, units: tuple[Unit, ...], sizes: tuple[int, ...], gains: tuple[float, ...]
    ) -> UnitFront:
        key = (sizes, gains)
        front = self.known.get(key)
        if not isinstance(front, UnitFront):
            front = self.known[key] = UnitFront(units, sizes, gains)
        return front

    def groups(self, groups: tuple[tuple[Alternative, ...], ...]) -> GroupFront:
        """Rule S8: the knapsack over these groups of units, once per distinct groups."""
        key = ("groups", groups)
        front = self.known.get(key)
        if not isinstance(front, GroupFront):
            front = self.known[key] = GroupFront(groups)
        return front


_PLAIN: Final = -2  # an option's ``point``: run the region plainly
_NOTHING: Final = -1  # checkpoint it keeping nothing (no policy); >= 0: a point of its front


@dataclass(frozen=True, slots=True)
class Options:
    """One region's Pareto set of options as columns, fewest bytes (costliest) first."""

    nbytes: torch.Tensor  # additive: the region's own bytes, storages charged up front excluded
    cost: torch.Tensor
    seconds: torch.Tensor
    flops: torch.Tensor
    point: torch.Tensor
    front: UnitFront | None
    draws: torch.Tensor  # bool: the option keeps the region's random draws (Rule S7)
    sets: tuple[frozenset[int], ...] | None = None
    """With a replay graph (Rule S8): the units each point keeps; its options but the one
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


def region_options(problem: Problem, index: int, fronts: Fronts | None = None) -> Options:
    """Region ``index``'s Pareto set of options, fewest bytes first (costliest first): plain,
    checkpointed keeping nothing or a point of its units' front, each of those also with its
    random draws kept where it has some (Rule S7)."""
    region = problem.regions[index]
    if region.plain_only:
        return Options(
            torch.tensor([own_bytes(problem, region.saved)]),
            torch.tensor([0.0], dtype=torch.float64),
            torch.tensor([0.0], dtype=torch.float64),
            torch.tensor([0]),
            torch.tensor([_PLAIN]),
            None,
            torch.tensor([False]),
        )
    if region.replay is not None:
        return _replay_options(problem, region, region.replay, fronts or Fronts())
    objective = problem.objective
    inputs = own_bytes(problem, region.inputs)
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
        sizes = tuple(own_bytes(problem, u.storages) for u in region.units)
        gains = tuple(objective.cost(u.seconds, u.flops) for u in region.units)
        front = (fronts or Fronts()).get(region.units, sizes, gains)
        policy = objective.cost(region.policy_seconds, 0)
        nbytes = torch.cat([nbytes, inputs + front.real_bytes])
        cost = torch.cat([cost, all_cost - front.gains + policy])
        seconds = torch.cat([seconds, all_seconds - front.saved_seconds + region.policy_seconds])
        flops = torch.cat([flops, all_flops - front.saved_flops])
        point = torch.cat([point, front.points])
    columns = _with_draws(problem, region, (nbytes, cost, seconds, flops, point))
    nbytes, cost, seconds, flops, point, draws = columns
    nbytes = torch.cat([torch.tensor([own_bytes(problem, region.saved)]), nbytes])
    charge = objective.cost(region.frame_seconds, 0)  # Rule M12
    cost = torch.cat([torch.tensor([0.0], dtype=torch.float64), cost + charge])
    seconds = torch.cat([torch.tensor([0.0], dtype=torch.float64), seconds])
    flops = torch.cat([torch.tensor([0]), flops])
    point = torch.cat([torch.tensor([_PLAIN]), point])
    draws = torch.cat([torch.tensor([False]), draws])
    keep = _pareto(nbytes, cost)
    return Options(
        nbytes[keep], cost[keep], seconds[keep], flops[keep], point[keep], front, draws[keep]
    )


def _replay_options(
    problem: Problem, region: RegionChoices, graph: ReplayGraph, fronts: Fronts
) -> Options:
    """Rule S8: the options of a region with a replay graph: plain, or checkpointed as its
    settled sets (``_settle``, once per distinct graph, sizes and policy) say, its inputs'
    bytes added; the Pareto set of them."""
    sizes = tuple(own_bytes(problem, u.storages) for u in region.units)
    group = -1 if region.draws is None else own_bytes(problem, region.draws.storages)
    key = (graph, sizes, group, region.policy_seconds)
    settled = fronts.replayed.get(key)
    if settled is None:
        settled = fronts.replayed[key] = _settle(problem, region, graph, sizes, group, fronts)
    nbytes = torch.cat(
        [
            torch.tensor([own_bytes(problem, region.saved)]),
            settled.nbytes + own_bytes(problem, region.inputs),
        ]
    )
    charge = problem.objective.cost(region.frame_seconds, 0)  # Rule M12
    cost = torch.cat([torch.tensor([0.0], dtype=torch.float64), settled.cost + charge])
    seconds = torch.cat([torch.tensor([0.0], dtype=torch.float64), settled.seconds])
    flops = torch.cat([torch.tensor([0]), settled.flops])
    point = torch.cat([torch.tensor([_PLAIN]), settled.point])
    draws = torch.cat([torch.tensor([False]), settled.draws])
    keep = _pareto(nbytes, cost)
    return Options(
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
    """A replay graph's checkpointed options, priced exactly (Rule S8), as columns: bytes (the
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
    fronts: Fronts,
) -> _Settled:
    """Rule S8: the knapsack over the units' groups (``unit_groups``) proposes the sets; each
    is settled (the units the replay would skip anyway dropped: bytes for nothing) and priced
    exactly by the closure, with and without the draws (``group``: their bytes, -1: none),
    beside keeping nothing (or only the draws) without a selective policy."""
    objective = problem.objective
    proposed = [frozenset[int]()]
    if region.units:
        proposed += fronts.groups(unit_groups(graph, sizes, objective)).sets()
    all_seconds, all_flops, _ = graph.replay(frozenset(), False, False)
    rows = [(0, all_seconds, all_flops, _NOTHING, False)]
    if group >= 0:  # the draws kept and nothing else, no selective policy: the draws modes only
        seconds, flops, _ = graph.replay(frozenset(), True, False)
        rows.append((group, seconds + modes_seconds(region, False, True), flops, _NOTHING, True))
    sets: dict[frozenset[int], int] = {}
    for units in dict.fromkeys(proposed):
        for draws in (False, True) if group >= 0 else (False,):
            kept = units - graph.useless(units, draws)
            seconds, flops, skips = graph.replay(kept, draws, True)
            seconds += modes_seconds(region, bool(kept or skips), draws)
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


_Columns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _with_draws(
    problem: Problem, region: RegionChoices, columns: _Columns
) -> tuple[torch.Tensor, ...]:
    """Rule S7: the checkpointed options (bytes, cost, seconds, FLOPs, point) and, where the
    region draws, each of them again with its draws kept (their bytes added, their seconds and
    FLOPs saved, the draws modes' cost paid, Rule S3); and which keep them."""
    nbytes, cost, seconds, flops, point = columns
    group = region.draws
    if group is None:
        return (*columns, torch.zeros(len(point), dtype=torch.bool))
    objective = problem.objective
    # The draws modes cost a policy's time on top of any selective modes (``modes_seconds``).
    policy_cost = objective.cost(region.policy_seconds, 0)
    return (
        torch.cat([nbytes, nbytes + own_bytes(problem, group.storages)]),
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
