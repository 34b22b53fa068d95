"""The routes Hugging Face users take to checkpointing (issue 29): PEFT, the ``Trainer``, quantized
fine-tuning, deep copies and the report of a reentrant step.

Tiny Llama models built from configs (random weights, no downloads) with LoRA adapters, trained
on the CPU for a few steps; every comparison starts from the same weights and seeds. A test named
``test_problem<N>_...`` failed before issue 29 was fixed (problem N of the issue); the others
check NOTE [transformers integration], Rules 9-11, and NOTE [Trainer callback]. Bytes are the
``saved_tensors_report``'s of a real step (in the ``Trainer``: of its own ``training_step``).
"""

from __future__ import annotations

import copy
import gc
import os
import re
import subprocess
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hf_support import BATCH, SEQ, VOCAB, tiny_llama

peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

from allocator_support import allocator_step  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import checkpointing  # noqa: E402
from checkpointing._module import is_module_checkpointed  # noqa: E402
from checkpointing.integrations import transformers as hf_checkpointing  # noqa: E402
from checkpointing.integrations.transformers import CheckpointingCallback  # noqa: E402
from checkpointing.policies import save_matmuls  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # Run in CI's first stage only (the `once` marker): an optional integration, whose checkpoint
    # mechanisms the rest of the suite tests on every release.
    pytest.mark.once,
    # PEFT reads model.is_gradient_checkpointing, which transformers 5.23 deprecates; and the
    # routes of issue 29 call the deprecated gradient_checkpointing_enable on purpose.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings(
        "ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"
    ),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
]

Route = Callable[[transformers.PreTrainedModel], torch.nn.Module]


def _llama(layers: int = 2) -> transformers.PreTrainedModel:
    """A tiny Llama with attention dropout, the same weights every time."""
    torch.manual_seed(0)
    return tiny_llama(layers, attention_dropout=0.1)


def _lora(model: transformers.PreTrainedModel) -> Any:
    """``model`` with LoRA adapters (dropout on), initialised from a fixed seed."""
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]
    )
    return peft.get_peft_model(model, config)


def _ids(seed: int = 7, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _step(model: torch.nn.Module, batch: int = BATCH) -> checkpointing.SavedTensorsReport:
    """One training step (forward and backward, seed 1) under the saved-tensors report."""
    model.train()
    ids = _ids(batch=batch)
    torch.manual_seed(1)
    with checkpointing.saved_tensors_report() as report:
        model(input_ids=ids, labels=ids).loss.backward()
    return report


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _lora_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _ours(model: torch.nn.Module) -> None:
    hf_checkpointing.enable(model, policy=save_matmuls())


# --- PEFT models (problem 1; NOTE [transformers integration], Rule 9) ----------------------------


def test_problem1_enable_and_disable_take_a_peft_model() -> None:
    """Issue 29 problem 1: ``enable(peft_model)`` raised a ``TypeError`` pointing to a harmful
    fix. It now checkpoints the base model's layers (before or after ``get_peft_model``), with
    the gradients of transformers' own checkpointing, and ``disable(peft_model)`` undoes it."""
    after = _lora(_llama())
    _ours(after)
    before = _llama()
    _ours(before)
    before = _lora(before)
    hf_own = _lora(_llama())
    hf_own.activation_checkpointing_enable()
    reports = [_step(model) for model in (after, before, hf_own)]
    for layer in [*after.get_base_model().model.layers, *before.get_base_model().model.layers]:
        assert repr(layer._gradient_checkpointing_func).startswith("checkpointing.checkpoint(")
    for model in (after, before):
        mine, theirs = _grads(model), _grads(hf_own)
        assert mine.keys() == theirs.keys()
        assert any("lora_" in name for name in mine)
        assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    assert reports[0].kept_bytes == reports[1].kept_bytes > 0
    assert reports[0].recompute_ops > 0
    hf_checkpointing.disable(after)
    assert not after.get_base_model().is_activation_checkpointing
    assert _step(after).recompute_ops == 0


def test_problem1_errors_name_the_working_call() -> None:
    """Issue 29 problem 1: for what ``enable`` cannot take, the error names the calls that work
    (the model or its PEFT model; ``checkpoint_module`` per block, which keeps parameter names)
    and warns off ``apply_activation_checkpointing``'s renaming instead of recommending it."""
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    peft_of_plain = peft.get_peft_model(plain, peft.LoraConfig(r=2, target_modules=["0"]))
    for model, got in [(torch.nn.Linear(2, 2), "got Linear"), (peft_of_plain, "wrapping Sequ")]:
        with pytest.raises(TypeError) as raised:
            hf_checkpointing.enable(model)
        message = str(raised.value)
        for phrase in (got, "PEFT model", "get_peft_model", "checkpoint_module(block)", "Fix"):
            assert phrase in message
        assert "renames their parameters" in message


# --- the usual switches after enable (problem 2; Rule 10) ----------------------------------------


def _kbit(use_checkpointing: bool) -> Route:
    """``prepare_model_for_kbit_training`` as on a quantized model, then LoRA. The attribute
    only marks the model as 8-bit for PEFT (bitsandbytes does not run on the CPU)."""

    def route(model: transformers.PreTrainedModel) -> torch.nn.Module:
        model.is_loaded_in_8bit = True
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=use_checkpointing)
        del model.is_loaded_in_8bit
        return _lora(model)

    return route


