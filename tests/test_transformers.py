"""``checkpointing.integrations.transformers`` on tiny random Hugging Face models (no downloads).

Every check runs the same model three ways side by side: plain (no checkpointing), transformers'
own ``activation_checkpointing_enable()`` (torch's checkpoint) and ours, from the same weights
and RNG seed, in training mode with dropout on. Tests named ``test_rule<k>_...`` check Rule k of
NOTE [transformers integration].
"""

from __future__ import annotations

import copy
import doctest
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from frame_support import counting_ops
from hf_support import BATCH, SEQ, VOCAB, tiny_llama

import checkpointing
from checkpointing import _compat
from checkpointing._module import is_module_checkpointed
from checkpointing.integrations import transformers as hf_checkpointing
from checkpointing.policies import MATMUL_OPS, offload_ops, save_attention, save_matmuls

# Run in CI's first stage only (the `once` marker): an optional integration, whose checkpoint
# mechanisms the rest of the suite tests on every release.
pytestmark = [pytest.mark.once, pytest.mark.usefixtures("one_torch_thread")]

# A model whose checkpointing is switched by a setup function (None: plain).
Setup = Callable[[transformers.PreTrainedModel], None] | None


def _llama(layers: int = 3, *, use_cache: bool = False) -> transformers.PreTrainedModel:
    return tiny_llama(layers, attention_dropout=0.1, use_cache=use_cache)


def _gpt2() -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, use_cache=False
    )  # resid, embedding and attention dropout: 0.1 each by default
    return transformers.GPT2LMHeadModel(config)


def _bert() -> transformers.PreTrainedModel:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )  # hidden and attention dropout: 0.1 each by default
    return transformers.BertForMaskedLM(config)


MODELS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert}


def _hf_own(model: transformers.PreTrainedModel) -> None:
    model.activation_checkpointing_enable()


def _ours(model: transformers.PreTrainedModel) -> None:
    hf_checkpointing.enable(model)


@dataclass
class Step:
    """One training step's outcome."""

    loss: torch.Tensor
    grads: list[torch.Tensor | None]
    report: checkpointing.SavedTensorsReport


def _ids() -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _step(model: transformers.PreTrainedModel, setup: Setup, *, train: bool = True) -> Step:
    """Forward and backward of a copy of ``model`` switched by ``setup``, from seed 1."""
    model = copy.deepcopy(model).train(train)
    if setup is not None:
        setup(model)
    ids = _ids()
    torch.manual_seed(1)
    with checkpointing.saved_tensors_report() as report:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return Step(loss.detach(), [p.grad for p in model.parameters()], report)


def _assert_same_step(ours: Step, reference: Step) -> None:
    assert torch.equal(ours.loss, reference.loss)
    assert len(ours.grads) == len(reference.grads)
    for mine, theirs in zip(ours.grads, reference.grads, strict=True):
        assert (mine is None) == (theirs is None)  # None: a frozen parameter, in both runs
        assert mine is None or torch.equal(mine, theirs)
    assert any(grad is not None for grad in ours.grads)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> transformers.PreTrainedModel:
    """Each tiny model once per module (built from its config, random weights)."""
    torch.manual_seed(0)
    return MODELS[request.param]()


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    """A 3-layer Llama with attention dropout."""
    torch.manual_seed(0)
    return _llama()


def test_gradients_equal_plain_and_hf_own(model: transformers.PreTrainedModel) -> None:
    """With dropout, our layers give bit-identical loss and gradients to the plain run and to
    transformers' own checkpointing (torch's checkpoint)."""
    ours = _step(model, _ours)
    assert ours.report.recompute_ops > 0  # the layers really were checkpointed
    _assert_same_step(ours, _step(model, None))
    _assert_same_step(ours, _step(model, _hf_own))


def test_kept_bytes_at_most_hf_own(model: transformers.PreTrainedModel) -> None:
    """Our checkpointing keeps no more activation bytes than transformers' own, and far fewer
    than the plain run. The report sees our RNG states and not torch's (which keeps one per
    layer as well), so they are left out of the comparison."""
    ours = _step(model, _ours).report
    hf_own = _step(model, _hf_own).report
    plain = _step(model, None).report
    assert ours.rng_state_bytes > 0
    assert ours.activation_bytes - ours.rng_state_bytes <= hf_own.activation_bytes
    assert ours.kept_bytes - ours.rng_state_bytes <= hf_own.kept_bytes
    assert ours.activation_bytes < plain.activation_bytes / 2


