"""``plan_checkpointing`` and ``ActivationPlan``: the planner's front door and its result.

Owns choosing the regions, reading the budget, turning the solver's answer into per-region
decisions keyed by op name and occurrence (Rule 3), installing them with ``checkpoint_module``
and a selective policy per region (Rule 11), all or nothing, with a picklable input-shape
check on the model (Rule 12); removing them, and printing them. Profiling belongs to
``profile``, deciding (offload included) to ``solver``, the JSON text to ``plan_json``; the
checkpoint mechanics to ``_module`` and ``_selective``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

import torch
from torch import nn

from .. import _compat
from .._errors import describe_value
from .._module import checkpoint_module, end_at, is_module_checkpointed, remove_checkpoint_module
from .._selective import (
    SKIP_IN_REPLAY,
    CheckpointPolicy,
    Op,
    ReplayAnswer,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)
from .._state import noop_context_fn
from .._units import format_bytes
from . import plan_json
from .draws import draw_contexts
from .installed import Installed, ShapeCheck, carries, new_mark, take_off
from .peak import predicted_peak
from .profile import ObjectiveName, StepProfile, profile_step, tail_regions
from .solver import (
    Choice,
    Problem,
    Solution,
    kept_storages,
    offloads,
    recompute_cost,
    recompute_flops,
    recompute_seconds,
    region_recompute,
    skipped,
    solve,
)
from .spans import SpanCost, SpanHooks, SpanKind, span_call_seconds, span_problems
from .trials import time_plans

__all__ = ["ActivationPlan", "RegionDecision", "SpanDecision", "plan_checkpointing"]


Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class RegionDecision:
    """What the plan does with one region (a submodule, by its qualified name)."""

    name: str
    type_name: str
    checkpoint: bool
    save: tuple[Key, ...] = ()
    """Outputs kept from the forward: (op, occurrence index within one call of the region)."""
    offload: tuple[Key, ...] = ()
    """Outputs moved to host memory in forward and back for recompute."""
    ops: int = 0
    kept_bytes: int = 0
    recompute_ms: float = 0.0
    recompute_flops: int = 0
    keep_draws: bool = False
    """Keep the outputs of all of the region's random ops; recompute draws nothing (Rule 19)."""
    skip: tuple[Key, ...] = ()
    """Ops the replay skips, handing out blanks: nothing backward needs reads their outputs
    (Rule 21)."""

    def describe(self) -> str:
        """The decision in words, for the table."""
        if not self.checkpoint:
            return "keep (no checkpoint)"
        if self.save:
            parts = [f"save {len(self.save)}/{self.ops} ops"]
        else:
            parts = ["recompute" if self.skip else "recompute all"]
        if self.skip:
            count = len(self.skip)
            parts.append(f"skips {count} op{'s' if count > 1 else ''} in replay")
        if self.keep_draws:
            parts.append("keep draws")
        if self.offload:
            parts.append(f"offload {len(self.offload)}")
        return "checkpoint, " + ", ".join(parts)


@dataclass(frozen=True, slots=True)
class SpanDecision:
    """Code around the blocks that the plan records and recomputes in backward (Rule 22): the
    ``"head"`` from the model's start to the start of module ``last`` (``first`` is ``""``, the
    model), or the ``"tail"`` from the start of module ``first`` to the end of module ``last``;
    or a ``"trail"``: module ``last``, the child region ``first`` calls last, whose frame ends
    where it starts (Rule 24)."""

    kind: SpanKind
    first: str
    last: str
    recompute_ms: float = 0.0
    recompute_flops: int = 0

    def describe(self) -> str:
        """Where it starts and ends, for the table."""
        if self.kind == "head":
            return f"head: the model's start to {self.last}'s, recorded and recomputed"
        if self.kind == "trail":
            return f"trail: {self.last}, recorded and recomputed ({self.first} ends before it)"
        return f"tail: {self.first}'s start to {self.last}'s end, recorded and recomputed"


