"""``checkpointing.apply_spec``: one mapping says what each module gets (NOTE [Spec grammar],
NOTE [Spec selection]).

On tiny GPT-2, Llama and Mixtral models (random weights, dropout on, ``use_cache=False`` in both
runs, so that the plain and the checkpointed layers are handed the same inputs) the gradients
equal the plain run's bitwise: every mechanism a spec installs replays the forward's kernels.
The grammar, the overlap rule and the errors are checked on a stack of linear layers.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import torch
from hf_support import zoo_member
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

import checkpointing
from checkpointing import apply_spec, load_spec


def _grads(model: nn.Module, step: Any) -> list[torch.Tensor | None]:
    """One seeded forward and backward of ``model``; every parameter's gradient."""
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    step(model).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_bitwise(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            assert torch.equal(g, w)


def _hf(name: str) -> tuple[nn.Module, Any]:
    """A zoo member without its key/value cache, and its step as ``model -> loss``."""
    member = zoo_member(name)
    member.model.config.use_cache = False
    return member.model, lambda m: member.loss_fn(m(*member.args, **member.kwargs))


HF_SPECS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "gpt2": (
        {
            "transformer.h.{0}": "full",
            "transformer.h.{-1}.attn": "save_matmuls",
            "transformer.h.{-1}.mlp": "offload",
        },
        {
            "transformer.h.0": "full",
            "transformer.h.1.attn": "save_matmuls()",
            "transformer.h.1.mlp": "offload",
        },
    ),
    "llama": (
        {
            "model.layers.*": "full",
            "model.layers.{1}": None,
            "model.layers.{1}.self_attn": "save_attention",
        },
        {
            "model.layers.0": "full",
            "model.layers.1": "none",
            "model.layers.1.self_attn": "save_attention()",
        },
    ),
    "mixtral": (
        {"model": {"layers.*.mlp": "save_routing", "layers.{0}.self_attn": "full"}},
        {
            "model.layers.0.self_attn": "full",
            "model.layers.0.mlp": "save_routing()",
            "model.layers.1.mlp": "save_routing()",
        },
    ),
}


@pytest.mark.once
@pytest.mark.parametrize("family", sorted(HF_SPECS))
def test_hf_gradients_equal_the_plain_run(family: str) -> None:
    """Each family under a mixed spec: what the result says it installed, and the gradients
    bitwise those of the plain run (dropout drawn alike: the regions preserve the RNG)."""
    model, step = _hf(family)
    spec, expected = HF_SPECS[family]
    plain = _grads(copy.deepcopy(model), step)
    result = apply_spec(model, spec)
    assert result.actions() == expected
    assert str(result).startswith("apply_spec: ")
    for name in expected:
        assert name in str(result)
    _assert_bitwise(_grads(model, step), plain)
    result.remove()
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())
    _assert_bitwise(_grads(model, step), plain)


@pytest.mark.once
def test_hf_default_cache_is_turned_off_while_training() -> None:
    """NOTE [Spec selection], Rule 4: with transformers' default ``use_cache=True``, a spec on
    a later layer (handed a cache holding the earlier layers' keys without it) trains like
    the ``use_cache=False`` run, bitwise; under ``no_grad`` the cache works as usual."""
    member = zoo_member("llama")
    model = member.model
    assert model.config.use_cache

    def step(m: nn.Module) -> torch.Tensor:
        return member.loss_fn(m(*member.args, **member.kwargs))

    reference = copy.deepcopy(model)
    reference.config.use_cache = False
    plain = _grads(reference, step)
    result = apply_spec(model, {"model.layers.1": "full"})
    _assert_bitwise(_grads(model, step), plain)
    with torch.no_grad():
        assert model(*member.args).past_key_values is not None
    result.remove()
    assert not checkpointing._spec.carries_spec(model)
    assert not model._forward_pre_hooks


def test_transformers_own_checkpointing_is_refused() -> None:
    """NOTE [Spec selection], Rule 3: a model whose layers run transformers' checkpointing is
    refused (the regions would nest in it); a dry run of only ``none`` values is not."""
    model, _ = _hf("llama")
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match=r"transformers' own activation checkpointing is on"):
        apply_spec(model, {"model.layers.*.mlp": "full"})
    assert apply_spec(model, {"model.layers.0": None}, dry_run=True).actions() == {
        "model.layers.0": "none"
    }
    model.activation_checkpointing_disable()
    apply_spec(model, {"model.layers.*.mlp": "full"}).remove()


