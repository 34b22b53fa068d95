"""``ActivationPlan``: the planner's result, and installing it on a model.

Owns the per-region and per-span decisions (keyed by op name and occurrence, Rule M3), turning
the solver's answer into them, installing them with ``checkpoint_module`` and a selective policy
per region (Rule A1), all or nothing, with a picklable input-shape check on the model (Rule A2);
removing them, printing them, and their JSON. The search belongs to ``search``, a region's
policy to ``contexts``, deciding (offload included) to ``solver``, the JSON text to
``plan_json``; the checkpoint mechanics to ``_module`` and ``_selective``.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, replace
from typing import Any

from torch import nn

from ..._chain import is_module_chained
from ..._errors import describe_value
from ..._module import is_module_checkpointed
from ..._selective import SKIP_IN_REPLAY, CheckpointPolicy, Op
from ..._state import noop_context_fn
from ..._units import format_bytes, format_flops
from ..measure.costs import DeviceCosts
from ..measure.profile import StepProfile
from ..measure.recorded_spans import SpanCost, SpanKind
from ..measure.step_profile import RegionProfile
from ..solve.peak import predicted_peak
from ..solve.problem import (
    Problem,
    Solution,
    kept_storages,
    recompute_cost,
    region_recompute,
    skipped,
)
from . import plan_json
from .contexts import Answer, _RegionContexts, resolve_op
from .contexts import _region_contexts_by_name as _region_contexts_by_name
from .installed import Installed, ShapeCheck, carries, install, new_mark, take_off
from .joins import Run, check_joined, check_trails, check_whole

__all__ = ["ActivationPlan", "RegionDecision", "SpanDecision", "resolve_op"]


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
    """Keep the outputs of all of the region's random ops; recompute draws nothing (Rule S7)."""
    skip: tuple[Key, ...] = ()
    """Ops the replay skips, handing out blanks: nothing backward needs reads their outputs
    (Rule S8)."""
    draws: bool = True
    """Whether the region drew random numbers when profiled. A checkpointed region that drew
    none keeps no RNG state, and a guard raises if it draws after all (Rule A3). True where
    unknown (a plan from before the field): the state is kept."""
    joined: bool = False
    """Checkpointed whole in one frame with the region before it in ``plan.regions``, which is
    checkpointed whole or joined itself: the two keep one input between them, as the segments
    of ``checkpoint_sequential`` do."""

    def describe(self, before: str = "the region before") -> str:
        """The decision in words, for the table (``before``: the region before it, by name)."""
        if not self.checkpoint:
            return "keep (no checkpoint)"
        if self.joined:  # Rule S9: one frame with the region before it
            return f"checkpoint, recompute all, with {before} in one frame"
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
    """Code around the blocks that the plan records and recomputes in backward (Rule M11): the
    ``"head"`` from the model's start to the start of module ``last`` (``first`` is ``""``, the
    model), or the ``"tail"`` from the start of module ``first`` to the end of module ``last``;
    or a ``"trail"``: module ``last``, the child region ``first`` calls last, whose frame ends
    where it starts (Rule M13)."""

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