_MSG_SPAN = (
    "checkpointing.ActivationPlan.apply: the plan records a span ({kind!r}) bounded by module "
    "{name!r}, which the model does not have (or the kind is not 'head', 'tail' or 'trail'). Fix: "
    "apply the plan to the model it was made for, or plan this model again."
)
_MSG_BUDGET_TYPE = (
    "checkpointing.plan_checkpointing: budget must be a float in (0, 1] (a fraction of the "
    "activation bytes the model keeps without checkpointing) or an int (bytes), got {got!r}. "
    "Fix: e.g. budget=0.5 or budget=2 * 1024**3."
)
_MSG_HOST_BUDGET = (
    "checkpointing.plan_checkpointing: host_budget must be None or an int >= 0 (bytes of host "
    "memory offloaded activations may use), got {got}. Fix: e.g. host_budget=8 * 1024**3."
)
_MSG_TIMING_STEPS = (
    "checkpointing.plan_checkpointing: timing_steps must be an int >= 0 (the most steps each "
    "candidate plan is timed for), got {got}. Fix: e.g. timing_steps=24 (the default), or "
    "timing_steps=0 to take the predicted plan untimed."
)
_MSG_OBJECTIVE = (
    "checkpointing.plan_checkpointing: objective must be one of {allowed}, got {got}. Fix: "
    "objective='time' (least predicted recompute time, the default) or objective='flops' "
    "(fewest recomputed FLOPs, as torch.compile's partitioner counts them)."
)
_MSG_MODEL_TYPE = (
    "checkpointing.plan_checkpointing: model must be an nn.Module (its submodules are the "
    "regions), got {got}. Fix: pass the model itself, e.g. plan_checkpointing(model, x, "
    "budget=0.5); wrap a plain function in an nn.Module first."
)
_MSG_KWARGS_TYPE = (
    "checkpointing.plan_checkpointing: example_kwargs must be None or a dict of the step's "
    "keyword arguments by name, got {got}. Fix: pass positional inputs as example_inputs (a "
    "tensor, or a tuple of them) and named ones as example_kwargs={{'attention_mask': mask}}."
)
_MSG_LOSS_FN_TYPE = (
    "checkpointing.plan_checkpointing: loss_fn must be None or a callable loss_fn(output) -> "
    "scalar tensor, got {got}. Fix: e.g. loss_fn=lambda output: output.logits.float().mean(), "
    "or leave it out to backward the sum of the floating-point outputs."
)
_MSG_BELOW_FLOOR = (
    "checkpointing.plan_checkpointing: budget {budget:,} bytes is below the smallest reachable "
    "{floor:,} bytes ({share:.1%} of the {baseline:,} bytes kept without checkpointing: every "
    "region checkpointed, keeping only its inputs and RNG states, and what runs outside the "
    "regions). Fix: give a budget of at least {floor:,} bytes, or choose regions that split the "
    "model finer (regions=...) so that less is kept at their boundaries."
)
_MSG_NO_REGIONS = (
    "checkpointing.plan_checkpointing: found no regions in {type_name}: {why}. Fix: pass "
    "regions=lambda module: isinstance(module, MyBlock) naming the blocks to checkpoint."
)
_MSG_REGIONS_TYPE = (
    "checkpointing.plan_checkpointing: regions must be None or a predicate "
    "(module) -> bool, got {got!r}. Fix: e.g. regions=lambda m: isinstance(m, MyBlock)."
)
_MSG_CHECKPOINTED = (
    "checkpointing.plan_checkpointing: region {name!r} is already checkpointed, so profiling "
    "would not see what it saves. Fix: checkpointing.remove_checkpoint_module(module) before "
    "planning again."
)
_MSG_PLANNED = (
    "checkpointing.plan_checkpointing: {where} carries the hooks of an applied ActivationPlan "
    "(a copy of a planned model, by copy.deepcopy or torch.save/load, carries them too), so "
    "profiling would measure the planned step, not the model's own. Fix: plan.remove(model) "
    "with that plan (or a pickled copy of it) before planning again."
)
_MSG_APPLIED_TWICE = (
    "checkpointing.ActivationPlan.apply: this plan is already applied to a model; applying it "
    "again would checkpoint its regions twice. Fix: call plan.remove(model) first."
)
_MSG_OTHER_MODEL = (
    "checkpointing.ActivationPlan.apply: this plan was profiled on another model object "
    "({expected}), not on the {observed} given. Its bytes and times describe that model. Fix: "
    "plan this one with plan_checkpointing(model, ...), or apply a copy of the decisions on "
    "purpose: ActivationPlan.from_json(plan.to_json()).apply(model)."
)
_MSG_STRUCTURE = (
    "checkpointing.ActivationPlan.apply: the model has no {type_name} named {name!r} (found "
    "{found}). The plan's regions must exist in the model under the same names. Fix: apply the "
    "plan to the model it was made for, or re-plan this one with plan_checkpointing."
)
_MSG_APPLY_MODEL_TYPE = (
    "checkpointing.ActivationPlan.apply: model must be an nn.Module, got {got}. Fix: pass the "
    "model the plan was made for, e.g. plan.apply(model)."
)
_MSG_NOT_APPLIED = (
    "checkpointing.ActivationPlan.remove: this plan is not applied to the {type_name} given, nor "
    "to a model it was copied from, so there is nothing to remove. Fix: remove it from the model "
    "passed to plan.apply(model), or a copy of that one."
)
_MSG_REGION_TAKEN = (
    "checkpointing.ActivationPlan.apply: region {name!r} is already checkpointed (by "
    "checkpoint_module or another plan). Fix: remove that checkpoint first."
)
_MSG_REGION_TWICE = (
    "checkpointing.ActivationPlan.apply: regions {first!r} and {second!r} are the same "
    "{type_name} module; checkpointing it twice would nest it inside itself. Nothing was "
    "installed. Fix: keep one decision per module in the plan."
)
_MSG_UNKNOWN_OP = (
    "checkpointing.ActivationPlan.from_json: unknown op {name!r} (expected a name like "
    "'aten.mm.default' that torch.ops resolves). Fix: load the plan with the torch version "
    "and custom-op libraries it was made with, or re-plan."
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
    timing_steps: int = 24,
) -> ActivationPlan:
    """Choose what to checkpoint so that the activations kept for backward fit ``budget``.

    Profiles a few real forward+backward steps of ``model`` on the example inputs, with grad
    enabled also under ``no_grad`` or ``inference_mode`` (the model, its buffers, ``.grad`` and
    the RNG states are left as they were), then chooses per region whether to checkpoint it
    and, inside checkpointed regions, which op outputs to keep, recompute or (with
    ``host_budget`` on an accelerator) offload, at the least predicted recompute time; with
    ``objective="time"``, where the prediction's least sure prices moved give other plans, the
    fastest of them timed on the model. Nothing is installed until ``plan.apply(model)``.

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
        objective: ``"time"`` (default): the least predicted recompute time, measured per op,
            with FLOPs breaking ties within the profile's noise; ``"flops"``: the fewest
            recomputed FLOPs (matrix work, as torch's FLOP counter and the compiler count
            it), with time breaking ties.
        timing_steps: with ``objective="time"``, where the prediction's least sure prices (the
            selective policy's cost per op, what a checkpointed region costs beyond its ops)
            moved give other plans, each is applied and timed on the model for at most this
            many interleaved steps (one leaves once clearly slower) and the fastest is
            returned; 0: the predicted plan, untimed.

    Returns:
        An ``ActivationPlan``: ``print(plan)``, ``plan.apply(model)``, ``plan.remove(model)``,
        ``plan.frontier()``, ``plan.to_json()``.

    Raises:
        TypeError: an argument of the wrong type (checked before anything runs).
        ValueError: the budget is below the smallest reachable bytes (the message names them).

    Example:
        >>> import torch, checkpointing
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8),
        ...                               torch.nn.Tanh()) for _ in range(4)])
        >>> x = torch.randn(16, 8, requires_grad=True)
        >>> plan = checkpointing.plan_checkpointing(model, x, budget=0.75)
        >>> _ = plan.apply(model)
        >>> model(x).sum().backward()
        >>> _ = plan.remove(model)
    """
    _check_arguments(model, budget, example_kwargs, loss_fn, host_budget, objective, timing_steps)
    planned = carries(model)  # NOTE [Installed plan], Rule 2
    if planned is not None:
        where = f"module {planned!r} of the model" if planned else "the model"
        raise ValueError(_MSG_PLANNED.format(where=where))
    named = find_regions(model, regions)
    for name, module in named:
        if is_module_checkpointed(module):
            raise ValueError(_MSG_CHECKPOINTED.format(name=name))
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    tail: list[tuple[str, nn.Module]] = []
    if regions is None:  # Rule 20: what runs after the blocks is a region too
        tail = [
            (name, module)
            for name, module in tail_regions(model, named, args, kwargs)
            if not is_module_checkpointed(module)
        ]
        named += tail
    profile = profile_step(model, named, args, kwargs, loss_fn, _RegionContexts({}), tail=len(tail))
    forward = [sum(op.seconds for op in r.ops) * r.calls for r in profile.regions]
    weights = profile.objective(objective)  # one weighing for every variant: costs compare
    trailed = profile.trailed() if regions is None else None  # Rule 24

    def variants_at(scale: float, frame: float) -> list[_Variant]:
        """The problem and its span variants (Rules 22 and 24) with the selective policy's
        per-op cost scaled by ``scale`` and ``frame`` of a region's forward time charged for
        checkpointing it (Rule 23)."""
        policy = profile.policy_seconds_per_op * scale

        def base_of(step: StepProfile) -> Problem:
            base = step.problem(policy, weights)
            if frame:
                charged = zip(base.regions, forward, strict=True)
                base = replace(
                    base, regions=tuple(replace(r, frame_seconds=frame * f) for r, f in charged)
                )
            return base

        if regions is not None:
            return [((), base_of(profile), profile)]
        ends = range(len(named) - len(tail), len(named))
        late = frozenset(profile.late)
        call = span_call_seconds()
        found = [
            (costs, problem, profile)
            for costs, problem in span_problems(
                base_of(profile), profile.spans, ends, policy, late, call_seconds=call
            )
        ]
        if trailed is not None:
            step, trails = trailed
            found += [
                (costs, problem, step)
                for costs, problem in span_problems(
                    base_of(step), profile.spans, ends, policy, late, trails, call
                )
            ]
        return found

    variants = variants_at(1.0, 0.0)
    first = [solve(problem, 0) for _, problem, _ in variants]
    baseline, floor = first[0].baseline_bytes, min(f.floor_bytes for f in first)
    budget_bytes = int(budget * baseline) if isinstance(budget, float) else budget
    if budget_bytes < floor:
        raise ValueError(
            _MSG_BELOW_FLOOR.format(
                budget=budget_bytes, floor=floor, baseline=baseline, share=floor / max(baseline, 1)
            )
        )
    frontier = _pareto_front([p for f in first for p in f.frontier])
    perturbed = _PERTURBED if objective == "time" and timing_steps else ()
    plans: dict[tuple[int, tuple[Choice, ...]], ActivationPlan] = {}
    draws = [(1.0, 0.0, True), *((scale, frame, True) for scale, frame in perturbed)]
    if perturbed and trailed is not None:
        draws.append((1.0, 0.0, False))  # Rule 24: trails' machinery timed against none
    for scale, frame, trails in draws:
        drawn = variants_at(scale, frame)  # those without trails first: indices agree
        index, found = _cheapest(
            [problem for _, problem, step in drawn if trails or step is profile], budget_bytes
        )
        if (index, found.choices) in plans or found.kept_bytes > budget_bytes:
            continue  # drawn before, or (without trails, below their floor) over the budget
        spans, problem, step = variants[index]  # Rule 23: priced as measured, whatever drew it
        solution = replace(  # Rule 22: the plan's ends and trade-off over all variants
            found,
            recompute_seconds=recompute_seconds(problem, found.choices),
            recompute_flops=recompute_flops(problem, found.choices),
            floor_bytes=floor,
            baseline_bytes=baseline,
            frontier=frontier,
        )
        # Rule 10: nothing on CPU, where host memory is the device memory.
        offload = (
            [frozenset[int]()] * len(problem.regions)
            if host_budget is None or profile.device.startswith("cpu")
            else offloads(problem, solution, host_budget)
        )
        plans[(index, found.choices)] = ActivationPlan._from_solution(
            step, problem, solution, budget_bytes, offload, objective, spans
        )
    candidates = list(plans.values())
    chosen = candidates[0]
    if len(candidates) > 1:  # Rule 23: the prediction's least sure prices disagree: time them
        relative = time_plans(model, candidates, args, kwargs, loss_fn, timing_steps)
        fastest = relative.index(min(relative))
        chosen = candidates[fastest]
        chosen.timed = (relative[fastest], *relative[:fastest], *relative[fastest + 1 :])
    chosen._model = weakref.ref(model)
    return chosen


