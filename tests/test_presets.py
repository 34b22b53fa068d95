"""Others' policy names: MaxText's ``remat_policy`` presets (``policies.maxtext``,
``"maxtext:<name>"``) and Hugging Face's ``gradient_checkpointing_kwargs``.

The presets are checked against MaxText's own lists (written out here from MaxText's
``layers/decoders.py``, ``Decoder.get_remat_policy``), then on tiny random Hugging Face models:
which tensors each keeps, offloads or recomputes (the saved-tensor report), with gradients equal
to the plain run's. ``gradient_checkpointing_kwargs`` runs side by side with transformers' own
``gradient_checkpointing_enable``. Tests named ``test_rule<k>_...`` check Rule k of NOTE [MaxText
presets], NOTE [transformers tags] or NOTE [gradient_checkpointing_kwargs].
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import transformers
from hf_support import BATCH, SEQ, VOCAB, tiny_llama

import checkpointing
from checkpointing import CheckpointPolicy
from checkpointing._presets import MAXTEXT_NAMES, MAXTEXT_PRESETS
from checkpointing.integrations import transformers as hf_checkpointing
from checkpointing.integrations._hf_tags import _TagInput, _TagOutput
from checkpointing.policies import as_context_fn, maxtext, save_only_these_names, tag

_TAG = torch.ops.checkpointing.tag.default
_QKV = {"query_proj", "key_proj", "value_proj", "qkv_proj"}
_MINIMAL = _QKV | {"out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"}
# MaxText's definitions, transcribed: (names saved on the device, names offloaded to host).
MAXTEXT: dict[str, tuple[set[str], set[str]]] = {
    "minimal_with_context": (_MINIMAL | {"context"}, set()),
    "minimal": (_MINIMAL, set()),
    "save_dot_with_context_except_mlp": (_QKV | {"context", "out_proj"}, set()),
    "save_dot_except_mlpwi": (_QKV | {"out_proj", "mlpwo"}, set()),
    "save_dot_except_mlp": (_QKV | {"out_proj"}, set()),
    "save_qkv_proj": (_QKV, set()),
    "qkv_proj_offloaded": (set(), {"query_proj", "key_proj", "value_proj"}),
    "minimal_offloaded": (set(), _MINIMAL),
    "save_out_proj": ({"out_proj"}, set()),
    "full": (set(), set()),
}
# What a Hugging Face Llama layer makes of MaxText's names (no fused projections).
_LLAMA_NAMES = set(MAXTEXT_NAMES) - {"qkv_proj", "mlpwi", "mla_q", "mla_kv", "decoder_layer_input"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _answers(policy: Any) -> dict[str, CheckpointPolicy]:
    """The policy's answer for a tag of each of MaxText's names."""
    return {name: policy(None, _TAG, torch.ones(1), name) for name in MAXTEXT_NAMES}


@pytest.mark.parametrize("preset", sorted(MAXTEXT))
def test_rule1_each_preset_is_maxtexts_list(preset: str) -> None:
    """Each preset saves MaxText's saved names, offloads its offloaded ones and recomputes every
    other name and op; the name ``"maxtext:<preset>"`` is the same policy."""
    saved, offloaded = MAXTEXT[preset]
    for policy in (maxtext(preset), checkpointing.policies._NAMED[f"maxtext:{preset}"]()):
        answers = _answers(policy)
        assert {n for n, a in answers.items() if a is CheckpointPolicy.MUST_SAVE} == saved
        host = {n for n, a in answers.items() if a is CheckpointPolicy.MUST_CPU_OFFLOAD}
        assert host == offloaded
        rest = set(MAXTEXT_NAMES) - saved - offloaded
        assert all(answers[n] is CheckpointPolicy.PREFER_RECOMPUTE for n in rest)
        assert policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.PREFER_RECOMPUTE
    assert set(MAXTEXT_PRESETS) == set(MAXTEXT)


def test_rule2_custom_places_each_tensor() -> None:
    """``"custom"`` keeps, offloads and recomputes each named tensor as its option says, and
    recomputes the names left out."""
    policy = maxtext("custom", query_proj="offload", key_proj="offload", out_proj="device")
    answers = _answers(policy)
    assert answers["query_proj"] is answers["key_proj"] is CheckpointPolicy.MUST_CPU_OFFLOAD
    assert answers["out_proj"] is CheckpointPolicy.MUST_SAVE
    assert answers["value_proj"] is answers["mlpwo"] is CheckpointPolicy.PREFER_RECOMPUTE
    assert _answers(maxtext("custom")) == _answers(maxtext("full"))


def test_rule2_bad_preset_arguments_are_errors() -> None:
    """Unknown presets and tensor names list the known ones; options go with ``"custom"`` only;
    a placement must be one of MaxText's three."""
    with pytest.raises(ValueError, match=r"unknown MaxText remat_policy 'minimall'.*'minimal'"):
        maxtext("minimall")
    with pytest.raises(TypeError, match=r"'minimal' takes no per-tensor options"):
        maxtext("minimal", query_proj="offload")
    with pytest.raises(TypeError, match=r"unknown tensor name\(s\) q_proj.*query_proj"):
        maxtext("custom", q_proj="offload")
    with pytest.raises(ValueError, match=r"query_proj='host'; expected 'remat', 'device'"):
        maxtext("custom", query_proj="host")
    with pytest.raises(ValueError, match=r"unknown policy name 'maxtext:minimall'.*maxtext:"):
        as_context_fn("maxtext:minimall")


