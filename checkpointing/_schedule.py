"""Schedules for ``checkpoint_sequential``: which ranges of a chain are checkpointed, nested how.

Owns the schedule tree (``Segment``, ``SequentialSchedule``), one builder per strategy, the cost
model (``LayerCost``), its predictions (bytes kept between forward and backward, the activation
peak, recompute time) and the dynamic program behind ``strategy="optimal"``. Measuring the costs
and running a schedule belong to ``_sequential``; checkpointing itself to ``_checkpoint``.

A schedule is a list of top-level segments covering ``[0, n)`` in order. A segment is either
*run* (its layers run plainly and keep what they save) or *checkpointed* (only its input is kept;
backward re-runs it). A checkpointed segment may hold child segments over its own range: it is
then checkpointed recursively (multi-level), which is how ``"log"`` and ``"optimal"`` reach
memory below what any single level of segments can.

NOTE [Sequential memory model]
Sizes: ``x[i]`` is the bytes of layer ``i``'s input (``x[0]`` the chain's input, ``x[i + 1]`` the
output of layer ``i``); ``saved[i]`` is what layer ``i`` keeps for backward beyond its input and
output; ``temp[i]`` what its ops allocate and free again (inner outputs of a block; their
gradients in backward), counted as if all were alive at once. ``need(a, b)`` is the memory a
node over ``[a, b)`` uses on top of what its caller holds (``x[a]`` and the gradient of ``x[b]``).

Rule 1: a run layer ``i`` first in its node holds ``saved[i] + x[i + 1]`` while the rest of the
        node runs, and needs ``saved[i] + x[i + 1] + temp[i] + x[i] (+ x[i + 1], the gradient
        coming in, when it is not the node's last layer)`` for its own backward. Its output is
        counted as held even where nothing saves it: an upper bound, never an underestimate.
Rule 2: a checkpointed child ``[a, k)`` holds only ``x[k]`` (the next sibling's input) while the
        rest runs; in backward the rest has been freed but the gradient of ``x[k]`` is live, so
        its recompute and backward get ``x[k]`` less: ``x[k] + max(need(child), need(rest))``.
        Its forward needs ``x[j] + x[j + 1] + saved[j] + temp[j]`` for its largest layer ``j``.
Rule 3: each layer runs once in forward and once more per checkpointed segment around it; the
        recompute time of a schedule is the sum of those extra runs (early stop can only save).
Rule 4: the predicted peak is ``x[0] + x[n] + need(0, n)``; ``budget`` bounds it, which also
        bounds the bytes kept after forward (they are all live when backward starts).
Rule 5: the dynamic program counts memory in slots: the greatest common divisor of all sizes
        (exact) while that gives at most ``_SLOTS`` slots, else ``budget / _SLOTS`` bytes with
        every size rounded *up*, so a schedule it returns fits the budget in the model; where
        rounding loses every schedule that fits, the memory-minimal one (the floor) is used.
Rule 6: the rules describe the non-reentrant frame, whose recomputed tensors die once unpacked.
        Nested reentrant checkpoints recompute inside backward with the outer graph alive; their
        measured peak can exceed the prediction (at the floor of a 32-layer chain: 178 KB
        measured for 154 KB predicted), so ``budget`` is a promise for ``use_reentrant=False``.
Rule 7: bookkeeping is not an activation: with ``preserve_rng_state=True`` a checkpoint keeps
        the CPU RNG state (about 5 KB, one copy for identical states; while nested recomputes
        restore theirs, up to one per level plus two are alive). The budget leaves it out; on
        tiny tensors it dominates.

Rejected: rotor's persistent schedules, which keep a layer's intermediates across several
backward steps. They cannot be written as nested ``checkpoint`` calls, and nesting is what our
non-reentrant frame makes cheap (its recomputed tensors die as soon as they are unpacked).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import torch

from . import _compat
from ._errors import internal_assert
from ._units import format_bytes

__all__ = [
    "STRATEGIES",
    "LayerCost",
    "Segment",
    "SequentialSchedule",
    "StrategyName",
    "balanced_sizes",
    "build_schedule",
    "memory_floor",
    "segment_bounds",
]

StrategyName = Literal["torch", "balanced", "sqrt", "log", "optimal"]
STRATEGIES: tuple[StrategyName, ...] = get_args(StrategyName)

# Most memory slots of the dynamic program (Rule 5): finer is closer to the budget, coarser faster.
_SLOTS = 1024
_INF = float("inf")


@dataclass(frozen=True)
class LayerCost:
    """What one function of the chain costs: forward time, output bytes, and what it keeps.

    ``saved_bytes`` is what the layer keeps for backward beyond its input and its output;
    ``keeps_input`` / ``keeps_output`` say whether it keeps those (``Linear`` keeps its input,
    ``tanh`` its output); ``temporary_bytes`` is what its ops allocate and free again (the
    inner outputs of a block, and their gradients in backward). Measured by
    ``sequential_schedule(..., input)`` in one profiling pass, or given by the user as ``costs=``.
    """

    time: float
    output_bytes: int
    saved_bytes: int = 0
    keeps_input: bool = True
    keeps_output: bool = False
    temporary_bytes: int = 0


@dataclass(frozen=True)
class Segment:
    """Layers ``[start, end)``: run plainly, or checkpointed (recursively, through ``children``)."""

    start: int
    end: int
    checkpointed: bool
    children: tuple[Segment, ...] = ()

    def layers(self) -> range:
        """The indices of the functions this segment runs."""
        return range(self.start, self.end)


@dataclass(frozen=True)
class SequentialSchedule:
    """A checkpointing schedule for a chain, with what it is predicted to cost.

    ``segments`` are the top-level segments, in order. The predictions (``kept_bytes``,
    ``peak_bytes``, ``recompute_time``) need the layers' costs and are ``None`` without them.
    ``print(schedule)`` draws the tree.
    """

    strategy: StrategyName
    n_layers: int
    segments: tuple[Segment, ...]
    costs: tuple[LayerCost, ...] | None = None
    input_bytes: int = 0
    budget: int | None = None

    @property
    def recompute_counts(self) -> tuple[int, ...]:
        """How many extra times each layer runs in backward (one per checkpoint around it)."""
        counts = [0] * self.n_layers
        for segment in _walk(self.segments):
            if segment.checkpointed:
                for i in segment.layers():
                    counts[i] += 1
        return tuple(counts)

    @property
    def depth(self) -> int:
        """The most checkpoints nested around one layer."""
        return max(self.recompute_counts, default=0)

    @property
    def recompute_time(self) -> float | None:
        """Predicted seconds spent re-running layers in backward: each layer runs once more
        per checkpointed segment around it."""
        if self.costs is None:
            return None
        return sum(c * cost.time for c, cost in zip(self.recompute_counts, self.costs, strict=True))

    @property
    def forward_time(self) -> float | None:
        """Predicted seconds of one plain forward of the chain."""
        return None if self.costs is None else sum(cost.time for cost in self.costs)

    @property
    def kept_bytes(self) -> int | None:
        """Predicted activation bytes kept from forward to backward (distinct tensors).

        The inputs of top-level checkpointed segments, and what top-level run layers keep
        (their saved tensors, and their input and output where they keep those).
        """
        return None if self.costs is None else self._kept(self.segments, self.costs)

    def _kept(self, segments: tuple[Segment, ...], costs: tuple[LayerCost, ...]) -> int:
        sizes = _sizes(costs, self.input_bytes)
        kept: set[int] = set()
        extra = 0
        for segment in segments:
            if segment.checkpointed:
                kept.add(segment.start)
                continue
            for i in segment.layers():
                extra += costs[i].saved_bytes
                if costs[i].keeps_input:
                    kept.add(i)
                if costs[i].keeps_output:
                    kept.add(i + 1)
        return extra + sum(sizes[k] for k in kept)

    @property
    def peak_bytes(self) -> int | None:
        """Predicted activation peak over forward and backward, in bytes: an upper bound (the
        chain's input and output included; the checkpoints' RNG states left out)."""
        if self.costs is None:
            return None
        model = _Model(self.costs, self.input_bytes)
        return model.edges() + model.need(_expand(self.segments, 0, self.n_layers), self.n_layers)

    def __str__(self) -> str:
        return "\n".join(self._lines())

    def _lines(self) -> Iterator[str]:
        budget = "" if self.budget is None else f", budget {format_bytes(self.budget)}"
        yield (
            f"SequentialSchedule(strategy={self.strategy!r}, {self.n_layers} layers, "
            f"{sum(self.recompute_counts)} layer re-runs, depth {self.depth}{budget})"
        )
        if self.costs is not None:
            recompute, forward = self.recompute_time or 0.0, self.forward_time or 0.0
            share = f" ({recompute / forward:.0%} of a forward)" if forward > 0 else ""
            yield (
                f"predicted: kept {format_bytes(self.kept_bytes or 0)}, peak "
                f"{format_bytes(self.peak_bytes or 0)}, recompute {_fmt_time(recompute)}{share}"
            )
        yield from self._tree(self.segments, "")

    def _tree(self, segments: tuple[Segment, ...], indent: str) -> Iterator[str]:
        for index, segment in enumerate(segments):
            last = index == len(segments) - 1
            branch, below = ("└─ ", "   ") if last else ("├─ ", "│  ")
            yield indent + branch + self._describe(segment)
            yield from self._tree(segment.children, indent + below)

    def _describe(self, segment: Segment) -> str:
        kind = "checkpoint" if segment.checkpointed else "run"
        text = f"{kind} [{segment.start}, {segment.end})"
        if self.costs is None:
            return text
        if segment.checkpointed:
            layers = self.costs[segment.start : segment.end]
            return text + f"  re-run {_fmt_time(sum(c.time for c in layers))}"
        return text + f"  keeps {format_bytes(self._kept((segment,), self.costs))}"


def _walk(segments: tuple[Segment, ...]) -> Iterator[Segment]:
    for segment in segments:
        yield segment
        yield from _walk(segment.children)


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


# --- the builders, one per strategy ------------------------------------------------------------


def segment_bounds(n_functions: int, segments: int) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` ranges of the chain, torch's way: every range but the last is
    checkpointed and has ``n_functions // segments`` functions; the last gets the remainder.

    >>> segment_bounds(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    """
    size = n_functions // segments
    bounds = [(start, start + size) for start in range(0, size * (segments - 1), size)]
    last_start = bounds[-1][1] if bounds else 0
    bounds.append((last_start, n_functions))
    return bounds


