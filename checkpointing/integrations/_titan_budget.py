"""The eager memory budget of ``integrations.torchtitan.MemoryBudgetAC``: plan at the first step.

Owns planning a torchtitan model's blocks on its first training step, for torchtitan's
``memory_budget`` (0: full checkpointing's activations, 1: none's), and the checks only a
torchtitan model needs. The first-step planning is shared with ``checkpointing.apply_spec``'s
budget key and lives in ``checkpointing._planning.first_step`` (NOTE [Budget at the first step]);
the configurable is ``torchtitan``'s module.

NOTE [torchtitan budget]
  Rule 1. torchtitan applies activation checkpointing to a model that may still be on the meta
          device and before its inputs exist, so nothing is planned then: the blocks are planned
          at the first forward that runs in training mode with grad enabled (NOTE [Budget at the
          first step], Rules 1-3: the share, the two plans, rank 0's plan on every rank).
  Rule 2. Under FSDP2 (``fully_shard``, which torchtitan always applies) the hook runs inside the
          sharded model's call, after FSDP's root hook, and the planner's step nests in it.
          Checked with torchtitan's own sharding on 2 gloo ranks: the planning step and the next
          give bitwise the unplanned sharded step's gradients. Refused where the root module
          holds parameters of its own (torchtitan's does not: embeddings, blocks and head are
          sharded apart): the nested step would reshard them under the interrupted forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from .. import _planning
from .._planning.first_step import plan_on_first_step as _plan_on_first_step

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

    def told(plan: _planning.ActivationPlan) -> None:
        planned(plan)
        _log.info("planned for memory_budget=%s:\n%s", memory_budget, plan)

    _plan_on_first_step(
        model, blocks, memory_budget, told, ready=_training_with_grad, before=_check_root
    )


def _training_with_grad(module: nn.Module) -> bool:
    """Rule 1: a training forward (an evaluation forward first leaves the hook in place)."""
    return module.training and torch.is_grad_enabled()


def _check_root(module: nn.Module) -> None:
    """Rule 2: a sharded root holding parameters of its own is refused."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own and is_fsdp_module(module):
        raise ValueError(_MSG_ROOT_PARAMETERS.format(names=", ".join(own)))


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2, public in ``torch.distributed.fsdp``) manages ``module``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule  # only where torch.distributed is built

    return isinstance(module, FSDPModule)
