"""Hugging Face ``transformers`` models checkpoint their layers with ``checkpointing``.

Owns ``enable(model, ...)`` and ``disable(model)``: the one-line switch from
``model.activation_checkpointing_enable()`` (which hard-wires ``torch.utils.checkpoint``) to
``checkpointing.checkpoint``, with a selective policy per layer (``checkpointing.policies``,
offload included). It leaves the checkpointing itself to ``checkpointing.checkpoint`` and
policies to ``checkpointing.policies``; which layers run checkpointed is decided by the model.

This is the only module of the package that imports ``transformers``; importing ``checkpointing``
never does.

NOTE [transformers integration]
  Rule 1. We plug in through the model's own hook, ``_set_gradient_checkpointing(enable=True,
          gradient_checkpointing_func=..., every_n_layers=...)``, exactly as
          ``activation_checkpointing_enable`` does: which modules checkpoint, what
          ``every_n_layers`` counts (only the repeated ``GradientCheckpointingLayer`` blocks) and
          how caches are switched off stay transformers' own. Nothing of torch or transformers is
          patched; ``disable`` calls the same hook with ``enable=False``, as
          ``activation_checkpointing_disable`` does.
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
          (``model.train()``); in eval mode their forward is the plain one.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, Final

from torch.utils.hooks import RemovableHandle

from .._checkpoint import checkpoint
from .._state import ContextFn
from ..policies import Policy, as_context_fn

_MSG_NO_TRANSFORMERS = (
    "checkpointing.integrations.transformers needs the Hugging Face `transformers` package, "
    "which is not installed (importing `checkpointing` itself never needs it). Fix: "
    "pip install transformers (checked against 5.23.0); in a clone of this repository: "
    "pip install -e . --group hf."
)

try:
    from transformers.modeling_utils import PreTrainedModel
except ImportError as error:
    raise ImportError(_MSG_NO_TRANSFORMERS, name="transformers") from error

__all__ = ["disable", "enable"]

# Keyword arguments of ``checkpoint`` that ``enable`` passes to every layer's checkpoint.
_CHECKPOINT_OPTIONS: Final = frozenset(
    {
        "context_fn",
        "debug",
        "determinism_check",
        "early_stop",
        "preserve_rng_state",
        "use_reentrant",
    }
)

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
    "expected some of {allowed} (or policy=, every_n_layers=). Fix: pass only "
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


def enable(
    model: PreTrainedModel,
    *,
    policy: Policy | None = None,
    every_n_layers: int = 1,
    **checkpoint_options: Any,
) -> None:
    """Make ``model``'s layers checkpoint with ``checkpointing.checkpoint`` (and ``policy``).

    The one-line replacement for ``model.activation_checkpointing_enable()``: the model decides
    which layers checkpoint, exactly as there (every ``every_n_layers``-th repeated block, in
    training mode only), and each of them runs ``checkpointing.checkpoint(...,
    use_reentrant=False)`` instead of torch's. See NOTE [transformers integration].

    Args:
        model: a transformers ``PreTrainedModel`` whose ``supports_gradient_checkpointing`` is
            true.
        policy: a selective-checkpoint policy (``checkpointing.policies``: ``save_matmuls()``,
            ``offload_ops(...)``, ...) run in every checkpointed layer; offload decisions move
            the outputs to host memory. ``None``: plain checkpointing (keep only the inputs).
        every_n_layers: checkpoint only every ``every_n_layers``-th layer (transformers'
            meaning); the others keep their activations.
        **checkpoint_options: passed to ``checkpointing.checkpoint`` for every layer
            (``use_reentrant`` (default ``False``), ``context_fn``, ``determinism_check``,
            ``debug``, ``early_stop``, ``preserve_rng_state``).

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``, or an option is unknown.
        ValueError: the model does not support checkpointing, its hook ignores our function,
            or the options contradict each other.

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
    """
    _check_model(model, "enable")
    layer_checkpoint = _LayerCheckpoint(_options(policy, every_n_layers, checkpoint_options))
    _install(model, layer_checkpoint, every_n_layers)
    _require_input_grads(model)


def disable(model: PreTrainedModel) -> None:
    """Switch ``model``'s checkpointing off, as ``model.activation_checkpointing_disable()`` does.

    Undoes ``enable`` (and transformers' own ``activation_checkpointing_enable``): every layer
    runs its plain forward again, and the input-embedding hooks that ``enable`` added are
    removed (NOTE [transformers integration], Rule 3).
    """
    _check_model(model, "disable")
    model._set_gradient_checkpointing(enable=False)
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
    unknown = sorted(checkpoint_options.keys() - _CHECKPOINT_OPTIONS)
    if unknown:
        hint = _HINT_OFFLOAD if "offload" in unknown else ""
        allowed = sorted(_CHECKPOINT_OPTIONS)
        raise TypeError(_MSG_UNKNOWN_OPTION.format(names=unknown, allowed=allowed, hint=hint))
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