def balanced_sizes(n_functions: int, segments: int) -> list[int]:
    """``segments`` sizes summing to ``n_functions`` that differ by at most one, larger first.

    >>> balanced_sizes(9, 5)
    [2, 2, 2, 2, 1]
    """
    size, extra = divmod(n_functions, segments)
    return [size + 1] * extra + [size] * (segments - extra)


def _one_level(bounds: Sequence[tuple[int, int]]) -> tuple[Segment, ...]:
    """All ranges checkpointed but the last, which runs plainly."""
    *checkpointed, (last_start, last_end) = bounds
    return (
        *(Segment(start, end, True) for start, end in checkpointed),
        Segment(last_start, last_end, False),
    )


def _balanced(n: int, segments: int) -> tuple[Segment, ...]:
    ends = list(itertools.accumulate(balanced_sizes(n, segments)))
    return _one_level(list(zip([0, *ends[:-1]], ends, strict=True)))


def _bisect(start: int, end: int) -> tuple[Segment, ...]:
    """Recursive bisection: checkpoint the first half (bisected again inside), then the rest."""
    if end - start <= 1:
        return (Segment(start, end, False),)
    middle = start + (end - start) // 2
    inner = _bisect(start, middle)
    first = Segment(start, middle, True, inner if len(inner) > 1 else ())
    return (first, *_bisect(middle, end))


