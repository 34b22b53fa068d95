"""``checkpoint_sequential``: checkpoint a chain of modules or functions by a schedule.

Owns the public front door (``checkpoint_sequential``, ``sequential_schedule``), the argument
checks and their messages (all made before any function runs), the profiling pass that measures
each function's costs for ``strategy="optimal"`` (leaving the modules as found, as the planner's
profile does, and once per chain and input signature in ``checkpoint_sequential``), and the loop
that runs a schedule through nested ``checkpoint`` calls.
What a schedule is, and how each strategy builds one, belongs to ``_schedule``; checkpointing
itself to ``_checkpoint``.

By default (``strategy="torch"``) it cuts exactly as torch 2.13 does: ``segments - 1``
checkpointed segments of ``len // segments`` functions, then the rest runs un-checkpointed, and
the input is handed to the first function as one argument. Every other strategy hands a tuple
input over as ``*input`` (and each function's tuple result to the next).

NOTE [Torch's path]

Rule 1. ``use_reentrant`` is checked first: a bool or ``None``, else a TypeError naming the fix
        before anything runs (torch reads any other value for its truth in each checkpointed
        segment: ``"false"`` runs the reentrant variant, and a tensor there, usually a second
        input given by position, fails or runs depending on its value and the segments).
Rule 2. With ``strategy="torch"`` and none of our keywords, no other argument is read before
        torch reads it: a bad ``segments`` or layer fails where torch's fails, with the same
        type.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.autograd.graph import saved_tensors_hooks

from . import _compat, _compiled
from ._checkpoint import check_use_reentrant, checkpoint
from ._context_fn import ContextFnOrPolicy, context_fn_from
from ._errors import describe_value
from ._schedule import (
    STRATEGIES,
    LayerCost,
    Segment,
    SequentialSchedule,
    StrategyName,
    build_schedule,
    memory_floor,
    segment_bounds,
)
from ._state import ContextFn, is_noop_context_fn, noop_context_fn, state_hooks_from
from ._trees import StorageKey, storage_key, storage_nbytes, tensors
from ._untouched import untouched

__all__ = ["checkpoint_sequential", "measure_costs", "segment_bounds", "sequential_schedule"]

_API_SEQUENTIAL: Final = "checkpointing.checkpoint_sequential"
_NO_INPUT: Final = object()
_MSG_NO_INPUT = (
    "checkpointing.checkpoint_sequential() missing required argument: 'input'. Fix: "
    "checkpoint_sequential(functions, segments, input) or, for a strategy that chooses its own "
    "segments, checkpoint_sequential(functions, input=x, strategy='sqrt')."
)
# Torch 2.15's wording (2.11-2.14 said "In version 2.9 we will raise ...").
_MSG_USE_REENTRANT_OMITTED = (
    "torch.utils.checkpoint.checkpoint_sequential: the use_reentrant parameter should be "
    "passed explicitly. In a future release, we will raise an exception if use_reentrant is not "
    "passed. use_reentrant=False is recommended, but if you need to preserve the current "
    "default behavior, you can pass use_reentrant=True. Refer to docs for more details on the "
    "differences between the two variants."
)
_MSG_UNEXPECTED_KWARGS = (
    "Unexpected keyword arguments: {names}. (checkpointing.checkpoint_sequential accepts "
    "preserve_rng_state and its own keywords strategy, budget, costs, context_fn, "
    "determinism_check, debug and early_stop. Fix: remove the others.)"
)
_MSG_BAD_SEGMENTS = (
    "checkpointing.{api}: segments must be an integer between 1 and the number "
    "of functions ({n}), got {segments!r}. Fix: pass segments=min(segments, {n}) (e.g. "
    "round(sqrt({n})) for the usual memory/compute balance)."
)
_MSG_FUNCTIONS_TYPE = (
    "checkpointing.{api}: functions must be an nn.Sequential or a sequence (list, tuple, "
    "nn.ModuleList) of modules or functions, got {got}. Nothing ran. Fix: wrap a single module "
    "or function in a list or an nn.Sequential, e.g. [layer] or nn.Sequential(layer)."
)
_MSG_NOT_CALLABLE = (
    "checkpointing.{api}: functions[{index}] must be callable (a module or a function), got "
    "{got}. Nothing ran. Fix: pass only modules and functions, e.g. nn.Sequential(*layers)."
)
_MSG_EMPTY = (
    "checkpointing.{api}: functions is empty; expected at least one module or function to run. "
    "Fix: pass a non-empty nn.Sequential or list."
)
_MSG_UNKNOWN_STRATEGY = (
    "checkpointing.{api}: unknown strategy {strategy!r}; expected one of {allowed} or a "
    "SequentialSchedule from checkpointing.sequential_schedule(). Fix: check the spelling."
)
_MSG_SEGMENTS_CHOSEN = (
    "checkpointing.{api}: strategy={strategy!r} chooses its own segments, got segments="
    "{segments!r}. Fix: pass segments=None, or strategy='balanced' for a fixed number of "
    "segments."
)
_MSG_BUDGET_WITHOUT_OPTIMAL = (
    "checkpointing.{api}: budget= is only used by strategy='optimal', got strategy="
    "{strategy!r} with budget={budget!r}. Fix: pass strategy='optimal', or drop budget."
)
_MSG_COSTS_WITHOUT_OPTIMAL = (
    "checkpointing.checkpoint_sequential: costs= is only used by strategy='optimal', got "
    "strategy={strategy!r}. Fix: pass strategy='optimal' with a budget, or drop costs "
    "(sequential_schedule() takes costs= with any strategy, for its predictions)."
)
_MSG_OPTIMAL_NEEDS_BUDGET = (
    "checkpointing.{api}: strategy='optimal' needs budget= (the activation bytes allowed), "
    "got none. Fix: pass budget=<bytes>; sequential_schedule(..., strategy='sqrt') prints "
    "the bytes other strategies need, for a starting point."
)
_MSG_BUDGET_TYPE = (
    "checkpointing.{api}: budget must be an int (bytes), got {budget!r} of type "
    "{type_name}. Fix: pass int(budget)."
)
_MSG_BUDGET_BELOW_FLOOR = (
    "checkpointing.{api}: budget={budget} bytes is below the floor of this chain, {floor} "
    "bytes (the least any nested schedule needs: the input, the output's gradient and the "
    "largest layer with its neighbours, by the measured costs). Fix: pass budget >= {floor}."
)
_MSG_BAD_COSTS = (
    "checkpointing.{api}: costs must hold one LayerCost per function ({n}), got {observed}. "
    "Fix: pass sequential_schedule(functions, None, input).costs, or build LayerCost(...) "
    "for each function."
)
_MSG_OPTIMAL_NEEDS_INPUT = (
    "checkpointing.sequential_schedule: strategy='optimal' needs the layers' costs: pass "
    "input (one profiling pass measures them) or costs=. Got neither."
)
_MSG_SCHEDULE_MISMATCH = (
    "checkpointing.checkpoint_sequential: the schedule is for {expected} functions, got "
    "{n}; and with a SequentialSchedule as strategy, segments, budget and costs must be "
    "None (got segments={segments!r}). Fix: build the schedule for these functions with "
    "sequential_schedule() and pass it alone."
)
_HINT_SECOND_INPUT = (
    " A tensor there is usually a second input given by position (the fourth positional "
    "argument is use_reentrant): pass the inputs as one tuple, input=(a, b) (every strategy but "
    "'torch' hands it over as *input), and use_reentrant by keyword."
)
_MSG_REENTRANT_OPTIONS = (
    "checkpointing.checkpoint_sequential: {what} is only supported with use_reentrant=False "
    "(it is handed to each segment's checkpoint), got use_reentrant=True. Fix: pass "
    "use_reentrant=False."
)


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[..., Any]],
    segments: int | None = None,
    input: Any = _NO_INPUT,
    use_reentrant: bool | None = None,
    *,
    strategy: StrategyName | SequentialSchedule = "torch",
    budget: int | None = None,
    costs: Sequence[LayerCost] | None = None,
    context_fn: ContextFnOrPolicy = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    recompute_state_hooks: object = None,
    **kwargs: Any,
) -> Any:
    """Run ``functions`` in order on ``input``, checkpointing segments chosen by ``strategy``.

    Drop-in for ``torch.utils.checkpoint.checkpoint_sequential``: with the default
    ``strategy="torch"`` the same segmenting, warnings and errors (only ``preserve_rng_state``
    and the keywords below are accepted in ``kwargs``; a bad ``segments`` is a clear
    ``ValueError``).

    Args:
        functions: an ``nn.Sequential`` or a sequence of modules or functions.
        segments: the number of segments for ``"torch"`` and ``"balanced"``; omitted (or
            ``None``) for the strategies that choose their own.
        input: the first function's input. With a strategy other than ``"torch"``, a tuple is
            passed as ``*input`` and each function's tuple result to the next as ``*result``.
        use_reentrant: as for ``checkpoint``; omitted warns and uses ``True``, as torch. With
            another strategy or our keywords it must be a bool.
        strategy: ``"torch"`` (torch's cut: the remainder runs un-checkpointed at the end),
            ``"balanced"`` (sizes differ by at most one), ``"sqrt"`` (round(sqrt(n)) balanced
            segments), ``"log"`` (recursive bisection: O(log n) activations kept, each layer
            re-run O(log n) times), ``"optimal"`` (least recompute time whose predicted peak fits
            ``budget``), or a ``SequentialSchedule`` from ``sequential_schedule()``.
        budget: for ``"optimal"``: the activation bytes allowed, kept and at the peak.
        costs: for ``"optimal"``: one ``LayerCost`` per function; omitted, one profiling pass
            on ``input`` measures them, leaving the modules as found, once per chain and input
            signature (shapes, dtypes, devices, the modules' training flags): later calls reuse
            them.
        context_fn, determinism_check, debug, early_stop: handed to each segment's
            ``checkpoint`` (``context_fn`` and ``debug`` need ``use_reentrant=False``).
        recompute_state_hooks: as for ``checkpoint``: each segment snapshots at its start and
            restores in its recompute.
        **kwargs: ``preserve_rng_state=True``, handed to each segment.

    Example:
        >>> import torch, checkpointing
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> out = checkpointing.checkpoint_sequential(model, 2, x, use_reentrant=False)
        >>> out = checkpointing.checkpoint_sequential(
        ...     model, input=x, use_reentrant=False, strategy="log")
    """
    if input is _NO_INPUT:
        raise TypeError(_MSG_NO_INPUT)
    check_use_reentrant(use_reentrant, _API_SEQUENTIAL, _HINT_SECOND_INPUT)  # NOTE [Torch's path]
    if use_reentrant is None:
        warnings.warn(_MSG_USE_REENTRANT_OMITTED, UserWarning, stacklevel=2)
        use_reentrant = True
    if context_fn is not noop_context_fn:  # NOTE [Context functions], Rule 4: turned once
        context_fn = context_fn_from(context_fn, _API_SEQUENTIAL)
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError(_MSG_UNEXPECTED_KWARGS.format(names=",".join(kwargs)))
    extension = _extension_in_use(strategy, context_fn, determinism_check, debug, early_stop)
    if extension is None and recompute_state_hooks is not None:
        extension = "recompute_state_hooks"
    if extension is not None:
        _check_use_reentrant(use_reentrant, context_fn, debug)
    chain = _as_list("checkpoint_sequential", functions)
    if isinstance(strategy, SequentialSchedule):
        if strategy.n_layers != len(chain) or (segments, budget, costs) != (None, None, None):
            raise ValueError(
                _MSG_SCHEDULE_MISMATCH.format(
                    expected=strategy.n_layers, n=len(chain), segments=segments
                )
            )
        schedule = strategy
    else:
        if costs is not None and strategy != "optimal":
            raise ValueError(_MSG_COSTS_WITHOUT_OPTIMAL.format(strategy=strategy))
        # Profile only where the schedule depends on the costs: the others run as they are.
        planning_input = input if strategy == "optimal" else None
        schedule = _schedule_for(
            "checkpoint_sequential",
            chain,
            segments,
            planning_input,
            strategy,
            budget,
            costs,
            measured=_MEASURED,
        )
    runner = _Runner(
        chain,
        unpack=schedule.strategy != "torch",
        options={
            "use_reentrant": use_reentrant,
            "preserve_rng_state": preserve,
            "context_fn": context_fn,
            "determinism_check": determinism_check,
            "debug": debug,
            "early_stop": early_stop,
            "recompute_state_hooks": state_hooks_from(
                recompute_state_hooks, "checkpointing.checkpoint_sequential"
            ),
        },
    )
    return runner.run(schedule.segments, runner.first_args(input), nested=False)


def sequential_schedule(
    functions: torch.nn.Sequential | Sequence[Callable[..., Any]],
    segments: int | None = None,
    input: Any = None,
    *,
    strategy: StrategyName = "torch",
    budget: int | None = None,
    costs: Sequence[LayerCost] | None = None,
) -> SequentialSchedule:
    """The schedule ``checkpoint_sequential`` would run, with its predicted costs.

    With ``input`` (and no ``costs``), one profiling pass measures each function's time, output
    bytes and what it keeps for backward, so the schedule predicts its kept bytes, activation
    peak and recompute time; ``print(schedule)`` draws it as a tree. Pass the schedule back as
    ``checkpoint_sequential(functions, None, input, strategy=schedule, ...)`` to run it without
    planning again.

    Example:
        >>> import torch, checkpointing
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(16)])
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> schedule = checkpointing.sequential_schedule(model, None, x, strategy="log")
        >>> print(schedule)  # doctest: +SKIP
    """
    api = "sequential_schedule"
    chain = _as_list(api, functions, runs=input is not None and costs is None)
    return _schedule_for(api, chain, segments, input, strategy, budget, costs)


# --- checks and planning ------------------------------------------------------------------------


def _as_list(api: str, functions: object, *, runs: bool = True) -> list[Any]:
    """The chain as a list; where it ``runs``, every entry checked callable before any runs.
    (``sequential_schedule`` without measuring takes placeholders: ``range(n)``.)"""
    if isinstance(functions, torch.nn.Sequential):
        return list(functions.children())
    if not isinstance(functions, Iterable) or isinstance(functions, str | bytes):
        raise TypeError(_MSG_FUNCTIONS_TYPE.format(api=api, got=describe_value(functions)))
    chain = list(functions)
    for index, function in enumerate(chain if runs else ()):
        if not callable(function):
            raise TypeError(
                _MSG_NOT_CALLABLE.format(api=api, index=index, got=describe_value(function))
            )
    return chain


def _extension_in_use(
    strategy: StrategyName | SequentialSchedule,
    context_fn: ContextFn,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
) -> str | None:
    """The first of our own options the call uses, as passed; ``None`` for torch's own call."""
    if isinstance(strategy, SequentialSchedule):
        return "strategy=<SequentialSchedule>"
    if strategy != "torch":
        return f"strategy={strategy!r}"
    if not is_noop_context_fn(context_fn):
        return "context_fn"
    if determinism_check != "default":
        return f"determinism_check={determinism_check!r}"
    if debug is not False:
        return f"debug={debug!r}"
    if early_stop is not True:
        return f"early_stop={early_stop!r}"
    return None


