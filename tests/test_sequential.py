"""``checkpoint_sequential``: torch's segmenting, side by side with torch, and correctness.

Which functions run twice (checkpointed) and which once (the trailing un-checkpointed range) is
compared with ``torch.utils.checkpoint.checkpoint_sequential`` for every small ``(n, segments)``
pair; gradients equal the un-checkpointed run on random layer stacks with random segment counts.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import releases
import torch
import torch.utils.checkpoint as tc
from frame_support import error_of, outcome
from hypothesis import given
from strategies import (
    StackSpec,
    layer_stacks,
    layer_stacks_with_dropout,
    segment_counts,
    stacks_and_segments,
)
from torch import nn

import checkpointing
from checkpointing._sequential import segment_bounds

VARIANTS = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "frame"])
IMPLEMENTATIONS = {"ours": checkpointing.checkpoint_sequential, "torch": tc.checkpoint_sequential}


class Counted(nn.Module):
    """``x * w + b`` with its own parameters, counting how often its forward runs."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(width, generator=gen, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(width, generator=gen, dtype=torch.float64))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x * self.w + self.b).tanh()


def _counts(run: Callable[..., Any], n: int, segments: int, use_reentrant: bool) -> list[int]:
    """How many times each of ``n`` functions ran in one forward and backward."""
    layers = [Counted(3, seed=i) for i in range(n)]
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    run(layers, segments, x, use_reentrant=use_reentrant).sum().backward()
    return [layer.calls for layer in layers]


def _reference_bounds(n: int, segments: int) -> list[tuple[int, int]]:
    """Segments of ``n // segments`` functions, the remainder joining the last one."""
    size = n // segments
    ranges = [(i * size, (i + 1) * size) for i in range(segments - 1)]
    return [*ranges, ((segments - 1) * size, n)]


# --- the signature and segment_bounds --------------------------------------------------------


def test_signature_matches_torch() -> None:
    """torch's parameters (names, kinds, torch's defaults; ``segments`` and ``input`` get
    defaults so that a strategy choosing its own segments needs none); ours are keyword-only
    with defaults."""
    ours = inspect.signature(checkpointing.checkpoint_sequential).parameters
    theirs = inspect.signature(tc.checkpoint_sequential).parameters
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    assert [(p.name, p.kind) for p in ours.values() if p.kind != keyword_only] == [
        (p.name, p.kind) for p in theirs.values()
    ]
    for name, p in theirs.items():
        if p.default is not inspect.Parameter.empty:
            assert ours[name].default == p.default
    assert ours["segments"].default is None
    extra = [p for p in ours.values() if p.kind == keyword_only]
    assert [p.name for p in extra] == [
        "strategy",
        "budget",
        "costs",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "recompute_state_hooks",
    ]
    assert all(p.default is not inspect.Parameter.empty for p in extra)


@pytest.mark.parametrize(
    ("n", "segments", "expected"),
    [
        (1, 1, [(0, 1)]),
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (5, 2, [(0, 2), (2, 5)]),
        (10, 3, [(0, 3), (3, 6), (6, 10)]),
        (7, 4, [(0, 1), (1, 2), (2, 3), (3, 7)]),
    ],
)
def test_segment_bounds_examples(n: int, segments: int, expected: list[tuple[int, int]]) -> None:
    """Worked examples: the remainder of n // segments goes to the last, un-checkpointed range."""
    assert segment_bounds(n, segments) == expected


