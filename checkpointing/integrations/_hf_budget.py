"""A memory-budget plan on a Hugging Face ``transformers`` model, for ``enable(budget=...)``.

Owns installing a ``checkpointing.plan_checkpointing`` plan over a model's
``GradientCheckpointingLayer`` blocks (profiled in training mode, each layer's key/value cache
dropped while autograd records, transformers' flags telling the truth) and finding and removing
it again from the model itself, a deep copy included. Its rules are Rules 6, 7, 8 and 11 of
NOTE [transformers integration] (in ``_hf_enable``, which owns ``enable``/``disable``, the
options and the input-embedding hooks); planning belongs to ``checkpointing._planning``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import PreTrainedModel

from .. import _compat
from .._kv_caches import drop_caches
from .._planning import ActivationPlan, plan_checkpointing
from .._planning.apply.installed import take_off_found
from .._planning.measure.steps import default_loss

__all__ = ["check_no_plan", "has_plan", "install_plan", "remove_plan"]

_MSG_ALREADY_ENABLED = (
    "checkpointing.integrations.transformers.enable: {cls} is already checkpointed ({how}); "
    "enabling {what} on top would checkpoint its layers twice (or profile them checkpointed). "
    "Fix: call checkpointing.integrations.transformers.disable(model) first (it also undoes "
    "transformers' own activation_checkpointing_enable())."
)
_HOW_PLAN = "by enable(model, budget=...), with hooks from its ActivationPlan"
_HOW_FLAGS = "its layers' gradient_checkpointing flags are on: enable(model) or transformers' own"
_MSG_NO_LAYERS = (
    "checkpointing.integrations.transformers.enable: {cls} has no GradientCheckpointingLayer "
    "blocks, which budget= plans over (the layers transformers checkpoints). Fix: plan it "
    "directly: checkpointing.plan_checkpointing(model, inputs, budget=..., regions=lambda m: "
    "isinstance(m, Block)).apply(model)."
)


class _RunLayer:
    """What a layer calls as ``_gradient_checkpointing_func`` under a budget plan (Rule 6): its
    forward, as it is; the plan's hooks around the layer's call checkpoint it."""

    __slots__ = ()

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    def __repr__(self) -> str:
        return "checkpointing's budget plan (its hooks on the layer checkpoint it)"


# Per model: the plan ``install_plan`` applied to it, for ``remove_plan`` to undo through
# ``plan.remove``. A deep copy is not in here: what it carries is found from it (Rule 11).
_plans: WeakKeyDictionary[PreTrainedModel, ActivationPlan] = WeakKeyDictionary()


def has_plan(model: PreTrainedModel) -> bool:
    """Rule 11: whether ``install_plan`` ran on ``model`` (or on the model it was deep-copied
    from): its layers carry the plan's cache hook (Rule 7)."""
    return any(_drop_cache in _compat.forward_pre_hooks(m) for m in model.modules() if _is_layer(m))


def check_no_plan(model: PreTrainedModel, what: str) -> None:
    """Rule 8: a model with a budget plan takes no other checkpointing until ``disable``."""
    if has_plan(model):
        cls = type(model).__name__
        raise ValueError(_MSG_ALREADY_ENABLED.format(cls=cls, how=_HOW_PLAN, what=what))


def install_plan(
    model: PreTrainedModel,
    budget: float | int,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> ActivationPlan:
    """Rules 6-8: plan the model's layers for ``budget`` in training mode, then install the
    plan's hooks, and transformers' flags if it checkpoints a layer. On any error the model is
    left as it was."""
    cls = type(model).__name__
    check_no_plan(model, "a budget plan")
    if any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        raise ValueError(_MSG_ALREADY_ENABLED.format(cls=cls, how=_HOW_FLAGS, what="a budget plan"))
    layers = [module for module in model.modules() if _is_layer(module)]
    if not layers:
        raise ValueError(_MSG_NO_LAYERS.format(cls=cls))
    cache_hooks = [
        layer.register_forward_pre_hook(_drop_cache, with_kwargs=True) for layer in layers
    ]
    try:
        with _training(model):
            plan = plan_checkpointing(
                model,
                () if example_inputs is None else example_inputs,
                budget=budget,
                regions=_is_layer,
                example_kwargs=None if example_kwargs is None else dict(example_kwargs),
                loss_fn=_model_loss if loss_fn is None else loss_fn,
            )
        plan.apply(model)
    except BaseException:
        for hook in cache_hooks:
            hook.remove()
        raise
    _plans[model] = plan
    # A pre-4.35 hook takes ``value`` and no function: its flags stay off (Rule 2 there).
    modern_hook = "value" not in inspect.signature(model._set_gradient_checkpointing).parameters
    if modern_hook and any(region.checkpoint for region in plan.regions):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=_RunLayer())
    return plan


def remove_plan(model: PreTrainedModel) -> None:
    """Remove what ``install_plan`` installed (transformers' flags aside: ``disable`` switches
    them off): through the plan on the model it was applied to; found from the model itself on
    a deep copy (Rule 11)."""
    if not has_plan(model):
        return
    plan = _plans.pop(model, None)
    if plan is not None:
        plan.remove(model)
    else:  # Rule 8: on a planned model, only the plan's checkpoints (its regions are the layers)
        layers = [name for name, module in model.named_modules() if _is_layer(module)]
        take_off_found(model, layers)
    for layer in filter(_is_layer, model.modules()):
        _compat.remove_forward_hooks(layer, _drop_cache, _drop_cache)  # a pre-hook only


def _is_layer(module: nn.Module) -> bool:
    """Rule 6: the planner's regions are the blocks transformers checkpoints."""
    return isinstance(module, GradientCheckpointingLayer)


def _drop_cache(
    layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Rule 7: while autograd records (so the layer may be recomputed), it runs without its
    key/value cache, as transformers' layers do under their own checkpointing: the planner's
    ``drop_caches`` (NOTE [Key/value caches]), under this integration's own name, by which
    ``has_plan`` finds the layers it planned."""
    return drop_caches(layer, args, kwargs)


@contextlib.contextmanager
def _training(model: nn.Module) -> Iterator[None]:
    """Rule 6: the model in training mode for the block; every module's mode put back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _model_loss(output: Any) -> torch.Tensor:
    """The profiled step's default loss: the model's own ``output.loss`` when it computed one
    (``labels`` given), else the sum of its floating-point outputs (the planner's default)."""
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else default_loss(output)
