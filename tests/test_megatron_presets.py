"""``checkpointing.megatron_spec``: Megatron-core's recompute settings as a spec (NOTE [Megatron
presets]), on tiny GPT-2, Llama and Mixtral models (random weights, dropout on,
``use_cache=False`` in both runs): each translation selects what the NOTE says, and the model
under it trains with gradients bitwise those of the plain run.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hf_support import zoo_member
from torch import nn

import checkpointing
from checkpointing import apply_spec, megatron_spec


def _hf(name: str, layers: int = 2) -> tuple[nn.Module, Any]:
    """A zoo member with ``layers`` layers, without its key/value cache, and its step."""
    member = zoo_member(name)
    member.model.config.use_cache = False
    return member.model, lambda m: member.loss_fn(m(*member.args, **member.kwargs))


def _grads(model: nn.Module, step: Any) -> list[torch.Tensor | None]:
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    step(model).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


# Per (family, settings): what each selected module gets, as the applied spec prints it.
CASES: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("llama", {"recompute_granularity": "full", "recompute_method": "uniform",
               "recompute_num_layers": 1},
     {"model.layers.0": "full", "model.layers.1": "full"}),
    ("gpt2", {"recompute_granularity": "full", "recompute_method": "block",
              "recompute_num_layers": 1},
     {"transformer.h.0": "full"}),
    ("gpt2", {"recompute_granularity": "selective"},
     {"transformer.h.0.attn": "core", "transformer.h.1.attn": "core"}),
    ("llama", {"recompute_granularity": "selective",
               "recompute_modules": ["core_attn", "mlp", "layernorm"]},
     {
         "model.layers.0.self_attn": "core",
         "model.layers.0.mlp": "full",
         "model.layers.0.input_layernorm": "full",
         "model.layers.0.post_attention_layernorm": "full",
         "model.layers.1.self_attn": "core",
         "model.layers.1.mlp": "full",
         "model.layers.1.input_layernorm": "full",
         "model.layers.1.post_attention_layernorm": "full",
     }),
    ("mixtral", {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
     {"model.layers.0.mlp": "save_routing()",
      "model.layers.1.mlp": "save_routing()"}),
    ("mixtral", {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]},
     {"model.layers.0.mlp.experts": "act", "model.layers.1.mlp.experts": "act"}),
]  # fmt: skip


def _shown(action: str) -> str:
    """The two ``recompute_ops`` policies by what they recompute."""
    if action == "save_ops(aten.mm, aten.addmm)":
        return "core"
    if action.startswith("save_ops(aten.mm, aten.addmm, aten.bmm"):
        return "act"
    return action


@pytest.mark.once
@pytest.mark.parametrize(("family", "settings", "expected"), CASES)
def test_translation_selects_and_trains_like_the_plain_run(
    family: str, settings: dict[str, Any], expected: dict[str, str]
) -> None:
    """NOTE [Megatron presets], Rules 1-3: the spec selects what the NOTE says, and the
    gradients are bitwise the plain run's (dropout drawn alike)."""
    model, step = _hf(family)
    plain = _grads(copy.deepcopy(model), step)
    result = apply_spec(model, megatron_spec(model, **settings))
    assert {name: _shown(action) for name, action in result.actions().items()} == expected
    for got, want in zip(_grads(model, step), plain, strict=True):
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert torch.equal(got, want)
    result.remove()


def test_none_and_defaults() -> None:
    """No granularity is no recompute (an empty spec); ``full`` without a method is every
    layer; ``selective`` defaults to ``['core_attn']``."""
    model, _ = _hf("llama")
    assert megatron_spec(model, recompute_granularity=None) == {}
    assert megatron_spec(model, recompute_granularity="full") == {"model.layers.*": "full"}
    assert list(megatron_spec(model, recompute_granularity="selective")) == [
        "model.layers.*.self_attn"
    ]
    assert megatron_spec(
        model, recompute_granularity="full", recompute_method="block", recompute_num_layers=5
    ) == {"model.layers.{:5}": "full"}


@pytest.mark.parametrize(
    ("family", "settings", "match"),
    [
        ("llama", {"recompute_granularity": "ful"}, r"recompute_granularity='ful'.*'full', "),
        (
            "llama",
            {"recompute_granularity": "full", "recompute_method": "blocks"},
            r"recompute_method='blocks'.*'uniform', 'block'",
        ),
        (
            "llama",
            {"recompute_granularity": "selective", "recompute_modules": ["core_atn"]},
            r"'core_atn'.*known names: 'core_attn', 'mlp', 'moe', 'moe_act', 'layernorm'",
        ),
        (
            "llama",
            {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]},
            r"multi-latent attention",
        ),
        ("llama", {"recompute_granularity": "selective", "recompute_modules": ["moe"]}, "no layer"),
        ("mixtral", {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, "dense"),
        (
            "mixtral",
            {"recompute_granularity": "selective", "recompute_modules": ["shared_experts"]},
            "shared experts",
        ),
        (
            "llama",
            {"recompute_granularity": "selective", "recompute_num_layers": 2},
            "must be None with recompute_granularity='selective'",
        ),
        (
            "llama",
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 2,
            },
            r"runs of 2 layers as one region.*recompute_num_layers=1",
        ),
        (
            "llama",
            {"recompute_granularity": "full", "recompute_method": "block"},
            "must be a positive integer",
        ),
        ("llama", {"recompute_granularity": "selective", "recompute_modules": []}, "is empty"),
    ],
)
def test_unknown_or_impossible_settings_are_clear_errors(
    family: str, settings: dict[str, Any], match: str
) -> None:
    """Unknown values list the known ones; settings a spec cannot express say why and the
    fix."""
    model, _ = _hf(family)
    with pytest.raises(ValueError, match=match):
        megatron_spec(model, **settings)


def test_no_layers_is_an_error() -> None:
    """NOTE [Megatron presets], Rule 1: a model without a list of layers."""
    with pytest.raises(ValueError, match=r"has no nn\.ModuleList of layers"):
        megatron_spec(nn.Linear(2, 2), recompute_granularity="full")


def test_layers_inside_layers_are_not_the_layers() -> None:
    """Rule 1: a list inside a layer (experts) is not taken for the layers, however long."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))

    spec = megatron_spec(Model(), recompute_granularity="full")
    assert spec == {"layers.*": "full"}
    assert checkpointing.apply_spec(Model(), spec, dry_run=True).actions() == {
        "layers.0": "full",
        "layers.1": "full",
    }
