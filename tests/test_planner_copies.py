"""Copies of a planned model (``copy.deepcopy``, ``torch.save``/``load``): the plan comes off a
copy, and a copy plans afresh once it has; and plans themselves pickle as data and apply."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from planner_support import TinyLlama, encoder, encoder_inputs, grads_of, llama_loss
from torch import nn

from checkpointing import ActivationPlan, plan_checkpointing
from checkpointing._module import is_module_checkpointed, remove_checkpoint_module
from checkpointing._planning import search as search_module


def _copy(model: nn.Module, how: str) -> nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _hooked(model: nn.Module) -> dict[str, tuple[int, int, bool]]:
    """Per module that has any: its forward pre-hooks, forward hooks, and whether it is
    checkpointed."""
    found = {}
    for name, module in model.named_modules():
        count = (len(module._forward_pre_hooks), len(module._forward_hooks))
        if any(count) or is_module_checkpointed(module):
            found[name] = (*count, is_module_checkpointed(module))
    return found


# A post-norm encoder (trails, Rule M13; joins off, which outbid them there), the same encoder
# with joined blocks (Rule S9) and a tiny Llama (head and tail spans, Rule M11).
_PLANNED = {
    "trails": (encoder, encoder_inputs, None, ["trail", "trail"]),
    "joined": (encoder, encoder_inputs, None, []),
    "head and tail": (
        TinyLlama,
        lambda: torch.randint(0, 64, (2, 16)),
        llama_loss,
        ["head", "tail"],
    ),
}


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("case", list(_PLANNED))
def test_remove_takes_the_plan_off_a_copy(
    case: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plan.remove(copy)`` of a copied planned model (it used to refuse) leaves no hook of
    the plan on any module of the copy, spans, trails and joined blocks included; the copy's
    gradients are the plain run's (bitwise, with dropout) and the original stays planned until
    removed."""
    build, make_inputs, loss_fn, kinds = _PLANNED[case]
    if case == "trails":
        monkeypatch.setattr(search_module, "JOINS", False)
    torch.manual_seed(0)
    model, x = build(), make_inputs()
    plain = grads_of(model, x, loss_fn)
    plan = plan_checkpointing(model, x, budget=0.3, loss_fn=loss_fn, objective="flops")
    assert [s.kind for s in plan.spans] == kinds
    if case == "joined":
        assert any(r.joined for r in plan.regions), str(plan)
    plan.apply(model)
    twin = _copy(model, how)
    assert _hooked(twin) == _hooked(model) != {}
    assert plan.remove(twin) is twin
    assert _hooked(twin) == {}
    for a, b in zip(plain, grads_of(twin, x, loss_fn), strict=True):
        assert torch.equal(a, b)
    assert _hooked(model) != {}
    with pytest.raises(ValueError, match="nor to a model it was copied from"):
        plan.remove(twin)  # nothing left to take off
    plan.remove(model)
    assert _hooked(model) == {}


@pytest.mark.parametrize("case", list(_PLANNED))
def test_a_copy_replans_as_a_fresh_model(case: str) -> None:
    """Planning a copy that still carries a plan's hooks is refused, naming ``plan.remove``
    (even with its regions' checkpoints removed by hand: the spans would be recorded while
    profiling); once removed, the copy measures what a fresh model does."""
    build, make_inputs, loss_fn, _kinds = _PLANNED[case]
    torch.manual_seed(0)
    model, x = build(), make_inputs()
    fresh = copy.deepcopy(model)
    plan = plan_checkpointing(model, x, budget=0.3, loss_fn=loss_fn, objective="flops")
    plan.apply(model)
    twin = copy.deepcopy(model)
    plan.remove(model)
    for region in plan.regions:
        module = twin.get_submodule(region.name)
        if region.checkpoint and is_module_checkpointed(module):
            remove_checkpoint_module(module)
    with pytest.raises(ValueError, match=r"carries the hooks of an applied ActivationPlan") as e:
        plan_checkpointing(twin, x, budget=0.3, loss_fn=loss_fn, objective="flops")
    for phrase in ("plan_checkpointing", "copy.deepcopy or torch.save/load", "Fix: plan.remove"):
        assert phrase in str(e.value)
    plan.remove(twin)
    again = plan_checkpointing(twin, x, budget=0.3, loss_fn=loss_fn, objective="flops")
    first = plan_checkpointing(fresh, x, budget=0.3, loss_fn=loss_fn, objective="flops")
    # What the profile measured (the plans themselves may differ: time breaks FLOP ties).
    assert (again.baseline_bytes, again.floor_bytes) == (first.baseline_bytes, first.floor_bytes)


# --- plans pickle -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_plan_pickles_as_data_and_applies(how: str) -> None:
    """``pickle``/``torch.save`` of a plan, applied or not (it used to raise "cannot pickle
    'weakref.ReferenceType'"): the copy equals the plan (its JSON and timings), is bound to no
    model, and applied to the model gives the plain run's gradients (bitwise, with dropout)."""
    model, x = encoder(), encoder_inputs()
    plain = grads_of(model, x, None)
    plan = plan_checkpointing(model, x, budget=0.3, objective="flops")
    plan.timed = (1.0, 1.25)
    plan.apply(model)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(plan))
    else:
        buffer = io.BytesIO()
        torch.save(plan, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    plan.remove(model)
    assert isinstance(loaded, ActivationPlan)
    assert loaded.to_json() == plan.to_json()
    assert loaded.timed == plan.timed
    assert str(loaded) == str(plan)
    loaded.apply(model)
    try:
        grads = grads_of(model, x, None)
    finally:
        loaded.remove(model)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a, b)