def _lora_then(switch: Callable[[Any], None]) -> Route:
    def route(model: transformers.PreTrainedModel) -> torch.nn.Module:
        peft_model = _lora(model)
        switch(peft_model)
        return peft_model

    return route


SWITCHES: dict[str, tuple[Route, Route]] = {
    # name: (the route with transformers' switch, the same route without it)
    "model.activation_checkpointing_enable()": (
        _lora_then(lambda m: m.get_base_model().activation_checkpointing_enable()),
        _lora,
    ),
    "model.gradient_checkpointing_enable()": (
        _lora_then(lambda m: m.get_base_model().gradient_checkpointing_enable()),
        _lora,
    ),
    "peft_model.gradient_checkpointing_enable()": (
        _lora_then(lambda m: m.gradient_checkpointing_enable()),
        _lora,
    ),
    "prepare_model_for_kbit_training": (_kbit(True), _kbit(False)),
}


# PEFT's prepare_model_for_kbit_training hands transformers gradient_checkpointing_kwargs={}, so
# torch's checkpoint, in the baseline without ours, warns that use_reentrant was not passed.
@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint. the use_reentrant:UserWarning")
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_problem2_later_switches_keep_our_policy(switch: str) -> None:
    """Issue 29 problem 2: a later ``activation_checkpointing_enable()`` (directly, through its
    deprecated alias, on the PEFT model, or by ``prepare_model_for_kbit_training``) silently
    replaced ours and lost the policy. Now the step keeps what ours alone keeps, byte for byte,
    more than transformers' checkpointing keeps."""
    with_switch, without = SWITCHES[switch]
    ours_then_switch = _llama()
    _ours(ours_then_switch)
    ours = _llama()
    _ours(ours)
    hf_own = _llama()  # the switch alone: transformers' own checkpointing
    kept = _step(with_switch(ours_then_switch)).kept_bytes
    assert kept == _step(without(ours)).kept_bytes
    assert kept > _step(with_switch(hf_own)).kept_bytes
    assert "save_matmuls" in repr(ours_then_switch.model.layers[0]._gradient_checkpointing_func)