# A problem to solve: the spans it records (Rules 22 and 24), and the profile it was made of.
_Variant = tuple[tuple[SpanCost, ...], Problem, StepProfile]


def _cheapest(problems: list[Problem], budget: int) -> tuple[int, Solution]:
    """Rule 22: the index of the variant whose solution fits ``budget`` at the least cost (the
    fewest recorded spans on a tie: they are listed first), and that solution; where none
    fits, the fewest bytes."""
    solved = [(index, solve(problem, budget)) for index, problem in enumerate(problems)]
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


def _check_arguments(
    model: object,
    budget: object,
    example_kwargs: object,
    loss_fn: object,
    host_budget: object,
    objective: object,
    timing_steps: object = 0,
) -> None:
    """Every argument's type and range, before anything runs."""
    if not isinstance(objective, str) or objective not in _OBJECTIVES:
        raise ValueError(_MSG_OBJECTIVE.format(allowed=_OBJECTIVES, got=describe_value(objective)))
    if not isinstance(model, nn.Module):
        raise TypeError(_MSG_MODEL_TYPE.format(got=describe_value(model)))
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(_MSG_BUDGET_TYPE.format(got=budget))
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(_MSG_BUDGET_TYPE.format(got=budget))
    if isinstance(budget, int) and budget < 0:
        raise ValueError(_MSG_BUDGET_TYPE.format(got=budget))
    if example_kwargs is not None and (
        not isinstance(example_kwargs, Mapping)
        or not all(isinstance(name, str) for name in example_kwargs)
    ):
        raise TypeError(_MSG_KWARGS_TYPE.format(got=describe_value(example_kwargs)))
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(_MSG_LOSS_FN_TYPE.format(got=describe_value(loss_fn)))
    if host_budget is not None:
        if isinstance(host_budget, bool) or not isinstance(host_budget, int):
            raise TypeError(_MSG_HOST_BUDGET.format(got=describe_value(host_budget)))
        if host_budget < 0:
            raise ValueError(_MSG_HOST_BUDGET.format(got=host_budget))
    if isinstance(timing_steps, bool) or not isinstance(timing_steps, int):
        raise TypeError(_MSG_TIMING_STEPS.format(got=describe_value(timing_steps)))
    if timing_steps < 0:
        raise ValueError(_MSG_TIMING_STEPS.format(got=timing_steps))


