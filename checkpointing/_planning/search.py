"""``plan_checkpointing``: the planner's front door, the search for a plan.

Owns choosing the regions, profiling the step once (``profiled``: a ``Profiled`` step plans at
any number of budgets, NOTE [Budget sweep]), reading each budget against the floor, asking the
solver with each span variant (Rules M11 and M13) and keeping the cheapest that fits; with
``timing_steps``, the candidates the least sure prices draw, timed on the model (Rule M12), and
rank 0's choice on every rank. ``plan_checkpointing`` reads as those steps, each a function
below. Checking the arguments belongs to ``arguments``; ``plan_sweep`` to ``sweep``.
Recording the step belongs to ``measure`` (``profile``), the prices to ``measure.costs``,
deciding to ``solve`` (``solver``), the plan object and installing it to ``apply`` (``plan``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Final

import torch
from torch import nn

from .._module import is_module_checkpointed
from .apply.plan import ActivationPlan
from .arguments import check_arguments, device_costs, planned_by_shapes, refuse_planned_or_static
from .measure.costs import DeviceCosts, costs_for
from .measure.profile import StepProfile, profile_step, tail_regions
from .measure.recorded_spans import SpanCost, SpanProfile, span_problems
from .measure.shapes import shape_step
from .measure.trials import time_plans
from .solve.offload_choice import offloads
from .solve.problem import (
    Choice,
    Objective,
    ObjectiveName,
    Problem,
    Solution,
    recompute_cost,
    recompute_flops,
    recompute_seconds,
)
from .solve.solver import baseline_bytes, floor_bytes, solve

__all__ = ["find_regions", "plan_checkpointing", "rank_zeros"]

_log = logging.getLogger("checkpointing.planner")

# Rule S9: whether plans may join regions into one frame (``ActivationPlan.apply`` installs each
# run of joined regions as one ``checkpoint_chain``); tests that pin another mechanism the joins
# would outbid (trails, Rule M13) turn it off.
JOINS = True

_MSG_BELOW_FLOOR = (
    "checkpointing.{api}: budget {budget:,} bytes is below the smallest reachable "
    "{floor:,} bytes ({share:.1%} of the {baseline:,} bytes kept without checkpointing: every "
    "region checkpointed, keeping only its inputs and RNG states, and what runs outside the "
    "regions). Fix: give a budget of at least {floor:,} bytes, or choose regions that split the "
    "model finer (regions=...) so that less is kept at their boundaries."
)
_MSG_NO_REGIONS = (
    "checkpointing.{api}: found no regions in {type_name}: {why}. Fix: pass "
    "regions=lambda module: isinstance(module, MyBlock) naming the blocks to checkpoint."
)
_MSG_REGIONS_TYPE = (
    "checkpointing.{api}: regions must be None or a predicate "
    "(module) -> bool, got {got!r}. Fix: e.g. regions=lambda m: isinstance(m, MyBlock)."
)
_MSG_CHECKPOINTED = (
    "checkpointing.{api}: region {name!r} is already checkpointed, so profiling "
    "would not see what it saves. Fix: checkpointing.remove_checkpoint_module(module) before "
    "planning again."
)


def plan_checkpointing(
    model: nn.Module,
    example_inputs: Any,
    *,
    budget: float | int,
    regions: Callable[[nn.Module], bool] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    host_budget: int | None = None,
    objective: ObjectiveName = "time",
    timing_steps: int = 0,
    device: str | DeviceCosts | None = None,
) -> ActivationPlan:
    """Choose what to checkpoint so that the activations kept for backward fit ``budget``.

    Records one real forward+backward step of ``model`` on the example inputs (after one
    forward that finds the modules after the blocks, or warms the model up), with grad enabled
    also under ``no_grad`` or ``inference_mode`` (the model, its buffers, ``.grad`` and the RNG
    states are left as they were), then chooses per region whether to checkpoint it and, inside
    checkpointed regions, which op outputs to keep, recompute or (with ``host_budget`` on an
    accelerator) offload, at the least predicted recompute cost. Nothing is installed until
    ``plan.apply(model)``.

    The plan is a function of the model (its structure, shapes and dtypes, and for models whose
    ops depend on values, such as a mixture of experts' routing, the values), the example
    inputs, the budget and the options: prices come from counted quantities (FLOPs, bytes,
    ops) and the cost model's constants per device class, never from a clock, so two calls
    give one plan, and so do the ranks of a job given the same inputs. Only
    ``timing_steps > 0`` times candidates on the model; then, where a default process group is
    initialized, every rank returns rank 0's choice (every rank must call). Progress is logged
    on the ``"checkpointing.planner"`` logger (level ``INFO``).

    Args:
        model: any ``nn.Module``; it must run without checkpointing while it is profiled.
        example_inputs: the positional arguments of one step (a tensor, or a tuple of them).
        budget: a float in (0, 1]: a fraction of the activation bytes the model keeps without
            checkpointing; or an int: bytes. Activation bytes are the storages autograd keeps
            for backward, each once, except the parameters, buffers and example inputs.
        regions: a predicate on submodules naming the regions (the outermost matches);
            default: the blocks of the model's longest ``nn.ModuleList``/``nn.Sequential``,
            and the modules called after the last block (a final norm, an LM head).
        example_kwargs: keyword arguments of one step.
        loss_fn: ``loss_fn(output) -> scalar``; default: the sum of the floating-point outputs.
        host_budget: bytes of host memory that offloaded outputs may use (accelerators only;
            on CPU, host memory is the device memory and nothing is offloaded).
        objective: ``"time"`` (default): the least predicted recompute time by the cost model
            (FLOPs at the device class's rate, bytes read and written at its bandwidth, a
            dispatch cost per op, and what a selective policy, a checkpointed region and a
            recorded span cost beyond their ops); ``"flops"``: the fewest recomputed FLOPs
            (matrix work, as torch's FLOP counter and the compiler count it), with predicted
            time breaking ties.
        timing_steps: 0 (default): the predicted plan. Above 0 (``objective="time"`` only
            matters then): where the cost model's least sure prices (the selective policy's
            per op, a checkpointed region's beyond its ops) moved give other plans, each is
            applied and timed on the model for at most this many interleaved steps (one leaves
            once clearly slower) and the fastest is returned; measured, so not deterministic.
        device: the device the plan is for, whose cost model prices it: None (default): the
            class of the device the model is on; a name (``"cpu"``, ``"a100-80gb"``,
            ``"h100-80gb"``, ``"h200"``); or a ``DeviceCosts``. The plan names it
            (``plan.costs``). With a model on the meta device or of fake tensors (or such
            inputs), nothing is allocated: the step runs on shapes (see "Planning for a device
            you do not have" in the docs), and an op that needs values (``.item()``,
            ``nonzero``) raises ``ValueError`` naming it.

    Returns:
        An ``ActivationPlan``: ``print(plan)``, ``plan.apply(model)``, ``plan.remove(model)``,
        ``plan.frontier()``, ``plan.to_json()``.

    Raises:
        TypeError: an argument of the wrong type (checked before anything runs).
        ValueError: the budget is below the smallest reachable bytes (the message names them).

    Example:
        >>> import torch, checkpointing
        >>> blocks = [torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
        ...                               torch.nn.Linear(64, 8)) for _ in range(4)]
        >>> model = torch.nn.Sequential(*blocks)
        >>> x = torch.randn(16, 8, requires_grad=True)
        >>> plan = checkpointing.plan_checkpointing(model, x, budget=0.5)
        >>> _ = plan.apply(model)
        >>> model(x).sum().backward()
        >>> _ = plan.remove(model)
    """
    step = profiled(
        "plan_checkpointing",
        model,
        example_inputs,
        [budget],
        regions,
        example_kwargs,
        loss_fn,
        host_budget,
        objective,
        timing_steps,
        device,
    )
    return step.plans([budget])[0]


def profiled(
    api: str,
    model: nn.Module,
    example_inputs: Any,
    budgets: list[float | int],
    regions: Callable[[nn.Module], bool] | None,
    example_kwargs: dict[str, Any] | None,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    host_budget: int | None,
    objective: ObjectiveName,
    timing_steps: int,
    device: str | DeviceCosts | None = None,
) -> Profiled:
    """The arguments checked (each of ``budgets``; ``api`` speaks in the messages), then the
    step profiled once, ready to be planned at any budget (``Profiled.plans``); on shapes where
    the model or the inputs are on the meta device or fake (NOTE [Planning without memory])."""
    for budget in budgets:
        check_arguments(
            model, budget, example_kwargs, loss_fn, host_budget, objective, timing_steps, api
        )
    costs = device_costs(device, api)
    refuse_planned_or_static(model, api)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    shapes = planned_by_shapes(model, args, kwargs, timing_steps, api)
    started = time.perf_counter()
    steps = shape_step(model, args, kwargs) if shapes else contextlib.nullcontext((args, kwargs))
    with steps as (step_args, step_kwargs):
        named, tail = _regions_and_tail(model, regions, step_args, step_kwargs, api, shapes)
        profile = profile_step(
            model,
            named,
            step_args,
            step_kwargs,
            loss_fn,
            tail=tail,
            warmed=regions is None,
            costs=costs,
            shapes=shapes,
        )
    measured = _Measured.of(profile, objective, len(named), tail, regions is None, costs)
    variants = _variants(measured, 1.0, 1.0)
    _log.info(
        "profiled in %.1f s: %d ops in %d regions; solving %d variants",
        time.perf_counter() - started,
        sum(len(region.ops) for region in profile.regions),
        len(profile.regions),
        len(variants),
    )
    baseline, floor = _baseline_and_floor([problem for _, problem, _ in variants])
    options = _Options(api, args, kwargs, loss_fn, host_budget, objective, timing_steps)
    return Profiled(model, options, measured, variants, (baseline, floor), started)


@dataclass(frozen=True)
class _Options:
    """What a ``Profiled`` step plans with besides the budget: the caller's name for the
    messages, the step's inputs and loss (for the timed race) and the options."""

    api: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor] | None
    host_budget: int | None
    objective: ObjectiveName
    timing_steps: int


