"""The planner's arguments, checked before anything runs: their types and ranges, and the models
it refuses (one carrying a plan's hooks, a ``DistributedDataParallel`` before its static graph's
first step), the device the plan is priced for (``device=``), and whether the step runs on
shapes (parameters or inputs without memory: NOTE [Planning without memory]). Every message
names the front door that was called (``plan_checkpointing`` or ``plan_sweep``: ``api``).
Choosing the regions, and reading the budget against the floor, belong to ``search``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .._compat import awaits_first_static_step
from .._errors import describe_value
from .apply.installed import carries
from .measure.costs import DEVICE_CLASSES, DeviceCosts, named_costs
from .measure.shapes import shapes_only

__all__ = ["check_arguments", "device_costs", "planned_by_shapes", "refuse_planned_or_static"]

_MSG_BUDGET_TYPE = (
    "checkpointing.{api}: budget must be a float in (0, 1] (a fraction of the "
    "activation bytes the model keeps without checkpointing) or an int (bytes), got {got!r}. "
    "Fix: e.g. budget=0.5 or budget=2 * 1024**3."
)
_MSG_HOST_BUDGET = (
    "checkpointing.{api}: host_budget must be None or an int >= 0 (bytes of host "
    "memory offloaded activations may use), got {got}. Fix: e.g. host_budget=8 * 1024**3."
)
_MSG_TIMING_STEPS = (
    "checkpointing.{api}: timing_steps must be an int >= 0 (the most steps each "
    "candidate plan is timed for; 0, the default: none), got {got}. Fix: e.g. timing_steps=0 "
    "(the predicted plan, deterministic) or timing_steps=24 (time the candidates on the model)."
)
_MSG_OBJECTIVE = (
    "checkpointing.{api}: objective must be one of {allowed}, got {got}. Fix: "
    "objective='time' (least predicted recompute time by the cost model, the default) or "
    "objective='flops' (fewest recomputed FLOPs, as torch.compile's partitioner counts them)."
)
_MSG_MODEL_TYPE = (
    "checkpointing.{api}: model must be an nn.Module (its submodules are the "
    "regions), got {got}. Fix: pass the model itself, e.g. {api}(model, x, ...); wrap a plain "
    "function in an nn.Module first."
)
_MSG_KWARGS_TYPE = (
    "checkpointing.{api}: example_kwargs must be None or a dict of the step's "
    "keyword arguments by name, got {got}. Fix: pass positional inputs as example_inputs (a "
    "tensor, or a tuple of them) and named ones as example_kwargs={{'attention_mask': mask}}."
)
_MSG_LOSS_FN_TYPE = (
    "checkpointing.{api}: loss_fn must be None or a callable loss_fn(output) -> "
    "scalar tensor, got {got}. Fix: e.g. loss_fn=lambda output: output.logits.float().mean(), "
    "or leave it out to backward the sum of the floating-point outputs."
)
_MSG_PLANNED = (
    "checkpointing.{api}: {where} carries the hooks of an applied ActivationPlan "
    "(a copy of a planned model, by copy.deepcopy or torch.save/load, carries them too), so "
    "profiling would measure the planned step, not the model's own. Fix: plan.remove(model) "
    "with that plan (or a pickled copy of it) before planning again."
)
_MSG_DEVICE = (
    "checkpointing.{api}: device must be None (the cost model of the device the "
    "model's tensors are on), the name of a device class, one of {names}, or a "
    "checkpointing.DeviceCosts, got {got}. Fix: e.g. device='h100-80gb', or "
    "device=checkpointing.DeviceCosts(...) with your device's constants."
)
_MSG_SHAPES_TIMED = (
    "checkpointing.{api}: timing_steps={steps} times candidate plans on the model, "
    "but the model or the example inputs are on the meta device or fake (planning by shapes): "
    "there is nothing to time. Fix: timing_steps=0 (the predicted plan), or plan on real "
    "tensors to time the candidates."
)
_MSG_STATIC_FIRST = (
    "checkpointing.{api}: {where} is a DistributedDataParallel with "
    "static_graph=True that has not trained its first step, the one whose backward records the "
    "graph; the planner's measured steps would be that step and leave the replica's reduction "
    "wrong. Fix: plan before wrapping (plan.apply(model), then DistributedDataParallel(model, "
    "static_graph=True)), or after the first training step."
)


def refuse_planned_or_static(model: nn.Module, api: str) -> None:
    """A model that carries a plan's hooks (NOTE [Installed plan], Rule 2), or a
    ``DistributedDataParallel`` with a static graph before its first step (Rule M15), is refused
    before anything runs."""
    planned = carries(model)
    if planned is not None:
        where = f"module {planned!r} of the model" if planned else "the model"
        raise ValueError(_MSG_PLANNED.format(api=api, where=where))
    for name, module in model.named_modules():
        if isinstance(module, nn.parallel.DistributedDataParallel) and awaits_first_static_step(
            module
        ):
            where = f"module {name!r} of the model" if name else "the model"
            raise ValueError(_MSG_STATIC_FIRST.format(api=api, where=where))


def device_costs(device: object, api: str) -> DeviceCosts | None:
    """The cost model ``device=`` names (None: the model's device class's, read later)."""
    if device is None or isinstance(device, DeviceCosts):
        return device
    found = named_costs(device) if isinstance(device, str) else None
    if found is None:
        raise ValueError(
            _MSG_DEVICE.format(api=api, names=DEVICE_CLASSES, got=describe_value(device))
        )
    return found


def planned_by_shapes(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], timing_steps: int, api: str
) -> bool:
    """Whether the step runs on shapes (NOTE [Planning without memory], Rule 1): then there is
    nothing to time (Rule M12), so ``timing_steps`` above 0 is refused before anything runs."""
    shapes = shapes_only(model, args, kwargs)
    if shapes and timing_steps:
        raise ValueError(_MSG_SHAPES_TIMED.format(api=api, steps=timing_steps))
    return shapes


def check_arguments(
    model: object,
    budget: object,
    example_kwargs: object,
    loss_fn: object,
    host_budget: object,
    objective: object,
    timing_steps: object,
    api: str,
) -> None:
    """Every argument's type and range, before anything runs (``api`` speaks in the
    messages)."""
    if not isinstance(objective, str) or objective not in _OBJECTIVES:
        raise ValueError(
            _MSG_OBJECTIVE.format(api=api, allowed=_OBJECTIVES, got=describe_value(objective))
        )
    if not isinstance(model, nn.Module):
        raise TypeError(_MSG_MODEL_TYPE.format(api=api, got=describe_value(model)))
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(_MSG_BUDGET_TYPE.format(api=api, got=budget))
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(_MSG_BUDGET_TYPE.format(api=api, got=budget))
    if isinstance(budget, int) and budget < 0:
        raise ValueError(_MSG_BUDGET_TYPE.format(api=api, got=budget))
    if example_kwargs is not None and (
        not isinstance(example_kwargs, Mapping)
        or not all(isinstance(name, str) for name in example_kwargs)
    ):
        raise TypeError(_MSG_KWARGS_TYPE.format(api=api, got=describe_value(example_kwargs)))
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(_MSG_LOSS_FN_TYPE.format(api=api, got=describe_value(loss_fn)))
    if host_budget is not None:
        if isinstance(host_budget, bool) or not isinstance(host_budget, int):
            raise TypeError(_MSG_HOST_BUDGET.format(api=api, got=describe_value(host_budget)))
        if host_budget < 0:
            raise ValueError(_MSG_HOST_BUDGET.format(api=api, got=host_budget))
    if isinstance(timing_steps, bool) or not isinstance(timing_steps, int):
        raise TypeError(_MSG_TIMING_STEPS.format(api=api, got=describe_value(timing_steps)))
    if timing_steps < 0:
        raise ValueError(_MSG_TIMING_STEPS.format(api=api, got=timing_steps))


_OBJECTIVES = ("time", "flops")