_OBJECTIVES = ("time", "flops")
# Rule 23: (scale of the selective policy's per-op cost, share of a region's forward time
# charged for checkpointing it) of the prices that draw the candidate plans besides the measured.
_PERTURBED: Final = ((0.5, 0.0), (2.0, 0.0), (1.0, 0.25), (0.5, 0.25))


def find_regions(
    model: nn.Module, predicate: Callable[[nn.Module], bool] | None
) -> list[tuple[str, nn.Module]]:
    """The regions, outermost matches of ``predicate`` (default: the longest container's
    blocks), in the model's module order, with their qualified names."""
    if predicate is None:
        containers = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) > 0
        ]
        if not containers:
            raise ValueError(
                _MSG_NO_REGIONS.format(
                    type_name=type(model).__name__, why="it has no nn.ModuleList or nn.Sequential"
                )
            )
        name, container = max(containers, key=lambda c: len(c[1]))  # the first longest
        prefix = f"{name}." if name else ""
        return [(f"{prefix}{child}", m) for child, m in container.named_children()]
    if not callable(predicate):
        raise TypeError(_MSG_REGIONS_TYPE.format(got=predicate))
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found)
        if not inside and predicate(module):
            found.append((name, module))
    if not found:
        raise ValueError(
            _MSG_NO_REGIONS.format(type_name=type(model).__name__, why="the predicate matched none")
        )
    return found


