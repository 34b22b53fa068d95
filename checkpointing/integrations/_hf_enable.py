"""Hugging Face models checkpoint their layers with ``checkpointing``: ``enable`` and ``disable``.

Owns what ``checkpointing.integrations.transformers`` offers (its face re-exports it):
``enable(model, ...)`` and ``disable(model)``, the one-line switch from
``model.activation_checkpointing_enable()`` (which hard-wires ``torch.utils.checkpoint``) to
``checkpointing.checkpoint``, with a selective policy per layer (``checkpointing.policies``,
offload included) or a memory budget (``checkpointing.plan_checkpointing`` on the model's
layers), on a model or on the PEFT model wrapping it; and what keeps that choice in place when
the usual switches (the ``Trainer``'s ``gradient_checkpointing=True``, PEFT) run after it. It
leaves the checkpointing itself to ``checkpointing.checkpoint``, policies to
``checkpointing.policies``, installing and removing a budget plan to ``_hf_budget`` (planning
to the planner), and the ``Trainer`` route (``CheckpointingCallback``) to ``_hf_callback``,
which imports this module; without a budget, which layers run checkpointed is decided by the
model. Imported through the face (``transformers``), which says what to install when
``transformers`` is missing.

NOTE [transformers integration]
  Rule 1. Without a budget, we plug in through the model's own hook,
          ``_set_gradient_checkpointing(enable=True, gradient_checkpointing_func=...,
          every_n_layers=...)``, exactly as ``activation_checkpointing_enable`` does: which
          modules checkpoint, what ``every_n_layers`` counts (only the repeated
          ``GradientCheckpointingLayer`` blocks) and how caches are switched off stay
          transformers' own. No class of torch or transformers is patched (Rule 10 sets
          attributes of the model instance); ``disable`` calls the same hook with
          ``enable=False``, as ``activation_checkpointing_disable`` does.
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
          (``checkpoint_module`` hooks on the chosen layers). When it checkpoints a layer,
          transformers' flags are switched on through the hook with ``_RunLayer``, which runs the
          layer's forward as it is (the plan's hooks around the call checkpoint it): no layer is
          checkpointed twice, and ``is_activation_checkpointing`` tells the truth to those who
          ask (the ``Trainer``'s DDP setup, PEFT).
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
  Rule 9. A PEFT model is unwrapped to the transformers model that owns the layers
          (``get_base_model()``, recognised by duck typing: PEFT is no dependency). Wrapping
          the layers instead (``apply_activation_checkpointing``) would rename their
          parameters, and PEFT's ``save_pretrained`` would then save no adapter weights.
  Rule 10. Ours survives the usual switches. ``enable`` sets the model instance's own
          ``activation_checkpointing_enable`` and ``activation_checkpointing_disable``
          (``_Switches``), which every route looks up on the instance: the ``Trainer``'s
          ``gradient_checkpointing=True`` calls the first, the deprecated
          ``gradient_checkpointing_enable`` (PEFT's ``prepare_model_for_kbit_training`` calls it)
          calls it on ``self``, and a PEFT model forwards the lookup to its base model. While
          ours is on, a later enable keeps it (with its policy; a warning names the options of
          that call it did not apply) and is an error on a budget plan (both would checkpoint
          the layers); a later disable is ours, then transformers'. Once ours is off, the
          switches hand the call to transformers' own and remove themselves. They hold the
          model weakly (a strong reference would be a cycle, keeping the model's memory until
          ``gc`` runs) and ``copy.deepcopy`` points them at the copy. Rejected: a forward
          pre-hook that puts ours back at the next step (it cannot see the options of the call
          that replaced ours, nor refuse it where it is made); patching ``PreTrainedModel``.
  Rule 11. What ``enable`` installed is found from the model (its layers' functions and hooks,
          its switches), never only from a registry: ``disable`` and Rule 8 work on a
          ``copy.deepcopy`` of an enabled model.
  Rule 12. ``policy=`` also takes the name of a policy of ``checkpointing.policies`` that takes
          no arguments (``"save_attention"``, ``"save_matmuls"``, ...), the spelling a
          configuration file or a command line can carry; the name becomes that factory's
          policy when ``enable`` checks its options (Rule 4), and an unknown name is an error
          listing the names. A policy with arguments is passed as the object. The table of
          names is ``checkpointing.policies``' own: ``as_context_fn`` and every ``context_fn=``
          take the same names. A name given as ``context_fn=`` (or in
          ``gradient_checkpointing_kwargs``, NOTE [gradient_checkpointing_kwargs]) is read as
          ``policy=``, so that it is tagged (Rule 15) and keeps the routing (Rule 13).
  Rule 13. A model with experts (its text config counts more than one in
          ``num_local_experts``, ``num_experts``, ``n_routed_experts`` or ``moe_num_experts``)
          keeps its routing (NOTE [Routing ops]): its layers run under ``save_routing()``, or
          ``either(policy, save_routing())`` with a policy. A recompute whose router scores
          the experts differently would route tokens elsewhere, and transformers' default
          experts (``grouped_mm``: tokens sorted by expert) keep every shape, so that would
          be wrong gradients in silence. Not added with the caller's own ``context_fn`` (the
          way to recompute the routing), ``use_reentrant=True`` or ``debug=True`` (neither
          runs a policy), nor with ``budget=`` (the plan decides per op). A dense model's
          layers run plain checkpointing, as before.
  Rule 14. ``spec=`` (``_hf_spec``) gives each module what a ``checkpointing.apply_spec``
          spec says, through ``checkpoint_module`` hooks (names and ``state_dict`` keys
          unchanged, so PEFT saves its adapters), instead of the model's hook: a spec picks any
          module (an attention, an MLP), not only the blocks transformers checkpoints. It
          excludes ``policy``, ``budget``, ``every_n_layers``, ``tile_mlp`` and checkpoint
          options (the spec says all of it). As with a budget (Rule 6), transformers' flags go
          on with ``_RunLayer`` when a region is installed, every region drops its empty cache
          while autograd records (Rule 7), and a model with a spec takes no other
          checkpointing until ``disable`` (Rule 8); with experts (Rule 13), ``full`` runs
          ``save_routing()`` and a policy ``either(policy, save_routing())``. What a spec
          installed is found from the model (Rule 11). A spec's budget value is refused (the
          spec installs at once; ``budget=`` plans the layers).
  Rule 15. A policy that keeps tensors by MaxText's names (``"maxtext:minimal"``,
          ``policies.maxtext(...)``, or ``save_only_these_names("query_proj", ...)``) finds
          them tagged: ``enable`` puts tag hooks on the layers' projections for the names the
          policy asks for (given as ``policy=``, its name, or a ``context_fn=`` running it; with
          ``spec=``, under each module the spec gives such a policy), and ``disable`` removes
          them (NOTE [transformers tags] in ``_hf_tags``).
"""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, overload

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.modeling_utils import PreTrainedModel

