"""A spec on a Hugging Face ``transformers`` model, for ``enable(spec=...)`` and
``CheckpointingCallback(spec=...)``.

Owns installing ``checkpointing.apply_spec``'s selection on a model (the routing of a model with
experts kept, transformers' flags telling the truth) and finding and removing it again, from the
model itself (a deep copy included). Its rules are Rule 14 of NOTE [transformers integration]
(in ``_hf_enable``, which owns ``enable``/``disable`` and the options); the spec's grammar and
selection belong to ``checkpointing._spec_grammar`` and ``checkpointing._spec``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Final

from transformers.modeling_utils import PreTrainedModel

from .._spec import AppliedSpec, Selected, carries_spec, install, remove_found, select
from .._spec_grammar import Action
from ..policies import either, save_routing
from ._hf_budget import _RunLayer, check_no_plan

__all__ = ["check_no_spec", "has_spec", "install_spec", "remove_spec"]

_API: Final = "integrations.transformers.enable"
_MSG_ALREADY = (
    "checkpointing.integrations.transformers.{api}: {cls} is already checkpointed ({how}); a "
    "spec on top would checkpoint its layers twice. Fix: call "
    "checkpointing.integrations.transformers.disable(model) first (it also undoes "
    "transformers' own activation_checkpointing_enable())."
)
_MSG_BUDGET = (
    "checkpointing.integrations.transformers.{api}: the spec key {key!r} has a budget ({value}); "
    "a spec given here installs its regions now, and a budget is planned at the first step. Fix: "
    "enable(model, budget=...) plans the layers for a budget; or, on a model without "
    "transformers' checkpointing, checkpointing.apply_spec(model, spec) plans a budget key at "
    "the first step."
)
_HOW_FLAGS = "its layers' gradient_checkpointing flags are on: enable(model) or transformers' own"
_HOW_SPEC = "by enable(model, spec=...)"


def has_spec(model: PreTrainedModel) -> bool:
    """Whether a spec's regions are installed on ``model`` (found from the model itself)."""
    return carries_spec(model)


def check_no_spec(model: PreTrainedModel, api: str) -> None:
    """Rule 14: a model with a spec takes no other checkpointing until ``disable``."""
    if has_spec(model):
        raise ValueError(_MSG_ALREADY.format(api=api, cls=type(model).__name__, how=_HOW_SPEC))


def install_spec(
    model: PreTrainedModel, spec: Mapping[str, Any], *, routing: bool, api: str = _API
) -> AppliedSpec:
    """Rule 14: the spec's selection installed on ``model``, each region keeping the routing
    where ``routing`` (a model with experts); transformers' flags on with ``_RunLayer`` when any
    region is installed. On any error the model is left as it was."""
    cls = type(model).__name__
    check_no_plan(model, "a spec")
    check_no_spec(model, api)
    if any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        raise ValueError(_MSG_ALREADY.format(api=api, cls=cls, how=_HOW_FLAGS))
    chosen = select(model, spec, f"{api}(spec=...)")
    budget = next((item for item in chosen if item.action.kind == "budget"), None)
    if budget is not None:
        raise ValueError(_MSG_BUDGET.format(api=api, key=budget.key, value=budget.action))
    if routing:
        chosen = [_keeping_routing(item) for item in chosen]
    result = AppliedSpec(chosen, sum(1 for _ in model.modules()) - 1, dry_run=False)
    install(result, model)
    # A pre-4.35 hook takes ``value`` and no function: its flags stay off.
    modern_hook = "value" not in inspect.signature(model._set_gradient_checkpointing).parameters
    if modern_hook and any(item.action.kind != "none" for item in chosen):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=_RunLayer())
    return result


def remove_spec(model: PreTrainedModel) -> None:
    """Take a spec's regions off ``model`` (transformers' flags aside: ``disable`` switches them
    off)."""
    remove_found(model)


def _keeping_routing(item: Selected) -> Selected:
    """Rule 14 (as Rule 13): ``full`` runs ``save_routing()`` and a policy ``either(policy,
    save_routing())``; ``offload`` recomputes nothing and ``none`` nothing at all."""
    if item.action.kind == "full":
        return dataclasses.replace(item, action=Action("policy", save_routing()))
    if item.action.kind == "policy" and item.action.policy is not None:
        policy = either(item.action.policy, save_routing())
        return dataclasses.replace(item, action=Action("policy", policy))
    return item