def test_hf_spec_from_toml_equals_the_dict() -> None:
    """The TOML text of a spec selects what the dict selects."""
    model, _ = _hf("llama")
    text = """
    [model.layers]
    "*" = "full"
    "{1}" = "none"
    "{1}.self_attn" = "save_attention"
    """
    from_toml = apply_spec(model, load_spec(text, format="toml"), dry_run=True)
    from_dict = apply_spec(model, HF_SPECS["llama"][0], dry_run=True)
    assert from_toml.actions() == from_dict.actions()


def _stack(n: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(n)])


@pytest.mark.parametrize(
    ("selector", "layers"),
    [
        ("{0:3}", [0, 1, 2]),
        ("{::3}", [0, 3, 6]),
        ("{1::3}", [1, 4, 7]),
        ("{:2}", [0, 1]),
        ("{-2:}", [6, 7]),
        ("{0,5,-1}", [0, 5, 7]),
        ("{ 2 , 4:6 }", [2, 4, 5]),
        ("*", list(range(8))),
    ],
)
def test_layer_selectors(selector: str, layers: list[int]) -> None:
    """NOTE [Spec grammar], Rule 2: indices, slices and lists pick integer-named children by
    position."""
    result = apply_spec(_stack(), {selector: "full"}, dry_run=True)
    assert list(result.actions()) == [str(i) for i in layers]


def test_double_star_and_globs() -> None:
    """Rule 1: ``**`` spans any number of components, ``*`` exactly one."""
    model = _stack(3)
    assert list(apply_spec(model, {"**.0": "full"}, dry_run=True).actions()) == [
        "0",
        "0.0",
        "1.0",
        "2.0",
    ]
    assert list(apply_spec(model, {"*.1": "full"}, dry_run=True).actions()) == [
        "0.1",
        "1.1",
        "2.1",
    ]


def test_most_specific_wins() -> None:
    """NOTE [Spec grammar], Rule 3: a literal beats a selector beats a glob, whatever the
    order of the mapping."""
    model = _stack(4)
    spec = {"{1}": "offload", "1": "save_matmuls", "*": "full", "{::2}": "none"}
    got = apply_spec(model, spec, dry_run=True).actions()
    assert got == {"0": "none", "1": "save_matmuls()", "2": "none", "3": "full"}
    reordered = dict(reversed(list(spec.items())))
    assert apply_spec(model, reordered, dry_run=True).actions() == got


def test_equal_specificity_is_an_error() -> None:
    """NOTE [Spec selection], Rule 2: two keys of equal specificity with different values on
    one module name both keys and the module; with the same value they agree."""
    model = _stack(4)
    with pytest.raises(ValueError, match=r"'2' is selected by '\{::2\}' \(full\) and by '\{2:\}'"):
        apply_spec(model, {"{::2}": "full", "{2:}": "offload"}, dry_run=True)
    same = apply_spec(model, {"{::2}": "full", "{2:}": "full"}, dry_run=True)
    assert list(same.actions()) == ["0", "2", "3"]


def test_nothing_matched_names_the_nearest_modules() -> None:
    """NOTE [Spec selection], Rule 1: a typo is an error naming the nearest names and the
    children found where the key's leading part matches."""
    model, _ = _hf("llama")
    with pytest.raises(ValueError, match=r"'model.layers.\*.self_atn' selects no module") as info:
        apply_spec(model, {"model.layers.*.self_atn": "full"})
    message = str(info.value)
    assert "'model.layers.0.self_attn'" in message
    assert "'model.layers.*' matches 2 module(s), whose children are named" in message
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ({"*": "ful"}, ValueError, r"unknown value 'ful' \(did you mean 'full'\?\)"),
        ({"*": 3}, TypeError, r"has the value 3 of type int"),
        ({"*": checkpointing.policies.save_matmuls}, TypeError, r"call it, save_matmuls\(\)"),
        ({"{9}": "full"}, IndexError, r"layer index 9 is out of range.*has 4"),
        ({"{1-3}": "full"}, ValueError, r"layer selector \{1-3\}"),
        ({"{::0}": "full"}, ValueError, r"step 0"),
        ({"a{1}": "full"}, ValueError, r"brace inside the component"),
        ({"0..1": "full"}, ValueError, r"empty component"),
        ({"**": "full"}, ValueError, r"selects the model itself"),
        ({3: "full"}, TypeError, r"spec keys are module-name patterns"),
        (["*"], TypeError, r"expected the spec as a mapping"),
    ],
)
def test_bad_specs_are_clear_errors(spec: Any, error: type[Exception], match: str) -> None:
    """Unknown values, bad selectors and bad keys say what was expected and the fix; nothing
    is installed."""
    model = _stack(4)
    with pytest.raises(error, match=match):
        apply_spec(model, spec)
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())


