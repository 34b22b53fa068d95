"""The ``Trainer`` route: ``CheckpointingCallback`` switches ``checkpointing`` on at train begin.

Owns ``CheckpointingCallback``, a ``transformers.TrainerCallback`` that runs
``checkpointing.integrations.transformers.enable`` on the ``Trainer``'s model (a PEFT model
included) with the policy, budget and options it was made with, and the batch a budget profiles
when none was given. What ``enable`` installs, and how it outlives a later
``activation_checkpointing_enable()``, belongs to ``_hf_enable`` (NOTE [transformers
integration]), which this module imports; the face (``transformers``) loads this module on
first use of the name: the ``Trainer``'s modules (``training_args``, ``trainer_callback`` and
some 300 more) load only for those who use it.

NOTE [Trainer callback]
  Rule 1. Options are checked when the callback is made, as ``enable`` checks them: a mistake
          fails before the ``Trainer`` is built.
  Rule 2. ``on_train_begin`` runs after the ``Trainer`` has switched on its own checkpointing
          (``TrainingArguments(gradient_checkpointing=True)``) and prepared the model, before the
          first step. Without a budget, ours replaces the ``Trainer``'s (a warning names the
          ``gradient_checkpointing_kwargs`` that were not applied); with a budget, the
          ``Trainer``'s flag is an error, as a budget over transformers' checkpointing is.
  Rule 3. A budget without ``example_inputs``/``example_kwargs`` profiles the first
          ``per_device_train_batch_size`` examples of the training set, collated by the
          ``Trainer``'s own collator (which drops the columns the model does not take), on
          ``args.device``. The CPU RNG is put back afterwards (a collator may draw, e.g. to mask
          tokens), and the data loader is not iterated (that would draw the sampler's order), so
          the steps see the data and dropout they would see without the callback.
  Rule 4. A second ``train()`` keeps the plan the first one installed (planning again would be
          refused, Rule 8 of NOTE [transformers integration]); without a budget, ``enable``
          runs again and replaces ours with the same.
  Rule 5. ``spec=`` is checked when the callback is made (its keys and values; the modules it
          names are matched at train begin, on the model) and installed by
          ``enable(model, spec=...)``; like a budget, it is an error beside the ``Trainer``'s
          own checkpointing, and a second ``train()`` keeps what the first installed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sized
from typing import Any

import torch
from torch import nn
from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState
from transformers.training_args import TrainingArguments

from .._planning import ActivationPlan
from .._spec import AppliedSpec
from .._spec_grammar import check_spec
from ..policies import Policy
from ._hf_budget import has_plan
from ._hf_enable import check_options, check_spec_alone, enable, unwrap
from ._hf_kwargs import from_hf_kwargs
from ._hf_spec import has_spec

__all__ = ["CheckpointingCallback"]

_API = "checkpointing.integrations.transformers.CheckpointingCallback"
_MSG_BUDGET_AND_TRAINER = (
    _API + ": budget= cannot run with TrainingArguments(gradient_checkpointing=True) (or "
    "activation_checkpointing=True): the Trainer switched on transformers' own checkpointing "
    "before training began, and it would run inside the plan's regions, checkpointing the "
    "layers twice. Fix: TrainingArguments(gradient_checkpointing=False); the plan checkpoints "
    "the layers it chooses."
)
_MSG_SPEC_AND_TRAINER = (
    _API + ": spec= cannot run with TrainingArguments(gradient_checkpointing=True) (or "
    "activation_checkpointing=True): the Trainer switched on transformers' own checkpointing "
    "before training began, and the spec's regions would be checkpointed twice. Fix: "
    "TrainingArguments(gradient_checkpointing=False); the spec says what is checkpointed."
)
_MSG_NO_EXAMPLE = (
    _API + "(budget=...) profiles one training step: without example_kwargs= it collates the "
    "first per_device_train_batch_size examples of the Trainer's train_dataset into a dict of "
    "the model's inputs, which needs a dataset with __len__ and __getitem__ and a collator "
    "returning a dict; got {got}. Fix: pass example_kwargs= (one batch as the model receives "
    "it, e.g. {{'input_ids': ids, 'labels': ids}})."
)
_MSG_TRAINER_KWARGS = (
    _API + " replaced the Trainer's own activation checkpointing "
    "(TrainingArguments(gradient_checkpointing=True)) with checkpointing's; its "
    "activation_checkpointing_kwargs (gradient_checkpointing_kwargs) {kwargs!r} were not "
    "applied. Fix: pass them to "
    "CheckpointingCallback(gradient_checkpointing_kwargs=...) and leave "
    "gradient_checkpointing off."
)


class CheckpointingCallback(TrainerCallback):
    """Checkpoint the ``Trainer``'s model with ``checkpointing`` from the start of training.

    The ``Trainer`` route to ``checkpointing.integrations.transformers.enable``: pass it in
    ``Trainer(..., callbacks=[CheckpointingCallback(policy=save_matmuls())])`` instead of
    ``TrainingArguments(gradient_checkpointing=True)``. When training begins it calls
    ``enable(model, ...)`` on the ``Trainer``'s model (a PEFT model's base model included), with
    a policy per layer or a memory budget; the model stays checkpointed after training, as with
    the ``Trainer``'s own flag. Options are checked when the callback is made, so a mistake
    fails before the ``Trainer`` is built. A second ``train()`` keeps the budget plan the first
    one installed; without a budget, ``enable`` runs again and installs the same.

    Args:
        policy, every_n_layers, gradient_checkpointing_kwargs, **checkpoint_options: as
            ``enable`` (a policy, or the name of one, run in every checkpointed layer; which
            layers; transformers' ``gradient_checkpointing_kwargs`` dict, as
            ``TrainingArguments`` takes it; options of ``checkpointing.checkpoint``).
        budget: as ``enable``: the activation bytes a step may keep (a fraction or bytes);
            the plan is made on the first batch of the training set unless ``example_inputs``
            or ``example_kwargs`` give one: its first ``per_device_train_batch_size``
            examples, collated by the ``Trainer``'s collator, on ``args.device``, without
            iterating the data loader and with the CPU RNG put back, so the steps see the data
            and dropout they would see without the callback. Leave the ``Trainer``'s
            ``gradient_checkpointing`` off with a budget (it is an error: the ``Trainer``
            switches its own checkpointing on first, and the layers would be checkpointed
            twice).
        example_inputs, example_kwargs, loss_fn: as ``enable``; only with ``budget``.
        spec: instead of all the above, as ``enable``: a spec (``checkpointing.apply_spec``'s
            mapping) installed at train begin; checked when the callback is made. Leave the
            ``Trainer``'s ``gradient_checkpointing`` off with a spec (it is an error).

    Attributes:
        plan: the ``ActivationPlan`` installed at train begin with ``budget``, else ``None``.
        applied: the ``AppliedSpec`` installed at train begin with ``spec``, else ``None``.

    Example:
        >>> import tempfile, torch, transformers
        >>> from checkpointing.integrations.transformers import CheckpointingCallback
        >>> from checkpointing.policies import save_matmuls
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(64, (8,))
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), max_steps=2,
        ...     per_device_train_batch_size=2, use_cpu=True, report_to="none",
        ...     save_strategy="no", disable_tqdm=True)
        >>> trainer = transformers.Trainer(model, args, train_dataset=[{"input_ids": ids,
        ...     "labels": ids}] * 4, callbacks=[CheckpointingCallback(policy=save_matmuls())])
        >>> _ = trainer.train()
        {'train_runtime': ...}
        >>> model.model.layers[0]._gradient_checkpointing_func
        checkpointing.checkpoint(use_reentrant=False, context_fn=...)
    """

    def __init__(
        self,
        *,
        policy: Policy | str | None = None,
        budget: float | int | None = None,
        every_n_layers: int = 1,
        example_inputs: Any = None,
        example_kwargs: Mapping[str, Any] | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        spec: Mapping[str, Any] | None = None,
        gradient_checkpointing_kwargs: Mapping[str, Any] | None = None,
        **checkpoint_options: Any,
    ) -> None:
        checkpoint_options = from_hf_kwargs(_API, gradient_checkpointing_kwargs, checkpoint_options)
        profiling = {"example_inputs=": example_inputs, "example_kwargs=": example_kwargs}
        profiling["loss_fn="] = loss_fn
        if spec is not None:  # Rule 5
            given = {"policy=": policy, "budget=": budget, **profiling}
            given["every_n_layers="] = None if every_n_layers == 1 else every_n_layers
            check_spec_alone(_API, given, checkpoint_options)
            check_spec(spec, _API.removeprefix("checkpointing."))
        check_options(_API, policy, budget, every_n_layers, profiling, checkpoint_options)
        self.spec = spec
        self.applied: AppliedSpec | None = None
        self.policy = policy
        self.budget = budget
        self.every_n_layers = every_n_layers
        self.example_inputs = example_inputs
        self.example_kwargs = example_kwargs
        self.loss_fn = loss_fn
        self.checkpoint_options = checkpoint_options
        self.plan: ActivationPlan | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Enable ours on the ``Trainer``'s model, after the ``Trainer`` switched its own
        checkpointing on and prepared the model, before the first step: without a budget ours
        replaces the ``Trainer``'s (a warning names the ``gradient_checkpointing_kwargs`` not
        applied); with a budget the ``Trainer``'s flag is an error."""
        model: nn.Module = kwargs["model"]
        if self.spec is not None:  # Rule 5
            if args.activation_checkpointing:
                raise ValueError(_MSG_SPEC_AND_TRAINER)
            if self.applied is None or not has_spec(unwrap(model, _API)):
                self.applied = enable(model, spec=self.spec)
            return
        if self.budget is None:
            if args.activation_checkpointing and args.activation_checkpointing_kwargs:
                message = _MSG_TRAINER_KWARGS.format(kwargs=args.activation_checkpointing_kwargs)
                warnings.warn(message, UserWarning, stacklevel=2)
            enable(
                model,
                policy=self.policy,
                every_n_layers=self.every_n_layers,
                **self.checkpoint_options,
            )
            return
        if args.activation_checkpointing:
            raise ValueError(_MSG_BUDGET_AND_TRAINER)
        if self.plan is not None and has_plan(unwrap(model, _API)):
            return  # Rule 4
        example_inputs, example_kwargs = self.example_inputs, self.example_kwargs
        if example_inputs is None and example_kwargs is None:
            example_kwargs = _first_batch(args, kwargs.get("train_dataloader"))
        self.plan = enable(
            model,
            budget=self.budget,
            example_inputs=example_inputs,
            example_kwargs=example_kwargs,
            loss_fn=self.loss_fn,
        )


def _first_batch(args: TrainingArguments, loader: object) -> dict[str, Any]:
    """Rule 3: the first ``per_device_train_batch_size`` examples of the training set, collated
    as the ``Trainer`` collates them, on its device; the CPU RNG as it was."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__") or collate is None:
        raise ValueError(_MSG_NO_EXAMPLE.format(got=f"a {type(dataset).__name__} dataset"))
    size = min(args.per_device_train_batch_size, len(dataset))
    with torch.random.fork_rng(devices=[]):
        batch = collate([dataset[index] for index in range(size)])
    if not isinstance(batch, Mapping):
        raise ValueError(_MSG_NO_EXAMPLE.format(got=f"a collated {type(batch).__name__}"))
    return {
        name: value.to(args.device) if isinstance(value, torch.Tensor) else value
        for name, value in batch.items()
    }