def build_schedule(
    strategy: StrategyName,
    n: int,
    segments: int | None,
    costs: tuple[LayerCost, ...] | None,
    input_bytes: int,
    budget: int | None,
) -> SequentialSchedule:
    """The schedule of ``strategy`` for ``n`` functions (arguments already validated)."""
    if strategy == "torch":
        internal_assert(segments is not None, "torch strategy without segments")
        top = _one_level(segment_bounds(n, segments or 1))
    elif strategy == "balanced":
        internal_assert(segments is not None, "balanced strategy without segments")
        top = _balanced(n, segments or 1)
    elif strategy == "sqrt":
        top = _balanced(n, max(1, round(math.sqrt(n))))
    elif strategy == "log":
        top = _bisect(0, n)
    else:
        internal_assert(costs is not None and budget is not None, "optimal without costs")
        if torch.compiler.is_dynamo_compiling():  # NOTE [Compiled regions], Rule 5
            numbers = tuple(_cost_numbers(cost) for cost in costs or ())
            top = _segments(_optimal_in_trace(numbers, input_bytes, budget or 0))
        else:
            top = _optimal(costs or (), input_bytes, budget or 0)
    return SequentialSchedule(strategy, n, top, costs, input_bytes, budget)


# A Segment (or LayerCost) as nested tuples of numbers: (start, end, checkpointed, children).
_Numbers = tuple[Any, ...]