def test_rule10_a_later_enable_names_the_options_it_did_not_apply() -> None:
    """Options of a later enable that ours does not have are named in one warning, with the
    fix; ours is kept. Options ours has (``use_reentrant=False``) pass silently."""
    model = _llama()
    _ours(model)
    function = model.model.layers[0]._gradient_checkpointing_func
    model.activation_checkpointing_enable({"use_reentrant": False})
    with pytest.warns(UserWarning, match="was kept") as caught:
        model.activation_checkpointing_enable({"use_reentrant": True}, every_n_layers=2)
    (warning,) = caught
    for phrase in (
        "use_reentrant=True",
        "every_n_layers=2",
        "enable(model, ...)",
        "disable(model)",
    ):
        assert phrase in str(warning.message)
    assert [layer._gradient_checkpointing_func for layer in model.model.layers] == [function] * 2
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_rule10_transformers_disable_is_ours_then_theirs() -> None:
    """``activation_checkpointing_disable()`` after ``enable`` switches ours off completely
    (input hooks and switches included); transformers' own enable works again afterwards."""
    model = _llama()
    _ours(model)
    assert "activation_checkpointing_enable" in vars(model)
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing
    assert "activation_checkpointing_enable" not in vars(model)
    assert not getattr(model, "_require_grads_hooks", None)
    model.activation_checkpointing_enable()
    assert "checkpointing" not in repr(model.model.layers[0]._gradient_checkpointing_func)
    assert model.is_activation_checkpointing


def test_rule10_switches_hold_the_model_weakly() -> None:
    """``enable`` makes no reference cycle: with ``gc`` off, the model is freed when dropped."""
    model = _lora(_llama())
    _ours(model)
    base = weakref.ref(model.get_base_model())
    gc.disable()
    try:
        del model
        assert base() is None
    finally:
        gc.enable()


# --- the Trainer (problems 2 and 3; NOTE [Trainer callback]) -------------------------------------


class _ReportingTrainer(transformers.Trainer):
    """A ``Trainer`` that reports what each of its own training steps keeps for backward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reports: list[checkpointing.SavedTensorsReport] = []

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with checkpointing.saved_tensors_report() as report:
            loss = super().training_step(*args, **kwargs)
        self.reports.append(report)
        return loss


def _train(
    model: torch.nn.Module,
    tmp_path: Path,
    *,
    callbacks: tuple[transformers.TrainerCallback, ...] = (),
    steps: int = 3,
    **arguments: Any,
) -> _ReportingTrainer:
    """``steps`` Trainer steps on the CPU (nothing saved, nothing reported outside)."""
    data = [{"input_ids": ids, "labels": ids} for ids in _ids(seed=3, batch=8)]
    args = transformers.TrainingArguments(
        str(tmp_path / "run"),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        **arguments,
    )
    trainer = _ReportingTrainer(model, args, train_dataset=data, callbacks=list(callbacks))
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    trainer.train()
    return trainer


def test_problem2_trainer_flag_keeps_our_policy(tmp_path: Path) -> None:
    """Issue 29 problem 2: the ``Trainer``'s ``gradient_checkpointing=True`` replaced ours (4.65
    MB kept became 0.72 MB in the issue). Its steps now keep what ours alone keeps, as does the
    callback route, and more than its own checkpointing; the LoRA weights are those of
    transformers' own checkpointing, bit for bit."""
    ours_then_flag = _llama()
    _ours(ours_then_flag)
    ours_alone = _llama()
    _ours(ours_alone)
    runs = {
        "ours + flag": _train(_lora(ours_then_flag), tmp_path, gradient_checkpointing=True),
        "ours": _train(_lora(ours_alone), tmp_path),
        "callback": _train(
            _lora(_llama()), tmp_path, callbacks=(CheckpointingCallback(policy=save_matmuls()),)
        ),
        "hf own": _train(_lora(_llama()), tmp_path, gradient_checkpointing=True),
    }
    kept = {name: [r.kept_bytes for r in trainer.reports] for name, trainer in runs.items()}
    assert kept["ours + flag"] == kept["ours"] == kept["callback"]
    assert all(a > b for a, b in zip(kept["ours"], kept["hf own"], strict=True))
    weights = [_lora_weights(trainer.model) for trainer in runs.values()]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][name], other[name]) for name in weights[0])