@pytest.mark.parametrize("placement", ["remat", "offload"])
def test_rule3_layer_input_stays_on_the_device(placement: str) -> None:
    """``decoder_layer_input`` other than ``"device"`` is refused (checkpoint keeps its inputs on
    the device); ``"device"`` is MaxText's default and accepted."""
    with pytest.raises(ValueError, match=r"decoder_layer_input=.*offload_wrapper"):
        maxtext("custom", decoder_layer_input=placement)
    assert _answers(maxtext("custom", decoder_layer_input="device")) == _answers(maxtext("full"))


def test_a_preset_by_name_on_tagged_code_keeps_the_tensor() -> None:
    """``context_fn="maxtext:qkv_proj_offloaded"`` on code that tags ``query_proj`` offloads that
    tensor (its bytes counted by ``OffloadStats``), with the plain run's gradients."""
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)

    def block(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return tag(t @ weight, "query_proj").softmax(-1).sum()

    block(x, w).backward()
    plain = w.grad.clone()
    w.grad = None
    stats = checkpointing.OffloadStats()
    context_fn = as_context_fn("maxtext:qkv_proj_offloaded", offload_stats=stats)
    checkpointing.checkpoint(block, x, w, use_reentrant=False, context_fn=context_fn).backward()
    assert torch.equal(w.grad, plain)
    assert stats.offloaded_bytes == stats.restored_bytes == 4 * 8 * 4


# --- On Hugging Face models ----------------------------------------------------------------
# Marked ``once`` (CI's first stage only), as the other tests of the optional transformers
# integration: the policies and tags they run are tested above on every release.


def _ids() -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _step(model: transformers.PreTrainedModel, **options: Any) -> tuple[Any, list[Any], Any]:
    """Loss, gradients and report of a training step of a copy of ``model``, enabled with
    ``options`` (none: the plain run)."""
    model = copy.deepcopy(model).train()
    if options:
        hf_checkpointing.enable(model, **options)
    ids = _ids()
    torch.manual_seed(1)
    with checkpointing.saved_tensors_report() as report:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], report


def _assert_same(ours: tuple[Any, list[Any], Any], reference: tuple[Any, list[Any], Any]) -> None:
    assert torch.equal(ours[0], reference[0])
    for mine, theirs in zip(ours[1], reference[1], strict=True):
        assert (mine is None) == (theirs is None)
        assert mine is None or torch.equal(mine, theirs)


