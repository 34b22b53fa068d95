"""``checkpoint_sequential`` strategies, ``sequential_schedule`` and the ``"optimal"`` planner.

Every strategy gives the gradients of the plain run (bit-identical, dropout included); each
layer runs as often as its schedule says; the bytes kept between forward and backward, seen by
an outer saved-tensors hook, equal the schedule's prediction; ``"log"`` keeps its allocator peak
(profiler memory events) at O(log n) layer outputs on a 256-layer chain; ``"optimal"`` never
goes above its budget, and at the memory of ``"balanced"`` re-runs less time on unequal layers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from allocator_support import allocator_step
from frame_support import error_of, outcome
from hypothesis import given
from strategies import (
    SequentialStrategy,
    StackSpec,
    layer_stacks,
    layer_stacks_with_dropout,
    stacks_and_strategies,
    unequal_chains,
)
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import checkpointing
from checkpointing import LayerCost, SequentialSchedule
from checkpointing._schedule import (
    _checkpoint_forward_needs,
    _cost_table,
    _Model,
    _slots,
    _unit,
    memory_floor,
)

# Tiny layers: a second torch thread only waits, and on a busy machine its waking costs more
# than the work.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

_RNG_STATE_BYTES = torch.get_rng_state().numel()
VARIANTS = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "frame"])


def _plan(
    model: Sequence[Any], x: Any, strategy: SequentialStrategy, segments: int | None, at: float
) -> SequentialSchedule:
    """The schedule of ``strategy``; for ``"optimal"`` a budget ``at`` of the way from the floor
    to twice the floor, by costs measured on ``x``."""
    if strategy != "optimal":
        return checkpointing.sequential_schedule(model, segments, x, strategy=strategy)
    measured = checkpointing.sequential_schedule(model, None, x, strategy="log")
    assert measured.costs is not None
    floor = memory_floor(measured.costs, measured.input_bytes)
    return checkpointing.sequential_schedule(
        model, None, x, strategy="optimal", budget=int(floor * (1 + at))
    )


class Mix(nn.Module):
    """``tanh(x @ W)`` with a fixed (buffer) ``W``: changes the width, keeps no parameters."""

    def __init__(self, width_in: int, width_out: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("w", torch.randn(width_in, width_out, generator=gen) / width_in**0.5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x @ self.w).tanh()


def _chain(widths: Sequence[int], in_width: int = 8) -> list[Mix]:
    """A chain of ``Mix`` layers with the given output widths."""
    ins = [in_width, *widths[:-1]]
    return [Mix(a, b, seed=i) for i, (a, b) in enumerate(zip(ins, widths, strict=True))]


def _with_times(schedule: SequentialSchedule, weights: Sequence[int]) -> tuple[LayerCost, ...]:
    """The measured costs with each layer's time replaced by its weight (deterministic)."""
    assert schedule.costs is not None
    return tuple(
        dataclasses.replace(cost, time=float(w))
        for cost, w in zip(schedule.costs, weights, strict=True)
    )


def _kept_bytes(forward: Callable[[], torch.Tensor], leave_out: Sequence[torch.Tensor]) -> int:
    """Bytes of distinct storages an outer saved-tensors hook sees during ``forward``."""
    left_out = {t.untyped_storage().data_ptr() for t in leave_out}
    seen: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in left_out:
            seen.setdefault(storage.data_ptr(), tensor)
        return tensor.detach()

    with saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    return sum(t.untyped_storage().nbytes() for t in seen.values())


def _allocator_peak(forward: Callable[[], torch.Tensor]) -> int:
    """Peak of the CPU allocator's running sum over forward and backward (profiler events)."""
    return allocator_step(forward).peak


# --- correctness: every strategy against the plain run ---------------------------------------


@VARIANTS
@given(case=stacks_and_strategies())
def test_gradients_equal_plain_run(
    use_reentrant: bool, case: tuple[StackSpec, SequentialStrategy, int | None, float]
) -> None:
    """Random stacks, every strategy (optimal at a random budget): bit-identical gradients."""
    spec, strategy, segments, at = case
    expected = spec.run(lambda model, x: model(x))
    got = spec.run(_checkpointed(use_reentrant, strategy, segments, at))
    got.assert_equal(expected)


