"""Sequence tiling of a transformers model's layers: what ``enable(model, tile_mlp=chunks)`` adds.

Owns which module of each decoder layer is tiled and how the tiling is found again and removed
(``disable``). The tiling itself is ``checkpointing.tiled_mlp`` and ``checkpointing.tiled_experts``
(``checkpoint_module(module, tile=...)``); checkpointing the layers stays ``_hf_enable``'s, which
imports this module.

NOTE [transformers tiling]
  Rule 1. ``tile_mlp=n`` tiles, in every ``GradientCheckpointingLayer``, the module named ``mlp``:
          a dense MLP along the tokens (``tiled_mlp``, dim 1 of ``(batch, tokens, hidden)``); an
          MoE block (its ``mlp`` holds ``experts``) at its experts, over the routed tokens
          (``tiled_experts``), the router staying untiled. The layer's checkpoint then stops its
          recompute at the tiled module's saved inputs (NOTE [Tiled regions], Rule 2): the MLP
          comes last in transformers' decoder layers, after it only the residual sum, which
          saves nothing.
  Rule 2. A model none of whose layers has an ``mlp`` is an error (the option would do nothing);
          so is ``tile_mlp`` with ``budget=`` (the plan is profiled on the untiled layers).
  Rule 3. ``disable`` removes the tiling of those modules (found from the modules, as NOTE
          [transformers integration], Rule 11, asks; one the caller installed there too), and a
          second ``enable`` replaces it. A module the caller had already checkpointed is left
          as it was.
"""

from __future__ import annotations

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .._module import is_module_checkpointed, remove_checkpoint_module
from .._tiled_recipes import tiled_experts, tiled_mlp
from .._tiling import TiledForward

__all__ = ["check_tile_mlp", "tile_layers", "untile_layers"]

_MSG_TILE_MLP = (
    "checkpointing.integrations.transformers.enable: tile_mlp must be a number of chunks (an "
    "int >= 1) or None, got {got!r}. Fix: e.g. enable(model, tile_mlp=8)."
)
_MSG_TILE_WITH_BUDGET = (
    "checkpointing.integrations.transformers.enable: tile_mlp cannot be combined with budget= "
    "(the plan is profiled on the untiled layers). Fix: drop one of them; to tile under a plan, "
    "call checkpointing.tiled_mlp(layer.mlp) on each layer before planning."
)
_MSG_NO_MLP = (
    "checkpointing.integrations.transformers.enable: tile_mlp was given, but no "
    "GradientCheckpointingLayer of {cls} has a module named mlp, so nothing would be tiled. "
    "Fix: drop tile_mlp, and tile the position-wise modules yourself with "
    "checkpointing.tiled_mlp(module, chunks=8)."
)


def check_tile_mlp(tile_mlp: object, budget: object) -> None:
    """Rule 2: a positive int, and not with a budget."""
    if tile_mlp is None:
        return
    if type(tile_mlp) is not int or tile_mlp < 1:
        raise ValueError(_MSG_TILE_MLP.format(got=tile_mlp))
    if budget is not None:
        raise ValueError(_MSG_TILE_WITH_BUDGET)


def tile_layers(model: nn.Module, chunks: int) -> None:
    """Rule 1: tile each decoder layer's MLP, or its experts (after removing an earlier
    tiling, Rule 3)."""
    untile_layers(model)
    targets = _targets(model)
    if not targets:
        raise ValueError(_MSG_NO_MLP.format(cls=type(model).__name__))
    for module, is_experts in targets:
        if is_module_checkpointed(module):
            continue  # the caller's own checkpoint of it stays
        if is_experts:
            tiled_experts(module, chunks)
        else:
            tiled_mlp(module, chunks)


def untile_layers(model: nn.Module) -> None:
    """Rule 3: remove the tiling of each decoder layer's MLP or experts."""
    for module, _ in _targets(model):
        if isinstance(module.__dict__.get("forward"), TiledForward):
            remove_checkpoint_module(module)


def _targets(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Rule 1: per decoder layer, its ``mlp``, or that MLP's ``experts`` (flagged True)."""
    targets = []
    for layer in model.modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module):
            experts = getattr(mlp, "experts", None)
            targets.append((experts, True) if isinstance(experts, nn.Module) else (mlp, False))
    return targets
