"""The eager memory budget of ``integrations.torchtitan.MemoryBudgetAC``: plan at the first step.

Owns turning torchtitan's ``memory_budget`` (0: full checkpointing's activations, 1: none's) into
the planner's bytes, and planning a torchtitan model's blocks on its first training step. The
planning itself is ``checkpointing._planning``'s; the configurable is ``torchtitan``'s module.

NOTE [Budget at the first step]
  Rule 1. torchtitan applies activation checkpointing to a model that may still be on the meta
          device and before its inputs exist, so nothing is planned then: a forward pre-hook on
          the model plans at the first forward that runs in training mode with grad enabled (an
          evaluation forward first leaves the hook in place), on that forward's own arguments,
          then removes itself; the forward it interrupted runs with the plan installed.
  Rule 2. The planner's budget is a share of the unplanned step's bytes; torchtitan's is a
          share of the way from full checkpointing's bytes (the planner's floor) to none's (its
          baseline). The first plan, at budget 1.0, measures both; a budget below 1 is then
          planned again, in bytes, at ``floor + memory_budget * (baseline - floor)``. Twice the
          profiling of one step, once per job. Rejected: a new budget form in the planner for
          one caller.
  Rule 3. Under FSDP2 (``fully_shard``, which torchtitan always applies) the hook runs inside the
          sharded model's call, after FSDP's root hook, and the planner's step nests in it.
          Checked with torchtitan's own sharding on 2 gloo ranks: the planning step and the next
          give bitwise the unplanned sharded step's gradients. Refused where the root module
          holds parameters of its own (torchtitan's does not: embeddings, blocks and head are
          sharded apart): the nested step would reshard them under the interrupted forward.
  Rule 4. Under a process group every rank plans (the profiled step's collectives need all
          of them) and then installs rank 0's plan, broadcast: one job trains one plan, also
          where the ranks' tokens route a mixture of experts differently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _planning

__all__ = ["plan_on_first_step"]

_log = logging.getLogger("checkpointing.torchtitan")

_MSG_ROOT_PARAMETERS = (
    "checkpointing.integrations.torchtitan.MemoryBudgetAC: the model is sharded with FSDP2 "
    "(fully_shard) and holds parameters of its own ({names}); the budget is planned at the first "
    "training forward, from inside the model's call, where the planner's own step would reshard "
    "them under it. Fix: shard those parameters' modules apart before fully_shard(model), as "
    "torchtitan does with the embeddings and the output head; or use SelectiveAC / FullAC."
)


def plan_on_first_step(
    model: nn.Module,
    blocks: list[nn.Module],
    memory_budget: float,
    planned: Callable[[_planning.ActivationPlan], None],
) -> None:
    """Rule 1: plan ``blocks`` at ``model``'s first training forward, for ``memory_budget``;
    ``planned(plan)`` is told the plan once it is installed."""

    def plan_now(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        handle.remove()
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own and is_fsdp_module(module):  # Rule 3
            raise ValueError(_MSG_ROOT_PARAMETERS.format(names=", ".join(own)))
        plan = _rank_zeros(_plan(module, blocks, args, kwargs, memory_budget))
        plan.apply(module)
        planned(plan)
        _log.info("planned for memory_budget=%s:\n%s", memory_budget, plan)

    handle = model.register_forward_pre_hook(plan_now, with_kwargs=True)


def _rank_zeros(plan: _planning.ActivationPlan) -> _planning.ActivationPlan:
    """Rule 4: rank 0's plan on every rank of the default process group, if there is one."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return plan
    shared: list[Any] = [plan.to_json()]
    torch.distributed.broadcast_object_list(shared, src=0)
    if torch.distributed.get_rank() == 0:
        return plan
    return _planning.ActivationPlan.from_json(shared[0])


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2, public in ``torch.distributed.fsdp``) manages ``module``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule  # only where torch.distributed is built

    return isinstance(module, FSDPModule)


def _plan(
    model: nn.Module,
    blocks: list[nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    memory_budget: float,
) -> _planning.ActivationPlan:
    """Rule 2: the plan of ``blocks`` at torchtitan's ``memory_budget``."""
    ids = {id(block) for block in blocks}

    def plan_at(budget: float | int) -> _planning.ActivationPlan:
        return _planning.plan_checkpointing(
            model,
            args,
            budget=budget,
            regions=lambda module: id(module) in ids,
            example_kwargs=kwargs,
        )

    widest = plan_at(1.0)
    if memory_budget >= 1:
        return widest
    floor, baseline = widest.floor_bytes, widest.baseline_bytes
    return plan_at(floor + int(memory_budget * (baseline - floor)))