@dataclass(frozen=True)
class Profiled:
    """One profiled step, planned at any number of budgets without running the model again
    (but for the timed race, ``timing_steps``): each plan is the one ``plan_checkpointing`` gives
    at that budget (the same solves of the same problems), bound to ``model``. ``ends``: the
    plain run's bytes and the floor."""

    model: nn.Module
    options: _Options
    measured: _Measured
    variants: list[_Variant]
    ends: tuple[int, int]
    started: float

    def plans(self, budgets: list[float | int]) -> list[ActivationPlan]:
        """The plan at each of ``budgets``, in their order; every budget is read against the
        floor (refused below it) before any is solved."""
        baseline, floor = self.ends
        limits = [_budget_bytes(b, baseline, floor, self.options.api) for b in budgets]
        return [self._plan(limit) for limit in limits]

    def _plan(self, budget_bytes: int) -> ActivationPlan:
        options = self.options
        candidates = _candidate_plans(
            self.measured,
            self.variants,
            budget_bytes,
            self.ends,
            options.host_budget,
            options.objective,
            options.timing_steps,
        )
        _log.info(
            "solved in %.1f s since the start: candidate plans %d, the first keeps %d of %d bytes",
            time.perf_counter() - self.started,
            len(candidates),
            candidates[0].kept_bytes,
            budget_bytes,
        )
        for candidate in candidates:  # NOTE [Planning without memory], Rule 4: prices named
            candidate.costs = self.measured.costs
        chosen = candidates[0]
        if options.timing_steps:  # Rule M12: opt-in, measured: the candidates timed on the model
            chosen = rank_zeros(
                _fastest(
                    self.model,
                    candidates,
                    options.args,
                    options.kwargs,
                    options.loss_fn,
                    options.timing_steps,
                )
            )
        chosen._model = weakref.ref(self.model)
        return chosen