def _check_use_reentrant(use_reentrant: bool, context_fn: ContextFn, debug: bool) -> None:
    """``use_reentrant`` False where our options need it."""
    if use_reentrant and (not is_noop_context_fn(context_fn) or debug is not False):
        what = "context_fn" if not is_noop_context_fn(context_fn) else "debug=True"
        raise ValueError(_MSG_REENTRANT_OPTIONS.format(what=what))


def _schedule_for(
    api: str,
    chain: list[Any],
    segments: int | None,
    input: Any,
    strategy: StrategyName,
    budget: int | None,
    costs: Sequence[LayerCost] | None,
    measured: _MeasuredCosts | None = None,
) -> SequentialSchedule:
    """Check the arguments in the order a user reads them, then build the schedule (measuring
    the costs through ``measured`` where given: once per chain and input signature)."""
    n = len(chain)
    if n == 0:
        raise ValueError(_MSG_EMPTY.format(api=api))
    if strategy not in STRATEGIES:
        allowed = ", ".join(map(repr, STRATEGIES))
        raise ValueError(_MSG_UNKNOWN_STRATEGY.format(api=api, strategy=strategy, allowed=allowed))
    _check_segments(api, strategy, segments, n)
    _check_budget(api, strategy, budget)
    found = _costs_for(api, chain, input, strategy, costs, measured)
    layer_costs, input_bytes = found if found is not None else (None, 0)
    if strategy == "optimal" and layer_costs is None:  # unmeasured, traced ([Compiled regions] 5)
        return build_schedule("balanced", n, n, None, 0, None)
    if strategy == "optimal" and budget is not None and layer_costs is not None:
        floor = memory_floor(layer_costs, input_bytes)
        if budget < floor:
            raise ValueError(_MSG_BUDGET_BELOW_FLOOR.format(api=api, budget=budget, floor=floor))
    return build_schedule(strategy, n, segments, layer_costs, input_bytes, budget)