def test_callback_trains_like_the_plain_trainer_and_saves_the_adapter(tmp_path: Path) -> None:
    """The callback route gives the LoRA weights of the plain ``Trainer``; its adapter saves with
    every LoRA tensor under PEFT's names and reloads equal (``PeftModel.from_pretrained``)."""
    trained = _train(
        _lora(_llama()), tmp_path, callbacks=(CheckpointingCallback(policy=save_matmuls()),)
    ).model
    plain = _train(_lora(_llama()), tmp_path).model
    weights = _lora_weights(trained)
    assert all(torch.equal(weights[name], value) for name, value in _lora_weights(plain).items())
    initial = _lora_weights(_lora(_llama()))
    assert any(not torch.equal(value, initial[name]) for name, value in weights.items())
    trained.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(weights) > 0
    reloaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "adapter")
    for name, value in _lora_weights(reloaded).items():
        assert torch.equal(value, weights[name])


def test_callback_checks_its_options_when_made() -> None:
    """Rule 1 of NOTE [Trainer callback]: a mistake fails when the callback is made, in
    ``enable``'s words, naming the callback."""
    mistakes: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"offload": True}, TypeError, "unknown checkpoint option(s) ['offload']"),
        ({"budget": 0.5, "policy": save_matmuls()}, ValueError, "cannot be combined with policy="),
        ({"example_kwargs": {}}, ValueError, "only describe the step that budget= plans for"),
        ({"every_n_layers": 0}, ValueError, "every_n_layers must be a positive int"),
    ]
    for options, error, phrase in mistakes:
        with pytest.raises(error) as raised:
            CheckpointingCallback(**options)
        assert str(raised.value).startswith(
            "checkpointing.integrations.transformers.CheckpointingCallback"
        )
        assert phrase in str(raised.value)
        assert "Fix" in str(raised.value)


def test_callback_takes_a_policy_by_name(tmp_path: Path) -> None:
    """``CheckpointingCallback(policy="save_matmuls")`` trains as with the policy object (the
    name is the spelling ``enable`` takes); an unknown name fails when the callback is made."""
    by_name = _train(
        _lora(_llama()), tmp_path, callbacks=(CheckpointingCallback(policy="save_matmuls"),)
    )
    by_object = _train(
        _lora(_llama()), tmp_path, callbacks=(CheckpointingCallback(policy=save_matmuls()),)
    )
    function = by_name.model.get_base_model().model.layers[0]._gradient_checkpointing_func
    assert "save_matmuls" in repr(function)
    kept = [[r.kept_bytes for r in trainer.reports] for trainer in (by_name, by_object)]
    assert kept[0] == kept[1] != []
    with pytest.raises(ValueError, match=r"CheckpointingCallback: unknown policy name 'save_at'"):
        CheckpointingCallback(policy="save_at")


class _Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        ids = _ids()[0]
        while True:
            yield {"input_ids": ids, "labels": ids}


def test_callback_budget_without_example_needs_a_sized_training_set(tmp_path: Path) -> None:
    """Rule 3 of NOTE [Trainer callback]: a training set the callback cannot index (a stream)
    is an error that names ``example_kwargs=``; with it, the budget plans."""
    callback = CheckpointingCallback(budget=0.5)
    args = transformers.TrainingArguments(
        str(tmp_path / "run"), max_steps=1, use_cpu=True, report_to="none", save_strategy="no"
    )
    trainer = transformers.Trainer(
        _lora(_llama(layers=3)), args, train_dataset=_Stream(), callbacks=[callback]
    )
    with pytest.raises(ValueError, match=r"__getitem__.*Fix: pass example_kwargs="):
        trainer.train()
    ids = _ids()
    given = CheckpointingCallback(budget=0.5, example_kwargs={"input_ids": ids, "labels": ids})
    _train(_lora(_llama(layers=3)), tmp_path, callbacks=(given,))
    assert given.plan is not None