def test_applying_twice_is_an_error() -> None:
    """NOTE [Spec selection], Rule 3: a module that already checkpoints is refused; after
    ``remove()`` the spec applies again."""
    model = _stack(2)
    first = apply_spec(model, {"*": "full"})
    with pytest.raises(ValueError, match="already checkpoints"):
        apply_spec(model, {"{0}": "save_matmuls"})
    first.remove()
    apply_spec(model, {"{0}": "save_matmuls"}).remove()


def test_dry_run_installs_nothing_and_prints_the_selection() -> None:
    """NOTE [Spec selection], Rule 5: the dry run prints what the real call installs."""
    model = _stack(4)
    spec = {"{::2}": "full", "{-1}": "save_matmuls", "{1}": "none"}
    dry = apply_spec(model, spec, dry_run=True)
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())
    assert str(dry) == (
        "apply_spec: 3 of 12 modules checkpointed (dry run: nothing installed)\n"
        "  0  Sequential  full            <- '{::2}'\n"
        "  1  Sequential  none            <- '{1}'\n"
        "  2  Sequential  full            <- '{::2}'\n"
        "  3  Sequential  save_matmuls()  <- '{-1}'"
    )
    real = apply_spec(model, spec)
    assert str(real) == str(dry).replace(" (dry run: nothing installed)", "")
    real.remove()


def test_a_stack_trains_like_the_plain_one() -> None:
    """Full recompute, a policy by name and by object, and offload on one stack: gradients
    bitwise the plain run's."""
    model = _stack(4)
    x = torch.randn(3, 4, requires_grad=True)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).square().sum()

    plain = _grads(copy.deepcopy(model), step)
    spec = {
        "{0}": "full",
        "{1}": "offload",
        "{2}": checkpointing.policies.save_ops(torch.ops.aten.addmm),
        "{3}.0": "save_matmuls",
    }
    result = apply_spec(model, spec)
    _assert_bitwise(_grads(model, step), plain)
    result.remove()


def test_load_spec_formats(tmp_path: pathlib.Path) -> None:
    """TOML by the standard library, from text or a file; an unknown format is refused; YAML
    where PyYAML is installed."""
    path = tmp_path / "spec.toml"
    path.write_text('"layers.{0:2}" = "full"\n')
    assert load_spec(path) == {"layers.{0:2}": "full"}
    with pytest.raises(ValueError, match="format must be 'toml' or 'yaml'"):
        load_spec('"x" = "full"')
    yaml = pytest.importorskip("yaml")
    del yaml
    assert load_spec("layers:\n  '{0:2}': full\n", format="yaml") == {"layers": {"{0:2}": "full"}}


def test_apply_activation_checkpointing_takes_a_spec() -> None:
    """NOTE [Applied wrappers], Rule 4: the spec's modules get wrappers, each with its policy,
    nested ones deepest first; gradients bitwise the plain run's; keys unchanged."""
    model = _stack(4)
    x = torch.randn(3, 4, requires_grad=True)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).square().sum()

    plain = _grads(copy.deepcopy(model), step)
    keys = sorted(model.state_dict())
    spec = {"{0}": "full", "{0}.0": "save_matmuls", "{2:}": "offload", "3": None}
    checkpointing.apply_activation_checkpointing(model, spec=spec)
    wrapped = {n: m.checkpoint_options.get("context_fn") for n, m in _wrappers(model)}
    assert sorted(wrapped) == ["0", "0._checkpoint_wrapped_module.0", "2"]
    assert "save_matmuls" in repr(wrapped["0._checkpoint_wrapped_module.0"])
    assert "offload" in repr(wrapped["2"])
    assert sorted(model.state_dict()) == keys
    _assert_bitwise(_grads(model, step), plain)


def _wrappers(model: nn.Module) -> list[tuple[str, Any]]:
    return [
        (n, m) for n, m in model.named_modules() if isinstance(m, checkpointing.CheckpointWrapper)
    ]