_COST_FIELDS: Final = tuple(field.name for field in dataclasses.fields(LayerCost))


def _cost_numbers(cost: LayerCost) -> _Numbers:
    """A ``LayerCost``'s fields in order (``dataclasses.astuple`` deep-copies, which torch 2.11's
    dynamo cannot trace)."""
    return tuple(getattr(cost, name) for name in _COST_FIELDS)


@_compat.assume_constant_result
def _optimal_in_trace(numbers: tuple[_Numbers, ...], input_bytes: int, budget: int) -> _Numbers:
    """``_optimal`` while dynamo traces: run by dynamo at trace time and taken as a constant,
    instead of traced (the dynamic program computes with tensors, which would land in the
    graph). Dynamo passes and takes constants only: the costs and the segments go as numbers."""
    top = _optimal(tuple(LayerCost(*fields) for fields in numbers), input_bytes, budget)
    return tuple(_as_numbers(segment) for segment in top)


def _as_numbers(segment: Segment) -> _Numbers:
    children = tuple(_as_numbers(child) for child in segment.children)
    return segment.start, segment.end, segment.checkpointed, children


def _segments(numbers: _Numbers) -> tuple[Segment, ...]:
    return tuple(Segment(a, b, c, _segments(children)) for a, b, c, children in numbers)


# --- the memory model (NOTE [Sequential memory model]) ----------------------------------------


def _sizes(costs: tuple[LayerCost, ...], input_bytes: int) -> list[int]:
    return [input_bytes, *(cost.output_bytes for cost in costs)]


# A node's children, expanded: ("run", i) for a run layer, ("checkpoint", a, k, children).
_Step = tuple[int, int, tuple[Segment, ...]] | int


def _expand(segments: tuple[Segment, ...], start: int, end: int) -> list[_Step]:
    """One step per run layer, one per checkpointed segment (with its own children)."""
    steps: list[_Step] = []
    for segment in segments:
        if segment.checkpointed:
            inner = segment.children or (Segment(segment.start, segment.end, False),)
            steps.append((segment.start, segment.end, inner))
        else:
            steps.extend(segment.layers())
    internal_assert(
        not segments or (segments[0].start == start and segments[-1].end == end),
        "segments do not cover their node",
    )
    return steps