@contextmanager
def _matmul_bytes_in_layers(model: transformers.PreTrainedModel) -> Iterator[list[int]]:
    """Count the bytes of matmul outputs produced inside the model's decoder layers."""
    inside = [False]
    total = [0]

    class _Counter(_compat.TorchDispatchMode):  # type: ignore[misc, no-untyped-call]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if inside[0] and func in MATMUL_OPS:
                total[0] += sum(
                    t.numel() * t.element_size()
                    for t in _compat.tree_leaves(out)
                    if isinstance(t, torch.Tensor)
                )
            return out

    handles = []
    for layer in model.model.layers:
        handles.append(layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        handles.append(layer.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    try:
        with _Counter():
            yield total
    finally:
        for handle in handles:
            handle.remove()


def test_save_matmuls_keeps_exactly_the_layers_matmuls(llama: transformers.PreTrainedModel) -> None:
    """``policy=save_matmuls()``: same gradients; it keeps the layers' matmul outputs on top of
    full checkpointing's bytes, byte for byte."""
    plain_model = copy.deepcopy(llama).train()
    ids = _ids()
    torch.manual_seed(1)
    with _matmul_bytes_in_layers(plain_model) as matmul_bytes:
        plain_model(input_ids=ids, labels=ids)
    saving = _step(llama, lambda m: hf_checkpointing.enable(m, policy=save_matmuls()))
    full = _step(llama, _ours)
    _assert_same_step(saving, _step(llama, None))
    assert matmul_bytes[0] > 0
    assert saving.report.kept_bytes - full.report.kept_bytes == matmul_bytes[0]
    assert saving.report.recompute_ops < full.report.recompute_ops


def test_offload_policy_keeps_fewer_bytes(llama: transformers.PreTrainedModel) -> None:
    """``policy=offload_ops(...)``: same gradients; the matmul outputs that ``save_matmuls``
    keeps are offloaded instead, so the device keeps only full checkpointing's bytes."""
    offloading = _step(llama, lambda m: hf_checkpointing.enable(m, policy=offload_ops(*MATMUL_OPS)))
    saving = _step(llama, lambda m: hf_checkpointing.enable(m, policy=save_matmuls()))
    full = _step(llama, _ours)
    _assert_same_step(offloading, _step(llama, None))
    offloaded = offloading.report.bytes_by_decision()["offloaded"]
    assert offloaded == saving.report.kept_bytes - full.report.kept_bytes > 0
    assert offloading.report.kept_bytes == full.report.kept_bytes < saving.report.kept_bytes
    torch_visible = offloading.report.kept_bytes - offloading.report.rng_state_bytes
    assert torch_visible <= _step(llama, _hf_own).report.kept_bytes  # torch's states unseen


@pytest.mark.parametrize("policy", ["save_attention", save_attention()], ids=repr)
def test_rule12_save_attention_by_name_keeps_each_layers_attention(policy: Any) -> None:
    """``policy="save_attention"`` (by name, Rule 12) or the object: same gradients as the plain
    run; each layer keeps its attention kernel's output, and backward runs no attention
    forward again."""
    torch.manual_seed(0)
    model = tiny_llama(layers=2)  # no attention dropout: the CPU kernel runs, and is kept
    saving = _step(model, lambda m: hf_checkpointing.enable(m, policy=policy))
    _assert_same_step(saving, _step(model, None))
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    kept = [
        r
        for r in saving.report.records
        if r.op == "_scaled_dot_product_flash_attention_for_cpu" and r.decision == "saved"
    ]
    output_shape = (BATCH, 4, SEQ, 8)  # 4 heads of 8 features
    assert [r.shape for r in kept].count(output_shape) == 2  # one per layer
    full = _step(model, _ours)
    output_bytes = 2 * BATCH * SEQ * 32 * 4  # two layers' float32 outputs
    assert saving.report.kept_bytes - full.report.kept_bytes >= output_bytes
    copied = copy.deepcopy(model)
    hf_checkpointing.enable(copied, policy=policy)
    ids = _ids()
    loss = copied(input_ids=ids, labels=ids).loss
    with counting_ops() as counts:
        loss.backward()
    assert counts[str(kernel)] == 0


def test_rule12_an_unknown_policy_name_lists_the_names() -> None:
    """A policy name that is none of ours is a ``ValueError`` listing the names, at enable."""
    with pytest.raises(ValueError, match=r"unknown policy name 'save_attn'.*'save_attention'"):
        hf_checkpointing.enable(tiny_llama(layers=1), policy="save_attn")


def _checkpointed_layers(model: transformers.PreTrainedModel) -> list[bool]:
    return [bool(layer.gradient_checkpointing) for layer in model.model.layers]


@pytest.mark.parametrize("every_n_layers", [1, 2, 3])
def test_rule1_every_n_layers_matches_hf(every_n_layers: int) -> None:
    """``every_n_layers`` checkpoints the very layers transformers' own option does, each with
    our function, and gives the same gradients and kept bytes."""
    torch.manual_seed(0)
    model = _llama(layers=4)
    ours = copy.deepcopy(model)
    hf_checkpointing.enable(ours, every_n_layers=every_n_layers)
    hf_own = copy.deepcopy(model)
    hf_own.activation_checkpointing_enable(every_n_layers=every_n_layers)
    assert _checkpointed_layers(ours) == _checkpointed_layers(hf_own)
    assert sum(_checkpointed_layers(ours)) == len(range(0, 4, every_n_layers))
    for layer in ours.model.layers:
        assert repr(layer._gradient_checkpointing_func).startswith("checkpointing.checkpoint(")
    our_step = _step(model, lambda m: hf_checkpointing.enable(m, every_n_layers=every_n_layers))
    hf_step = _step(
        model, lambda m: m.activation_checkpointing_enable(every_n_layers=every_n_layers)
    )
    _assert_same_step(our_step, hf_step)
    # the report sees our RNG states (one per checkpointed layer here) and not torch's
    assert our_step.report.rng_state_bytes > 0
    assert our_step.report.kept_bytes - our_step.report.rng_state_bytes == (
        hf_step.report.kept_bytes
    )


def test_disable_restores_plain_forward(llama: transformers.PreTrainedModel) -> None:
    """After ``disable``, no layer checkpoints: the step keeps and computes what the plain run
    does, and the model looks as after transformers' own enable and disable."""

    def enable_then_disable(model: transformers.PreTrainedModel) -> None:
        hf_checkpointing.enable(model, policy=save_matmuls())
        hf_checkpointing.disable(model)
        assert not model.is_activation_checkpointing
        assert not getattr(model, "_require_grads_hooks", None)
        for module in model.modules():
            assert "checkpointing" not in repr(getattr(module, "_gradient_checkpointing_func", ""))

    restored = _step(llama, enable_then_disable)
    plain = _step(llama, None)
    _assert_same_step(restored, plain)
    assert restored.report.recompute_ops == 0
    assert restored.report.kept_bytes == plain.report.kept_bytes


def _embedding_output(model: transformers.PreTrainedModel) -> torch.Tensor:
    return model.get_input_embeddings()(_ids())


def test_rule3_input_grads_as_hf(llama: transformers.PreTrainedModel) -> None:
    """The input embeddings' output requires grad after ``enable`` (as after transformers' own),
    even with frozen embeddings, and ``disable`` removes only the hooks ``enable`` added."""
    ours, hf_own = copy.deepcopy(llama), copy.deepcopy(llama)
    for model in (ours, hf_own):
        model.get_input_embeddings().weight.requires_grad_(False)
    hf_checkpointing.enable(ours)
    hf_own.activation_checkpointing_enable()
    assert _embedding_output(ours).requires_grad
    assert _embedding_output(hf_own).requires_grad
    hf_checkpointing.disable(ours)
    assert not _embedding_output(ours).requires_grad
    # Hooks the user (or PEFT) installed before stay after disable.
    ours.enable_input_require_grads()
    hf_checkpointing.enable(ours)
    hf_checkpointing.disable(ours)
    assert _embedding_output(ours).requires_grad
    ours.disable_input_require_grads()


def test_rule3_reentrant_with_frozen_embeddings(llama: transformers.PreTrainedModel) -> None:
    """With frozen embeddings, ``use_reentrant=True`` still gives the layers their gradients:
    the embeddings' output requires grad, as transformers arranges for its own checkpointing."""

    def frozen(setup: Setup) -> Setup:
        def apply(model: transformers.PreTrainedModel) -> None:
            model.get_input_embeddings().weight.requires_grad_(False)
            if setup is not None:
                setup(model)

        return apply

    ours = _step(llama, frozen(lambda m: hf_checkpointing.enable(m, use_reentrant=True)))
    assert ours.report.recompute_ops > 0
    assert sum(grad is None for grad in ours.grads) == 1  # the embeddings only
    _assert_same_step(ours, _step(llama, frozen(None)))


def test_rule5_eval_mode_runs_plainly(llama: transformers.PreTrainedModel) -> None:
    """In eval mode the layers run their plain forward (nothing recomputed), as with
    transformers' own checkpointing."""
    ours = _step(llama, _ours, train=False)
    plain = _step(llama, None, train=False)
    _assert_same_step(ours, plain)
    assert ours.report.recompute_ops == 0
    assert ours.report.kept_bytes == plain.report.kept_bytes


def _train(model: transformers.PreTrainedModel, setup: Setup, steps: int) -> list[torch.Tensor]:
    """AdamW steps on a copy of ``model``; the losses, then the final parameters."""
    model = copy.deepcopy(model).train()
    if setup is not None:
        setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(VOCAB, (BATCH, SEQ), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses + [p.detach() for p in model.parameters()]


def test_adamw_steps_identical_to_hf_own(llama: transformers.PreTrainedModel) -> None:
    """Three AdamW steps with dropout: losses and parameters bit-identical to transformers' own
    checkpointing and to the plain run."""
    policy = save_matmuls()
    ours = _train(llama, lambda m: hf_checkpointing.enable(m, policy=policy), steps=3)
    for reference in (_train(llama, _hf_own, steps=3), _train(llama, None, steps=3)):
        assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))


def test_rule4_options_reach_checkpoint_not_forward(llama: transformers.PreTrainedModel) -> None:
    """Checkpoint options are passed to every layer's checkpoint (here ``debug`` and
    ``early_stop``), not to the layer's forward."""
    model = copy.deepcopy(llama)
    hf_checkpointing.enable(model, debug=True, early_stop=False, determinism_check="none")
    function = model.model.layers[0]._gradient_checkpointing_func
    assert function.options == {
        "use_reentrant": False,
        "debug": True,
        "early_stop": False,
        "determinism_check": "none",
    }
    _assert_same_step(
        _step(llama, lambda m: hf_checkpointing.enable(m, debug=True)), _step(llama, None)
    )


def test_enable_twice_replaces_the_policy(llama: transformers.PreTrainedModel) -> None:
    """A second ``enable`` replaces the first: the last one wins. (transformers' own enable
    after ours keeps ours: ``tests/test_transformers_routes.py``, Rule 10.)"""

    def twice(model: transformers.PreTrainedModel) -> None:
        hf_checkpointing.enable(model, policy=save_matmuls())
        hf_checkpointing.enable(model)

    assert _step(llama, twice).report.kept_bytes == _step(llama, _ours).report.kept_bytes


# --- budget= (NOTE [transformers integration], Rules 6-8) ----------------------------------------


def _batch() -> dict[str, torch.Tensor]:
    """The step ``_step`` and ``_train`` run, as the example ``enable(budget=...)`` profiles."""
    ids = _ids()
    return {"input_ids": ids, "labels": ids}


def _layers_checkpointed(model: transformers.PreTrainedModel) -> list[bool]:
    return [is_module_checkpointed(layer) for layer in model.model.layers]


def _budget(fraction: float, plans: list[checkpointing.ActivationPlan]) -> Setup:
    """Enable a plan for ``fraction`` of the plain run's activation bytes; keep it in ``plans``.
    The plan's layers, and only they, checkpoint through its hooks; transformers' flags are on
    (``is_activation_checkpointing`` tells the truth) with a function that runs each layer's
    forward as it is, inside the plan's hooks."""

    def setup(model: transformers.PreTrainedModel) -> None:
        plan = hf_checkpointing.enable(model, budget=fraction, example_kwargs=_batch())
        assert _layers_checkpointed(model) == [region.checkpoint for region in plan.regions]
        assert model.is_activation_checkpointing == any(_layers_checkpointed(model))
        for layer in model.model.layers:
            assert "budget plan" in repr(layer._gradient_checkpointing_func)
        plans.append(plan)

    return setup


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_rule6_budget_fits_measured_bytes_with_plain_gradients(
    llama: transformers.PreTrainedModel, fraction: float
) -> None:
    """``budget=``: the activation bytes the step keeps (``saved_tensors_report``) fit the budget
    (+2 %), a fraction of the plain run's; loss and gradients equal the plain run's bit for bit
    (dropout on)."""
    plans: list[checkpointing.ActivationPlan] = []
    step = _step(llama, _budget(fraction, plans))
    plain = _step(llama, None)
    (plan,) = plans
    assert plan.baseline_bytes == plain.report.activation_bytes
    assert plan.budget_bytes == int(fraction * plain.report.activation_bytes)
    assert step.report.activation_bytes <= plan.budget_bytes * 1.02, str(plan)
    assert step.report.recompute_ops > 0
    _assert_same_step(step, plain)
    assert "LlamaDecoderLayer" in str(plan)


def test_rule6_budget_is_planned_in_training_mode(llama: transformers.PreTrainedModel) -> None:
    """A model in eval mode is planned as it trains (dropout drawn) and left in eval mode: the
    plan's baseline is the training step's bytes, and the training step fits the budget."""
    plans: list[checkpointing.ActivationPlan] = []

    def from_eval(model: transformers.PreTrainedModel) -> None:
        model.eval()
        _budget(0.5, plans)(model)
        assert not any(module.training for module in model.modules())
        model.train()

    step = _step(llama, from_eval)
    plain = _step(llama, None)
    assert plans[0].baseline_bytes == plain.report.activation_bytes
    assert step.report.activation_bytes <= plans[0].budget_bytes * 1.02
    _assert_same_step(step, plain)


def test_rule7_budget_drops_the_cache_while_recording() -> None:
    """With ``use_cache=True`` (Llama's default) the planned layers train without their cache,
    as under transformers' own checkpointing (a recompute would write it twice); under
    ``no_grad`` the cache still fills."""
    torch.manual_seed(0)
    model = _llama(use_cache=True)
    plans: list[checkpointing.ActivationPlan] = []
    step = _step(model, _budget(0.5, plans))
    assert step.report.recompute_ops > 0
    _assert_same_step(step, _step(model, None))
    planned = copy.deepcopy(model).eval()
    hf_checkpointing.enable(planned, budget=0.5, example_kwargs=_batch())
    with torch.no_grad():
        cache = planned(**_batch()).past_key_values
    assert cache is not None
    assert cache.get_seq_length() == SEQ


def test_budget_adamw_steps_identical_to_plain(llama: transformers.PreTrainedModel) -> None:
    """Three AdamW steps with a budget plan and dropout: losses and parameters bit-identical to
    the plain run."""
    planned = _train(llama, _budget(0.5, []), steps=3)
    plain = _train(llama, None, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(planned, plain, strict=True))


def test_budget_disable_restores_plain_forward(llama: transformers.PreTrainedModel) -> None:
    """``disable`` removes a budget plan: no hooks left (plan, cache, input embeddings), and the
    step keeps and computes what the plain run does; a new plan can be enabled after."""

    def enable_then_disable(model: transformers.PreTrainedModel) -> None:
        hooks = [len(m._forward_pre_hooks) for m in model.modules()]
        _budget(0.25, [])(model)
        assert any(_layers_checkpointed(model))
        hf_checkpointing.disable(model)
        assert [len(m._forward_pre_hooks) for m in model.modules()] == hooks
        assert not any(_layers_checkpointed(model))
        assert not getattr(model, "_require_grads_hooks", None)

    restored = _step(llama, enable_then_disable)
    plain = _step(llama, None)
    _assert_same_step(restored, plain)
    assert restored.report.recompute_ops == 0
    assert restored.report.kept_bytes == plain.report.kept_bytes
    model = copy.deepcopy(llama)
    enable_then_disable(model)
    _budget(0.5, [])(model)
    assert any(_layers_checkpointed(model))


def test_rule8_one_checkpointing_at_a_time(llama: transformers.PreTrainedModel) -> None:
    """A budget plan is refused on a model whose layers already checkpoint (ours or
    transformers' own), any ``enable`` on a model with a plan is refused, and the model is left
    as it was each time."""
    model = copy.deepcopy(llama).train()
    batch = _batch()
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="already checkpointed"):
        hf_checkpointing.enable(model, budget=0.5, example_kwargs=batch)
    assert model.is_activation_checkpointing
    assert not any(_layers_checkpointed(model))
    hf_checkpointing.disable(model)
    plan = hf_checkpointing.enable(model, budget=0.5, example_kwargs=batch)
    checkpointed = _layers_checkpointed(model)
    for retry in (
        lambda: hf_checkpointing.enable(model),
        lambda: hf_checkpointing.enable(model, budget=0.9, example_kwargs=batch),
    ):
        with pytest.raises(ValueError, match=re.escape("enable(model, budget=...)")):
            retry()
        assert _layers_checkpointed(model) == checkpointed
        assert model.is_activation_checkpointing == any(checkpointed)
    assert checkpointed == [region.checkpoint for region in plan.regions]


