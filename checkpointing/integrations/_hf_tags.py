"""MaxText's tensor names on a transformers model's layers: the tags a name-based policy reads.

Owns ``tag_layers(model, context_fn)``, ``tag_spec(model, applied)`` and ``untag_layers(model)``:
forward hooks on the submodules of a model's ``GradientCheckpointingLayer`` blocks (or of the
modules a spec gave a policy) that name their outputs (and the attention
output projection's input) with ``checkpointing.policies.tag``, by MaxText's names
(``query_proj``, ``out_proj``, ``mlpwi_0``, ...; NOTE [MaxText presets] in
``checkpointing/_presets.py``), so that ``policies.maxtext(...)`` and any
``save_only_these_names``/``offload_these_names`` over those names keep them. ``_hf_enable``
calls them; the tags' meaning is the policies'.

NOTE [transformers tags]
  Rule 1. A layer's submodule is named by its attribute name (the last part of its path), the
          names transformers' Llama-style layers use: ``q_proj`` -> ``query_proj``, ``k_proj``
          -> ``key_proj``, ``v_proj`` -> ``value_proj``, ``qkv_proj`` -> ``qkv_proj``, ``o_proj``
          -> ``out_proj`` (and its input -> ``context``), ``gate_proj`` -> ``mlpwi_0``,
          ``up_proj`` -> ``mlpwi_1``, ``gate_up_proj`` -> ``mlpwi``, ``down_proj`` ->
          ``mlpwo``. A module inside a named one (PEFT's ``q_proj.base_layer``) is not named
          again: the outer module's output is the projection's, adapter included.
  Rule 2. Only the names the policy asks for are tagged (``tag`` costs a dispatch per call). A
          MaxText name the policy asks for that no submodule of the model makes (a mixture of
          experts' fused experts have no ``gate_proj``) is said once per ``enable`` in a
          warning, naming them: they are recomputed, not kept. MaxText keeps nothing for a name
          its model never tags either, but our user asked through a model they did not write.
          Not said: a fused name whose unfused names the policy asks for and the model makes
          (``qkv_proj`` beside ``query_proj``, ``mlpwi`` beside ``mlpwi_0``), and the reverse:
          MaxText lists both forms in every preset, for either kind of model.
  Rule 3. The hooks are instances of our classes, found on the model and removed through
          ``_compat.modules`` (NOTE [transformers integration], Rule 11: ``disable`` works on a
          ``copy.deepcopy`` of an enabled model, whose hooks are copies). A later ``enable``
          removes the previous tags first.
  Rule 4. A hook only tags: ``tag`` returns its tensor and the hooks return None, so the
          forward computes what it computed untagged (outside a selective checkpoint, a tag is
          a no-op dispatch).
  Rule 5. The names are read from the policy each layer runs, however it was given:
          ``policy=`` (or its name), a policy given as ``context_fn=``, or
          ``as_context_fn(policy, ...)`` (with an ``OffloadStats``, say). A ``context_fn`` of
          any other kind names nothing, and nothing is tagged.
  Rule 6. With ``enable(spec=...)``, each module the spec gives a policy is tagged under it
          with the names that policy asks for (the module itself too: a spec may pick
          ``q_proj``), as a layer is under ``policy=``; modules under two such policies are
          hooked once per name.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, Final

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .. import _compat
from .._presets import MAXTEXT_NAMES
from .._selective import create_selective_checkpoint_contexts
from .._selective.unkept import asked_of
from .._spec import AppliedSpec
from ..policies import tag

__all__ = ["tag_layers", "tag_spec", "untag_layers"]

# Rule 1: a submodule's attribute name -> the MaxText name of its output.
_OUTPUT_NAMES: Final = {
    "q_proj": "query_proj",
    "k_proj": "key_proj",
    "v_proj": "value_proj",
    "qkv_proj": "qkv_proj",
    "o_proj": "out_proj",
    "gate_proj": "mlpwi_0",
    "up_proj": "mlpwi_1",
    "gate_up_proj": "mlpwi",
    "down_proj": "mlpwo",
}
# Rule 1: a submodule's attribute name -> the MaxText name of its first input.
_INPUT_NAMES: Final = {"o_proj": "context"}
# Rule 2: MaxText's lists name the fused and the unfused projections both; a model has one.
_ALTERNATIVES: Final = {
    "qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "query_proj": ("qkv_proj",),
    "key_proj": ("qkv_proj",),
    "value_proj": ("qkv_proj",),
    "mlpwi": ("mlpwi_0", "mlpwi_1"),
    "mlpwi_0": ("mlpwi",),
    "mlpwi_1": ("mlpwi",),
}
_MSG_UNTAGGED = (
    "checkpointing.integrations.transformers.enable: the policy {policy!r} keeps MaxText's "
    "tensor name(s) {names}, which no submodule of {cls}'s layers makes (MaxText's names are "
    "given to the outputs of submodules named {modules}): those tensors are recomputed, not "
    "kept. Fix: pick a preset over names this model has, or tag the tensors in the model's "
    "code with checkpointing.policies.tag(tensor, name)."
)


class _TagOutput:
    """A forward hook naming its module's output (Rule 4: it returns None)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            tag(output, self.name)

    def __repr__(self) -> str:
        return f"checkpointing's tag {self.name!r} (output)"