class _Model:
    """The sizes of one chain and the rules of NOTE [Sequential memory model]."""

    def __init__(self, costs: tuple[LayerCost, ...], input_bytes: int) -> None:
        self.costs = costs
        self.x = _sizes(costs, input_bytes)

    def edges(self) -> int:
        """What the whole chain's caller holds: its input and the output's gradient (Rule 4)."""
        return self.x[0] + self.x[-1]

    def keep(self, i: int) -> int:
        """What run layer ``i`` holds while the rest of its node runs (Rule 1)."""
        return self.costs[i].saved_bytes + self.x[i + 1]

    def run_need(self, i: int, last: bool) -> int:
        """Run layer ``i``'s own forward and backward (Rule 1)."""
        cost = self.costs[i]
        forward = self.x[i + 1] + cost.saved_bytes + cost.temporary_bytes
        backward = self.keep(i) + cost.temporary_bytes + self.x[i] + (0 if last else self.x[i + 1])
        return max(forward, backward)

    def forward_need(self, i: int, first: bool) -> int:
        """Layer ``i`` run under a checkpoint: its input (unless held), output and temporaries."""
        cost = self.costs[i]
        own = self.x[i + 1] + cost.saved_bytes + cost.temporary_bytes
        return (0 if first else self.x[i]) + own

    def need(self, steps: list[_Step], end: int) -> int:
        """The memory of a node made of ``steps`` ending at ``end`` (Rules 1 and 2)."""
        rest = 0
        for step in reversed(steps):
            if isinstance(step, int):
                rest = max(self.run_need(step, step + 1 == end), self.keep(step) + rest)
            else:
                a, k, children = step
                forward = max(self.forward_need(j, j == a) for j in range(a, k))
                inner = self.need(_expand(children, a, k), k)
                rest = max(forward, self.x[k] + max(inner, rest))
        return rest


# The two answers below are cached, never their O(n^2) tables: with ``costs=`` given, every
# training step asks for the same schedule, while measured costs differ on every call (their
# times do) and would only fill a cache of tables (16 of them held 56 MiB for 24 layers).


def memory_floor(costs: tuple[LayerCost, ...], input_bytes: int) -> int:
    """The smallest predicted peak of any nested schedule of this chain (NOTE Rule 4)."""
    if torch.compiler.is_dynamo_compiling():  # NOTE [Compiled regions], Rule 5
        numbers = tuple(_cost_numbers(cost) for cost in costs)
        return _memory_floor_in_trace(numbers, input_bytes)
    return _memory_floor(costs, input_bytes)


@functools.lru_cache(maxsize=16)
def _memory_floor(costs: tuple[LayerCost, ...], input_bytes: int) -> int:
    floor, _ = _floor_table(costs, input_bytes)
    return floor


@_compat.assume_constant_result
def _memory_floor_in_trace(numbers: tuple[_Numbers, ...], input_bytes: int) -> int:
    """``memory_floor`` run by dynamo at trace time, on the costs as numbers (as
    ``_optimal_in_trace``)."""
    return _memory_floor(tuple(LayerCost(*fields) for fields in numbers), input_bytes)


def _floor_table(
    costs: tuple[LayerCost, ...], input_bytes: int
) -> tuple[int, dict[tuple[int, int], int]]:
    """The floor and, per node ``(a, b)``, the memory-minimal first step (0: run layer ``a``,
    ``k``: checkpoint ``[a, k)``). Rules 1 and 2 with unbounded recompute; O(n^3)."""
    model, n = _Model(costs, input_bytes), len(costs)
    need: dict[tuple[int, int], int] = {}
    first: dict[tuple[int, int], int] = {}
    forward = _checkpoint_forward_needs(model, n)
    for length in range(1, n + 1):
        for a in range(n - length + 1):
            b = a + length
            rest = need.get((a + 1, b), 0)
            best, choice = max(model.run_need(a, a + 1 == b), model.keep(a) + rest), 0
            for k in range(a + 1, b):
                option = max(forward[a][k], model.x[k] + max(need[a, k], need[k, b]))
                if option < best:
                    best, choice = option, k
            need[a, b], first[a, b] = best, choice
    return model.edges() + need[0, n], first


def _checkpoint_forward_needs(model: _Model, n: int) -> list[list[int]]:
    """``[a][k]``: the forward memory of checkpointing ``[a, k)`` (Rule 2)."""
    table = [[0] * (n + 1) for _ in range(n + 1)]
    for a in range(n):
        worst = 0
        for k in range(a + 1, n + 1):
            worst = max(worst, model.forward_need(k - 1, k - 1 == a))
            table[a][k] = worst
    return table