def test_budget_error_leaves_model_as_it_was(llama: transformers.PreTrainedModel) -> None:
    """A budget below the smallest reachable bytes raises the planner's error, and the model is
    left with no hooks (cache, input embeddings) and can be planned again."""
    model = copy.deepcopy(llama).train()
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    with pytest.raises(ValueError, match="smallest reachable"):
        hf_checkpointing.enable(model, budget=1, example_kwargs=_batch())
    assert [len(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert not getattr(model, "_require_grads_hooks", None)
    hf_checkpointing.enable(model, budget=0.5, example_kwargs=_batch())


def test_budget_default_loss_without_labels(llama: transformers.PreTrainedModel) -> None:
    """Without ``labels`` (no ``output.loss``) the profiled step's loss is the sum of the
    floating-point outputs, the logits; the plan fits a step that backwards from them."""
    model = copy.deepcopy(llama).train()
    plan = hf_checkpointing.enable(model, budget=0.5, example_kwargs={"input_ids": _ids()})
    torch.manual_seed(1)
    with checkpointing.saved_tensors_report() as report:
        model(input_ids=_ids()).logits.sum().backward()
    assert report.recompute_ops > 0
    assert report.activation_bytes <= plan.budget_bytes * 1.02


def test_module_docstring_examples() -> None:
    """The examples in the integration's docstrings run as written (``CheckpointingCallback``'s
    when accelerate, which the ``Trainer`` needs, is installed)."""
    modules = [importlib.import_module("checkpointing.integrations._hf_enable")]
    if importlib.util.find_spec("accelerate") is not None:
        modules.append(importlib.import_module("checkpointing.integrations._hf_callback"))
    for module in modules:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0, module.__name__
        assert result.failed == 0, module.__name__


_IMPORT_PROBE = """
import sys
import checkpointing, checkpointing.integrations, checkpointing.policies
assert "transformers" not in sys.modules, "importing checkpointing imported transformers"
sys.modules["transformers"] = None  # as if it were not installed
try:
    import checkpointing.integrations.transformers
except ImportError as error:
    print(error)
else:
    raise AssertionError("no ImportError without transformers")
"""


def test_transformers_is_optional() -> None:
    """Importing ``checkpointing`` never imports transformers; without it, the integration
    module raises an ImportError that says what to install."""
    package_parent = str(Path(checkpointing.__file__).parent.parent)
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE],
        env={**os.environ, "PYTHONPATH": package_parent},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for phrase in ("checkpointing.integrations.transformers", "pip install transformers", "5.23"):
        assert phrase in result.stdout
