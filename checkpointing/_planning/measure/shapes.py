"""Planning without memory: a model on the meta device, or of fake tensors, profiled by shapes.

Owns ``shapes_only`` (whether a model and its example inputs hold no memory to run) and
``shape_step`` (the setting a step of shapes runs in: one ``FakeTensorMode``, the model's
parameters and buffers swapped for fake ones and the inputs made fake, value-dependent ops
refused by name). The recorder and the live-byte count tell storages apart there by their objects
(NOTE [Storage keys], Rule 4); the profile is the same data a real step gives. Pricing for the
device the plan is for belongs to ``costs`` (``named_costs``), the search's arguments to
``search``.

NOTE [Planning without memory]
  Rule 1. A model or an example input with a parameter, buffer or tensor on the meta device or
          fake (``FakeTensorMode``'s) is planned by shapes: the steps run under one fake mode
          (the fake tensors' own, else a new one), every parameter, buffer and input as a fake
          tensor of its shape, strides, dtype and ``requires_grad`` (a meta one on the CPU, so
          that ops take the CPU's kernels, as the small twin that checks the plan runs them;
          a fake one on its own device), swapped in for the steps and out after (the model is
          left as found, Rule M7). Nothing is allocated: the fake mode runs no real kernel (an op
          without a shape rule is refused, not run on zeros).
  Rule 2. The profile is the real step's: the ops, their order and keys (Rule M3), the storages
          they make and share (each named by its storage object while it lives, NOTE [Storage
          keys], Rule 4), what autograd saves and the live bytes at each op (NOTE [Live bytes],
          counted the same way). So a plan of shapes keeps, to the byte, what the same model's
          plan on real tensors keeps, and its JSON applies to the real model.
  Rule 3. An op whose result depends on values (``.item()``, ``bool(tensor)``, ``nonzero``,
          boolean masks, a mixture of experts' routing counts) has no answer without them: the
          planner raises naming the op and the fix (plan on real tensors), never a plan of
          guessed shapes.
  Rule 4. The kernels are those of the fake tensors' device: a meta model plans with the CPU's
          (its attention is the CPU's flash kernel, whose saved tensors are the output, the
          log-sum-exp and the inputs, as CUDA's flash kernel's are); the prices are those of
          the device the plan is for (``device=``), named in the plan.
  Rule 5. A model may branch on whether its tensors are fake, and is planned along the branch
          it takes with them: transformers takes a fake tensor for a trace and then builds the
          causal mask it skips on real tensors (and repeats the keys and values for it), except
          where a cache object gives the mask's sizes (``use_cache=True``; the planned layers
          run without it, NOTE [Key/value caches], Rule 2). Nothing here can tell such a branch
          from the model's own logic; the docs say to plan with the settings that take, with
          fake tensors, the path the real step takes, and the tests pin that path for a Llama.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ... import _compat
from ..._trees import tensors

__all__ = ["shape_step", "shapes_only"]

_MSG_VALUES = (
    "checkpointing.plan_checkpointing: the model runs {op}, whose result depends on tensor "
    "values, while planning by shapes (the model or the example inputs are on the meta device "
    "or fake), where there are none: a plan would rest on guessed shapes. Fix: plan on real "
    "tensors (a smaller copy of the model that runs here, or the real one on its device), or "
    "keep that op out of the step planned."
)
_MSG_TWO_MODES = (
    "checkpointing.plan_checkpointing: the fake tensors of the model and the example inputs "
    "belong to more than one FakeTensorMode, so no single step can run them. Fix: make the "
    "model and the inputs under one mode (with FakeTensorMode() as mode: ...), or put the "
    "model on the meta device (with torch.device('meta'): ...)."
)


def _without_memory(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or _compat.is_fake_tensor(tensor)


def shapes_only(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Rule 1: whether any parameter, buffer or example input is on the meta device or fake."""
    every = itertools.chain(model.parameters(), model.buffers(), tensors((args, kwargs)))
    return any(_without_memory(t) for t in every)


def _mode_of(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Rule 1: the fake tensors' one mode, or a new one where none is fake."""
    every = itertools.chain(model.parameters(), model.buffers(), tensors((args, kwargs)))
    modes = {id(m): m for t in every if (m := _compat.fake_mode_of(t)) is not None}
    if len(modes) > 1:
        raise ValueError(_MSG_TWO_MODES)
    return next(iter(modes.values()), None) or _compat.new_fake_mode()


def _fake(tensor: torch.Tensor, mode: Any) -> torch.Tensor:
    """Rule 1: ``tensor`` as a fake tensor of ``mode`` (a meta one on the CPU); a fake one of
    that mode as it is."""
    if _compat.fake_mode_of(tensor) is mode:
        return tensor
    device = torch.device("cpu") if tensor.is_meta else tensor.device
    with mode:
        made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    made.requires_grad_(tensor.requires_grad)
    return nn.Parameter(made, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else made


def _fake_tree(tree: Any, mode: Any) -> Any:
    """The tuples, lists and dicts of ``tree`` with every tensor made fake."""
    if isinstance(tree, torch.Tensor):
        return _fake(tree, mode)
    if isinstance(tree, tuple | list):
        return type(tree)(_fake_tree(item, mode) for item in tree)
    if isinstance(tree, dict):
        return {key: _fake_tree(item, mode) for key, item in tree.items()}
    return tree


@contextlib.contextmanager
def shape_step(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Rules 1 and 3: the fake example inputs, inside the fake mode with the model's parameters
    and buffers fake; an op that needs values raises ``ValueError`` naming it."""
    mode = _mode_of(model, args, kwargs)
    swapped = {
        name: _fake(tensor, mode)
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
    }
    fake_args, fake_kwargs = _fake_tree(args, mode), _fake_tree(kwargs, mode)
    try:
        with _compat.reparametrized(model, swapped), mode:
            yield fake_args, fake_kwargs
    except _compat.SHAPE_ONLY_ERRORS as error:
        raise ValueError(_MSG_VALUES.format(op=getattr(error, "func", error))) from error