def _check_segments(api: str, strategy: StrategyName, segments: object, n: int) -> None:
    if strategy in ("torch", "balanced"):
        if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n:
            raise ValueError(_MSG_BAD_SEGMENTS.format(api=api, n=n, segments=segments))
    elif segments is not None:
        raise ValueError(_MSG_SEGMENTS_CHOSEN.format(api=api, strategy=strategy, segments=segments))


def _check_budget(api: str, strategy: StrategyName, budget: object) -> None:
    if strategy != "optimal":
        if budget is not None:
            raise ValueError(
                _MSG_BUDGET_WITHOUT_OPTIMAL.format(api=api, strategy=strategy, budget=budget)
            )
        return
    if budget is None:
        raise ValueError(_MSG_OPTIMAL_NEEDS_BUDGET.format(api=api))
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(
            _MSG_BUDGET_TYPE.format(api=api, budget=budget, type_name=type(budget).__name__)
        )


def _costs_for(
    api: str,
    chain: list[Any],
    input: Any,
    strategy: StrategyName,
    costs: Sequence[LayerCost] | None,
    measured: _MeasuredCosts | None = None,
) -> tuple[tuple[LayerCost, ...], int] | None:
    """The given or measured costs and the input's bytes; ``None`` where neither is possible."""
    unpack = strategy != "torch"
    if costs is not None:
        given = tuple(costs)
        if len(given) != len(chain) or not all(isinstance(c, LayerCost) for c in given):
            observed = f"{len(given)} items of types {sorted({type(c).__name__ for c in given})}"
            raise ValueError(_MSG_BAD_COSTS.format(api=api, n=len(chain), observed=observed))
        inputs = tensors(_Runner.args_of(input, unpack))
        if _compiled.compiling():  # storages are not traceable ([Compiled regions] Rule 5)
            return given, sum(t.numel() * t.element_size() for t in inputs)
        return given, _bytes_of(inputs, set())
    if input is None:
        if strategy == "optimal":
            raise ValueError(_MSG_OPTIMAL_NEEDS_INPUT)
        return None
    if _compiled.compiling():  # nothing is measured in a trace ([Compiled regions] Rule 5)
        _compiled.say_once("optimal")
        return None
    if measured is None:
        return measure_costs(chain, input, unpack)
    return measured.costs(chain, input, unpack)


