"""Planning at a model's first forward under grad: for callers that have no example inputs.

Owns the forward pre-hook that plans a given set of regions, for a share of the way from full
recompute's bytes to none's, on the arguments of the first forward that is ready (the caller says
what ready means), installs the plan and removes itself; and turning the share into the planner's
bytes. The planning itself is ``search``'s. Used by ``checkpointing.apply_spec`` (a budget key)
and by ``integrations.torchtitan.MemoryBudgetAC`` (its eager budget), which add their own checks.

NOTE [Budget at the first step]
  Rule 1. A caller without example inputs plans nothing when it is configured: a forward pre-hook
          on the model plans at the first forward that is ready (with grad enabled, and for
          torchtitan in training mode; an earlier forward leaves the hook in place), on that
          forward's own arguments, then removes itself before planning (the planner's own step
          calls the model again); the forward it interrupted runs with the plan installed.
  Rule 2. The planner's budget is a share of the unplanned step's bytes; a share here is one of
          the way from full recompute of the regions (the planner's floor, 0.0) to keeping all
          they save (its baseline, 1.0), as torchtitan's ``memory_budget``. The step is profiled
          once (NOTE [Budget sweep], Rule 1): the plan at budget 1.0 reads both, and a share
          below 1 is then solved on the same profile, in bytes, at ``floor + share * (baseline -
          floor)``. Rejected: a new budget form in the planner for these callers.
  Rule 3. Under a process group every rank plans (the profiled step's collectives need all
          of them) and then installs rank 0's plan, broadcast: one job trains one plan, also
          where the ranks' tokens route a mixture of experts differently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .apply.plan import ActivationPlan
from .search import profiled, rank_zeros

__all__ = ["plan_on_first_step"]


def plan_on_first_step(
    model: nn.Module,
    regions: list[nn.Module],
    share: float,
    planned: Callable[[ActivationPlan], None],
    *,
    ready: Callable[[nn.Module], bool],
    before: Callable[[nn.Module], None] | None = None,
) -> RemovableHandle:
    """Rule 1: plan ``regions`` at ``model``'s first forward for which ``ready(model)``, for
    ``share``; ``before(model)`` runs first (a caller's checks), ``planned(plan)`` once the plan
    is installed. Returns the hook's handle (removing it cancels the planning)."""

    def plan_now(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not ready(module):
            return
        handle.remove()
        if before is not None:
            before(module)
        plan = rank_zeros(_plan(module, regions, args, kwargs, share))
        plan.apply(module)
        planned(plan)

    handle = model.register_forward_pre_hook(plan_now, with_kwargs=True)
    return handle


def _plan(
    model: nn.Module,
    regions: list[nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    share: float,
) -> ActivationPlan:
    """Rule 2: the plan of ``regions`` at ``share``."""
    ids = {id(region) for region in regions}

    def chosen(module: nn.Module) -> bool:
        return id(module) in ids

    step = profiled("plan_checkpointing", model, args, [1.0], chosen, kwargs, None, None, "time", 0)
    widest = step.plans([1.0])[0]
    if share >= 1:
        return widest
    floor, baseline = widest.floor_bytes, widest.baseline_bytes
    return step.plans([floor + int(share * (baseline - floor))])[0]