@given(pair=segment_counts(max_functions=40))
def test_segment_bounds_properties(pair: tuple[int, int]) -> None:
    """Ranges are contiguous, cover every function, and all but the last hold n // segments."""
    n, segments = pair
    bounds = segment_bounds(n, segments)
    assert bounds == _reference_bounds(n, segments)
    assert len(bounds) == segments
    assert bounds[0][0] == 0
    assert bounds[-1][1] == n
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(bounds))
    assert all(end - start == n // segments for start, end in bounds[:-1])
    assert bounds[-1][1] > bounds[-1][0]


# --- torch's segmenting, measured ------------------------------------------------------------


@VARIANTS
def test_forward_counts_equal_torch_for_every_small_pair(use_reentrant: bool) -> None:
    """For every 1 <= segments <= n <= 8, each function runs as often as under torch."""
    for n in range(1, 9):
        for segments in range(1, n + 1):
            mine = _counts(checkpointing.checkpoint_sequential, n, segments, use_reentrant)
            theirs = _counts(tc.checkpoint_sequential, n, segments, use_reentrant)
            assert mine == theirs, (n, segments)
            *checkpointed, (last_start, _) = segment_bounds(n, segments)
            expected = [2] * (checkpointed[-1][1] if checkpointed else 0)
            assert mine == [*expected, *[1] * (n - last_start)], (n, segments)


@pytest.mark.parametrize("container", ["Sequential", "list", "tuple", "functions"])
@VARIANTS
def test_containers_give_torch_results(container: str, use_reentrant: bool) -> None:
    """nn.Sequential, lists, tuples and plain functions: outputs and gradients equal torch's."""
    results = []
    for run in IMPLEMENTATIONS.values():
        layers = [Counted(4, seed=i) for i in range(5)]
        functions: Sequence[Callable[[torch.Tensor], torch.Tensor]]
        if container == "Sequential":
            functions = nn.Sequential(*layers)
        elif container == "list":
            functions = layers
        elif container == "tuple":
            functions = tuple(layers)
        else:
            functions = [lambda t, layer=layer: layer(t) * 2 for layer in layers]
        torch.manual_seed(9)
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        out = run(functions, 2, x, use_reentrant=use_reentrant)
        out.sum().backward()
        grads = [x.grad] + [p.grad for layer in layers for p in layer.parameters()]
        results.append((out.detach(), grads, [layer.calls for layer in layers]))
    (my_out, my_grads, my_calls), (their_out, their_grads, their_calls) = results
    assert torch.equal(my_out, their_out)
    assert my_calls == their_calls
    for a, b in zip(my_grads, their_grads, strict=True):
        assert torch.equal(a, b)


# --- correctness over random layer stacks ----------------------------------------------------


@VARIANTS
@given(case=stacks_and_segments())
def test_gradients_equal_unchecked_run(use_reentrant: bool, case: tuple[StackSpec, int]) -> None:
    """Random stacks and segment counts: gradients bit-identical to the unchecked run."""
    spec, segments = case
    expected = spec.run(lambda model, x: model(x))
    got = spec.run(
        lambda model, x: checkpointing.checkpoint_sequential(
            model, segments, x, use_reentrant=use_reentrant
        )
    )
    got.assert_equal(expected)


@VARIANTS
@given(case=stacks_and_segments(layer_stacks_with_dropout()))
def test_dropout_bit_identical_with_preserved_rng(
    use_reentrant: bool, case: tuple[StackSpec, int]
) -> None:
    """Dropout, preserve_rng_state default: bit-identical, caller's stream as unchecked."""
    spec, segments = case
    torch.manual_seed(11)
    expected = spec.run(lambda model, x: model(x))
    torch.manual_seed(11)
    got = spec.run(
        lambda model, x: checkpointing.checkpoint_sequential(
            model, segments, x, use_reentrant=use_reentrant
        )
    )
    got.assert_equal(expected)
    assert torch.equal(got.rng_after, expected.rng_after)


@VARIANTS
@given(case=stacks_and_segments(layer_stacks_with_dropout()))
def test_unpreserved_rng_matches_torch(use_reentrant: bool, case: tuple[StackSpec, int]) -> None:
    """preserve_rng_state=False reaches each segment: results and RNG afterwards equal torch's."""
    spec, segments = case
    results = []
    for run in IMPLEMENTATIONS.values():
        torch.manual_seed(12)
        results.append(
            spec.run(
                lambda model, x, run=run: run(
                    model, segments, x, use_reentrant=use_reentrant, preserve_rng_state=False
                )
            )
        )
    mine, theirs = results
    mine.assert_equal(theirs)
    assert torch.equal(mine.rng_after, theirs.rng_after)


@VARIANTS
@pytest.mark.parametrize("preserve", [True, False])
def test_preserve_rng_state_is_passed_to_segments(use_reentrant: bool, preserve: bool) -> None:
    """Dropout in a checkpointed segment re-draws from the caller's stream only without preserve."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 6), nn.Tanh())
    x = torch.randn(4, 6, requires_grad=True)
    torch.manual_seed(13)
    model(x).sum().backward()
    unchecked_rng = torch.get_rng_state()
    torch.manual_seed(13)
    checkpointing.checkpoint_sequential(
        model, 2, x, use_reentrant=use_reentrant, preserve_rng_state=preserve
    ).sum().backward()
    assert torch.equal(torch.get_rng_state(), unchecked_rng) == preserve


# --- warnings and errors side by side --------------------------------------------------------


def test_omitted_use_reentrant_warns_once_like_torch() -> None:
    """Omitting use_reentrant gives torch's one UserWarning, word for word, then runs reentrant."""
    outcomes = {}
    for name, run in IMPLEMENTATIONS.items():
        layers = [Counted(3, seed=i) for i in range(4)]
        x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        outcomes[name] = outcome(lambda run=run, layers=layers, x=x: run(layers, 2, x))
        out = outcomes[name][0]
        assert isinstance(out, torch.Tensor)
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            torch.autograd.grad(out.sum(), x)
    assert outcomes["ours"][1] == [(UserWarning, releases.SEQUENTIAL_USE_REENTRANT_WARNING)]
    if releases.has(releases.REWORDED_WARNING):
        assert outcomes["ours"][1] == outcomes["torch"][1]
    else:  # older releases word it "In version 2.9 ..."; the category is the same
        assert [category for category, _ in outcomes["torch"][1]] == [UserWarning]


@pytest.mark.parametrize(
    "use_reentrant", [True, False, None], ids=["reentrant", "frame", "omitted"]
)
def test_unexpected_kwargs_raise_like_torch(use_reentrant: bool | None) -> None:
    """Unknown keyword arguments: torch's ValueError (its message first) and the same warnings."""
    layers = [nn.Linear(3, 3) for _ in range(3)]
    x = torch.randn(2, 3, requires_grad=True)
    mine = outcome(
        lambda: checkpointing.checkpoint_sequential(
            layers, 2, x, use_reentrant=use_reentrant, foo=1, context_fns=None
        )
    )
    theirs = outcome(
        lambda: tc.checkpoint_sequential(
            layers, 2, x, use_reentrant=use_reentrant, foo=1, context_fns=None
        )
    )
    assert [c for c, _ in mine[1]] == [c for c, _ in theirs[1]]
    if releases.has(releases.REWORDED_WARNING):
        assert mine[1] == theirs[1]
    assert all(m == releases.SEQUENTIAL_USE_REENTRANT_WARNING for _, m in mine[1])
    my_type, my_message = error_of(mine)
    their_type, their_message = error_of(theirs)
    assert my_type is their_type is ValueError
    assert their_message == "Unexpected keyword arguments: foo,context_fns"
    assert my_message.startswith(their_message)


@pytest.mark.parametrize(("n", "segments"), [(4, 0), (4, -1), (4, -3), (4, 5), (1, 2), (3, 100)])
@VARIANTS
def test_bad_segment_count_is_a_clear_value_error(
    n: int, segments: int, use_reentrant: bool
) -> None:
    """segments < 1 or > len(functions): a ValueError naming the API and both numbers.

    Beyond torch, which fails oddly: 0 raises ZeroDivisionError, more segments than functions
    raises ValueError("range() arg 3 must not be zero"), and a negative count silently runs
    everything without checkpointing.
    """
    layers = [Counted(3, seed=i) for i in range(n)]
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="checkpoint_sequential") as info:
        checkpointing.checkpoint_sequential(layers, segments, x, use_reentrant=use_reentrant)
    message = str(info.value)
    assert str(segments) in message
    assert str(n) in message
    assert all(layer.calls == 0 for layer in layers)


