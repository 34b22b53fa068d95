"""A region's unit knapsacks: which sets of its units are worth keeping (Rules S5 and S8).

A region's checkpointed options are the Pareto set of a 0/1 knapsack over its units
(``UnitFront``), solved by dynamic programming over bytes: on the grid of the greatest common
divisor of the units' sizes (exact) while that has at most ``_UNIT_POINTS`` points, else on
``_UNIT_POINTS`` equal steps, sizes rounded up. Where a region's replay may skip ops (Rule S8:
``ReplayGraph``), the knapsack values each unit with the skippable ops it alone keeps computing,
takes at most one of the units that free one another (``unit_groups``: groups of alternatives,
``GroupFront``), and its sets are only proposals: ``options`` settles and prices each exactly by
the replay's closure. Regions of one structure and costs (the blocks of a model) share one front
(``options.Fronts``): computed once.
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Final

import torch

from .problem import Objective, ReplayGraph, Unit

__all__ = ["Alternative", "GroupFront", "UnitFront", "unit_groups"]

_UNIT_POINTS: Final = 1 << 15  # a region's unit knapsack: at most this many byte steps


class UnitFront:
    """The 0/1 knapsack over a region's units by dynamic programming over bytes: for every
    byte step, the most cost a set of units saves, with what it saves in seconds and FLOPs,
    its real bytes, and a table to read the set back. Shared by regions of equal unit sizes
    and costs (Rule S5): computed once for all the blocks of a model."""

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


# One alternative of a group of units (Rule S8): the units kept, their bytes, what they save.
Alternative = tuple[frozenset[int], int, float]
_ALTERNATIVES: Final = 64  # a group's alternatives at most: the best per bytes, evenly spread


def unit_groups(
    graph: ReplayGraph, sizes: tuple[int, ...], objective: Objective
) -> tuple[tuple[Alternative, ...], ...]:
    """Rule S8: the region's units as knapsack groups. A unit that frees another
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
    found: dict[int, list[Alternative]] = {}
    for unit in value:  # in op order, children first: a unit frees only ops before it
        combos: list[Alternative] = [(frozenset(), 0, 0.0)]
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
    """Rule S8: per unit worth keeping, in op order, its value with nothing else kept (its own
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


def _best_per_bytes(alternatives: list[Alternative]) -> list[Alternative]:
    """The alternatives no other beats on both bytes and value, fewest bytes first; at most
    ``_ALTERNATIVES`` of them, evenly spread."""
    ordered = sorted(alternatives, key=lambda a: (a[1], -a[2]))
    kept: list[Alternative] = []
    for alternative in ordered:
        if not kept or alternative[2] > kept[-1][2]:
            kept.append(alternative)
    if len(kept) > _ALTERNATIVES:
        picks = torch.linspace(0, len(kept) - 1, _ALTERNATIVES).round().long().tolist()
        kept = [kept[i] for i in dict.fromkeys(picks)]
    return kept


class GroupFront:
    """Rule S8: the knapsack over a region's groups of units (``unit_groups``), at most one
    alternative per group, by dynamic programming over bytes as ``UnitFront``; for every byte step
    where the most value grows, the units of the best choice (proposals, priced exactly after).
    Shared by regions of equal groups: computed once for all the blocks of a model."""

    def __init__(self, groups: tuple[tuple[Alternative, ...], ...]) -> None:
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