def _kept(report: checkpointing.SavedTensorsReport) -> dict[tuple[str | None, str], int]:
    """Per (tag name, decision), how many tensors the layers' regions kept (saved or offloaded),
    the regions' RNG states and inputs aside."""
    counts: dict[tuple[str | None, str], int] = {}
    for record in report.records:
        in_layer = not record.region.startswith(("inputs of ", "(outside"))
        if in_layer and record.decision != "recomputed" and record.op != "rng state":
            key = (record.name, record.decision)
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    """A 2-layer Llama with attention dropout (use_cache off, as in the plain run)."""
    torch.manual_seed(0)
    return tiny_llama(2, attention_dropout=0.1)


@pytest.fixture(scope="module")
def plain(llama: transformers.PreTrainedModel) -> tuple[Any, list[Any], Any]:
    return _step(llama)


@pytest.mark.once
@pytest.mark.parametrize("preset", sorted(MAXTEXT))
def test_preset_on_llama_keeps_maxtexts_tensors(
    preset: str, llama: transformers.PreTrainedModel, plain: tuple[Any, list[Any], Any]
) -> None:
    """``enable(policy="maxtext:<preset>")`` on a Llama: each layer keeps (on the device or in
    host memory) exactly the tensors MaxText's list names that a Llama layer makes, one of each
    per layer, and recomputes everything else; gradients equal the plain run's, dropout on."""
    saved, offloaded = MAXTEXT[preset]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Rule 2 of the tags: nothing a Llama lacks is asked for
        ours = _step(llama, policy=f"maxtext:{preset}")
    _assert_same(ours, plain)
    expected = {(name, "saved"): 2 for name in saved & _LLAMA_NAMES}
    expected |= {(name, "offloaded"): 2 for name in offloaded & _LLAMA_NAMES}
    assert _kept(ours[2]) == expected
    offloaded_bytes = ours[2].bytes_by_decision()["offloaded"]
    assert (offloaded_bytes > 0) == bool(offloaded)


@pytest.mark.once
def test_rule4_tagged_bytes_are_the_projections(llama: transformers.PreTrainedModel) -> None:
    """``qkv_proj_offloaded`` moves exactly the three projections' outputs (pre-rotary, as
    Rule 4 says) to host: per layer 2x16 tokens x (32 + 16 + 16) float32 features."""
    report = _step(llama, policy="maxtext:qkv_proj_offloaded")[2]
    assert report.bytes_by_decision()["offloaded"] == 2 * BATCH * SEQ * (32 + 16 + 16) * 4


@pytest.mark.once
def test_rule5_offload_stats_count_the_projections(
    llama: transformers.PreTrainedModel, plain: tuple[Any, list[Any], Any]
) -> None:
    """A preset given as ``context_fn=as_context_fn(..., offload_stats=stats)`` is tagged as
    ``policy=`` is: the stats count the three projections of both layers, moved and brought
    back, and the gradients are the plain run's."""
    stats = checkpointing.OffloadStats()
    context_fn = as_context_fn(maxtext("qkv_proj_offloaded"), offload_stats=stats)
    ours = _step(llama, context_fn=context_fn)
    _assert_same(ours, plain)
    projections = 2 * BATCH * SEQ * (32 + 16 + 16) * 4
    assert stats.offloaded_bytes == stats.restored_bytes == projections
    assert stats.offloaded_tensors == 2 * 3


@pytest.mark.once
def test_rule1_tags_any_name_based_policy(llama: transformers.PreTrainedModel) -> None:
    """A policy object over MaxText's names is tagged too, and a name given as ``context_fn``
    is read as the policy."""
    by_object = _step(llama, policy=save_only_these_names("out_proj"))
    by_context_fn = _step(llama, context_fn="maxtext:save_out_proj")
    assert _kept(by_object[2]) == _kept(by_context_fn[2]) == {("out_proj", "saved"): 2}