def test_callback_replaces_the_trainer_flag_and_names_its_kwargs(tmp_path: Path) -> None:
    """Rule 2 of NOTE [Trainer callback]: with the ``Trainer``'s own flag on as well, the
    callback's checkpointing wins, and ``gradient_checkpointing_kwargs`` it did not apply are
    named in a warning."""
    with pytest.warns(UserWarning, match=r"\{'use_reentrant': True\} were not applied"):
        trainer = _train(
            _lora(_llama()),
            tmp_path,
            callbacks=(CheckpointingCallback(policy=save_matmuls()),),
            activation_checkpointing=True,
            activation_checkpointing_kwargs={"use_reentrant": True},
        )
    function = trainer.model.get_base_model().model.layers[0]._gradient_checkpointing_func
    assert "save_matmuls" in repr(function)


_LAZY_PROBE = """
import sys
import checkpointing.integrations.transformers as hf
assert "transformers.trainer_callback" not in sys.modules
from checkpointing.integrations.transformers import CheckpointingCallback
from transformers.trainer_callback import TrainerCallback
assert issubclass(CheckpointingCallback, TrainerCallback)
assert hf.CheckpointingCallback is CheckpointingCallback
"""


def test_callback_loads_the_trainer_only_when_used() -> None:
    """The integration imports the ``Trainer``'s modules only when ``CheckpointingCallback`` is
    first used."""
    package_parent = str(Path(checkpointing.__file__).parent.parent)
    result = subprocess.run(
        [sys.executable, "-c", _LAZY_PROBE],
        env={**os.environ, "PYTHONPATH": package_parent},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.filterwarnings("error")
def test_problem3_budget_callback_fits_and_warns_nothing(tmp_path: Path) -> None:
    """Issue 29 problem 3: a budget under the ``Trainer`` warned falsely that it may not hold
    (the extra input was the ``Trainer``'s 0-d ``num_items_in_batch``). The callback plans on
    the training set's first batch, no warning is raised, every step fits the budget, and the
    LoRA weights are the plain ``Trainer``'s."""
    callback = CheckpointingCallback(budget=0.5)
    trainer = _train(_lora(_llama(layers=3)), tmp_path, callbacks=(callback,))
    plan = callback.plan
    assert plan is not None
    assert any(region.checkpoint for region in plan.regions)
    for report in trainer.reports:
        assert report.recompute_ops > 0
        assert report.activation_bytes <= plan.budget_bytes * 1.02, str(plan)
    assert trainer.model.get_base_model().is_activation_checkpointing
    plain = _lora_weights(_train(_lora(_llama(layers=3)), tmp_path).model)
    weights = _lora_weights(trainer.model)
    assert all(torch.equal(weights[name], value) for name, value in plain.items())
    trainer.train()  # Rule 4 there: a second train() keeps the plan
    assert callback.plan is plan


def _planned() -> Any:
    """A LoRA model whose base has a budget plan (enabled on the base model, the route that
    worked before issue 29, so that the tests below fail for their own problem before it)."""
    model = _lora(_llama(layers=3))
    ids = _ids()
    batch = {"input_ids": ids, "labels": ids}
    hf_checkpointing.enable(model.get_base_model(), budget=0.5, example_kwargs=batch)
    return model


def _plan_state(model: Any) -> list[tuple[bool, bool]]:
    layers = model.get_base_model().model.layers
    return [(is_module_checkpointed(layer), layer.gradient_checkpointing) for layer in layers]


def _kbit_on(model: Any, tmp_path: Path) -> None:
    model.get_base_model().is_loaded_in_8bit = True  # as in _kbit
    peft.prepare_model_for_kbit_training(model.get_base_model())


def _budget_callback_on_flag(model: Any, tmp_path: Path) -> None:
    callback = CheckpointingCallback(budget=0.5)
    _train(_lora(_llama(layers=3)), tmp_path, callbacks=(callback,), gradient_checkpointing=True)


# Ways to switch transformers' checkpointing on over (or next to) a budget plan.
_SWITCH_ON: dict[str, Callable[[Any, Path], object]] = {
    "trainer": lambda model, tmp_path: _train(model, tmp_path, gradient_checkpointing=True),
    "activation_checkpointing_enable": lambda model, _: model.activation_checkpointing_enable(),
    "prepare_model_for_kbit_training": _kbit_on,
    "callback": _budget_callback_on_flag,
}


@pytest.mark.parametrize("switch", list(_SWITCH_ON))
def test_problem3_budget_refuses_transformers_checkpointing(switch: str, tmp_path: Path) -> None:
    """Issue 29 problem 3: a budget plan together with transformers' own checkpointing was
    accepted, and the plan had no effect. Each way of combining them is now a ``ValueError``
    that names the fix, and leaves the plan as it was."""
    model = _planned()
    state = _plan_state(model)
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        _SWITCH_ON[switch](model, tmp_path)
    assert _plan_state(model) == state


def test_problem3_is_activation_checkpointing_tells_the_truth() -> None:
    """Issue 29 problem 3: after a budget, ``is_activation_checkpointing`` read False. It reads
    True while the plan checkpoints a layer (so does the deprecated ``is_gradient_checkpointing``)
    and False after ``disable``."""
    model = _planned().get_base_model()
    assert model.is_activation_checkpointing
    with pytest.warns(FutureWarning):
        assert model.is_gradient_checkpointing
    hf_checkpointing.disable(model)
    assert not model.is_activation_checkpointing


# --- deep copies (problem 4; Rule 11) ------------------------------------------------------------


def _hooks(model: torch.nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def test_problem4_disable_and_enable_on_a_deep_copy() -> None:
    """Issue 29 problem 4: on a ``copy.deepcopy`` of a budgeted model, ``disable`` left the
    plan's hooks and ``enable`` was accepted on top of them. Now ``enable(copy)`` is refused,
    ``disable(copy)`` removes every hook the plan and ``enable`` put there (the original keeps
    its own), the copy steps as the plain model does, and can be planned again."""
    untouched = _hooks(_lora(_llama(layers=3)))
    original = _planned()
    planned = _plan_state(original)
    duplicate = copy.deepcopy(original)
    assert _plan_state(duplicate) == planned
    with pytest.raises(ValueError, match=re.escape("enable(model, budget=...)")):
        hf_checkpointing.enable(duplicate.get_base_model())
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        duplicate.activation_checkpointing_enable()  # the copy's switches act on the copy
    hf_checkpointing.disable(duplicate.get_base_model())
    assert _hooks(duplicate) == untouched
    assert not duplicate.get_base_model().is_activation_checkpointing
    assert "activation_checkpointing_enable" not in vars(duplicate.get_base_model())
    assert _plan_state(original) == planned
    plain = _lora(_llama(layers=3))
    assert _step(duplicate).kept_bytes == _step(plain).kept_bytes
    ids = _ids()
    hf_checkpointing.enable(duplicate, budget=0.5, example_kwargs={"input_ids": ids, "labels": ids})
    hf_checkpointing.disable(original)
    assert _hooks(original) == untouched


def test_rule11_deep_copy_of_a_policy_model_switches_itself() -> None:
    """A deep copy of a model with ours keeps ours, and its switches act on the copy: a later
    enable keeps the copy's policy, ``disable(copy)`` leaves the original checkpointed."""
    original = _llama()
    _ours(original)
    duplicate = copy.deepcopy(original)
    duplicate.activation_checkpointing_enable()
    assert "save_matmuls" in repr(duplicate.model.layers[0]._gradient_checkpointing_func)
    hf_checkpointing.disable(duplicate)
    assert not duplicate.is_activation_checkpointing
    assert original.is_activation_checkpointing
    assert "activation_checkpointing_enable" in vars(original)


# --- the report of a reentrant step (problem 5) --------------------------------------------------


def test_problem5_reentrant_report_is_stable_and_says_what_it_cannot_see() -> None:
    """Issue 29 problem 5: under ``use_reentrant=True`` the report counted the tensors the
    re-run saves inside backward (freed there): 4.2-5.8 MB, different every run, where the
    allocator held 0.74 MB. Now a reentrant step reports what a non-reentrant one does, less
    the RNG states it keeps by plain reference (which no hook sees; its note says so), the same
    every run; and the non-reentrant count is the allocator's to 2 %."""
    reports = {}
    held = {}
    for reentrant in (True, False):
        model = _llama(layers=3)
        hf_checkpointing.enable(model, use_reentrant=reentrant)
        runs = [_step(model, batch=4) for _ in range(3)]
        assert len({(r.kept_bytes, r.activation_bytes) for r in runs}) == 1
        reports[reentrant] = runs[0]
        torch.manual_seed(1)
        held[reentrant] = allocator_step(_loss_of(model, _ids(batch=4))).held
    reentrant, frame = reports[True], reports[False]
    assert held[True] == held[False]
    assert frame.activation_bytes == pytest.approx(held[False], rel=0.02)
    assert reentrant.activation_bytes == frame.activation_bytes - frame.rng_state_bytes
    assert reentrant.rng_state_bytes == 0
    assert frame.rng_state_bytes > 0
    assert any("use_reentrant=True" in note and "RNG" in note for note in reentrant.notes)
    assert "use_reentrant=True" in str(reentrant)
    assert not frame.notes


def _loss_of(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: model(input_ids=ids, labels=ids).loss


# --- no garbage over many steps ------------------------------------------------------------------


def _ours_in(garbage: list[Any]) -> list[str]:
    """The garbage objects that are tensors or belong to checkpointing's code."""
    found = []
    for obj in garbage:
        module = type(obj).__module__
        if isinstance(obj, types.FunctionType | types.MethodType):
            module = getattr(obj, "__module__", None) or ""
        if issubclass(type(obj), torch.Tensor) or module.startswith("checkpointing"):
            found.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
    return found


def test_soak_callback_route_leaves_no_cyclic_garbage(tmp_path: Path) -> None:
    """300 ``Trainer`` steps of a PEFT model through the callback, with ``gc`` disabled, leave
    no cyclic garbage of ours, and fewer garbage objects than steps: the ``Trainer`` itself
    leaves 3, once (torch's own checkpoint, under ``gradient_checkpointing=True``, 7 per
    step)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_cache=False,
    )
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    ids = torch.randint(32, (4,))
    args = transformers.TrainingArguments(
        str(tmp_path / "run"),
        max_steps=300,
        per_device_train_batch_size=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model,
        args,
        train_dataset=[{"input_ids": ids, "labels": ids}] * 4,
        callbacks=[CheckpointingCallback(policy=save_matmuls())],
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        trainer.train()
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert model.get_base_model().model.layers[0]._gradient_checkpointing_func.options
    assert not _ours_in(garbage), _ours_in(garbage)
    assert len(garbage) < 300


# The recipe keeps the Trainer's defaults, as on an accelerator; on a CPU-only machine the data
# loader warns that the pinned memory it asks for is not used.
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_readme_recipe_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "With PEFT and the Trainer" recipe (docs/guide/transformers.md) runs as written and
    saves an adapter with every LoRA tensor."""
    root = Path(checkpointing.__file__).parent.parent
    page = (root / "docs" / "guide" / "transformers.md").read_text()
    section = page.split("## With PEFT and the Trainer", 1)[1]
    recipe = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(recipe, "docs/guide/transformers.md", "exec"), namespace)
    layer = namespace["model"].get_base_model().model.layers[0]
    assert "save_matmuls" in repr(layer._gradient_checkpointing_func)
    saved = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 2 * 2 * 2  # lora_A and lora_B of q_proj and v_proj, in 2 layers