# --- measured costs, once per chain -----------------------------------------------------------

# Input signatures remembered per chain: a training loop's full batches and its last, smaller one.
_SIGNATURES_PER_CHAIN: Final = 4
_Measured = tuple[tuple[LayerCost, ...], int]


def _signature(chain: list[Any], input: Any, unpack: bool) -> Hashable:
    """What the measured costs depend on besides the functions themselves: each input tensor's
    shape, dtype, device and ``requires_grad`` (other inputs by type), and the modules'
    training flags."""
    inputs = tuple(
        (tuple(item.shape), item.dtype, item.device, item.requires_grad)
        if isinstance(item, torch.Tensor)
        else type(item)
        for item in _Runner.args_of(input, unpack)
    )
    return unpack, inputs, tuple(f.training for f in chain if isinstance(f, torch.nn.Module))


@dataclass
class _Chain:
    """The costs measured for one chain: its functions after the first (weakly, to tell the
    chain apart from another with the same first function), by input signature."""

    rest: tuple[weakref.ref[Any], ...]
    by_signature: dict[Hashable, _Measured]

    def is_for(self, chain: list[Any]) -> bool:
        return len(self.rest) == len(chain) - 1 and all(
            ref() is function for ref, function in zip(self.rest, chain[1:], strict=False)
        )