def _checkpointed(
    use_reentrant: bool, strategy: SequentialStrategy, segments: int | None, at: float
) -> Callable[[nn.Sequential, torch.Tensor], torch.Tensor]:
    """The forward of a strategy's run, planned on the model and input it is given."""

    def forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        schedule = _plan(model, x, strategy, segments, at)
        out: torch.Tensor = checkpointing.checkpoint_sequential(
            model, None, x, use_reentrant=use_reentrant, strategy=schedule
        )
        return out

    return forward


@VARIANTS
@given(case=stacks_and_strategies(layer_stacks_with_dropout()))
def test_dropout_bit_identical(
    use_reentrant: bool, case: tuple[StackSpec, SequentialStrategy, int | None, float]
) -> None:
    """Dropout, RNG preserved: bit-identical to the plain run, the RNG stream left as it."""
    spec, strategy, segments, at = case
    torch.manual_seed(21)
    expected = spec.run(lambda model, x: model(x))
    torch.manual_seed(21)
    got = spec.run(_checkpointed(use_reentrant, strategy, segments, at))
    got.assert_equal(expected)
    assert torch.equal(got.rng_after, expected.rng_after)


def _pair_layer(i: int) -> Callable[..., Any]:
    """``(h, g, scale, name) -> (h', g', scale, name)``: two tensors mixed, two items passed on."""

    def layer(h: torch.Tensor, g: torch.Tensor, scale: float, name: str) -> Any:
        assert name == "tag"
        return (h * g).sin() * scale + i, (g + h).tanh(), scale, name

    return layer


@pytest.mark.parametrize("strategy", ["balanced", "sqrt", "log"])
@VARIANTS
def test_tuple_inputs_are_unpacked(strategy: SequentialStrategy, use_reentrant: bool) -> None:
    """A tuple input reaches each function as ``*input``; non-tensors pass through; the last
    function may return one tensor. Gradients equal the plain run."""
    functions = [_pair_layer(i) for i in range(6)]
    functions.append(lambda h, g, scale, name: h + g)
    h = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    value: Any = (h, g, 0.5, "tag")
    for function in functions:
        value = function(*value) if isinstance(value, tuple) else function(value)
    expected = torch.autograd.grad(value.sum(), (h, g))
    segments = 3 if strategy == "balanced" else None
    out = checkpointing.checkpoint_sequential(
        functions, segments, (h, g, 0.5, "tag"), use_reentrant=use_reentrant, strategy=strategy
    )
    assert torch.equal(out, value)
    out.sum().backward()
    assert torch.equal(h.grad, expected[0])
    assert torch.equal(g.grad, expected[1])