def _regions_and_tail(
    model: nn.Module,
    regions: Callable[[nn.Module], bool] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    api: str,
    shapes: bool = False,
) -> tuple[list[tuple[str, nn.Module]], int]:
    """The regions (none already checkpointed) and, by default, the tail's modules after them
    (Rule M10: what runs after the blocks is a region too), with how many of them are the
    tail's."""
    named = find_regions(model, regions, api)
    for name, module in named:
        if is_module_checkpointed(module):
            raise ValueError(_MSG_CHECKPOINTED.format(api=api, name=name))
    _log.info(
        "planning %s: %d regions, one forward and one recorded step",
        type(model).__name__,
        len(named),
    )
    if regions is not None:
        return named, 0
    tail = [
        (name, module)
        for name, module in tail_regions(model, named, args, kwargs, shapes)
        if not is_module_checkpointed(module)
    ]
    return named + tail, len(tail)


@dataclass(frozen=True)
class _Measured:
    """What the search reads off the profiled step: the step, its device class's prices, the
    objective's weights (one weighing for every variant: costs compare), the step cut at its
    trails (Rule M13; None: none, or a ``regions`` predicate) and where the tail's regions are
    (Rule M11). ``spans``: whether recorded spans may be offered (not with a predicate)."""

    profile: StepProfile
    costs: DeviceCosts
    weights: Objective
    trailed: tuple[StepProfile, list[SpanProfile]] | None
    ends: range
    spans: bool

    @classmethod
    def of(
        cls,
        profile: StepProfile,
        objective: ObjectiveName,
        regions: int,
        tail: int,
        spans: bool,
        costs: DeviceCosts | None = None,
    ) -> _Measured:
        trailed = profile.trailed() if spans else None
        ends = range(regions - tail, regions)
        costs = costs_for(profile.device) if costs is None else costs
        return cls(profile, costs, profile.objective(objective), trailed, ends, spans)