# What a planned region answers for one op call: torch's answers, or ours (Rule 21).
Answer = CheckpointPolicy | ReplayAnswer


class _KeyedPolicy:
    """One region call's selective policy: the decision for each (op, occurrence) (Rule 3).
    A fresh one per call of the region, so occurrences count from 0 in every forward."""

    __slots__ = ("counts", "decisions")

    def __init__(self, decisions: dict[tuple[Op, int], Answer]) -> None:
        self.decisions = decisions
        self.counts: dict[Op, int] = {}

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> Answer:
        index = self.counts.get(op, 0)
        self.counts[op] = index + 1
        return self.decisions.get((op, index), CheckpointPolicy.PREFER_RECOMPUTE)


class _RegionContexts:
    """The ``context_fn`` of one planned region: SAC modes around a fresh ``_KeyedPolicy``
    (where it keeps, offloads or skips, Rule 21), over the draws modes where it keeps its
    random draws (Rule 19). Pickled with the model (``torch.save``) by op names: torch's op
    objects do not pickle."""

    __slots__ = ("decisions", "keep_draws")

    def __init__(
        self, decisions: dict[tuple[Op, int], Answer], *, keep_draws: bool = False
    ) -> None:
        self.decisions = decisions
        self.keep_draws = keep_draws

    def __call__(self) -> tuple[Any, Any]:
        if not self.keep_draws:
            return self._selective()
        return draw_contexts(self._selective() if self.decisions else None)

    def _selective(self) -> tuple[Any, Any]:
        policy = _KeyedPolicy(self.decisions)
        # The public ``Policy`` protocol names torch's answers only; the modes take ours too
        # (SKIP_IN_REPLAY, NOTE [Selective checkpoint cache], Rule 2).
        return create_selective_checkpoint_contexts(policy)  # type: ignore[arg-type]  # see above

    def __reduce__(self) -> tuple[Any, ...]:
        named = [(str(op), index, policy) for (op, index), policy in self.decisions.items()]
        return _region_contexts_by_name, (named, self.keep_draws)


def _region_contexts_by_name(
    named: list[tuple[str, int, Answer]], keep_draws: bool = False
) -> _RegionContexts:
    """A pickled ``_RegionContexts`` back, its ops resolved by name."""
    return _RegionContexts(
        {(resolve_op(op), index): policy for op, index, policy in named}, keep_draws=keep_draws
    )


_ShapeCheck = ShapeCheck  # the name models pickled with a plan applied (before issue 40) refer to


def resolve_op(name: str) -> Op:
    """The op named like ``aten.mm.default`` (what ``str(op)`` gives)."""
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.rpartition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        raise ValueError(_MSG_UNKNOWN_OP.format(name=name)) from None
    if not isinstance(op, _compat.OpOverload):
        raise ValueError(_MSG_UNKNOWN_OP.format(name=name))
    return op