class _MeasuredCosts:
    """``checkpoint_sequential``'s measured costs for ``"optimal"``, so that a training loop
    measures its chain once, not on every step (the schedule itself is cached by ``_schedule``).
    Keyed weakly by the chain's first function: an entry dies with it, holds no module or tensor
    alive (costs are numbers), and keeps ``_SIGNATURES_PER_CHAIN`` signatures. A chain whose
    first function cannot be weakly referenced or hashed, or whose others cannot be weakly
    referenced, is measured on every call."""

    def __init__(self) -> None:
        self._chains: weakref.WeakKeyDictionary[Any, _Chain] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def costs(self, chain: list[Any], input: Any, unpack: bool) -> _Measured:
        """The chain's costs on inputs like ``input``: remembered, or measured now."""
        signature = _signature(chain, input, unpack)
        with self._lock:
            entry = self._entry(chain)
            found = None if entry is None else entry.by_signature.get(signature)
        if found is not None:
            return found
        found = measure_costs(chain, input, unpack)
        with self._lock:
            entry = self._entry(chain, create=True)
            if entry is not None:
                entry.by_signature.pop(signature, None)  # the newest last
                entry.by_signature[signature] = found
                while len(entry.by_signature) > _SIGNATURES_PER_CHAIN:
                    del entry.by_signature[next(iter(entry.by_signature))]
        return found

    def _entry(self, chain: list[Any], create: bool = False) -> _Chain | None:
        try:
            entry = self._chains.get(chain[0])
            if (entry is None or not entry.is_for(chain)) and create:
                rest = tuple(weakref.ref(function) for function in chain[1:])
                entry = self._chains[chain[0]] = _Chain(rest, {})
        except TypeError:  # not weakly referable, or not hashable
            return None
        return entry if entry is not None and entry.is_for(chain) else None