from .._checkpoint import CHECKPOINT_OPTIONS, check_use_reentrant, checkpoint
from .._errors import internal_error
from .._planning import ActivationPlan
from .._spec import AppliedSpec
from .._state import ContextFn
from ..policies import (
    Policy,
    _named,
    as_context_fn,
    either,
    save_routing,
)
from ._hf_budget import check_no_plan, has_plan, install_plan, remove_plan
from ._hf_kwargs import from_hf_kwargs
from ._hf_spec import check_no_spec, has_spec, install_spec, remove_spec
from ._hf_tags import tag_layers, tag_spec, untag_layers
from ._hf_tiling import check_tile_mlp, tile_layers, untile_layers

__all__ = [
    "check_options",
    "check_spec_alone",
    "disable",
    "enable",
    "unwrap",
]

_API = "checkpointing.integrations.transformers.enable"
_FIX_BLOCKS = (
    "checkpoint each block with checkpointing.checkpoint_module(block), which keeps parameter "
    "names and state_dict keys (checkpointing.apply_activation_checkpointing wraps the blocks "
    "and renames their parameters: PEFT's save_pretrained then saves no adapter weights)"
)
_MSG_NOT_A_MODEL = (
    "checkpointing.integrations.transformers.{api}: expected a transformers PreTrainedModel, or "
    "a PEFT model wrapping one, got {type_name}. Fix: pass the model (e.g. "
    "AutoModelForCausalLM.from_config(config)) or the PeftModel that get_peft_model(model, "
    "config) returned ({api} uses its get_base_model()). For an nn.Module that is no "
    "transformers model, " + _FIX_BLOCKS + "."
)
_MSG_UNSUPPORTED = (
    "checkpointing.integrations.transformers.{api}: {cls} does not support activation "
    "checkpointing (its supports_gradient_checkpointing is False), so its layers never call a "
    "checkpoint function. Fix: " + _FIX_BLOCKS + "."
)
_MSG_HOOK_IGNORED = (
    "checkpointing.integrations.transformers.enable: {cls}._set_gradient_checkpointing did not "
    "hand checkpointing's function to any layer ({why}), so its layers would not checkpoint "
    "with checkpointing. The model was left as it was. Fix: " + _FIX_BLOCKS + "."
)
_WHY_OLD_HOOK = "its hook takes `value`, the format of transformers < 4.35, and no function"
_WHY_OVERRIDE = "its hook is overridden and checkpoints some other way"
# Rule 13: the config attributes that count a model's experts.
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_MSG_UNKNOWN_OPTION = (
    "{api}: unknown checkpoint option(s) {names}; expected some of {allowed} (or policy=, "
    "every_n_layers=, budget=, example_inputs=, example_kwargs=, loss_fn=). Fix: pass only "
    "checkpointing.checkpoint() options; they would otherwise reach each layer's forward, which "
    "ignores them.{hint}"
)
_HINT_OFFLOAD = (
    " transformers' offload=True is spelled with a policy here: "
    "policy=checkpointing.policies.offload_ops(...) keeps the named ops' outputs in host memory."
)
_MSG_POLICY_AND_CONTEXT_FN = (
    "{api}: got both policy= and context_fn=; each layer runs under one context_fn. Fix: pass "
    "policy=save_matmuls() (it becomes the context_fn), or context_fn= alone."
)
_MSG_REENTRANT_CONTEXT = (
    "{api}: use_reentrant=True cannot run a policy, a context_fn or debug=True (the reentrant "
    "variant has no saved-tensor hooks); a gradient_checkpointing_kwargs dict without "
    "use_reentrant means True, as torch reads it. Fix: use_reentrant=False (transformers' "
    "default, and ours when left out)."
)
_MSG_EVERY_N_LAYERS = (
    "{api}: every_n_layers must be a positive int (1 checkpoints every layer, 2 every second "
    "one, ...), got {got!r}. Fix: every_n_layers=1."
)
_MSG_BUDGET_WITH = (
    "{api}: budget= cannot be combined with {what}: the plan chooses per layer whether to "
    "checkpoint it and which op outputs to keep, and installs non-reentrant checkpoint hooks "
    "with its own policy. Fix: pass budget= (with example_inputs=/example_kwargs=) alone, or "
    "{what} without budget=."
)
_MSG_BUDGET_NEEDS_EXAMPLE = (
    "checkpointing.integrations.transformers.enable: budget= needs example_inputs= or "
    "example_kwargs= (one training step's inputs, e.g. example_kwargs={'input_ids': ids, "
    "'labels': ids}) to profile the step it plans for; got neither. Fix: pass a batch of the "
    "shapes you train with."
)
_MSG_EXAMPLE_WITHOUT_BUDGET = (
    "{api}: {names} only describe the step that budget= plans for, and no budget was given, so "
    "they would be ignored. Fix: add budget=0.5 (a fraction of the activation bytes kept "
    "without checkpointing) or bytes, or drop {names}."
)
_CALLED_BY = (
    "{cls}.activation_checkpointing_enable() was called (directly, through "
    "gradient_checkpointing_enable(), by the Trainer's gradient_checkpointing=True or by PEFT's "
    "prepare_model_for_kbit_training)"
)
_MSG_SPEC_WITH = (
    "{api}: spec= says which module gets what, so {what} cannot be given with it. Fix: drop "
    "{what}, or write it into the spec (a policy per pattern, e.g. "
    "{{'model.layers.*': 'save_matmuls'}})."
)
_MSG_PLAN_AND_FLAGS = (
    "checkpointing.integrations.transformers: " + _CALLED_BY + " on a model with a budget plan "
    "from enable(model, budget=...) (or the regions of enable(model, spec=...)): transformers' "
    "checkpointing would run inside the plan's regions, checkpointing the layers twice, and "
    "the plan would no longer describe the step. The model was left as it was. Fix: leave "
    "transformers' checkpointing off (the plan or spec already checkpoints): "
    "TrainingArguments(gradient_checkpointing=False), "
    "prepare_model_for_kbit_training(model, use_gradient_checkpointing=False); or call "
    "checkpointing.integrations.transformers.disable(model) first."
)
_MSG_KEPT = (
    "checkpointing.integrations.transformers: " + _CALLED_BY + " on a model whose layers "
    "checkpoint with {ours!r}, set by checkpointing.integrations.transformers.enable(model, "
    "...). That checkpointing was kept; {ignored} of this call were not applied. Fix: pass "
    "them to enable(model, ...) instead{hint}, or call disable(model) first to use "
    "transformers' own checkpointing."
)
_HINT_KEPT_OFFLOAD = " (offload=True: policy=checkpointing.policies.offload_ops(...))"
_ENABLE = "activation_checkpointing_enable"
_DISABLE = "activation_checkpointing_disable"
# What a checkpoint option means when ours leaves it out (Rule 10 compares a later call's).
_CHECKPOINT_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(checkpoint).parameters.items()
    if name in CHECKPOINT_OPTIONS
}