class ActivationPlan:
    """What to checkpoint, save, recompute and offload to fit a memory budget.

    Made by ``checkpointing.plan_checkpointing`` (or ``ActivationPlan.from_json``). Install
    with ``apply(model)``, undo with ``remove(model)``; ``print(plan)`` shows per region the
    decision, kept bytes and predicted recompute time against the budget; ``frontier()`` gives
    the (kept bytes, recompute ms) trade-off from keeping everything to checkpointing all.

    Attributes:
        regions: one ``RegionDecision`` per region, in model order.
        budget_bytes, baseline_bytes, floor_bytes: the budget, the bytes kept without
            checkpointing, and the fewest bytes any plan keeps.
        kept_bytes, recompute_ms, recompute_flops: the plan's predicted kept bytes, recompute
            time and recomputed FLOPs (matrix work).
        peak_bytes: the predicted peak of the step's memory (forward and backward: kept
            activations, the region being recomputed, gradients), above what the model and
            inputs hold; 0 where the device's allocator cannot be read.
        step_ms: the profiled step's time (forward and backward, without checkpointing).
        timed: where ``plan_checkpointing`` timed candidate plans on the model (Rule 23), their
            step times relative to each other (per round over the round's mean, the median
            of the rounds), this plan's first; else empty (also after JSON).
        objective: what the plan minimizes, ``"time"`` or ``"flops"``.
        solver: ``"exact"``, or ``"grid"``: solved on a byte grid of ``grid_bytes``, as if
            each region's bytes were rounded up to it.
    """

    def __init__(
        self,
        *,
        regions: tuple[RegionDecision, ...],
        budget_bytes: int,
        baseline_bytes: int,
        floor_bytes: int,
        outside_bytes: int,
        kept_bytes: int,
        recompute_ms: float,
        step_ms: float,
        solver: str,
        grid_bytes: int,
        device: str,
        input_shapes: list[list[int]],
        frontier: list[tuple[int, float]],
        objective: str = "time",
        recompute_flops: int = 0,
        peak_bytes: int = 0,
        spans: tuple[SpanDecision, ...] = (),
    ) -> None:
        self.regions = regions
        self.spans = spans
        self.budget_bytes = budget_bytes
        self.baseline_bytes = baseline_bytes
        self.floor_bytes = floor_bytes
        self.outside_bytes = outside_bytes
        self.kept_bytes = kept_bytes
        self.recompute_ms = recompute_ms
        self.step_ms = step_ms
        self.solver = solver
        self.grid_bytes = grid_bytes
        self.objective = objective
        self.recompute_flops = recompute_flops
        self.peak_bytes = peak_bytes
        self.device = device
        self.input_shapes = input_shapes
        self._frontier = frontier
        self._model: weakref.ref[nn.Module] | None = None
        self._applied: Installed | None = None
        self._mark = new_mark()  # NOTE [Installed plan], Rule 1
        self.timed: tuple[float, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        """A plan pickles as data: the model it is bound or applied to stays behind."""
        return {**self.__dict__, "_model": None, "_applied": None}

    @classmethod
    def _from_solution(
        cls,
        profile: StepProfile,
        problem: Problem,
        solution: Solution,
        budget_bytes: int,
        offload: list[frozenset[int]],
        objective: str,
        span_costs: tuple[SpanCost, ...] = (),
    ) -> ActivationPlan:
        decisions = []
        for index, (region, choice) in enumerate(
            zip(profile.regions, solution.choices, strict=True)
        ):
            units = problem.regions[index].units
            moved = offload[index]
            kept = kept_storages(problem, index, choice) - problem.outside
            # Offloaded outputs are served like kept ones (with the policy installed for them).
            served = Choice(
                choice.checkpoint, choice.saved | moved, choice.draws, choice.skip or bool(moved)
            )
            recompute, flops = region_recompute(problem, index, served)
            decisions.append(
                RegionDecision(
                    name=region.name,
                    type_name=region.type_name,
                    checkpoint=choice.checkpoint,
                    save=tuple(units[i].key for i in sorted(choice.saved)),
                    offload=tuple(units[i].key for i in sorted(moved)),
                    ops=len(region.ops),
                    kept_bytes=sum(problem.storage_bytes[s] for s in kept),
                    recompute_ms=1e3 * recompute,
                    recompute_flops=flops,
                    keep_draws=choice.draws,
                    skip=skipped(problem, index, served),
                )
            )
        names = [r.name for r in profile.regions]
        spans = tuple(
            SpanDecision(
                cost.kind,
                "" if span.start < 0 else names[span.start],
                names[span.until],
                1e3 * cost.seconds,
                cost.flops,
            )
            for cost in span_costs
            for span in profile.spans
            if span.kind == cost.kind
        ) + tuple(  # Rule 24: a trail names its region and its child module
            SpanDecision("trail", names[c.region], c.module, 1e3 * c.seconds, c.flops)
            for c in span_costs
            if c.kind == "trail"
        )
        return cls(
            regions=tuple(decisions),
            spans=spans,
            budget_bytes=budget_bytes,
            baseline_bytes=solution.baseline_bytes,
            floor_bytes=solution.floor_bytes,
            outside_bytes=sum(problem.storage_bytes[s] for s in problem.outside),
            kept_bytes=solution.kept_bytes,
            recompute_ms=sum(d.recompute_ms for d in decisions)
            + sum(s.recompute_ms for s in spans),
            step_ms=1e3 * profile.step_seconds,
            solver=solution.method,
            grid_bytes=solution.grid_bytes,
            device=profile.device,
            input_shapes=profile.input_shapes,
            frontier=[(b, 1e3 * s) for b, s in solution.frontier],
            objective=objective,
            recompute_flops=sum(d.recompute_flops for d in decisions)
            + sum(s.recompute_flops for s in spans),
            peak_bytes=predicted_peak(problem, solution.choices),
        )

    # -- installing ---------------------------------------------------------------------------

    def apply(self, model: nn.Module) -> nn.Module:
        """Install the plan: ``checkpoint_module`` (non-reentrant, names and ``state_dict``
        keys untouched) on each checkpointed region, with a selective policy where it keeps or
        offloads outputs, and forward hooks that record its spans (Rule 22). Returns
        ``model``. All or nothing: raises ``ValueError``, with
        nothing installed, if the plan is applied already, was profiled on another model,
        names regions the model lacks or one module twice, or a region is checkpointed
        already; an applied model pickles (``torch.save``) like the model itself."""
        if not isinstance(model, nn.Module):
            raise TypeError(_MSG_APPLY_MODEL_TYPE.format(got=describe_value(model)))
        if self._applied is not None:
            raise ValueError(_MSG_APPLIED_TWICE)
        bound = None if self._model is None else self._model()
        if self._model is not None and bound is not model:
            raise ValueError(
                _MSG_OTHER_MODEL.format(
                    expected=_describe_model(bound), observed=_describe_model(model)
                )
            )
        chosen = self._regions_in(model)
        head, tail, trails = self._spans_in(model)
        installed: list[nn.Module] = []
        ends: list[torch.utils.hooks.RemovableHandle] = []
        try:  # all or nothing: what was installed goes again if a later step raises
            for module, context_fn in chosen:
                checkpoint_module(module, context_fn=context_fn)
                installed.append(module)
            for region, child in trails:  # Rule 24: before the trail's scope starts
                if is_module_checkpointed(region):
                    ends.append(end_at(region, child))
            check = ShapeCheck(self.input_shapes, self._mark)
            hook = model.register_forward_pre_hook(check, with_kwargs=True)
            spans = SpanHooks(model, head, tail, [child for _, child in trails], self._mark)
        except BaseException:
            for handle in ends:
                handle.remove()
            for module in installed:
                remove_checkpoint_module(module)
            raise
        self._applied = Installed(weakref.ref(model), installed, hook, spans, ends)
        self._model = weakref.ref(model)
        return model

    def _regions_in(self, model: nn.Module) -> list[tuple[nn.Module, Any]]:
        """The modules to checkpoint and their ``context_fn``s; every region is checked here,
        before ``apply`` installs anything."""
        modules = dict(model.named_modules())
        seen: dict[int, int] = {}
        chosen = []
        for index, region in enumerate(self.regions):
            module = modules.get(region.name)
            if module is None or type(module).__qualname__ != region.type_name:
                found = type(module).__qualname__ if module is not None else "nothing"
                raise ValueError(
                    _MSG_STRUCTURE.format(type_name=region.type_name, name=region.name, found=found)
                )
            first = seen.setdefault(id(module), index)
            if first != index:
                raise ValueError(
                    _MSG_REGION_TWICE.format(
                        first=self.regions[first].name,
                        second=region.name,
                        type_name=region.type_name,
                    )
                )
            if region.checkpoint:
                if is_module_checkpointed(module):
                    raise ValueError(_MSG_REGION_TAKEN.format(name=region.name))
                chosen.append((module, _context_fn(region)))
        return chosen

    def _spans_in(
        self, model: nn.Module
    ) -> tuple[
        nn.Module | None,
        tuple[nn.Module, nn.Module] | None,
        list[tuple[nn.Module, nn.Module]],
    ]:
        """Rule 22: the module whose start ends the head, and the tail's first and last
        modules, where the plan records them (checked by ``_regions_in``: they are regions);
        Rule 24: each trail's region and child module."""
        modules = dict(model.named_modules())
        for span in self.spans:
            for name in (span.first, span.last):
                if name not in modules or span.kind not in ("head", "tail", "trail"):
                    raise ValueError(_MSG_SPAN.format(kind=span.kind, name=name))
        head = next((modules[s.last] for s in self.spans if s.kind == "head"), None)
        tail = next(
            ((modules[s.first], modules[s.last]) for s in self.spans if s.kind == "tail"), None
        )
        trails = [(modules[s.first], modules[s.last]) for s in self.spans if s.kind == "trail"]
        return head, tail, trails

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo ``apply(model)``: the regions run plainly again. Returns ``model``; also a copy
        of it (``copy.deepcopy``, ``torch.save``/``load``), whose every hook of this plan goes.
        (Called during the model's forward it raises; the regions not yet removed stay, and a
        later ``remove`` finishes.)"""
        applied = self._applied
        if applied is not None and applied.model() is model:
            applied.remove()
            self._applied = None
        elif carries(model, self._mark) is not None:  # a copy: NOTE [Installed plan], Rule 1
            trails = [(s.first, s.last) for s in self.spans if s.kind == "trail"]
            take_off(model, self._mark, [r.name for r in self.regions if r.checkpoint], trails)
        else:
            raise ValueError(_MSG_NOT_APPLIED.format(type_name=type(model).__name__))
        return model

    # -- reading ------------------------------------------------------------------------------

    def frontier(self) -> list[tuple[int, float]]:
        """(predicted kept bytes, predicted recompute ms) along the trade-off, from keeping
        everything (no checkpoint, 0 ms) to checkpointing every region and keeping nothing."""
        return list(self._frontier)

    def table(self) -> str:
        """Per region: decision, kept bytes, recompute ms; then the totals and the budget."""
        width = max([len("(outside regions)"), *(len(r.name) for r in self.regions)])
        type_width = max([4, *(len(r.type_name) for r in self.regions)])
        decided = max([30, *(len(r.describe()) for r in self.regions)])
        header = (
            f"{'region':<{width}}  {'type':<{type_width}}  {'decision':<{decided}} "
            f"{'activations kept':>16} {'recompute ms':>13}"
        )
        lines = [
            f"ActivationPlan: {len(self.regions)} regions, budget "
            f"{format_bytes(self.budget_bytes)} "
            f"({self.budget_bytes / max(self.baseline_bytes, 1):.1%} of the "
            f"{format_bytes(self.baseline_bytes)} of activations kept without checkpointing)",
            header,
            "-" * len(header),
        ]
        for r in self.regions:
            lines.append(
                f"{r.name:<{width}}  {r.type_name:<{type_width}}  {r.describe():<{decided}} "
                f"{format_bytes(r.kept_bytes):>16} {r.recompute_ms:>13.3f}"
            )
        lines.append(
            f"{'(outside regions)':<{width}}  {'':<{type_width}}  {'':<{decided}} "
            f"{format_bytes(self.outside_bytes):>16} {0.0:>13.3f}"
        )
        for span in self.spans:
            lines.append(f"{span.describe()}: {span.recompute_ms:.3f} ms")
        lines.append("-" * len(header))
        solver = (
            "exact"
            if self.solver == "exact"
            else f"on a grid of {format_bytes(self.grid_bytes)} per region"
        )
        lines.append(
            f"predicted: {format_bytes(self.kept_bytes)} of activations kept (each storage once: "
            f"a report's activation_bytes) <= budget {format_bytes(self.budget_bytes)}; recompute "
            f"{self.recompute_ms:.3f} ms and "
            f"{self.recompute_flops / 1e9:.3f} GFLOP per step (profiled step {self.step_ms:.3f} ms)"
        )
        if self.peak_bytes:
            lines.append(f"predicted peak of the step: {format_bytes(self.peak_bytes)}")
        if self.timed:
            others = ", ".join(f"{t:.3f}" for t in self.timed[1:])
            lines.append(
                f"the fastest of {len(self.timed)} candidate plans timed on the model: step time "
                f"{self.timed[0]:.3f} of their mean, the others' {others}"
            )
        lines.append(
            f"smallest reachable: {format_bytes(self.floor_bytes)}; objective: {self.objective}; "
            f"solver: {solver}; device: {self.device}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        checkpointed = sum(r.checkpoint for r in self.regions)
        return (
            f"ActivationPlan({checkpointed}/{len(self.regions)} regions checkpointed, "
            f"{format_bytes(self.kept_bytes)} of activations kept, budget "
            f"{format_bytes(self.budget_bytes)})"
        )

    # -- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The plan as JSON text, ops by name (``aten.mm.default``); read back by
        ``ActivationPlan.from_json``."""
        return plan_json.write(
            {
                "budget_bytes": self.budget_bytes,
                "baseline_bytes": self.baseline_bytes,
                "floor_bytes": self.floor_bytes,
                "outside_bytes": self.outside_bytes,
                "kept_bytes": self.kept_bytes,
                "recompute_ms": self.recompute_ms,
                "step_ms": self.step_ms,
                "solver": self.solver,
                "grid_bytes": self.grid_bytes,
                "objective": self.objective,
                "recompute_flops": self.recompute_flops,
                "peak_bytes": self.peak_bytes,
                "device": self.device,
                "input_shapes": self.input_shapes,
                "frontier": self._frontier,
                "regions": [asdict(r) for r in self.regions],
                "spans": [asdict(s) for s in self.spans],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes | dict[str, Any]) -> ActivationPlan:
        """A plan from ``to_json``'s text (or the dict ``json.loads`` makes of it); it applies
        to any model with the same region names and types. Every field is checked now, with
        the op names: ``ValueError`` names the field that is missing or malformed."""
        fields, regions = plan_json.read(text)
        decisions = tuple(RegionDecision(**region) for region in regions)
        fields["spans"] = tuple(SpanDecision(**span) for span in fields["spans"])
        for region in decisions:
            for name, _ in (*region.save, *region.offload, *region.skip):
                resolve_op(name)
        return cls(regions=decisions, **fields)


def _context_fn(region: RegionDecision) -> Any:
    """Rule 11: a region that keeps, offloads and skips nothing runs as plain checkpoint (no
    selective modes); Rule 21: the ops it skips are answered ``SKIP_IN_REPLAY``."""
    if not region.save and not region.offload and not region.skip:
        return _RegionContexts({}, keep_draws=True) if region.keep_draws else noop_context_fn
    decisions: dict[tuple[Op, int], Answer] = {}
    for name, index in region.save:
        decisions[(resolve_op(name), index)] = CheckpointPolicy.MUST_SAVE
    for name, index in region.offload:
        decisions[(resolve_op(name), index)] = CheckpointPolicy.MUST_CPU_OFFLOAD
    for name, index in region.skip:
        decisions[(resolve_op(name), index)] = SKIP_IN_REPLAY
    return _RegionContexts(decisions, keep_draws=region.keep_draws)


def _describe_model(model: nn.Module | None) -> str:
    if model is None:
        return "a model that no longer exists"
    return f"{type(model).__name__} at {id(model):#x}"