def test_empty_chain_raises_value_error_like_torch() -> None:
    """An empty list of functions is a ValueError in both (ours says why)."""
    x = torch.randn(2, 3, requires_grad=True)
    mine = outcome(lambda: checkpointing.checkpoint_sequential([], 1, x, use_reentrant=True))
    theirs = outcome(lambda: tc.checkpoint_sequential([], 1, x, use_reentrant=True))
    assert error_of(mine)[0] is error_of(theirs)[0] is ValueError
    assert "checkpoint_sequential" in error_of(mine)[1]


def test_input_without_grad_reentrant_like_torch() -> None:
    """Reentrant with an input not requiring grad: torch's warnings and (missing) gradients."""
    outcomes = []
    for run in IMPLEMENTATIONS.values():
        layers = [Counted(3, seed=i) for i in range(6)]
        torch.manual_seed(14)  # the same input for both implementations
        x = torch.randn(2, 3, dtype=torch.float64)
        result, caught = outcome(
            lambda run=run, layers=layers, x=x: run(layers, 3, x, use_reentrant=True)
        )
        assert isinstance(result, torch.Tensor)
        result.sum().backward()
        grads = [p.grad for layer in layers for p in layer.parameters()]
        outcomes.append((caught, grads))
    (my_warnings, my_grads), (their_warnings, their_grads) = outcomes
    assert my_warnings == their_warnings
    assert len(my_warnings) == 2  # one per checkpointed segment
    for a, b in zip(my_grads, their_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a, b)