# The names models pickled with a plan applied refer to (before the search and the policies
# left this module): ``_region_contexts_by_name`` above, and the shape check (before issue 40).
_ShapeCheck = ShapeCheck


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
        step_ms: the step's time (forward and backward, without checkpointing) as the cost
            model predicts it: the forward's ops, thrice (Rule M8); no clock.
        timed: where ``plan_checkpointing`` timed candidate plans on the model (``timing_steps``,
            Rule M12), their step times relative to each other (per round over the round's mean,
            the median of the rounds), this plan's first; else empty (also after JSON).
        objective: what the plan minimizes, ``"time"`` or ``"flops"``.
        cost: the objective's predicted cost, what the solver minimized (``"time"``: seconds of
            recompute, what the checkpointed regions cost beyond their ops included, FLOPs
            weighing on near-ties; ``"flops"``: FLOPs, seconds on ties). It compares plans of
            one model and objective: along a sweep it never falls as the budget falls (NOTE
            [Budget sweep], Rule 2), where ``recompute_ms`` alone may. 0 in JSON from before
            the field.
        solver: ``"exact"``, or ``"grid"``: solved on a byte grid of ``grid_bytes``, as if
            each region's bytes were rounded up to it.
        costs: the cost model's constants the plan was priced with (``DeviceCosts``: the
            device class's name, its FLOP rates, bandwidth and per-op costs); None for a plan
            read from JSON written before plans named them.
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
        cost: float = 0.0,
        costs: DeviceCosts | None = None,
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
        self.cost = cost
        self.device = device
        self.costs = costs
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
        costs: DeviceCosts | None = None,
    ) -> ActivationPlan:
        decisions = []
        for index, (region, choice) in enumerate(
            zip(profile.regions, solution.choices, strict=True)
        ):
            units = problem.regions[index].units
            moved = offload[index]
            kept = kept_storages(problem, index, choice) - problem.outside
            # Offloaded outputs are served like kept ones (with the policy installed for them).
            served = replace(choice, saved=choice.saved | moved, skip=choice.skip or bool(moved))
            recompute, flops = region_recompute(problem, index, served)
            decisions.append(
                RegionDecision(
                    name=region.name,
                    type_name=region.type_name,
                    checkpoint=choice.checkpoint,
                    save=tuple(units[i].key for i in sorted(choice.saved))
                    + (_collectives(region) if choice.checkpoint else ()),
                    offload=tuple(units[i].key for i in sorted(moved)),
                    ops=len(region.ops),
                    kept_bytes=sum(problem.storage_bytes[s] for s in kept),
                    recompute_ms=1e3 * recompute,
                    recompute_flops=flops,
                    keep_draws=choice.draws,
                    skip=skipped(problem, index, served),
                    draws=region.draws,
                    joined=choice.joined,
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
        ) + tuple(  # Rule M13: a trail names its region and its child module
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
            cost=recompute_cost(problem, solution.choices),
            costs=costs,
        )

    # -- installing ---------------------------------------------------------------------------

    def apply(self, model: nn.Module) -> nn.Module:
        """Install the plan: ``checkpoint_module`` (non-reentrant, names and ``state_dict``
        keys untouched) on each checkpointed region, with a selective policy where it keeps or
        offloads outputs, and forward hooks that record its spans (Rule M11). Returns
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
        runs = self._regions_in(model)
        head, tail, trails = self._spans_in(model)
        check_trails(runs, self.spans)
        modules = dict(model.named_modules())
        regions = [modules[r.name] for r in self.regions]
        shapes, mark = self.input_shapes, self._mark
        self._applied = install(model, runs, trails, (head, tail), regions, shapes, mark)
        self._model = weakref.ref(model)
        return model

    def _regions_in(self, model: nn.Module) -> list[Run]:
        """The modules to checkpoint, their ``context_fn``s and decisions, in runs: one region
        alone, or a region and those joined to it (Rule A4). Every region is checked here,
        before ``apply`` installs anything."""
        modules = dict(model.named_modules())
        seen: dict[int, int] = {}
        runs: list[Run] = []
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
            joined = getattr(region, "joined", False)  # a decision pickled before the field
            if joined:
                check_joined(self.regions, index, runs)
            if region.checkpoint:
                if is_module_checkpointed(module) or is_module_chained(module):
                    raise ValueError(_MSG_REGION_TAKEN.format(name=region.name))
                chosen = (module, _context_fn(region), region)
                if joined:
                    runs[-1].append(chosen)
                else:
                    runs.append([chosen])
        for run in runs:
            if len(run) > 1:
                check_whole([decision for _, _, decision in run])
        return runs

    def _spans_in(
        self, model: nn.Module
    ) -> tuple[
        nn.Module | None,
        tuple[nn.Module, nn.Module] | None,
        list[tuple[nn.Module, nn.Module]],
    ]:
        """Rule M11: the module whose start ends the head, and the tail's first and last
        modules, where the plan records them (checked by ``_regions_in``: they are regions);
        Rule M13: each trail's region and child module."""
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
        before = ["", *(r.name for r in self.regions)]  # Rule S9: a joined region names it
        said = [r.describe(b) for r, b in zip(self.regions, before, strict=False)]
        decided = max([30, *(len(d) for d in said)])
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
        for r, decision in zip(self.regions, said, strict=True):
            lines.append(
                f"{r.name:<{width}}  {r.type_name:<{type_width}}  {decision:<{decided}} "
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
        flops = self.recompute_flops
        work = f"{format_flops(flops)} of matrix work" if flops else "no matrix work"
        lines.append(
            f"predicted: {format_bytes(self.kept_bytes)} of activations kept (each storage once: "
            f"a report's activation_bytes) <= budget {format_bytes(self.budget_bytes)}; recompute "
            f"{self.recompute_ms:.3f} ms and {work} per step (predicted step {self.step_ms:.3f} ms)"
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
        if self.costs is not None:
            lines.append(f"priced for {self.costs.describe()}")
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

    def __eq__(self, other: object) -> bool:
        """Plans are equal when their JSON is: the same decisions, budget and predictions (the
        model a plan is bound or applied to, and ``timed``, which JSON leaves out, do not
        count). Unhashable, as a mutable value."""
        if not isinstance(other, ActivationPlan):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]  # a mutable value, as a list

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
                "cost": self.cost,
                **({} if self.costs is None else {"costs": asdict(self.costs)}),
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
        if fields["costs"] is not None:
            fields["costs"] = DeviceCosts(**fields["costs"])
        for region in decisions:
            for name, _ in (*region.save, *region.offload, *region.skip):
                resolve_op(name)
        return cls(regions=decisions, **fields)


def _context_fn(region: RegionDecision) -> Any:
    """Rule A1: a region that keeps, offloads and skips nothing runs as plain checkpoint (no
    selective modes); Rule S8: the ops it skips are answered ``SKIP_IN_REPLAY``."""
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


def _collectives(region: RegionProfile) -> tuple[Key, ...]:
    """Rule M15: the keys of a region's collectives, kept by the selective policy they give it
    (never re-run in backward)."""
    return tuple(dict.fromkeys((c.op, c.index) for c in region.ops if c.kind == "kept"))


def _describe_model(model: nn.Module | None) -> str:
    if model is None:
        return "a model that no longer exists"
    return f"{type(model).__name__} at {id(model):#x}"