_MEASURED: Final = _MeasuredCosts()


# --- the profiling pass -------------------------------------------------------------------------

_StorageKey = tuple[StorageKey | None, int]  # where, and its bytes (0 where it has no key)


def _key(tensor: torch.Tensor) -> _StorageKey:
    return storage_key(tensor), storage_nbytes(tensor)


def _bytes_of(tensors: Iterator[torch.Tensor], leave_out: set[_StorageKey]) -> int:
    storages = {_key(t) for t in tensors} - leave_out
    return sum(size for _, size in storages)


def measure_costs(chain: list[Any], input: Any, unpack: bool) -> tuple[tuple[LayerCost, ...], int]:
    """Each function's ``LayerCost`` from one forward pass, and the input's bytes.

    Each function runs on a detached copy of its input (floating tensors requiring grad), so
    only one function's saved tensors are alive at a time; what it saves is seen by a
    saved-tensors hook, by storage (parameters and buffers left out); what its ops allocate is
    seen by a dispatch mode. The modules are left as found, as the planner's profile leaves its
    model (NOTE [Planner measure], Rule M7: buffers such as BatchNorm's statistics, ``.grad``, the
    RNG streams); side effects of plain functions on other state are not undone.
    """
    modules = [f for f in chain if isinstance(f, torch.nn.Module)]
    params = {_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}
    args = _Runner.args_of(input, unpack)
    input_bytes = _bytes_of(tensors(args), params)
    costs = []
    # Grad on (and inference mode off) whatever the caller's modes: a forward that records.
    with untouched(modules, list(tensors(args))), torch.enable_grad(), torch.inference_mode(False):
        for function in chain:
            args = tuple(_detached(item) for item in args)
            saved: set[_StorageKey] = set()

            def pack(tensor: torch.Tensor, saved: set[_StorageKey] = saved) -> torch.Tensor:
                saved.add(_key(tensor))
                return tensor.detach()  # kept alive by the graph until the next function

            allocations = _Allocations()
            with saved_tensors_hooks(pack, _unpack), allocations:
                started = time.perf_counter()
                result = function(*args)
                seconds = time.perf_counter() - started
            inputs = {_key(t) for t in tensors(args)}
            outputs = {_key(t) for t in tensors(result)}
            temporary = allocations.storages - inputs - outputs - saved - params
            costs.append(
                LayerCost(
                    time=seconds,
                    output_bytes=_bytes_of(tensors(result), params),
                    saved_bytes=sum(size for _, size in saved - inputs - outputs - params),
                    keeps_input=bool(saved & inputs),
                    keeps_output=bool(saved & outputs),
                    temporary_bytes=sum(size for _, size in temporary),
                )
            )
            args = _Runner.args_of(result, unpack)
    return tuple(costs), input_bytes