def _variants(
    measured: _Measured, scale: float, frame: float, joins: bool | None = None
) -> list[_Variant]:
    """The problem and its span variants (Rules M11 and M13), those without trails first, with
    the selective policy's per-op cost scaled by ``scale`` and what a checkpointed region costs
    beyond its ops by ``frame`` (Rule M12: 1 and 1 but for the timed candidates); ``joins``:
    whether regions may be joined (Rule S9; default ``JOINS``)."""
    profile, costs = measured.profile, measured.costs
    joins = JOINS if joins is None else joins
    policy = costs.policy_seconds_per_op * scale

    def charged(step: StepProfile) -> Problem:
        base = step.problem(policy, measured.weights)
        per_op = costs.frame_seconds_per_op * frame
        pairs = zip(base.regions, step.regions, strict=True)
        framed = tuple(
            replace(
                r,
                frame_seconds=per_op * p.stop * p.calls,
                rest_frame_seconds=per_op * (len(p.ops) - p.stop) * p.calls,  # Rule S9
                joinable=r.joinable and joins,
            )
            for r, p in pairs
        )
        return replace(base, regions=framed)

    if not measured.spans:
        return [((), charged(profile), profile)]
    late, call = frozenset(profile.late), costs.span_call_seconds
    found: list[_Variant] = [
        (span_costs, problem, profile)
        for span_costs, problem in span_problems(
            charged(profile), profile.spans, measured.ends, policy, late, call_seconds=call
        )
    ]
    if measured.trailed is not None:
        step, trails = measured.trailed
        found += [
            (span_costs, problem, step)
            for span_costs, problem in span_problems(
                charged(step), profile.spans, measured.ends, policy, late, trails, call
            )
        ]
    return found