class _TagInput:
    """A forward pre-hook naming its module's first input (Rule 4: it returns None)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            tag(args[0], self.name)

    def __repr__(self) -> str:
        return f"checkpointing's tag {self.name!r} (input)"


def tag_layers(model: nn.Module, context_fn: object) -> None:
    """Tag the MaxText names that the policy ``context_fn`` runs asks for on ``model``'s layers
    (Rules 1-3); none when it asks for none. Warns of asked names no submodule makes (Rule 2)."""
    policy = _policy_in(context_fn)
    roots = [
        (name, layer, policy)
        for name, layer in model.named_modules()
        if isinstance(layer, GradientCheckpointingLayer)
    ]
    _tag(model, roots)


def tag_spec(model: nn.Module, applied: AppliedSpec) -> None:
    """Rule 6: tag, under each module a spec gave a policy, the MaxText names that policy asks
    for (the module itself included, when it is a named projection)."""
    roots = [
        (selected.name, selected.module, selected.action.policy)
        for selected in applied.selected
        if selected.action.kind == "policy"
    ]
    _tag(model, roots)


def _tag(model: nn.Module, roots: Sequence[tuple[str, nn.Module, object]]) -> None:
    """Rules 1-3: the previous tags removed, each root's asked names tagged under it (once per
    module and name), a warning for the names asked that nothing made."""
    untag_layers(model)
    asked_anywhere: set[str] = set()
    made: set[str] = set()
    hooked: set[tuple[int, str]] = set()
    for prefix, root, policy in roots:
        asked = set(asked_of(policy).names & MAXTEXT_NAMES.keys())
        asked_anywhere |= asked
        if asked:
            made |= _tag_under(prefix, root, asked, hooked)
    missing = sorted(
        name
        for name in asked_anywhere - made - {"decoder_layer_input"}  # an input: kept anyway
        if not made.intersection(_ALTERNATIVES.get(name, ()))
    )
    if missing:
        policies = ", ".join(sorted({repr(policy) for _, _, policy in roots}))
        modules = ", ".join(sorted(_OUTPUT_NAMES))
        message = _MSG_UNTAGGED.format(
            policy=policies, names=missing, cls=type(model).__name__, modules=modules
        )
        warnings.warn(message, UserWarning, stacklevel=4)


def _policy_in(context_fn: object) -> object:
    """Rule 5: the policy a layer's ``context_fn`` runs: ``as_context_fn``'s partial of one, or
    a policy given as ``context_fn`` (anything else asks for no name)."""
    if (
        isinstance(context_fn, functools.partial)
        and context_fn.func is create_selective_checkpoint_contexts
        and context_fn.args
    ):
        return context_fn.args[0]
    return context_fn


def _tag_under(
    prefix: str, root: nn.Module, asked: set[str], hooked: set[tuple[int, str]]
) -> set[str]:
    """Hook ``root`` and its submodules whose names' tags are ``asked`` (Rule 1), each module
    and name once (``hooked``); the names made."""
    made: set[str] = set()
    named: list[str] = []
    for path, module in root.named_modules(prefix=prefix):
        if any(path.startswith(outer + ".") for outer in named):
            continue  # Rule 1: inside a named module
        attribute = path.rpartition(".")[2]
        output_name = _OUTPUT_NAMES.get(attribute)
        if output_name is None:
            continue
        named.append(path)
        input_name = _INPUT_NAMES.get(attribute)
        for name, is_input in ((output_name, False), (input_name, True)):
            if name is None or name not in asked:
                continue
            made.add(name)
            if (id(module), name) in hooked:
                continue
            hooked.add((id(module), name))
            if is_input:
                module.register_forward_pre_hook(_TagInput(name))
            else:
                module.register_forward_hook(_TagOutput(name))
    return made


def untag_layers(model: nn.Module) -> None:
    """Remove every tag hook ``tag_layers`` put on ``model`` (Rule 3)."""
    for module in model.modules():
        for hook in _compat.forward_hooks(module):
            if isinstance(hook, _TagOutput):
                _compat.remove_forward_hooks(module, hook, hook)
        for pre_hook in _compat.forward_pre_hooks(module):
            if isinstance(pre_hook, _TagInput):
                _compat.remove_forward_hooks(module, pre_hook, pre_hook)
