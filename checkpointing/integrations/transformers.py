"""Hugging Face ``transformers`` models checkpoint their layers with ``checkpointing``.

Owns ``enable(model, ...)`` and ``disable(model)``: the one-line switch from
``model.activation_checkpointing_enable()`` (which hard-wires ``torch.utils.checkpoint``) to
``checkpointing.checkpoint``, with a selective policy per layer (``checkpointing.policies``,
offload included) or a memory budget (``checkpointing.plan_checkpointing`` on the model's
layers). It leaves the checkpointing itself to ``checkpointing.checkpoint``, policies to
``checkpointing.policies`` and budgets to the planner; without a budget, which layers run
checkpointed is decided by the model.

This is the only module of the package that imports ``transformers``; importing ``checkpointing``
never does.

NOTE [transformers integration]
  Rule 1. Without a budget, we plug in through the model's own hook,
          ``_set_gradient_checkpointing(enable=True, gradient_checkpointing_func=...,
          every_n_layers=...)``, exactly as ``activation_checkpointing_enable`` does: which
          modules checkpoint, what ``every_n_layers`` counts (only the repeated
          ``GradientCheckpointingLayer`` blocks) and how caches are switched off stay
          transformers' own. Nothing of torch or transformers is patched; ``disable`` calls
          the same hook with ``enable=False``, as ``activation_checkpointing_disable`` does.
  Rule 2. A model whose hook does not hand our function to any layer (a pre-4.35 hook taking
          ``value``, or an override that checkpoints with another library) is an error, and the
          model is left as it was: silently training without our checkpointing is not an option.
  Rule 3. Inputs that need grads are handled as ``activation_checkpointing_enable`` does: when the
          model's main input is ``input_ids`` (or a PEFT adapter is loaded), the output of the
          input embeddings requires grad (``enable_input_require_grads``). ``disable`` removes
          those hooks only if ``enable`` added them.
  Rule 4. Options are checked by ``enable``, not at the first forward. An unknown option would
          otherwise reach the layer's ``forward`` as a keyword argument, which transformers'
          layers accept (``**kwargs``) and ignore.
  Rule 5. As with transformers' own checkpointing, layers checkpoint only in training mode
          (``model.train()``); in eval mode their forward is the plain one. (With a budget,
          the plan's regions checkpoint whenever autograd records, as ``plan.apply`` does.)
  Rule 6. With ``budget=``, the regions are the model's ``GradientCheckpointingLayer`` blocks
          (the layers transformers checkpoints). The plan is profiled with the model in
          training mode (dropout drawn, as in the steps it is for; each module's mode is put
          back) and without any checkpointing, then installed by ``ActivationPlan.apply``
          (``checkpoint_module`` hooks on the chosen layers). transformers'
          ``gradient_checkpointing`` flags stay off, so no layer is checkpointed twice.
  Rule 7. With ``budget=``, every region drops its key/value cache while autograd records, as
          transformers' layers do under their own checkpointing (``use_cache=False``,
          ``past_key_values``/``layer_past`` set to None unless the layer only reads the cache,
          ``_can_checkpoint_with_cache``): a recompute would write the cache a second time and
          see other shapes. The forward pre-hook doing it is installed before planning, so the
          profile sees the ops the steps run, and before the plan's hooks, which see its
          arguments. Under ``torch.no_grad()`` (generation) the cache works as usual.
  Rule 8. One checkpointing at a time. ``enable(budget=...)`` on a model whose layers
          already checkpoint (ours or transformers' own) is an error, and so is any ``enable``
          on a model with a budget plan; ``disable`` first. (Without a budget, a second
          ``enable`` replaces the first through the hook, as transformers' own does.)
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._checkpoint import CHECKPOINT_OPTIONS, checkpoint
from .._planning import ActivationPlan, plan_checkpointing
from .._planning.profile import default_loss
from .._state import ContextFn
from ..policies import Policy, as_context_fn

_MSG_NO_TRANSFORMERS = (
    "checkpointing.integrations.transformers needs the Hugging Face `transformers` package, "
    "which is not installed (importing `checkpointing` itself never needs it). Fix: "
    "pip install transformers (checked against 5.23.0); in a clone of this repository: "
    "pip install -e . --group hf."
)

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.modeling_utils import PreTrainedModel
except ImportError as error:
    raise ImportError(_MSG_NO_TRANSFORMERS, name="transformers") from error

__all__ = ["disable", "enable"]


_MSG_NOT_A_MODEL = (
    "checkpointing.integrations.transformers.{api}: expected a transformers PreTrainedModel, got "
    "{type_name}. Fix: pass the model itself (e.g. AutoModelForCausalLM.from_config(config)); "
    "for any other nn.Module use checkpointing.apply_activation_checkpointing(model, "
    "check_fn=...)."
)
_MSG_UNSUPPORTED = (
    "checkpointing.integrations.transformers.{api}: {cls} does not support activation "
    "checkpointing (its supports_gradient_checkpointing is False), so its layers never call a "
    "checkpoint function. Fix: checkpoint its blocks with "
    "checkpointing.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, "
    "Block))."
)
_MSG_HOOK_IGNORED = (
    "checkpointing.integrations.transformers.enable: {cls}._set_gradient_checkpointing did not "
    "hand checkpointing's function to any layer ({why}), so its layers would not checkpoint "
    "with checkpointing. The model was left as it was. Fix: checkpoint its blocks with "
    "checkpointing.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, "
    "Block))."
)
_WHY_OLD_HOOK = "its hook takes `value`, the format of transformers < 4.35, and no function"
_WHY_OVERRIDE = "its hook is overridden and checkpoints some other way"
_MSG_UNKNOWN_OPTION = (
    "checkpointing.integrations.transformers.enable: unknown checkpoint option(s) {names}; "
    "expected some of {allowed} (or policy=, every_n_layers=, budget=, example_inputs=, "
    "example_kwargs=, loss_fn=). Fix: pass only "
    "checkpointing.checkpoint() options; they would otherwise reach each layer's forward, which "
    "ignores them.{hint}"
)
_HINT_OFFLOAD = (
    " transformers' offload=True is spelled with a policy here: "
    "policy=checkpointing.policies.offload_ops(...) keeps the named ops' outputs in host memory."
)
_MSG_POLICY_AND_CONTEXT_FN = (
    "checkpointing.integrations.transformers.enable: got both policy= and context_fn=; each "
    "layer runs under one context_fn. Fix: pass policy=save_matmuls() (it becomes the "
    "context_fn), or context_fn= alone."
)
_MSG_REENTRANT_CONTEXT = (
    "checkpointing.integrations.transformers.enable: use_reentrant=True cannot run a policy, a "
    "context_fn or debug=True (the reentrant variant has no saved-tensor hooks). Fix: leave "
    "use_reentrant out (False, transformers' default too)."
)
_MSG_EVERY_N_LAYERS = (
    "checkpointing.integrations.transformers.enable: every_n_layers must be a positive int (1 "
    "checkpoints every layer, 2 every second one, ...), got {got!r}. Fix: every_n_layers=1."
)
_MSG_BUDGET_WITH = (
    "checkpointing.integrations.transformers.enable: budget= cannot be combined with {what}: "
    "the plan chooses per layer whether to checkpoint it and which op outputs to keep, and "
    "installs non-reentrant checkpoint hooks with its own policy. Fix: pass budget= (with "
    "example_inputs=/example_kwargs=) alone, or {what} without budget=."
)
_MSG_BUDGET_NEEDS_EXAMPLE = (
    "checkpointing.integrations.transformers.enable: budget= needs example_inputs= or "
    "example_kwargs= (one training step's inputs, e.g. example_kwargs={{'input_ids': ids, "
    "'labels': ids}}) to profile the step it plans for; got neither. Fix: pass a batch of the "
    "shapes you train with."
)
_MSG_EXAMPLE_WITHOUT_BUDGET = (
    "checkpointing.integrations.transformers.enable: {names} only describe the step that "
    "budget= plans for, and no budget was given, so they would be ignored. Fix: add "
    "budget=0.5 (a fraction of the activation bytes kept without checkpointing) or bytes, or "
    "drop {names}."
)
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


class _LayerCheckpoint:
    """What a layer calls as ``_gradient_checkpointing_func(function, *args)``: our checkpoint
    with the options ``enable`` was given."""

    __slots__ = ("options",)

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, *args, **self.options, **kwargs)

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={value!r}" for name, value in self.options.items())
        return f"checkpointing.checkpoint({options})"


# Per model: the input-embedding hooks ``enable`` added (Rule 3), for ``disable`` to remove.
_added_input_hooks: weakref.WeakKeyDictionary[PreTrainedModel, list[RemovableHandle]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _Budgeted:
    """What ``enable(budget=...)`` installed on a model (Rules 6 and 7), for ``disable``."""

    plan: ActivationPlan
    cache_hooks: list[RemovableHandle]


_budgeted: weakref.WeakKeyDictionary[PreTrainedModel, _Budgeted] = weakref.WeakKeyDictionary()


@overload
def enable(
    model: PreTrainedModel,
    *,
    policy: Policy | None = None,
    budget: None = None,
    every_n_layers: int = 1,
    **checkpoint_options: Any,
) -> None: ...


@overload
def enable(
    model: PreTrainedModel,
    *,
    budget: float | int,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **checkpoint_options: Any,
) -> ActivationPlan: ...


def enable(
    model: PreTrainedModel,
    *,
    policy: Policy | None = None,
    budget: float | int | None = None,
    every_n_layers: int = 1,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **checkpoint_options: Any,
) -> ActivationPlan | None:
    """Make ``model``'s layers checkpoint with ``checkpointing.checkpoint`` (and ``policy``), or
    fit a memory budget (``budget``).

    The one-line replacement for ``model.activation_checkpointing_enable()``: the model decides
    which layers checkpoint, exactly as there (every ``every_n_layers``-th repeated block, in
    training mode only), and each of them runs ``checkpointing.checkpoint(...,
    use_reentrant=False)`` instead of torch's. With ``budget``, ``checkpointing.plan_checkpointing``
    decides instead, per layer, whether to checkpoint it and which op outputs to keep, from one
    profiled training step on the example inputs. See NOTE [transformers integration].

    Args:
        model: a transformers ``PreTrainedModel`` whose ``supports_gradient_checkpointing`` is
            true.
        policy: a selective-checkpoint policy (``checkpointing.policies``: ``save_matmuls()``,
            ``offload_ops(...)``, ...) run in every checkpointed layer; offload decisions move
            the outputs to host memory. ``None``: plain checkpointing (keep only the inputs).
        budget: the activation bytes the training step may keep, as ``plan_checkpointing``
            reads it: a float in (0, 1] (a fraction of what the model keeps without
            checkpointing) or an int (bytes). Needs ``example_inputs`` or ``example_kwargs``;
            excludes ``policy``, ``every_n_layers`` and checkpoint options.
        every_n_layers: checkpoint only every ``every_n_layers``-th layer (transformers'
            meaning); the others keep their activations.
        example_inputs, example_kwargs: one training step's positional and keyword arguments
            (e.g. ``example_kwargs={"input_ids": ids, "labels": ids}``), with the shapes you
            train with; only with ``budget``.
        loss_fn: ``loss_fn(output) -> scalar`` for the profiled step; default: the model's own
            ``output.loss`` when it computes one (``labels`` given), else the sum of its
            floating-point outputs. Only with ``budget``.
        **checkpoint_options: passed to ``checkpointing.checkpoint`` for every layer
            (``use_reentrant`` (default ``False``), ``context_fn``, ``determinism_check``,
            ``debug``, ``early_stop``, ``preserve_rng_state``).

    Returns:
        With ``budget``, the installed ``checkpointing.ActivationPlan`` (``print(plan)`` shows
        per layer the decision, kept bytes and recompute time); otherwise ``None``.

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``, or an option is unknown.
        ValueError: the model does not support checkpointing, its hook ignores our function,
            the options contradict each other, it is already checkpointed in the other way
            (Rule 8), or the budget is below the smallest reachable bytes.

    Example:
        >>> import torch, transformers
        >>> import checkpointing.integrations.transformers as hf_checkpointing
        >>> from checkpointing.policies import save_matmuls
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).train()
        >>> hf_checkpointing.enable(model, policy=save_matmuls())
        >>> model.model.layers[0]._gradient_checkpointing_func
        checkpointing.checkpoint(use_reentrant=False, context_fn=...)
        >>> ids = torch.randint(64, (1, 8))
        >>> model(input_ids=ids, labels=ids).loss.backward()
        >>> hf_checkpointing.disable(model)
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> plan = hf_checkpointing.enable(model, budget=0.5, example_kwargs=batch)
        >>> plan.kept_bytes <= plan.budget_bytes
        True
        >>> model(**batch).loss.backward()
    """
    _check_model(model, "enable")
    if budget is None:
        profiling = {"example_inputs=": example_inputs, "example_kwargs=": example_kwargs}
        given = [name for name, v in {**profiling, "loss_fn=": loss_fn}.items() if v is not None]
        if given:
            raise ValueError(_MSG_EXAMPLE_WITHOUT_BUDGET.format(names=", ".join(given)))
        layer_checkpoint = _LayerCheckpoint(_options(policy, every_n_layers, checkpoint_options))
        _check_no_plan(model, "checkpointing through its hook")
        _install(model, layer_checkpoint, every_n_layers)
        _require_input_grads(model)
        return None
    _check_known(checkpoint_options)
    conflict = _budget_conflict(policy, every_n_layers, checkpoint_options)
    if conflict is not None:
        raise ValueError(_MSG_BUDGET_WITH.format(what=conflict))
    if example_inputs is None and example_kwargs is None:
        raise ValueError(_MSG_BUDGET_NEEDS_EXAMPLE)
    return _enable_budget(model, budget, example_inputs, example_kwargs, loss_fn)


def disable(model: PreTrainedModel) -> None:
    """Switch ``model``'s checkpointing off, as ``model.activation_checkpointing_disable()`` does.

    Undoes ``enable`` (with or without a budget; and transformers' own
    ``activation_checkpointing_enable``): every layer runs its plain forward again, a budget
    plan's hooks are removed, and so are the input-embedding hooks that ``enable`` added
    (NOTE [transformers integration], Rule 3).
    """
    _check_model(model, "disable")
    budgeted = _budgeted.pop(model, None)
    if budgeted is not None:
        budgeted.plan.remove(model)
        for hook in budgeted.cache_hooks:
            hook.remove()
    model._set_gradient_checkpointing(enable=False)
    _remove_input_hooks(model)


def _remove_input_hooks(model: PreTrainedModel) -> None:
    """Rule 3: remove the input-embedding hooks ``enable`` added, and only those."""
    added = _added_input_hooks.pop(model, None)
    if added is not None and getattr(model, "_require_grads_hooks", None) is added:
        model.disable_input_require_grads()  # type: ignore[no-untyped-call]  # untyped in 5.23


def _check_model(model: object, api: str) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(_MSG_NOT_A_MODEL.format(api=api, type_name=type(model).__name__))
    if not model.supports_gradient_checkpointing:
        raise ValueError(_MSG_UNSUPPORTED.format(api=api, cls=type(model).__name__))


def _options(
    policy: Policy | None, every_n: object, checkpoint_options: dict[str, Any]
) -> dict[str, Any]:
    """The options each layer passes to ``checkpoint``, checked now (Rule 4)."""
    _check_known(checkpoint_options)
    if not isinstance(every_n, int) or isinstance(every_n, bool) or every_n < 1:
        raise ValueError(_MSG_EVERY_N_LAYERS.format(got=every_n))
    options = {"use_reentrant": False, **checkpoint_options}
    if policy is not None:
        if "context_fn" in options:
            raise ValueError(_MSG_POLICY_AND_CONTEXT_FN)
        context_fn: ContextFn = as_context_fn(policy)
        options["context_fn"] = context_fn
    if options["use_reentrant"] and ("context_fn" in options or options.get("debug")):
        raise ValueError(_MSG_REENTRANT_CONTEXT)
    return options


def _check_known(checkpoint_options: dict[str, Any]) -> None:
    """Rule 4: an unknown option is an error now, not a keyword a layer's forward swallows."""
    unknown = sorted(checkpoint_options.keys() - CHECKPOINT_OPTIONS)
    if unknown:
        hint = _HINT_OFFLOAD if "offload" in unknown else ""
        allowed = sorted(CHECKPOINT_OPTIONS)
        raise TypeError(_MSG_UNKNOWN_OPTION.format(names=unknown, allowed=allowed, hint=hint))