def _baseline_and_floor(problems: list[Problem]) -> tuple[int, int]:
    """The plain run's bytes (the first problem's: no span recorded) and the fewest any variant
    can keep (Rule M11: the lowest floor), read off the problems."""
    return baseline_bytes(problems[0]), min(floor_bytes(problem) for problem in problems)


def _budget_bytes(budget: float | int, baseline: int, floor: int, api: str) -> int:
    """The budget in bytes (a float is a share of ``baseline``), refused below ``floor``."""
    budget_bytes = int(budget * baseline) if isinstance(budget, float) else budget
    if budget_bytes < floor:
        share = floor / max(baseline, 1)
        found = {"budget": budget_bytes, "floor": floor, "baseline": baseline, "share": share}
        raise ValueError(_MSG_BELOW_FLOOR.format(api=api, **found))
    return budget_bytes


def _candidate_plans(
    measured: _Measured,
    variants: list[_Variant],
    budget: int,
    ends: tuple[int, int],
    host_budget: int | None,
    objective: str,
    timing_steps: int,
) -> list[ActivationPlan]:
    """The distinct plans that fit ``budget``: the cost model's own first, then (Rule M12, with
    ``timing_steps``) those the least sure prices moved draw, and (Rule M13) the cheapest without
    trails; each priced by the model whatever drew it, with the plain run's bytes and the floor
    (``ends``) and the trade-off curve over every variant (Rule M11)."""
    solved = [solve(problem, budget) for _, problem, _ in variants]
    frontier = _pareto_front([point for s in solved for point in s.frontier])
    plans: dict[tuple[int, tuple[Choice, ...]], ActivationPlan] = {}
    for index, found in _drawn(measured, variants, solved, budget, timing_steps):
        if (index, found.choices) in plans or found.kept_bytes > budget:
            continue  # drawn before, or (without trails, below their floor) over the budget
        spans, problem, step = variants[index]  # Rule M12: priced by the model, whatever drew it
        solution = replace(  # Rule M11: the plan's ends and trade-off over all variants
            found,
            recompute_seconds=recompute_seconds(problem, found.choices),
            recompute_flops=recompute_flops(problem, found.choices),
            floor_bytes=ends[1],
            baseline_bytes=ends[0],
            frontier=frontier,
        )
        # Rule S2: nothing on CPU, where host memory is the device memory.
        offload = (
            [frozenset[int]()] * len(problem.regions)
            if host_budget is None or measured.profile.device.startswith("cpu")
            else offloads(problem, solution, host_budget)
        )
        plans[(index, found.choices)] = ActivationPlan._from_solution(
            step, problem, solution, budget, offload, objective, spans
        )
    return list(plans.values())


def _drawn(
    measured: _Measured,
    variants: list[_Variant],
    solved: list[Solution],
    budget: int,
    timing_steps: int,
) -> Iterator[tuple[int, Solution]]:
    """The cheapest variant's index (into ``variants``) and answer at the cost model's own prices
    (``solved`` already), then (Rule M12, with ``timing_steps``) at each of ``_PERTURBED``, and
    (Rule M13) without trails where the step has some."""
    yield _cheapest_of([problem for _, problem, _ in variants], solved, budget)
    if not timing_steps:
        return
    draws = [(scale, frame, True) for scale, frame in _PERTURBED]
    if measured.trailed is not None:
        draws.append((1.0, 1.0, False))  # Rule M13: trails' machinery timed against none
    for scale, frame, trails in draws:
        drawn = _variants(measured, scale, frame)  # those without trails first: indices agree
        yield _cheapest(
            [problem for _, problem, step in drawn if trails or step is measured.profile], budget
        )