@pytest.mark.once
def test_rule6_a_spec_tags_under_its_modules(
    llama: transformers.PreTrainedModel, plain: tuple[Any, list[Any], Any]
) -> None:
    """``enable(spec=...)`` tags under each module the spec gives a MaxText preset: a layer's
    attention keeps its projections, the other layer (``full``) keeps none; gradients equal the
    plain run's; ``disable`` removes the tags."""
    spec = {"model.layers.{0}.self_attn": "maxtext:save_qkv_proj", "model.layers.1": "full"}
    ours = _step(llama, spec=spec)
    _assert_same(ours, plain)
    named = {key: n for key, n in _kept(ours[2]).items() if key[0] is not None}
    assert named == {(name, "saved"): 1 for name in ("query_proj", "key_proj", "value_proj")}
    model = copy.deepcopy(llama)
    hf_checkpointing.enable(model, spec=spec)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert any(isinstance(h, _TagOutput) for h in q_proj._forward_hooks.values())
    hf_checkpointing.disable(model)
    assert not any(isinstance(h, _TagOutput) for h in q_proj._forward_hooks.values())


@pytest.mark.once
def test_rule3_disable_removes_the_tags(llama: transformers.PreTrainedModel) -> None:
    """``disable`` removes every tag hook, on the model and on a deep copy of it; a second
    ``enable`` replaces the first one's tags."""

    def hooks(model: torch.nn.Module) -> list[Any]:
        found = []
        for module in model.modules():
            found += [h for h in module._forward_hooks.values() if isinstance(h, _TagOutput)]
            found += [h for h in module._forward_pre_hooks.values() if isinstance(h, _TagInput)]
        return found

    model = copy.deepcopy(llama)
    hf_checkpointing.enable(model, policy="maxtext:minimal_with_context")
    assert len(hooks(model)) == 2 * 8  # 7 projections and the context, per layer
    hf_checkpointing.enable(model, policy="maxtext:save_out_proj")
    assert len(hooks(model)) == 2
    copied = copy.deepcopy(model)
    hf_checkpointing.disable(copied)
    assert hooks(copied) == []
    assert len(hooks(model)) == 2
    hf_checkpointing.disable(model)
    assert hooks(model) == []


def _mixtral() -> transformers.PreTrainedModel:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


@pytest.mark.once
def test_rule2_mixtral_says_which_names_it_lacks() -> None:
    """On a Mixtral (fused experts: no per-projection modules), ``minimal_with_context`` keeps
    the attention's tensors and the routing, warns that MaxText's MLP names are recomputed,
    and gives the plain run's gradients."""
    model = _mixtral()
    with pytest.warns(UserWarning, match=r"\['mlpwi', 'mlpwi_0', 'mlpwi_1', 'mlpwo'\]"):
        ours = _step(model, policy="maxtext:minimal_with_context")
    _assert_same(ours, _step(model))
    kept = _kept(ours[2])
    named = {key: n for key, n in kept.items() if key[0] is not None}
    attention = {"query_proj", "key_proj", "value_proj", "out_proj", "context"}
    assert named == {(name, "saved"): 2 for name in attention}
    assert any(name is None for name, _ in kept)  # the routing (a Llama keeps none unnamed)


# --- gradient_checkpointing_kwargs ---------------------------------------------------------


def _layer_options(model: transformers.PreTrainedModel) -> dict[str, Any]:
    options: dict[str, Any] = model.model.layers[0]._gradient_checkpointing_func.options
    return options


def _hf_step(model: transformers.PreTrainedModel, kwargs: Any) -> tuple[Any, list[Any], Any]:
    """A step of a copy of ``model`` under transformers' own ``gradient_checkpointing_enable``."""
    model = copy.deepcopy(model).train()
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ids = _ids()
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], None