@pytest.mark.parametrize(
    ("given", "other"),
    [
        ({"check_fn": lambda m: True}, "check_fn"),
        ({"auto_wrap_policy": lambda module, recurse, nonwrapped_numel: True}, "auto_wrap_policy"),
        ({"context_fn": "save_matmuls"}, "context_fn"),
    ],
)
def test_apply_activation_checkpointing_spec_refuses_a_second_answer(
    given: dict[str, Any], other: str
) -> None:
    """Rule 4: ``check_fn``, ``auto_wrap_policy`` or ``context_fn`` beside a spec is refused."""
    model = _stack(2)
    with pytest.raises(ValueError, match=f"so {other} cannot be given beside it"):
        checkpointing.apply_activation_checkpointing(model, spec={"*": "full"}, **given)
    assert not _wrappers(model)


@pytest.mark.parametrize(
    "wrapper_fn",
    [checkpointing.offload_wrapper, checkpointing.OffloadWrapper, offload_wrapper],
    ids=["ours", "our-class", "torch"],
)
def test_apply_activation_checkpointing_spec_policy_needs_a_wrapper_taking_it(
    wrapper_fn: Any,
) -> None:
    """Rule 4: a policy (or ``"offload"``) in the spec for an offload wrapper, which takes no
    ``context_fn`` and recomputes nothing, is refused before any module is wrapped, naming the
    keys and the fix (it was Python's "unexpected keyword argument 'context_fn'")."""
    model = _stack(3)
    spec = {"{0}": "save_matmuls", "{1}": "offload", "{2}": "full"}
    with pytest.raises(TypeError) as info:
        checkpointing.apply_activation_checkpointing(model, wrapper_fn, spec=spec)
    message = str(info.value)
    assert message.startswith("checkpointing.apply_activation_checkpointing: the spec gives")
    assert "'{0}', '{1}' a policy" in message
    assert f"checkpoint_wrapper_fn={wrapper_fn.__name__} takes no context_fn" in message
    assert "Fix: give those keys 'full'" in message
    assert [type(m).__name__ for m in model] == ["Sequential"] * 3  # nothing wrapped


def test_apply_activation_checkpointing_spec_full_with_offload_wrapper() -> None:
    """Rule 4: ``"full"`` hands the selected modules to any ``checkpoint_wrapper_fn`` as they
    are; with ``offload_wrapper``, they are wrapped and the gradients are the plain run's."""
    model = _stack(3)
    x = torch.randn(3, 4, requires_grad=True)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).square().sum()

    plain = _grads(copy.deepcopy(model), step)
    spec = {"{0:2}": "full", "{2}": None}
    checkpointing.apply_activation_checkpointing(model, checkpointing.offload_wrapper, spec=spec)
    assert [type(m).__name__ for m in model] == ["OffloadWrapper", "OffloadWrapper", "Sequential"]
    _assert_bitwise(_grads(model, step), plain)


# --- integrations.transformers: enable(spec=...) and CheckpointingCallback(spec=...) ----------


def test_enable_takes_a_spec() -> None:
    """Rule 14 of NOTE [transformers integration]: ``enable(model, spec=...)`` installs the
    spec's regions (gradients bitwise the plain run's), transformers' flags tell the truth,
    other checkpointing is refused until ``disable``, which takes everything off (on a deep
    copy too)."""
    from checkpointing.integrations import transformers as hf

    model, step = _hf("llama")
    plain = _grads(copy.deepcopy(model), step)
    result = hf.enable(
        model, spec={"model.layers.{0}.mlp": "save_matmuls", "model.layers.1": "full"}
    )
    assert result.actions() == {
        "model.layers.0.mlp": "save_matmuls()",
        "model.layers.1": "full",
    }
    assert model.is_activation_checkpointing
    _assert_bitwise(_grads(model, step), plain)
    with pytest.raises(ValueError, match=r"enable\(model, spec=\.\.\.\)"):
        hf.enable(model, policy="save_matmuls")
    with pytest.raises(ValueError, match=r"budget plan"):
        model.activation_checkpointing_enable()
    copied = copy.deepcopy(model)
    for each in (model, copied):
        hf.disable(each)
        assert not each.is_activation_checkpointing
        assert not any(checkpointing._module.is_module_checkpointed(m) for m in each.modules())
    _assert_bitwise(_grads(model, step), plain)