@given(spec=layer_stacks(min_depth=1, max_depth=4))
def test_one_segment_checkpoints_nothing(spec: StackSpec) -> None:
    """segments=1 runs the whole chain un-checkpointed: the plain result, bit for bit."""
    expected = spec.run(lambda model, x: model(x))
    got = spec.run(
        lambda model, x: checkpointing.checkpoint_sequential(model, 1, x, use_reentrant=True)
    )
    got.assert_equal(expected)


# --- an extra positional input lands in use_reentrant (NOTE [Torch's path], Rule 1) -----------


class TwoInputs(nn.Module):
    """``a * w + b``: a first layer that needs two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.w + b


class Truthy:
    """A non-bool ``use_reentrant`` that counts how often it is asked for its truth value."""

    def __init__(self, value: bool) -> None:
        self.value = value
        self.asked = 0

    def __bool__(self) -> bool:
        self.asked += 1
        return self.value

    def __repr__(self) -> str:
        return f"Truthy({self.value})"


def _one_input_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3, dtype=torch.float64), nn.Tanh())


@pytest.mark.parametrize("segments", [1, 2])
@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: nn.Sequential(TwoInputs(), nn.Tanh()), lambda: torch.randn(2, 3)),
        (_one_input_model, lambda: torch.randn(2, 3)),
        (_one_input_model, lambda: torch.tensor(1.0)),
        (_one_input_model, lambda: Truthy(False)),
    ],
    ids=["second input", "extra tensor", "extra scalar tensor", "truthy object"],
)
def test_non_bool_use_reentrant_by_position_is_refused_before_anything_runs(
    build: Callable[[], nn.Sequential], flag: Callable[[], object], segments: int
) -> None:
    """A non-bool ``use_reentrant`` (often a second input given by position) is a TypeError
    naming the fix before any layer runs or the value is read for its truth; torch reads its
    truth in each checkpointed segment instead, and runs or fails inside."""
    model, value = build(), flag()
    calls: list[nn.Module] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(module))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="use_reentrant must be True or False") as info:
        checkpointing.checkpoint_sequential(model, segments, x, value)
    assert "use_reentrant=False" in str(info.value)
    assert not calls
    assert not isinstance(value, Truthy) or value.asked == 0


@pytest.mark.parametrize(
    ("segments", "options"),
    [
        (2, {"strategy": "balanced"}),
        (None, {"strategy": "sqrt"}),
        (None, {"strategy": "log"}),
        (2, {"debug": True}),
        (2, {"context_fn": lambda: (contextlib.nullcontext(), contextlib.nullcontext())}),
        (2, {"determinism_check": "none"}),
    ],
    ids=["balanced", "sqrt", "log", "debug", "context_fn", "determinism_check"],
)
@pytest.mark.parametrize("flag", [torch.ones(2), "yes"], ids=["tensor", "str"])
def test_non_bool_use_reentrant_with_our_options_is_a_clear_type_error(
    segments: int | None, options: dict[str, Any], flag: object
) -> None:
    """Our strategies and keywords need a bool use_reentrant: a TypeError naming the fix."""
    layers = [Counted(3, seed=i) for i in range(4)]
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="checkpoint_sequential") as info:
        checkpointing.checkpoint_sequential(layers, segments, x, flag, **options)
    assert type(flag).__name__ in str(info.value)
    assert ("input=(" in str(info.value)) is isinstance(flag, torch.Tensor)
    assert all(layer.calls == 0 for layer in layers)