@pytest.mark.once
@pytest.mark.parametrize(
    "kwargs",
    [
        None,
        {"use_reentrant": False},
        {"use_reentrant": True},
        {"use_reentrant": False, "preserve_rng_state": True, "determinism_check": "none"},
        {"use_reentrant": False, "debug": False, "early_stop": False},
    ],
    ids=repr,
)
def test_rule1_hf_kwargs_match_hf_own(kwargs: Any, llama: transformers.PreTrainedModel) -> None:
    """``enable(gradient_checkpointing_kwargs=kw)`` runs each layer with the options transformers'
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)`` hands torch: the same
    loss and gradients bit for bit (dropout on), and those options in the layer's function."""
    model = copy.deepcopy(llama)
    hf_checkpointing.enable(model, gradient_checkpointing_kwargs=kwargs)
    assert _layer_options(model) == (kwargs or {"use_reentrant": False})
    ours = _step(llama, gradient_checkpointing_kwargs=kwargs)
    _assert_same(ours, _hf_step(llama, kwargs))


@pytest.mark.once
def test_rule1_a_dict_without_use_reentrant_is_torchs_default(
    llama: transformers.PreTrainedModel,
) -> None:
    """``{}`` means torch's default, as in transformers: torch's warning, then the reentrant
    variant; a policy with it is refused at enable."""
    model = copy.deepcopy(llama)
    hf_checkpointing.enable(model, gradient_checkpointing_kwargs={})
    assert _layer_options(model) == {"use_reentrant": None}
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        ours = _step(llama, gradient_checkpointing_kwargs={})
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        theirs = _hf_step(llama, {})
    _assert_same(ours, theirs)
    with pytest.raises(ValueError, match="without use_reentrant means True"):
        hf_checkpointing.enable(model, policy="save_matmuls", gradient_checkpointing_kwargs={})


@pytest.mark.once
def test_rule2_unknown_keys_list_the_known_ones(llama: transformers.PreTrainedModel) -> None:
    """A key that is no checkpoint option, a non-dict and an option given twice are errors
    (Rules 2 and 3), from ``enable`` and from the callback alike."""
    from checkpointing.integrations.transformers import CheckpointingCallback

    model = copy.deepcopy(llama)
    known = r"\['context_fn', 'debug', 'determinism_check', 'early_stop', 'preserve_rng_state'"
    for make in (
        lambda kw: hf_checkpointing.enable(model, gradient_checkpointing_kwargs=kw),
        lambda kw: CheckpointingCallback(gradient_checkpointing_kwargs=kw),
    ):
        with pytest.raises(TypeError, match=r"unknown gradient_checkpointing_kwargs key\(s\) "):
            make({"use_reentrant": False, "offload": True})
        with pytest.raises(TypeError, match=known):
            make({"reentrant": False})
        with pytest.raises(TypeError, match="must be a dict"):
            make([("use_reentrant", False)])
    with pytest.raises(TypeError, match=r"\['use_reentrant'\] given both"):
        hf_checkpointing.enable(
            model, use_reentrant=False, gradient_checkpointing_kwargs={"use_reentrant": True}
        )


@pytest.mark.once
def test_callback_takes_hf_kwargs(llama: transformers.PreTrainedModel, tmp_path: Any) -> None:
    """``CheckpointingCallback(gradient_checkpointing_kwargs=kw)`` installs what ``enable`` with
    the same dict installs, when training begins."""
    from checkpointing.integrations.transformers import CheckpointingCallback

    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    callback = CheckpointingCallback(
        policy="maxtext:save_qkv_proj", gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    model = copy.deepcopy(llama)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    function = model.model.layers[0]._gradient_checkpointing_func
    assert function.options["use_reentrant"] is False
    assert "context_fn" in function.options
    q_proj = model.model.layers[0].self_attn.q_proj
    assert any(isinstance(h, _TagOutput) for h in q_proj._forward_hooks.values())