def test_enable_spec_keeps_the_routing_of_experts() -> None:
    """Rule 14 (as Rule 13): on a model with experts, ``full`` runs ``save_routing()`` and a
    policy ``either(policy, save_routing())``."""
    from checkpointing.integrations import transformers as hf

    model, _ = _hf("mixtral")
    result = hf.enable(model, spec={"model.layers.0": "full", "model.layers.1": "save_matmuls"})
    assert result.actions() == {
        "model.layers.0": "save_routing()",
        "model.layers.1": "either(save_matmuls(), save_routing())",
    }
    hf.disable(model)


@pytest.mark.parametrize(
    "others",
    [{"policy": "save_matmuls"}, {"budget": 0.5}, {"every_n_layers": 2}, {"use_reentrant": False}],
)
def test_enable_spec_refuses_other_options(others: dict[str, Any]) -> None:
    """Rule 14: the spec says everything; another option beside it is an error naming it."""
    from checkpointing.integrations import transformers as hf

    model, _ = _hf("llama")
    name = next(iter(others))
    with pytest.raises(ValueError, match=f"so {name}= cannot be given with it"):
        hf.enable(model, spec={"model.layers.*": "full"}, **others)
    with pytest.raises(ValueError, match=f"so {name}= cannot be given with it"):
        hf.CheckpointingCallback(spec={"model.layers.*": "full"}, **others)
    assert not model.is_activation_checkpointing


def test_callback_checks_its_spec_when_made() -> None:
    """NOTE [Trainer callback], Rule 5: a bad value fails when the callback is made."""
    from checkpointing.integrations import transformers as hf

    with pytest.raises(ValueError, match="unknown value 'save_matmul'"):
        hf.CheckpointingCallback(spec={"model.layers.*": "save_matmul"})


@pytest.mark.once
def test_callback_installs_its_spec_at_train_begin(tmp_path: pathlib.Path) -> None:
    """Rule 5: the ``Trainer`` trains the model with the spec's regions installed."""
    import transformers

    from checkpointing.integrations import transformers as hf

    model, _ = _hf("llama")
    ids = torch.randint(64, (8,))
    args = transformers.TrainingArguments(
        str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    callback = hf.CheckpointingCallback(spec={"model.layers.{-1}": "full"})
    data = [{"input_ids": ids, "labels": ids}] * 2
    transformers.Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
    assert callback.applied is not None
    assert callback.applied.actions() == {"model.layers.1": "full"}
    assert checkpointing._module.is_module_checkpointed(model.model.layers[1])


def test_a_name_added_to_the_policy_table_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [Spec grammar], Rule 4: names resolve through ``checkpointing.policies``' one table,
    so a name added to it is a value at once (and one never added lists the table's names)."""
    from checkpointing.policies import _NAMED, save_ops

    monkeypatch.setitem(_NAMED, "test:save_mm", lambda: save_ops(torch.ops.aten.mm))
    model = _stack(2)
    got = apply_spec(model, {"{0}": "test:save_mm"}, dry_run=True).actions()
    assert got == {"0": "save_ops(aten.mm)"}
    with pytest.raises(ValueError, match=r"'test:save_mm'"):
        apply_spec(model, {"{0}": "test:save_m"})


def _encoder() -> tuple[nn.Sequential, torch.Tensor]:
    """Three encoder layers with dropout, training, and their input."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
        for _ in range(3)
    ]
    return nn.Sequential(*layers).train(), torch.randn(2, 8, 32)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_budget_key_plans_at_the_first_step_with_grad(share: float) -> None:
    """NOTE [Spec budget], Rules 2 and 4: nothing is planned under no_grad; the first step with
    grad plans and gives bitwise the plain run's gradients, and so does the next; what the
    step keeps fits the share of the way from full recompute to keeping everything."""
    model, x = _encoder()
    plain = copy.deepcopy(model)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).sum()

    want = _grads(plain, step)
    applied = apply_spec(model, {"*": f"budget:{share}"})
    assert applied.actions()["0"] == f"budget {share} (planned at first step)"
    assert f"budget {share} (planned at first step)" in str(applied)
    with torch.no_grad():
        model(x)
    assert applied.plan is None
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())
    _assert_bitwise(_grads(model, step), want)
    plan = applied.plan
    assert plan is not None
    assert plan.budget_bytes == plan.floor_bytes + int(
        share * (plan.baseline_bytes - plan.floor_bytes)
    )
    for name, text in applied.actions().items():
        decided = {r.name: r for r in plan.regions}[name]
        assert text == f"budget {share}: {decided.describe()}"
    assert any(r.checkpoint for r in plan.regions)
    _assert_bitwise(_grads(model, step), want)
    torch.manual_seed(7)
    with checkpointing.saved_tensors_report() as report:
        step(model).backward()
    assert report.activation_bytes <= plan.budget_bytes * 1.02, str(plan)
    applied.remove()
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())
    _assert_bitwise(_grads(model, step), want)


def test_budget_key_beside_other_keys() -> None:
    """NOTE [Spec budget], Rules 1 and 2: the budget plans the modules its key decides (not one
    a more specific key gives another value); the other keys' regions go on at the first step
    with grad, after the plan; gradients stay bitwise the plain run's."""
    model, x = _encoder()
    plain = copy.deepcopy(model)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).sum()

    want = _grads(plain, step)
    applied = apply_spec(model, {"*": "budget:0.3", "2": "full", "1": "none"})
    assert not checkpointing._module.is_module_checkpointed(model[2])
    _assert_bitwise(_grads(model, step), want)
    assert applied.plan is not None
    assert [r.name for r in applied.plan.regions] == ["0"]
    assert checkpointing._module.is_module_checkpointed(model[2])
    assert applied.actions()["2"] == "full"
    assert applied.actions()["1"] == "none"
    _assert_bitwise(_grads(model, step), want)
    applied.remove()
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())