def _budget_conflict(
    policy: Policy | None, every_n: object, checkpoint_options: dict[str, Any]
) -> str | None:
    """What was passed with ``budget=`` that the plan cannot honour, if anything: the plan
    installs its own policy, per layer, on non-reentrant hooks (Rule 6)."""
    if policy is not None:
        return "policy="
    if every_n != 1:
        return f"every_n_layers={every_n!r}"
    for name, value in checkpoint_options.items():
        if name == "use_reentrant":
            if value is not False:
                return f"use_reentrant={value!r}"
        else:
            return f"{name}="
    return None


def _check_no_plan(model: PreTrainedModel, what: str) -> None:
    """Rule 8: a model with a budget plan takes no other checkpointing until ``disable``."""
    if model in _budgeted:
        cls = type(model).__name__
        raise ValueError(_MSG_ALREADY_ENABLED.format(cls=cls, how=_HOW_PLAN, what=what))


def _enable_budget(
    model: PreTrainedModel,
    budget: float | int,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> ActivationPlan:
    """Rules 6-8: plan the model's layers for ``budget`` in training mode, then install the
    plan's hooks. On any error the model is left as it was."""
    cls = type(model).__name__
    _check_no_plan(model, "a budget plan")
    if any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        raise ValueError(_MSG_ALREADY_ENABLED.format(cls=cls, how=_HOW_FLAGS, what="a budget plan"))
    layers = [module for module in model.modules() if _is_layer(module)]
    if not layers:
        raise ValueError(_MSG_NO_LAYERS.format(cls=cls))
    cache_hooks = [
        layer.register_forward_pre_hook(_drop_cache, with_kwargs=True) for layer in layers
    ]
    _require_input_grads(model)
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
        _remove_input_hooks(model)
        raise
    _budgeted[model] = _Budgeted(plan, cache_hooks)
    return plan


def _is_layer(module: nn.Module) -> bool:
    """Rule 6: the planner's regions are the blocks transformers checkpoints."""
    return isinstance(module, GradientCheckpointingLayer)


def _drop_cache(
    layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Rule 7: while autograd records (so the layer may be recomputed), it runs without its
    key/value cache, as transformers' layers do under their own checkpointing."""
    if not torch.is_grad_enabled():
        return None
    names = ["past_key_values", "layer_past"]
    if getattr(layer, "_can_checkpoint_with_cache", False):
        names = []
    dropped: dict[str, bool | None] = {n: None for n in names if kwargs.get(n) is not None}
    if kwargs.get("use_cache"):
        dropped["use_cache"] = False
    return (args, {**kwargs, **dropped}) if dropped else None


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


def _install(model: PreTrainedModel, layer_checkpoint: _LayerCheckpoint, every_n: int) -> None:
    """Hand ``layer_checkpoint`` to the model's layers through its own hook (Rules 1 and 2)."""
    cls = type(model).__name__
    if "value" in _parameter_names(model._set_gradient_checkpointing):
        raise ValueError(_MSG_HOOK_IGNORED.format(cls=cls, why=_WHY_OLD_HOOK))
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=layer_checkpoint, every_n_layers=every_n
    )
    installed = any(
        getattr(module, "_gradient_checkpointing_func", None) is layer_checkpoint
        and getattr(module, "gradient_checkpointing", False)
        for module in model.modules()
    )
    if not installed:
        model._set_gradient_checkpointing(enable=False)
        raise ValueError(_MSG_HOOK_IGNORED.format(cls=cls, why=_WHY_OVERRIDE))


def _parameter_names(function: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _require_input_grads(model: PreTrainedModel) -> None:
    """Rule 3: as ``activation_checkpointing_enable``, make the input embeddings' output require
    grad, unless hooks for that are already in place."""
    if model.main_input_name != "input_ids" and not getattr(model, "_hf_peft_config_loaded", False):
        return
    if getattr(model, "_require_grads_hooks", None):
        return
    model.enable_input_require_grads()  # type: ignore[no-untyped-call]  # untyped in 5.23
    hooks = getattr(model, "_require_grads_hooks", None)
    if hooks:
        _added_input_hooks[model] = hooks