# --- "optimal": the dynamic program -------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _optimal(costs: tuple[LayerCost, ...], input_bytes: int, budget: int) -> tuple[Segment, ...]:
    """The nested schedule of least recompute time whose predicted peak fits ``budget``."""
    n = len(costs)
    table = _cost_table(costs, input_bytes, budget)
    model = _Model(costs, input_bytes)
    unit, slots = _unit(model, budget)
    available = slots - _slots(model.x[0], unit) - _slots(model.x[-1], unit)
    if available < 0 or not math.isfinite(float(table.least_time(0, n)[available])):
        # Rounding lost every schedule (Rule 5): the memory-minimal one fits the budget.
        _, first = _floor_table(costs, input_bytes)
        return _tidy(_rebuild(lambda a, b, m: first[a, b], model, 0, n, 0, unit))
    return _tidy(_rebuild(table.first_step, model, 0, n, available, unit))


def _unit(model: _Model, budget: int) -> tuple[float, int]:
    """The slot size in bytes and the budget in slots (Rule 5)."""
    sizes = [
        *model.x,
        *(c.saved_bytes for c in model.costs),
        *(c.temporary_bytes for c in model.costs),
    ]
    exact = math.gcd(*sizes)
    if exact > 0 and budget // exact <= _SLOTS:
        return float(exact), budget // exact
    return budget / _SLOTS, _SLOTS


def _slots(size: int, unit: float) -> int:
    """``size`` bytes in memory slots, rounded up (Rule 5)."""
    return math.ceil(size / unit) if size > 0 else 0


@dataclass(frozen=True)
class _Table:
    """Per node ``(a, b)`` and memory ``m`` (slots): least recompute time, first step.

    Stored by node length: ``cost[b - a][a, m]``; ``cost[0]`` is the empty node (zero time).
    """

    cost: list[torch.Tensor]
    choice: list[torch.Tensor]

    def least_time(self, a: int, b: int) -> torch.Tensor:
        """Node ``(a, b)``'s least recompute time at every memory size."""
        return self.cost[b - a][a]

    def first_step(self, a: int, b: int, memory: int) -> int:
        """Node ``(a, b)``'s first step at ``memory`` slots: 0 runs layer ``a``, ``k``
        checkpoints ``[a, k)``."""
        return int(self.choice[b - a][a, memory])


@dataclass(frozen=True)
class _Sizes:
    """One chain's sizes in memory slots, and its prefix times, as tensors the table reads."""

    memory: torch.Tensor  # 0 .. slots
    x: torch.Tensor  # x[i], layer i's input
    keep: torch.Tensor  # what run layer i holds while the rest of its node runs
    own: torch.Tensor  # [i, last]: run layer i's own need, last in its node or not
    forward: torch.Tensor  # [a, k]: the forward need of checkpointing [a, k)
    times: torch.Tensor  # times[i]: the forward time of layers [0, i)