def test_budget_removed_before_its_first_step_plans_nothing() -> None:
    """NOTE [Spec budget], Rule 4: ``remove()`` cancels a planning not yet run."""
    model, x = _encoder()
    applied = apply_spec(model, {"{0:2}": "budget:0.5"})
    applied.remove()
    model(x).sum().backward()
    assert applied.plan is None
    assert not any(checkpointing._module.is_module_checkpointed(m) for m in model.modules())


def test_budget_dry_run_shows_the_share() -> None:
    model, _ = _encoder()
    result = apply_spec(model, {"{-1}": "budget:1"}, dry_run=True)
    assert str(result).splitlines()[1].split() == [
        "2",
        "TransformerEncoderLayer",
        "budget",
        "1.0",
        "(planned",
        "at",
        "first",
        "step)",
        "<-",
        "'{-1}'",
    ]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"{0}": "budget:0.5", "{1}": "budget:0.5"}, r"two budget keys, '\{0\}'"),
        ({"*": "budget:1.5"}, r"the budget 'budget:1.5'; expected 'budget:S'"),
        ({"*": "budget:-0.1"}, r"the budget 'budget:-0.1'"),
        ({"*": "budget:half"}, r"the budget 'budget:half'"),
        ({"*": "budget:nan"}, r"the budget 'budget:nan'"),
        ({"*": "budget:0.5", "0.linear1": "full"}, r"'0.linear1' \(full, from '0.linear1'\)"),
        ({"0.linear1": "budget:0.5", "0": "full"}, r"lies inside '0' \(full, from '0'\)"),
    ],
)
def test_budget_errors(spec: dict[str, Any], match: str) -> None:
    """NOTE [Spec grammar], Rule 5, and NOTE [Spec budget], Rules 1 and 3."""
    model, _ = _encoder()
    with pytest.raises(ValueError, match=match):
        apply_spec(model, spec)
    assert not model._forward_pre_hooks


def test_budget_is_refused_where_a_spec_installs_at_once() -> None:
    """A budget needs the first step: ``apply_activation_checkpointing`` refuses it."""
    model, _ = _encoder()
    with pytest.raises(ValueError, match=r"'\*' has a budget.*Fix: checkpointing.apply_spec"):
        checkpointing.apply_activation_checkpointing(model, spec={"*": "budget:0.5"})


@pytest.mark.once
def test_hf_budget_key_gradients_equal_the_plain_run() -> None:
    """NOTE [Spec budget] on GPT-2 (cache off): the planning step and the next are bitwise the
    plain run's; ``enable(spec=...)`` refuses a budget value with the fix."""
    from checkpointing.integrations import transformers as hf

    model, step = _hf("gpt2")
    want = _grads(copy.deepcopy(model), step)
    applied = apply_spec(model, {"transformer.h.*": "budget:0.5"})
    _assert_bitwise(_grads(model, step), want)
    assert applied.plan is not None
    _assert_bitwise(_grads(model, step), want)
    applied.remove()
    with pytest.raises(ValueError, match=r"has a budget.*Fix: enable\(model, budget=\.\.\.\)"):
        hf.enable(model, spec={"transformer.h.*": "budget:0.5"})