def _fastest(
    model: nn.Module,
    candidates: list[ActivationPlan],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    timing_steps: int,
) -> ActivationPlan:
    """Rule M12: the candidate the model runs fastest, with the timings (alone: itself)."""
    if len(candidates) == 1:
        return candidates[0]
    _log.info("timing %d candidate plans, at most %d rounds", len(candidates), timing_steps)
    relative = time_plans(model, candidates, args, kwargs, loss_fn, timing_steps)
    fastest = relative.index(min(relative))
    chosen = candidates[fastest]
    chosen.timed = (relative[fastest], *relative[:fastest], *relative[fastest + 1 :])
    return chosen


def rank_zeros(plan: ActivationPlan) -> ActivationPlan:
    """Where a default process group is initialized, rank 0's plan on every rank: one job trains
    one plan. The timed race's choice (Rule M12: measured times differ between ranks) and the
    first-step planning's plan (NOTE [Budget at the first step], Rule 3) both go through here."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return plan
    shared: list[Any] = [(plan.to_json(), plan.timed)]
    torch.distributed.broadcast_object_list(shared, src=0)
    if torch.distributed.get_rank() == 0:
        return plan
    text, timed = shared[0]
    agreed = ActivationPlan.from_json(text)
    agreed.timed = tuple(timed)
    return agreed


# A problem to solve: the spans it records (Rules M11 and M13), and the profile it was made of.
_Variant = tuple[tuple[SpanCost, ...], Problem, StepProfile]


def _cheapest(problems: list[Problem], budget: int) -> tuple[int, Solution]:
    """Rule M11: the index of the variant whose solution fits ``budget`` at the least cost (the
    fewest recorded spans on a tie: they are listed first), and that solution; where none
    fits, the fewest bytes."""
    return _cheapest_of(problems, [solve(problem, budget) for problem in problems], budget)


def _cheapest_of(
    problems: list[Problem], solutions: list[Solution], budget: int
) -> tuple[int, Solution]:
    """``_cheapest`` of the problems solved already (``solutions``, in their order)."""
    solved = list(enumerate(solutions))
    fitting = [v for v in solved if v[1].kept_bytes <= budget]
    if not fitting:
        return min(solved, key=lambda v: v[1].kept_bytes)
    return min(fitting, key=lambda v: recompute_cost(problems[v[0]], v[1].choices))


def _pareto_front(points: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """The (bytes, seconds) points no other beats on both, most bytes first."""
    kept: list[tuple[int, float]] = []
    for point in sorted(points):
        if not kept or point[1] < kept[-1][1]:
            kept.append(point)
    return tuple(reversed(kept))


# Rule M12 (timing_steps > 0 only): (scale of the selective policy's per-op cost, scale of what a
# checkpointed region costs beyond its ops) of the prices that draw the timed candidate plans
# besides the cost model's own (1, 1).
_PERTURBED: Final = ((0.5, 1.0), (2.0, 1.0), (1.0, 0.0), (0.5, 2.0))


def find_regions(
    model: nn.Module,
    predicate: Callable[[nn.Module], bool] | None,
    api: str = "plan_checkpointing",
) -> list[tuple[str, nn.Module]]:
    """The regions, outermost matches of ``predicate`` (default: the longest container's
    blocks), in the model's module order, with their qualified names (``api`` speaks in the
    messages)."""
    if predicate is None:
        containers = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) > 0
        ]
        if not containers:
            raise ValueError(
                _MSG_NO_REGIONS.format(
                    api=api,
                    type_name=type(model).__name__,
                    why="it has no nn.ModuleList or nn.Sequential",
                )
            )
        name, container = max(containers, key=lambda c: len(c[1]))  # the first longest
        prefix = f"{name}." if name else ""
        return [(f"{prefix}{child}", m) for child, m in container.named_children()]
    if not callable(predicate):
        raise TypeError(_MSG_REGIONS_TYPE.format(api=api, got=predicate))
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found)
        if not inside and predicate(module):
            found.append((name, module))
    if not found:
        raise ValueError(
            _MSG_NO_REGIONS.format(
                api=api, type_name=type(model).__name__, why="the predicate matched none"
            )
        )
    return found


# What a planned region answers for one op call: torch's answers, or ours (Rule S8).