class _Allocations(_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Collects the storages of every op's tensor outputs (what a function allocates)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.storages: set[_StorageKey] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self.storages.add(_key(item))
        return out


def _detached(item: Any) -> Any:
    if not isinstance(item, torch.Tensor):
        return item
    return item.detach().requires_grad_(item.is_floating_point() or item.is_complex())


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# --- running a schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Runner:
    """Runs segments of ``chain``: plainly, or in (nested) ``checkpoint`` calls."""

    chain: list[Any]
    unpack: bool
    options: dict[str, Any]

    @staticmethod
    def args_of(value: Any, unpack: bool) -> tuple[Any, ...]:
        """The positional arguments the next function gets from ``value``."""
        return value if unpack and isinstance(value, tuple) else (value,)

    def first_args(self, input: Any) -> tuple[Any, ...]:
        """The first function's arguments."""
        return self.args_of(input, self.unpack)

    def run(self, segments: tuple[Segment, ...], args: tuple[Any, ...], nested: bool) -> Any:
        """Run ``segments`` in order on ``args``; the last function's result."""
        result: Any = None
        for segment in segments:
            function = self._segment_function(segment)
            if segment.checkpointed and self._checkpoints(nested):
                result = checkpoint(function, *args, **self.options)
            else:
                result = function(*args)
            args = self.args_of(result, self.unpack)
        return result

    def _checkpoints(self, nested: bool) -> bool:
        # A reentrant checkpoint's forward runs under no_grad, where a nested one has nothing
        # to save (and would warn that no input requires grad): run it plainly there. Nesting
        # comes only from our strategies, so use_reentrant is a bool (NOTE [Torch's path], Rule 1).
        return not nested or not self.options["use_reentrant"] or torch.is_grad_enabled()

    def _segment_function(self, segment: Segment) -> Callable[..., Any]:
        if segment.children:

            def nested(*args: Any) -> Any:
                return self.run(segment.children, args, nested=True)

            return nested

        def forward(*args: Any) -> Any:
            result: Any = None
            for j in segment.layers():
                result = self.chain[j](*args)
                args = self.args_of(result, self.unpack)
            return result

        return forward