def test_torch_strategy_passes_a_tuple_whole_like_torch() -> None:
    """The default strategy hands a tuple input over as one argument, as torch does."""
    functions = [lambda pair: (pair[0].sin(), pair[1]) for _ in range(3)]
    functions.append(lambda pair: pair[0] * pair[1])
    results = []
    for run in (checkpointing.checkpoint_sequential, tc.checkpoint_sequential):
        torch.manual_seed(1)
        h = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        g = torch.randn(2, 3, dtype=torch.float64)
        out = run(functions, 2, (h, g), use_reentrant=False)
        out.sum().backward()
        results.append((out, h.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# --- the schedules: shapes, recompute counts, kept bytes -------------------------------------


def test_balanced_fixes_torch_remainder() -> None:
    """9 layers in 5 segments: torch runs 1,1,1,1,5; balanced runs 2,2,2,2,1 (pytorch#68423)."""
    sizes = {}
    for strategy in ("torch", "balanced"):
        schedule = checkpointing.sequential_schedule(list(range(9)), 5, strategy=strategy)
        sizes[strategy] = [s.end - s.start for s in schedule.segments]
        assert [s.checkpointed for s in schedule.segments] == [True] * 4 + [False]
    assert sizes == {"torch": [1, 1, 1, 1, 5], "balanced": [2, 2, 2, 2, 1]}


@pytest.mark.parametrize("strategy", ["sqrt", "log"])
def test_segments_may_be_omitted_when_the_strategy_chooses(strategy: str) -> None:
    """``checkpoint_sequential(model, input=x, strategy=...)``: no ``segments`` argument, the
    same output and gradients as the plain run; no ``input`` is a TypeError that shows the call."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(9)]).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = checkpointing.checkpoint_sequential(
        model, input=x, use_reentrant=False, strategy=strategy
    )
    (grad,) = torch.autograd.grad(out.sum(), x)
    (expected,) = torch.autograd.grad(model(x).sum(), x)
    assert torch.equal(grad, expected)
    with pytest.raises(TypeError, match="missing required argument: 'input'"):
        checkpointing.checkpoint_sequential(model, use_reentrant=False, strategy=strategy)


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
def test_log_nests_log_n_deep(n: int) -> None:
    """Recursive bisection: floor(log2 n) checkpoints deep, ceil(log2 n) + 1 top-level segments
    covering the chain; the last layer is never re-run."""
    schedule = checkpointing.sequential_schedule(list(range(n)), strategy="log")
    assert schedule.depth == math.floor(math.log2(n))
    assert len(schedule.segments) == math.ceil(math.log2(n)) + 1
    assert schedule.segments[0].start == 0
    assert schedule.segments[-1].end == n
    assert all(a.end == b.start for a, b in itertools.pairwise(schedule.segments))
    assert schedule.recompute_counts[-1] == 0


@pytest.mark.parametrize(
    ("strategy", "segments"), [("torch", 3), ("balanced", 3), ("sqrt", None), ("log", None)]
)
@VARIANTS
def test_each_layer_runs_as_the_schedule_says(
    strategy: SequentialStrategy, segments: int | None, use_reentrant: bool
) -> None:
    """Calls per layer over forward and backward = 1 + the schedule's recompute count."""
    layers = _chain([8] * 11)
    x = torch.randn(2, 8, requires_grad=True)
    schedule = checkpointing.sequential_schedule(layers, segments, x, strategy=strategy)
    for layer in layers:
        layer.calls = 0
    checkpointing.checkpoint_sequential(
        layers, segments, x, use_reentrant=use_reentrant, strategy=strategy
    ).sum().backward()
    assert [layer.calls for layer in layers] == [1 + c for c in schedule.recompute_counts]


@given(case=stacks_and_strategies(layer_stacks(min_depth=2)))
def test_kept_bytes_equal_prediction(
    case: tuple[StackSpec, SequentialStrategy, int | None, float],
) -> None:
    """Bytes an outer hook sees kept (parameters left out) = the schedule's ``kept_bytes``."""
    spec, strategy, segments, at = case
    model = spec.build()
    x = spec.make_input()
    schedule = _plan(model, x, strategy, segments, at)
    kept = _kept_bytes(
        lambda: checkpointing.checkpoint_sequential(
            model, None, x, use_reentrant=False, strategy=schedule
        ).sum(),
        list(model.parameters()),
    )
    assert kept == schedule.kept_bytes


def test_log_peak_is_logarithmic_on_256_layers() -> None:
    """256 tanh layers: ``"log"`` peaks at O(log n) layer outputs (allocator, forward and
    backward), below sqrt segments and far below no checkpointing; it keeps about log2(n)."""
    n, output = 256, 1024 * 4
    layers: list[Callable[[torch.Tensor], torch.Tensor]] = [torch.tanh] * n
    x = torch.randn(1024, requires_grad=True)
    peaks = {}
    for strategy in ("none", "sqrt", "log"):
        if strategy == "none":
            forward: Callable[[], torch.Tensor] = functools.partial(
                checkpointing.checkpoint_sequential, layers, 1, x, use_reentrant=False
            )
        else:
            forward = functools.partial(
                checkpointing.checkpoint_sequential,
                layers,
                None,
                x,
                use_reentrant=False,
                strategy=strategy,
            )
        peaks[strategy] = _allocator_peak(lambda forward=forward: forward().sum()) / output
    kept = _kept_bytes(
        lambda: checkpointing.checkpoint_sequential(
            layers, None, x, use_reentrant=False, strategy="log"
        ).sum(),
        [],
    )
    log_n = math.log2(n)
    assert kept / output <= log_n + 1
    assert peaks["log"] <= 2 * log_n
    assert peaks["log"] < peaks["sqrt"] / 2
    assert peaks["none"] > n


# --- "optimal" ------------------------------------------------------------------------------


@given(chain=unequal_chains(max_depth=8))
def test_optimal_never_exceeds_budget(chain: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    """Unequal layers, budgets from the floor to the plain run's: the measured kept bytes and
    allocator peak stay within the budget (RNG states aside), and each layer runs as the
    schedule says."""
    widths, weights = chain
    layers = _chain(widths)
    x = torch.randn(4, 8, requires_grad=True)
    measured = checkpointing.sequential_schedule(layers, 1, x)
    costs = _with_times(measured, weights)
    floor = memory_floor(costs, measured.input_bytes)
    plain = measured.peak_bytes
    assert plain is not None
    for budget in sorted({floor, (floor + plain) // 2, max(floor, plain)}):
        schedule = checkpointing.sequential_schedule(
            layers, None, x, strategy="optimal", budget=budget, costs=costs
        )
        assert schedule.peak_bytes is not None
        assert schedule.peak_bytes <= budget

        def forward(schedule: SequentialSchedule = schedule, preserve: bool = True) -> Any:
            out = checkpointing.checkpoint_sequential(
                layers, None, x, use_reentrant=False, strategy=schedule, preserve_rng_state=preserve
            )
            return out.sum()

        for layer in layers:
            layer.calls = 0
        assert _kept_bytes(forward, [layer.w for layer in layers]) <= budget
        assert [layer.calls for layer in layers] == [1 + c for c in schedule.recompute_counts]
        assert _allocator_peak(functools.partial(forward, preserve=False)) <= budget
        # NOTE [Sequential memory model], Rule 7: RNG states are bookkeeping, not activations.
        states = schedule.depth + 2
        assert _allocator_peak(forward) <= budget + states * _RNG_STATE_BYTES


def test_optimal_recomputes_less_than_balanced_at_its_memory() -> None:
    """Unequal layers: at the predicted peak of ``"balanced"`` (every segment count),
    ``"optimal"`` re-runs at most as much time, and strictly less for most counts; the
    measured allocator peak fits that memory too."""
    widths = [16, 64, 16, 128, 32, 16, 64, 8, 32, 16, 64, 16, 128, 32, 16, 64]
    weights = [1, 9, 1, 20, 2, 1, 9, 1, 3, 1, 9, 1, 20, 2, 1, 9]
    layers = _chain(widths)
    x = torch.randn(4, 8, requires_grad=True)
    costs = _with_times(checkpointing.sequential_schedule(layers, 1, x), weights)
    wins = 0
    for segments in range(2, len(layers) + 1):
        balanced = checkpointing.sequential_schedule(
            layers, segments, x, strategy="balanced", costs=costs
        )
        assert balanced.peak_bytes is not None
        assert balanced.recompute_time is not None
        optimal = checkpointing.sequential_schedule(
            layers, None, x, strategy="optimal", budget=balanced.peak_bytes, costs=costs
        )
        assert optimal.recompute_time is not None
        assert optimal.recompute_time <= balanced.recompute_time
        wins += optimal.recompute_time < balanced.recompute_time
        peak = _allocator_peak(
            lambda optimal=optimal: checkpointing.checkpoint_sequential(
                layers, None, x, use_reentrant=False, strategy=optimal, preserve_rng_state=False
            ).sum()
        )
        assert peak <= balanced.peak_bytes
    assert wins >= (len(layers) - 1) // 2


def test_optimal_nests_when_memory_is_tight() -> None:
    """At the floor of a uniform 32-layer chain the optimal schedule is nested (multi-level)."""
    costs = tuple(LayerCost(time=1.0, output_bytes=100, keeps_output=True) for _ in range(32))
    x = torch.randn(25)  # 100 bytes
    floor = memory_floor(costs, 100)
    schedule = checkpointing.sequential_schedule(
        list(range(32)), None, x, strategy="optimal", budget=floor, costs=costs
    )
    assert schedule.depth >= 2
    assert schedule.peak_bytes is not None
    assert schedule.peak_bytes <= floor


def _reference_table(
    costs: tuple[LayerCost, ...], input_bytes: int, budget: int
) -> tuple[dict[tuple[int, int], list[float]], dict[tuple[int, int], list[int]]]:
    """The ``"optimal"`` table written out one node, memory size and first step at a time
    (Rules 1 and 2): least recompute time and first step (0: run layer ``a``; ``k``: checkpoint
    ``[a, k)``; the first best in that order) per node ``(a, b)``, per memory slot."""
    model = _Model(costs, input_bytes)
    unit, slots = _unit(model, budget)
    n = len(costs)
    x = [_slots(size, unit) for size in model.x]
    forward = _checkpoint_forward_needs(model, n)
    times = [0.0, *itertools.accumulate(cost.time for cost in costs)]
    least = {(a, a): [0.0] * (slots + 1) for a in range(n + 1)}
    first: dict[tuple[int, int], list[int]] = {}
    for length in range(1, n + 1):
        for a in range(n - length + 1):
            b = a + length
            own = _slots(model.run_need(a, length == 1), unit)
            keep = _slots(model.keep(a), unit)
            least[a, b], first[a, b] = [], []
            for m in range(slots + 1):
                best = least[a + 1, b][m - keep] if m >= max(own, keep) else math.inf
                step = 0
                for k in range(a + 1, b):
                    left = m - x[k]
                    if left < 0 or m < _slots(forward[a][k], unit):
                        continue
                    option = least[a, k][left] + least[k, b][left] + (times[k] - times[a])
                    if option < best:
                        best, step = option, k
                least[a, b].append(best)
                first[a, b].append(step)
    return least, first


@pytest.mark.parametrize(
    ("n", "unit", "jitter", "seed"),
    [
        (1, 64, 0, 0),
        (2, 64, 0, 1),
        (5, 1, 0, 2),
        (7, 4, 0, 3),
        (9, 16, 0, 4),
        (10, 100, 0, 5),
        (11, 8, 0, 6),
        (4, 1000, 7, 7),
        (5, 1000, 7, 8),
    ],
)
def test_cost_table_equals_written_out_reference(n: int, unit: int, jitter: int, seed: int) -> None:
    """The ``"optimal"`` table (computed a block of nodes per tensor op) equals the written-out
    dynamic program exactly, times and first steps, on random chains: equal times (ties),
    empty outputs, large temporaries, budgets from the floor up, exact slots and (sizes off
    the ``unit`` grid by up to ``jitter`` bytes) rounded ones (NOTE [Sequential memory model],
    Rule 5)."""
    rng = random.Random(seed)
    costs = tuple(
        LayerCost(
            time=rng.choice([1.0, 2.0, 0.1 * rng.randint(1, 30)]),
            output_bytes=unit * rng.randint(0, 9) + rng.randint(0, jitter),
            saved_bytes=unit * rng.randint(0, 3),
            keeps_input=rng.random() < 0.5,
            keeps_output=rng.random() < 0.5,
            temporary_bytes=unit * rng.choice([0, rng.randint(1, 20)]),
        )
        for _ in range(n)
    )
    input_bytes = unit * rng.randint(1, 5)
    floor = memory_floor(costs, input_bytes)
    for budget in (floor, int(floor * 1.7), 3 * floor):
        table = _cost_table(costs, input_bytes, budget)
        least, first = _reference_table(costs, input_bytes, budget)
        for a, b in itertools.combinations(range(n + 1), 2):
            expected = torch.tensor(least[a, b], dtype=torch.float64)
            assert torch.equal(table.least_time(a, b), expected), (budget, a, b)
            steps = [table.first_step(a, b, m) for m in range(len(first[a, b]))]
            assert steps == first[a, b], (budget, a, b)


def test_schedule_prints_as_a_tree() -> None:
    """``print(schedule)``: a header with the predictions, one line per segment, nested."""
    layers = _chain([8] * 8)
    x = torch.randn(2, 8, requires_grad=True)
    text = str(checkpointing.sequential_schedule(layers, None, x, strategy="log"))
    lines = text.splitlines()
    assert lines[0].startswith("SequentialSchedule(strategy='log', 8 layers")
    assert lines[1].startswith("predicted: kept ")
    assert "peak" in lines[1]
    assert "recompute" in lines[1]
    assert lines[2].startswith("├─ checkpoint [0, 4)")
    assert "│  ├─ checkpoint [0, 2)" in text
    assert lines[-1].startswith("└─ run [7, 8)  keeps ")


# --- options handed to each segment ---------------------------------------------------------


def test_context_fn_reaches_every_segment() -> None:
    """A SAC policy given as ``context_fn`` sees the ops of every checkpointed segment."""
    seen: list[Any] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if not ctx.is_recompute:
            seen.append(op)
        return checkpointing.CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(checkpointing.create_selective_checkpoint_contexts, policy)
    layers = _chain([8] * 8)
    x = torch.randn(2, 8, requires_grad=True)
    expected = torch.autograd.grad(nn.Sequential(*layers)(x).sum(), x)[0]
    out = checkpointing.checkpoint_sequential(
        layers, None, x, use_reentrant=False, strategy="sqrt", context_fn=context_fn
    )
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected)
    assert seen.count(torch.ops.aten.tanh.default) == 6  # layers 0-5 in three checkpoints


def test_determinism_check_and_early_stop_reach_segments() -> None:
    """A bad ``determinism_check`` is rejected by each segment's checkpoint; ``early_stop=False``
    re-runs a last function that saves nothing, which early stop skips."""
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="determinism_check"):
        checkpointing.checkpoint_sequential(
            _chain([8] * 4), 2, x, use_reentrant=False, determinism_check="sometimes"
        )
    calls = []

    def saves_nothing(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t * 2.0

    for early_stop, expected in ((True, 1), (False, 2)):
        calls.clear()
        functions = [_chain([8])[0], saves_nothing, *_chain([8] * 2)]
        checkpointing.checkpoint_sequential(
            functions, 2, x, use_reentrant=False, early_stop=early_stop
        ).sum().backward()
        assert len(calls) == expected


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "phrase"),
    [
        ({"strategy": "fast"}, ValueError, "unknown strategy 'fast'"),
        ({"strategy": "log", "segments": 2}, ValueError, "chooses its own segments"),
        ({"strategy": "balanced", "segments": None}, ValueError, "got None"),
        ({"strategy": "balanced", "segments": 9}, ValueError, "between 1 and"),
        ({"strategy": "optimal"}, ValueError, "needs budget="),
        ({"strategy": "optimal", "budget": 1.5e6}, TypeError, "must be an int"),
        (
            {"strategy": "optimal", "budget": 10, "costs": (LayerCost(1.0, 64),) * 4},
            ValueError,
            "below the floor",
        ),
        ({"strategy": "sqrt", "budget": 10**6}, ValueError, "only used by strategy='optimal'"),
        ({"strategy": "sqrt", "costs": ()}, ValueError, "costs= is only used"),
        ({"strategy": "optimal", "budget": 10**6, "costs": ()}, ValueError, "one LayerCost"),
    ],
)
def test_bad_arguments_are_clear_errors(
    kwargs: dict[str, Any], error: type[Exception], phrase: str
) -> None:
    """Each mistake raises before any layer runs, naming the API and the fix."""
    layers = _chain([8] * 4)
    x = torch.randn(2, 8, requires_grad=True)
    segments = kwargs.pop("segments", None)
    with pytest.raises(error, match="checkpoint_sequential") as info:
        checkpointing.checkpoint_sequential(layers, segments, x, use_reentrant=False, **kwargs)
    assert phrase in str(info.value)
    assert "Fix" in str(info.value)
    assert all(layer.calls == 0 for layer in layers)


def test_floor_is_named_in_the_error() -> None:
    """A budget below the floor names the floor, and the floor itself is accepted."""
    layers = _chain([8] * 4)
    x = torch.randn(2, 8, requires_grad=True)
    costs = checkpointing.sequential_schedule(layers, 1, x).costs
    assert costs is not None
    floor = memory_floor(costs, x.numel() * 4)
    with pytest.raises(ValueError, match=f"Fix: pass budget >= {floor}"):
        checkpointing.sequential_schedule(layers, None, x, strategy="optimal", budget=floor - 1)
    schedule = checkpointing.sequential_schedule(layers, None, x, strategy="optimal", budget=floor)
    assert schedule.peak_bytes is not None
    assert schedule.peak_bytes <= floor


@pytest.mark.parametrize("option", [{"debug": True}, {"context_fn": tc.noop_context_fn}])
def test_reentrant_rejects_frame_options(option: dict[str, Any]) -> None:
    """``debug`` / a non-default ``context_fn`` with ``use_reentrant=True``: a clear error."""
    if "context_fn" in option:
        option = {"context_fn": lambda: tc.noop_context_fn()}
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="only supported with use_reentrant=False"):
        checkpointing.checkpoint_sequential(_chain([8] * 4), 2, x, use_reentrant=True, **option)


def test_schedule_for_other_functions_is_refused() -> None:
    """A schedule built for another chain length is a ValueError, not a silent mismatch."""
    schedule = checkpointing.sequential_schedule(list(range(5)), strategy="log")
    x = torch.randn(2, 8, requires_grad=True)
    result = outcome(
        lambda: checkpointing.checkpoint_sequential(
            _chain([8] * 4), None, x, use_reentrant=False, strategy=schedule
        )
    )
    error, message = error_of(result)
    assert error is ValueError
    assert "schedule is for 5 functions, got 4" in message