class _LayerCheckpoint:
    """What a layer calls as ``_gradient_checkpointing_func(function, *args)``: our checkpoint
    with the options ``enable`` was given."""

    __slots__ = ("every_n_layers", "options")

    def __init__(self, options: dict[str, Any], every_n_layers: int) -> None:
        self.options = options
        self.every_n_layers = every_n_layers

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, *args, **self.options, **kwargs)

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={value!r}" for name, value in self.options.items())
        return f"checkpointing.checkpoint({options})"


class _Switches:
    """The model's own ``activation_checkpointing_enable``/``_disable`` while ours is on, and
    the input-embedding hooks ``enable`` added (Rules 3, 10 and 11)."""

    __slots__ = ("_model", "input_hooks")

    def __init__(self, model: PreTrainedModel, input_hooks: list[RemovableHandle] | None) -> None:
        self._model = weakref.ref(model)
        self.input_hooks = input_hooks

    def model(self) -> PreTrainedModel:
        model = self._model()
        if model is None:  # only the model's attributes reach these methods: it is alive
            internal_error("a model's activation-checkpointing switch outlived the model")
        return model

    def enable(
        self,
        activation_checkpointing_kwargs: dict[str, Any] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
    ) -> None:
        """A later enable: ours stays, or is refused over a plan; with ours off, theirs."""
        model = self.model()
        if has_plan(model) or has_spec(model):
            raise ValueError(_MSG_PLAN_AND_FLAGS.format(cls=type(model).__name__))
        ours = _our_layer_checkpoint(model)
        if ours is None:  # switched off some other way: transformers' own, as if never ours
            _remove_switches(model)
            _remove_input_hooks(model, self.input_hooks)
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs, every_n_layers=every_n_layers, offload=offload
            )
            return
        ignored = _not_applied(ours, activation_checkpointing_kwargs, every_n_layers, offload)
        if ignored:
            message = _MSG_KEPT.format(
                cls=type(model).__name__,
                ours=ours,
                ignored=", ".join(ignored),
                hint=_HINT_KEPT_OFFLOAD if offload else "",
            )
            warnings.warn(message, UserWarning, stacklevel=2)

    def disable(self) -> None:
        """A later disable: ours (plan and hooks included), then transformers' own."""
        model = self.model()
        disable(model)
        model.activation_checkpointing_disable()  # type: ignore[no-untyped-call]  # untyped in 5.23

    def __deepcopy__(self, memo: dict[int, Any]) -> _Switches:
        model = self.model()
        copied = memo.get(id(model), model)  # the model's copy, made before its attributes
        return _Switches(copied, copy.deepcopy(self.input_hooks, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Switches, (self.model(), self.input_hooks))

    def __repr__(self) -> str:
        return f"checkpointing's switches of {type(self.model()).__name__} (NOTE Rule 10)"


@overload
def enable(model: nn.Module, *, spec: Mapping[str, Any]) -> AppliedSpec: ...


@overload
def enable(
    model: nn.Module,
    *,
    policy: Policy | str | None = None,
    budget: None = None,
    every_n_layers: int = 1,
    tile_mlp: int | None = None,
    gradient_checkpointing_kwargs: Mapping[str, Any] | None = None,
    **checkpoint_options: Any,
) -> None: ...


@overload
def enable(
    model: nn.Module,
    *,
    budget: float | int,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **checkpoint_options: Any,
) -> ActivationPlan: ...


def enable(
    model: nn.Module,
    *,
    policy: Policy | str | None = None,
    budget: float | int | None = None,
    every_n_layers: int = 1,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    tile_mlp: int | None = None,
    spec: Mapping[str, Any] | None = None,
    gradient_checkpointing_kwargs: Mapping[str, Any] | None = None,
    **checkpoint_options: Any,
) -> ActivationPlan | AppliedSpec | None:
    """Make ``model``'s layers checkpoint with ``checkpointing.checkpoint`` (and ``policy``), or
    fit a memory budget (``budget``).

    The one-line replacement for ``model.activation_checkpointing_enable()``: the model decides
    which layers checkpoint, exactly as there (every ``every_n_layers``-th repeated block, in
    training mode only), and each of them runs ``checkpointing.checkpoint(...,
    use_reentrant=False)`` instead of torch's. With ``budget``, ``checkpointing.plan_checkpointing``
    decides instead, per layer, whether to checkpoint it and which op outputs to keep, from one
    profiled training step on the example inputs. A later ``activation_checkpointing_enable()``
    (the ``Trainer``'s ``gradient_checkpointing=True``, PEFT) keeps this choice, or refuses a
    budget plan.

    Args:
        model: a transformers ``PreTrainedModel`` whose ``supports_gradient_checkpointing`` is
            true, or a PEFT model wrapping one (``get_peft_model(model, config)``).
        policy: a selective-checkpoint policy (``checkpointing.policies``: ``save_matmuls()``,
            ``offload_ops(...)``, ...) run in every checkpointed layer; offload decisions move
            the outputs to host memory. The name of one that takes no arguments works too
            (``"save_attention"``, ``"save_matmuls"``, ``"save_everything"``,
            ``"save_nothing"``, and MaxText's remat policies as ``"maxtext:minimal"`` and the
            like: the layers' projections are then tagged with MaxText's names, NOTE
            [transformers tags]). ``None``: plain checkpointing (keep only the inputs).
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
        gradient_checkpointing_kwargs: the dict transformers'
            ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` takes, read as
            transformers reads it (NOTE [gradient_checkpointing_kwargs]): torch's checkpoint
            options, e.g. ``{"use_reentrant": False}``; a key that is none of them is an error.
        tile_mlp: a number of chunks: each layer's MLP (or an MoE layer's experts) becomes a
            sequence-tiled region (``checkpointing.tiled_mlp``; NOTE [transformers tiling]),
            for long context. Not with ``budget``.
        spec: instead of all the above, a spec as ``checkpointing.apply_spec`` reads it (which
            module gets full recompute, a policy, offload or nothing, e.g.
            ``{"model.layers.{0:8}.self_attn": "save_matmuls"}``), installed through
            ``checkpoint_module`` hooks; on a model with experts the routing is kept.

    Returns:
        With ``budget``, the installed ``checkpointing.ActivationPlan`` (``print(plan)`` shows
        per layer the decision, kept bytes and recompute time); with ``spec``, the
        ``checkpointing.AppliedSpec`` (``print`` it to see which module got what); otherwise
        ``None``.

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel`` (nor a PEFT model of one), or an
            option is unknown.
        ValueError: the model does not support checkpointing, its hook ignores our function,
            the options contradict each other, it is already checkpointed in a way this call
            cannot replace (a budget over any checkpointing, or anything over a budget plan:
            ``disable`` first), or the budget is below the smallest reachable bytes.

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
    base = unwrap(model, "enable")
    checkpoint_options = from_hf_kwargs(_API, gradient_checkpointing_kwargs, checkpoint_options)
    profiling = {"example_inputs=": example_inputs, "example_kwargs=": example_kwargs}
    profiling["loss_fn="] = loss_fn
    if spec is not None:  # Rule 14
        given = {"policy=": policy, "budget=": budget, "tile_mlp=": tile_mlp, **profiling}
        given["every_n_layers="] = None if every_n_layers == 1 else every_n_layers
        check_spec_alone(_API, given, checkpoint_options)
        input_hooks = _require_input_grads(base)
        try:
            result = install_spec(base, spec, routing=_has_experts(base))
        except BaseException:
            _remove_input_hooks(base, input_hooks)
            raise
        _install_switches(base, input_hooks)
        tag_spec(base, result)  # Rule 15
        return result
    if policy is None and isinstance(checkpoint_options.get("context_fn"), str):
        policy = checkpoint_options.pop("context_fn")  # a name is its policy (Rule 12)
    if isinstance(policy, str):
        policy = _named(_API, policy)  # Rule 12
    if budget is None and _has_experts(base) and _runs_a_policy(checkpoint_options):
        policy = _with_routing(policy)  # Rule 13
    layer_options = check_options(
        _API, policy, budget, every_n_layers, profiling, checkpoint_options
    )
    check_tile_mlp(tile_mlp, budget)
    if budget is None:
        layer_checkpoint = _LayerCheckpoint(layer_options, every_n_layers)
        check_no_plan(base, "checkpointing through its hook")
        check_no_spec(base, "enable")
        _install(base, layer_checkpoint, every_n_layers)
        tag_layers(base, layer_options.get("context_fn"))  # Rule 15
        _install_switches(base, _require_input_grads(base))
        if tile_mlp is not None:
            tile_layers(base, tile_mlp)
        return None
    if example_inputs is None and example_kwargs is None:
        raise ValueError(_MSG_BUDGET_NEEDS_EXAMPLE)
    input_hooks = _require_input_grads(base)
    try:
        plan = install_plan(base, budget, example_inputs, example_kwargs, loss_fn)
    except BaseException:
        _remove_input_hooks(base, input_hooks)
        raise
    _install_switches(base, input_hooks)
    return plan


def disable(model: nn.Module) -> None:
    """Switch ``model``'s checkpointing off, as ``model.activation_checkpointing_disable()`` does.

    Undoes ``enable`` (with or without a budget, on the model, its PEFT model or a deep copy of
    it; and transformers' own ``activation_checkpointing_enable``): every layer runs its plain
    forward again, a budget plan's hooks are removed, and so are the input-embedding hooks, if
    ``enable`` added them, and the layers' tiling (``tile_mlp``).
    """
    base = unwrap(model, "disable")
    untile_layers(base)
    untag_layers(base)
    switches = _remove_switches(base)
    remove_plan(base)
    remove_spec(base)
    base._set_gradient_checkpointing(enable=False)
    if switches is not None:
        _remove_input_hooks(base, switches.input_hooks)


def unwrap(model: object, api: str) -> PreTrainedModel:
    """Rule 9: the transformers model that owns the layers, checked: ``model`` itself, or the
    model a PEFT model wraps."""
    base = model
    get_base_model = getattr(model, "get_base_model", None)
    if not isinstance(model, PreTrainedModel) and callable(get_base_model):
        base = get_base_model()
    if not isinstance(base, PreTrainedModel):
        type_name = type(model).__name__
        if base is not model:
            type_name += f" wrapping {type(base).__name__}"
        raise TypeError(_MSG_NOT_A_MODEL.format(api=api, type_name=type_name))
    if not base.supports_gradient_checkpointing:
        raise ValueError(_MSG_UNSUPPORTED.format(api=api, cls=type(base).__name__))
    return base


def check_options(
    api: str,
    policy: Policy | str | None,
    budget: float | int | None,
    every_n: object,
    profiling: dict[str, object],
    checkpoint_options: dict[str, Any],
) -> dict[str, Any]:
    """Rule 4, for ``enable`` and ``CheckpointingCallback``: the options each layer passes to
    ``checkpoint`` (none with a budget), checked now. ``profiling``: the arguments that only
    describe a budget's step (example inputs, loss function), by name."""
    _check_known(api, checkpoint_options)
    if isinstance(policy, str):
        policy = _named(api, policy)  # Rule 12
    if budget is not None:
        conflict = _budget_conflict(policy, every_n, checkpoint_options)
        if conflict is not None:
            raise ValueError(_MSG_BUDGET_WITH.format(api=api, what=conflict))
        return {}
    given = [name for name, value in profiling.items() if value is not None]
    if given:
        raise ValueError(_MSG_EXAMPLE_WITHOUT_BUDGET.format(api=api, names=", ".join(given)))
    if not isinstance(every_n, int) or isinstance(every_n, bool) or every_n < 1:
        raise ValueError(_MSG_EVERY_N_LAYERS.format(api=api, got=every_n))
    check_use_reentrant(checkpoint_options.get("use_reentrant"), api)
    options = {"use_reentrant": False, **checkpoint_options}
    if policy is not None:
        if "context_fn" in options:
            raise ValueError(_MSG_POLICY_AND_CONTEXT_FN.format(api=api))
        context_fn: ContextFn = as_context_fn(policy)
        options["context_fn"] = context_fn
    if _reentrant(options) and ("context_fn" in options or options.get("debug")):
        raise ValueError(_MSG_REENTRANT_CONTEXT.format(api=api))
    return options


def check_spec_alone(
    api: str, given: dict[str, object], checkpoint_options: dict[str, Any]
) -> None:
    """Rule 14: nothing beside ``spec=`` (``given``: the other arguments by name, None where
    not given)."""
    others = [name for name, value in given.items() if value is not None]
    others += [f"{name}=" for name in checkpoint_options]
    if others:
        raise ValueError(_MSG_SPEC_WITH.format(api=api, what=", ".join(others)))


def _has_experts(model: PreTrainedModel) -> bool:
    """Rule 13: whether the model's (text) config counts more than one expert."""
    config = model.config
    get_text_config = getattr(config, "get_text_config", None)
    text_config = get_text_config() if callable(get_text_config) else config
    for name in _EXPERT_COUNTS:
        count = getattr(text_config, name, None)
        if isinstance(count, int) and not isinstance(count, bool) and count > 1:
            return True
    return False


def _runs_a_policy(checkpoint_options: dict[str, Any]) -> bool:
    """Rule 13: whether the layers may run a policy of ours: no ``context_fn`` of the caller's,
    not reentrant, no debug."""
    return not (
        "context_fn" in checkpoint_options
        or _reentrant(checkpoint_options)
        or checkpoint_options.get("debug")
    )


def _reentrant(options: dict[str, Any]) -> bool:
    """Whether ``options`` run the reentrant variant: ``use_reentrant`` true, or ``None`` (torch's
    default, which a ``gradient_checkpointing_kwargs`` dict without it stands for); ours when
    left out is False."""
    value = options.get("use_reentrant", False)
    return value is None or bool(value)


def _with_routing(policy: Policy | None) -> Policy:
    """Rule 13: ``policy`` keeping the routing too."""
    if policy is None:
        return save_routing()
    return either(policy, save_routing())


def _check_known(api: str, checkpoint_options: dict[str, Any]) -> None:
    """Rule 4: an unknown option is an error now, not a keyword a layer's forward swallows."""
    unknown = sorted(checkpoint_options.keys() - CHECKPOINT_OPTIONS)
    if unknown:
        hint = _HINT_OFFLOAD if "offload" in unknown else ""
        allowed = sorted(CHECKPOINT_OPTIONS)
        raise TypeError(
            _MSG_UNKNOWN_OPTION.format(api=api, names=unknown, allowed=allowed, hint=hint)
        )


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


def _our_layer_checkpoint(model: PreTrainedModel) -> _LayerCheckpoint | None:
    """Rule 10: our function, on a layer that checkpoints with it; None when ours is off."""
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(function, _LayerCheckpoint) and getattr(
            module, "gradient_checkpointing", False
        ):
            return function
    return None


def _not_applied(
    ours: _LayerCheckpoint, options: dict[str, Any] | None, every_n: int, offload: bool
) -> list[str]:
    """Rule 10: the options of a later ``activation_checkpointing_enable`` that ours differs
    from (an option ours leaves at ``checkpoint``'s default counts as that default)."""
    ignored = [
        f"{name}={value!r}"
        for name, value in (options or {}).items()
        if ours.options.get(name, _CHECKPOINT_DEFAULTS.get(name)) != value
    ]
    if every_n != ours.every_n_layers:
        ignored.append(f"every_n_layers={every_n!r}")
    if offload:
        ignored.append("offload=True")
    return ignored


def _install_switches(model: PreTrainedModel, input_hooks: list[RemovableHandle] | None) -> None:
    """Rule 10: set the model's own enable/disable to ours (once), recording the input hooks
    that ``enable`` added (Rule 3)."""
    switches = _switches(model)
    if switches is None:
        switches = _Switches(model, input_hooks)
        setattr(model, _ENABLE, switches.enable)
        setattr(model, _DISABLE, switches.disable)
    elif input_hooks is not None:
        switches.input_hooks = input_hooks


def _switches(model: PreTrainedModel) -> _Switches | None:
    """Rule 11: the switches set on ``model`` (found through its own attribute)."""
    owner = getattr(vars(model).get(_ENABLE), "__self__", None)
    return owner if isinstance(owner, _Switches) else None


def _remove_switches(model: PreTrainedModel) -> _Switches | None:
    """Rule 10: give the model back transformers' own enable/disable; the removed switches."""
    switches = _switches(model)
    if switches is not None:
        vars(model).pop(_ENABLE, None)
        vars(model).pop(_DISABLE, None)
    return switches


def _require_input_grads(model: PreTrainedModel) -> list[RemovableHandle] | None:
    """Rule 3: as ``activation_checkpointing_enable``, make the input embeddings' output require
    grad, unless hooks for that are already in place; the hooks it added, if any."""
    if model.main_input_name != "input_ids" and not getattr(model, "_hf_peft_config_loaded", False):
        return None
    if getattr(model, "_require_grads_hooks", None):
        return None
    model.enable_input_require_grads()  # type: ignore[no-untyped-call]  # untyped in 5.23
    hooks: list[RemovableHandle] | None = getattr(model, "_require_grads_hooks", None)
    return hooks or None


def _remove_input_hooks(model: PreTrainedModel, added: list[RemovableHandle] | None) -> None:
    """Rule 3: remove the input-embedding hooks ``enable`` added, and only those."""
    if added is not None and getattr(model, "_require_grads_hooks", None) is added:
        model.disable_input_require_grads()  # type: ignore[no-untyped-call]  # untyped in 5.23
