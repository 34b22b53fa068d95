"""``plan_sweep``: the plans of several budgets from one profiled step.

Owns checking the list of budgets and the promise a sweep keeps (NOTE [Budget sweep]). The
profiling, the search at each budget and every other argument belong to ``search``: a sweep is
``plan_checkpointing``'s search run once per budget on the problems one profile gave.

NOTE [Budget sweep]
  Rule 1. One profile, many solves. ``plan_sweep`` runs the model as one ``plan_checkpointing``
          call does (one forward, one recorded step, one plain step for the peak; more only for
          the timed race, ``timing_steps``), then solves the same problems at each budget: each
          plan equals, decision for decision and byte for byte (its JSON), the plan
          ``plan_checkpointing`` gives at that budget. Every budget is checked before the model
          runs, and read against the floor before any is solved: a sweep refuses whole.
  Rule 2. The promise (``timing_steps=0``, the default; tested on tiny models of several
          families, 12-point sweeps from the floor to 1.0, in ``tests/test_planner_sweep.py``):
          at every budget the predicted kept bytes are at most the budget; as the budget falls,
          the kept bytes never rise and the objective's predicted cost (``plan.cost``, what the
          solver minimizes) never falls; the same budget gives the same plan. The cost, not
          ``recompute_ms``: the time objective also charges what each checkpointed region costs
          beyond its ops (Rule M12), so a plan that checkpoints fewer regions may predict fewer
          recompute milliseconds at a smaller budget and still cost more. Why it holds: the
          solver's least cost at a budget is over choices whose set only grows with the budget,
          ties going to fewer bytes (Rule S5), and the cheapest span variant that fits is kept
          (Rule M11); the exact-bytes finish of Rule S5 is greedy, so the monotone parts are a
          tested property, not a proof (finer sweeps: benchmarks/RESULTS.md, "The plan across a
          budget sweep"). With ``timing_steps > 0`` the plans are measured choices and promise
          only the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .._errors import describe_value
from .apply.plan import ActivationPlan
from .measure.costs import DeviceCosts
from .search import profiled
from .solve.problem import ObjectiveName

__all__ = ["plan_sweep"]

_MSG_BUDGETS = (
    "checkpointing.plan_sweep: budgets must be a non-empty list or tuple of budgets (each a "
    "float in (0, 1], a fraction of the activation bytes kept without checkpointing, or an int, "
    "bytes), got {got}. Fix: e.g. budgets=[0.3, 0.5, 0.7]; for one budget call "
    "plan_checkpointing(model, x, budget=0.5)."
)


def plan_sweep(
    model: nn.Module,
    example_inputs: Any,
    *,
    budgets: Sequence[float | int],
    regions: Callable[[nn.Module], bool] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    host_budget: int | None = None,
    objective: ObjectiveName = "time",
    timing_steps: int = 0,
    device: str | DeviceCosts | None = None,
) -> list[ActivationPlan]:
    """The plan at each of ``budgets``, from one profiled step: ``plan_checkpointing`` at each
    budget, for the price of one call.

    Records the step once, as ``plan_checkpointing`` does, then solves at every budget: the
    plans are those separate ``plan_checkpointing`` calls with the same arguments give, in the
    order of ``budgets``, each bound to ``model`` (apply one at a time). Every budget is checked
    before the model runs, and each against the smallest reachable bytes before any is solved.

    The promise (NOTE [Budget sweep], Rule 2; with the default ``timing_steps=0``): at every
    budget, ``plan.kept_bytes <= plan.budget_bytes``; as the budget falls, ``kept_bytes`` never
    rises and the predicted cost the objective minimizes (``plan.cost``) never falls; the same
    budget gives the same plan. With
    ``timing_steps > 0`` each budget's plan is the fastest candidate measured on the model, and
    only the first holds.

    Args:
        model: as for ``plan_checkpointing``.
        example_inputs: as for ``plan_checkpointing``.
        budgets: a non-empty list or tuple of budgets, each as ``plan_checkpointing``'s
            ``budget`` (a float in (0, 1], a fraction of the activation bytes kept without
            checkpointing; or an int, bytes), in any order; repeats allowed.
        regions: as for ``plan_checkpointing``.
        example_kwargs: as for ``plan_checkpointing``.
        loss_fn: as for ``plan_checkpointing``.
        host_budget: as for ``plan_checkpointing``.
        objective: as for ``plan_checkpointing``; ``plan.cost`` is in its units.
        timing_steps: as for ``plan_checkpointing`` (above 0, each budget's candidates are
            timed on the model).
        device: as for ``plan_checkpointing`` (the cost model the plans are priced for; a model
            on the meta device or of fake tensors is planned on shapes).

    Returns:
        One ``ActivationPlan`` per budget, in the order of ``budgets``.

    Raises:
        TypeError: an argument of the wrong type (checked before anything runs).
        ValueError: a budget below the smallest reachable bytes (the message names them).

    Example:
        >>> import torch, checkpointing
        >>> blocks = [torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
        ...                               torch.nn.Linear(64, 8)) for _ in range(4)]
        >>> model = torch.nn.Sequential(*blocks)
        >>> x = torch.randn(16, 8, requires_grad=True)
        >>> plans = checkpointing.plan_sweep(model, x, budgets=[0.9, 0.6, 0.4])
        >>> all(plan.kept_bytes <= plan.budget_bytes for plan in plans)
        True
    """
    if not isinstance(budgets, list | tuple) or not budgets:
        raise TypeError(_MSG_BUDGETS.format(got=describe_value(budgets)))
    chosen = list(budgets)
    step = profiled(
        "plan_sweep",
        model,
        example_inputs,
        chosen,
        regions,
        example_kwargs,
        loss_fn,
        host_budget,
        objective,
        timing_steps,
        device,
    )
    return step.plans(chosen)