def _slot_sizes(model: _Model, unit: float, slots: int) -> _Sizes:
    """The sizes the table compares, in slots of ``unit`` bytes (Rule 5: rounded up)."""
    n = len(model.costs)

    def tensor(values: list[Any]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return _Sizes(
        memory=torch.arange(slots + 1),
        x=tensor([_slots(s, unit) for s in model.x]),
        keep=tensor([_slots(model.keep(i), unit) for i in range(n)]),
        own=tensor(
            [[_slots(model.run_need(i, last), unit) for last in (False, True)] for i in range(n)]
        ),
        forward=tensor(
            [[_slots(v, unit) for v in row] for row in _checkpoint_forward_needs(model, n)]
        ),
        times=torch.tensor(
            [0.0, *itertools.accumulate(c.time for c in model.costs)], dtype=torch.float64
        ),
    )


# Most numbers one tensor op of the table handles: below torch's grain size (32768) an op runs on
# the calling thread. Above it, and always for reductions over a dimension, torch wakes its
# worker threads, which on a busy machine costs milliseconds per op: more than the op's work.
_OP_NUMBERS = 32768


def _cost_table(costs: tuple[LayerCost, ...], input_bytes: int, budget: int) -> _Table:
    """Rules 1 and 2 at every memory size, one node length at a time (a node only reads
    shorter ones): the nodes of a length are computed together, a block of rows per op."""
    model = _Model(costs, input_bytes)
    unit, slots = _unit(model, budget)
    sizes = _slot_sizes(model, unit, slots)
    n, size = len(costs), slots + 1
    rows = max(1, _OP_NUMBERS // size)
    cost = [torch.zeros(n + 1, size, dtype=torch.float64)]
    choice = [torch.zeros(n + 1, size, dtype=torch.int32)]
    for length in range(1, n + 1):
        nodes = n - length + 1
        parts = [
            _nodes(cost, sizes, length, a, min(a + rows, nodes)) for a in range(0, nodes, rows)
        ]
        cost.append(torch.cat([best for best, _ in parts]))
        choice.append(torch.cat([pick for _, pick in parts]))
    return _Table(cost, choice)


def _nodes(
    cost: list[torch.Tensor], sizes: _Sizes, length: int, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Least time and first step of the nodes ``(a, a + length)`` for ``a`` in
    ``[start, stop)``, at every memory size."""
    memory, starts = sizes.memory[None, :], torch.arange(start, stop)
    # Rule 1: run layer a, then the rest (a + 1, b) with what layer a keeps less.
    best = _shifted_rows(cost[length - 1][start + 1 : stop + 1], sizes.keep[starts])
    best[memory < sizes.own[starts, 1 if length == 1 else 0][:, None]] = _INF
    pick = torch.zeros(best.shape, dtype=torch.int32)
    # Rule 2: checkpoint [a, k), then the rest, both with x[k] less. Taking k in order and
    # only strictly better options keeps the first best step (running layer a first of all).
    for j in range(1, length):
        k = starts + j
        both = cost[j][start:stop] + cost[length - j][start + j : stop + j]
        index = memory - sizes.x[k][:, None]
        option = both.gather(1, index.clamp(min=0))
        option[(index < 0) | (memory < sizes.forward[starts, k][:, None])] = _INF
        option += (sizes.times[k] - sizes.times[starts])[:, None]
        better = option < best
        best = torch.where(better, option, best)
        pick = torch.where(better, k[:, None].to(torch.int32), pick)
    return best, pick


def _shifted_rows(values: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """``out[i, m] = values[i, m - by[i]]``, infinite where ``m < by[i]``."""
    index = torch.arange(values.shape[1])[None, :] - by[:, None]
    out = values.gather(1, index.clamp(min=0))
    out[index < 0] = _INF
    return out


# Which first step node (a, b) takes at m memory slots: 0 runs layer a, k checkpoints [a, k).
_FirstStep = Callable[[int, int, int], int]


def _rebuild(
    first: _FirstStep, model: _Model, a: int, b: int, memory: int, unit: float
) -> list[Segment]:
    """The segments of node ``[a, b)`` at ``memory`` slots, following the first-step table."""
    segments: list[Segment] = []
    while a < b:
        k = first(a, b, memory)
        if k == 0:
            segments.append(Segment(a, a + 1, False))
            memory -= _slots(model.keep(a), unit)
            a += 1
            continue
        memory -= _slots(model.x[k], unit)
        inner = _tidy(_rebuild(first, model, a, k, memory, unit))
        segments.append(Segment(a, k, True, inner if len(inner) > 1 else ()))
        a = k
    return segments


def _tidy(segments: list[Segment]) -> tuple[Segment, ...]:
    """Merge neighbouring run segments into one (the same schedule, a shorter tree)."""
    merged: list[Segment] = []
    for segment in segments:
        if merged and not segment.checkpointed and not merged[-1].checkpointed:
            merged[-1] = Segment(merged[-1].start, segment.end, False)
        else:
            merged.append(segment)
    return tuple(merged)
