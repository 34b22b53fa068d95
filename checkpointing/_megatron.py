"""Megatron-core's recompute settings, translated into a spec on a Hugging Face model.

Owns ``megatron_spec``: ``recompute_granularity``, ``recompute_method``,
``recompute_num_layers`` and ``recompute_modules`` (the fields of Megatron-core's
``TransformerConfig``) read as a ``checkpointing.apply_spec`` mapping over the model's decoder
layers and their attention, MLP, MoE and norm modules. Finding those modules is structural
(below); the spec's grammar belongs to ``_spec_grammar``, installing it to ``_spec``.

NOTE [Megatron presets]
  Rule 1. The decoder layers are the children of the model's longest ``nn.ModuleList`` that
          no other list holds (ties: the first; experts in a list inside a layer are not
          layers), as Megatron's ``TransformerBlock`` holds its layers; in a layer, the
          attention is the child whose class name ends in ``Attention``, the feed-forward the
          child holding an ``experts`` child (an MoE block) or whose class name ends in
          ``MLP``, the norms the children whose class name holds ``Norm``, the shared experts
          the MoE block's child named ``shared_expert`` or ``shared_experts``. A name in
          ``recompute_modules`` whose module no layer has is an error.
  Rule 2. ``full`` checkpoints whole layers: ``uniform`` with ``recompute_num_layers=1`` (or no
          method) every layer, ``block`` the first ``recompute_num_layers``. Megatron's
          ``uniform`` with more than one layer per unit checkpoints a run of layers as one
          region (one input kept per run); a spec's regions are modules, and no module holds a
          run of layers, so that is refused with the fix rather than translated into something
          that keeps more.
  Rule 3. ``selective`` translates per name, in every layer: ``core_attn`` the attention
          module under ``save_ops`` of the projections' matrix products (``mm``, ``addmm``):
          the core (scores, softmax, dropout, the fused kernels) is recomputed, and so is the
          rotary embedding, cheap, between the projections and the core; ``mlp`` the dense
          MLP, full; ``moe`` the MoE block under ``save_routing()`` (recomputed, its routing
          kept, NOTE [Routing ops]); ``moe_act`` the experts under ``save_ops`` of their matrix
          products, so the activation and the gated product are recomputed from them;
          ``shared_experts``, full; ``layernorm`` the layer's norms, full.
          Rejected: "keep everything but the core" (``recompute_ops``): it keeps every other
          op's output, buffers later written in place among them (transformers' attention and
          experts fill ``empty_like`` buffers), which selective checkpointing refuses.
  Rule 4. ``layernorm`` differs from Megatron's: Megatron discards the norm's output and
          recomputes it when the next projection needs it (output-discarding checkpoint); a
          region around the norm module recomputes its inner values but the projection after it
          still keeps its output. Gradients are the same; the memory saved is less.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch
from torch import nn

from .policies import Policy, save_ops

__all__ = ["megatron_spec"]

_GRANULARITIES: Final = ("full", "selective")
_METHODS: Final = ("uniform", "block")
_MODULES: Final = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts")

_MSG_VALUE = (
    "checkpointing.megatron_spec: {field}={got!r} is not one of Megatron-core's values; "
    "expected one of {known}. Fix: pass one of those (Megatron-core's TransformerConfig "
    "spells them so)."
)
_MSG_MODULE = (
    "checkpointing.megatron_spec: recompute_modules holds {got!r}, which is not translated; "
    "known names: {known}{why}. Fix: drop it, or use checkpointing.apply_spec with a pattern "
    "for the module you mean."
)
_WHY_MLA = " ('mla_up_proj' is Megatron's multi-latent attention, which no layer here has)"
_MSG_NUM_LAYERS = (
    "checkpointing.megatron_spec: recompute_num_layers must be a positive integer with "
    "recompute_granularity='full' and recompute_method={method!r}, got {got!r}. Fix: pass "
    "e.g. recompute_num_layers=1."
)
_MSG_SELECTIVE_NUM = (
    "checkpointing.megatron_spec: recompute_num_layers must be None with "
    "recompute_granularity='selective' (Megatron-core: 'selective' always uses all layers), "
    "got {got!r}. Fix: drop recompute_num_layers, or use recompute_granularity='full'."
)
_MSG_UNIFORM_RUN = (
    "checkpointing.megatron_spec: recompute_method='uniform' with recompute_num_layers={got} "
    "checkpoints runs of {got} layers as one region each in Megatron-core; a spec's regions "
    "are modules, and no module of {model} holds a run of layers. Fix: "
    "recompute_num_layers=1 (every layer its own region: one more kept layer input per "
    "layer), or checkpointing.checkpoint_sequential over the layers in your own forward."
)
_MSG_NO_LAYERS = (
    "checkpointing.megatron_spec: {model} has no nn.ModuleList of layers, so its decoder "
    "layers cannot be found. Fix: write the spec by hand (checkpointing.apply_spec with "
    "patterns for your blocks)."
)
_MSG_ABSENT = (
    "checkpointing.megatron_spec: recompute_modules names {name!r}, but no layer of {model} "
    "has {what}. Fix: drop {name!r} from recompute_modules."
)
_MSG_NO_MODULES = (
    "checkpointing.megatron_spec: recompute_modules is empty, so 'selective' would checkpoint "
    "nothing. Fix: name modules (Megatron-core's default is ['core_attn']), or leave "
    "recompute_granularity unset."
)

# Rule 3: the projections' matrix products, kept in an attention region: everything else (the
# core: scores, softmax, dropout, the fused kernels; and the rotary embedding) is recomputed.
_PROJECTIONS: Final = ("mm", "addmm")
# Rule 3: the experts' matrix products (one per expert, or grouped), kept in an experts region:
# the activation and the gated product are recomputed from them.
_EXPERT_PRODUCTS: Final = ("mm", "addmm", "bmm", "_grouped_mm")


def megatron_spec(
    model: nn.Module,
    *,
    recompute_granularity: str | None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    recompute_modules: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Megatron-core's recompute settings as a spec for ``checkpointing.apply_spec``.

    The four fields of Megatron-core's ``TransformerConfig``, with its values and defaults,
    read over a Hugging Face model's decoder layers (Llama, GPT-2, Mixtral and models built
    like them): ``"full"`` checkpoints whole layers (``"uniform"`` with one layer per unit:
    all of them; ``"block"``: the first ``recompute_num_layers``); ``"selective"`` the named
    parts of every layer (``recompute_modules``, default ``["core_attn"]``: ``core_attn``,
    ``mlp``, ``moe``, ``moe_act``, ``layernorm``, ``shared_experts``). ``None`` checkpoints
    nothing (an empty spec). The guide's page "Per-module specs" sets each translation beside
    Megatron's definition.

    Example:
        >>> import transformers, checkpointing
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32,
        ...     intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> checkpointing.megatron_spec(model, recompute_granularity="full",
        ...     recompute_method="block", recompute_num_layers=2)
        {'model.layers.{:2}': 'full'}
    """
    _check_value("recompute_granularity", recompute_granularity, (*_GRANULARITIES, None))
    _check_value("recompute_method", recompute_method, (*_METHODS, None))
    if recompute_granularity is None:
        return {}
    prefix, layers = _layers(model)
    if recompute_granularity == "full":
        return _full(model, prefix, recompute_method, recompute_num_layers)
    if recompute_num_layers is not None:
        raise ValueError(_MSG_SELECTIVE_NUM.format(got=recompute_num_layers))
    names = ["core_attn"] if recompute_modules is None else list(recompute_modules)
    if not names:
        raise ValueError(_MSG_NO_MODULES)
    for name in names:
        if name not in _MODULES:
            why = _WHY_MLA if name == "mla_up_proj" else ""
            known = ", ".join(map(repr, _MODULES))
            raise ValueError(_MSG_MODULE.format(got=name, known=known, why=why))
    spec: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        found = _selected(name, layers)
        if not found:
            raise ValueError(
                _MSG_ABSENT.format(name=name, model=type(model).__name__, what=_WHAT[name])
            )
        spec.update(_keys(prefix, len(layers), found, _value(name)))
    return spec


def _check_value(field: str, value: object, known: tuple[str | None, ...]) -> None:
    if value not in known:
        raise ValueError(
            _MSG_VALUE.format(field=field, got=value, known=", ".join(map(repr, known)))
        )


def _full(
    model: nn.Module, prefix: str, method: str | None, num_layers: int | None
) -> dict[str, Any]:
    """Rule 2."""
    if method is None:
        return {f"{prefix}.*": "full"}
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(_MSG_NUM_LAYERS.format(method=method, got=num_layers))
    if method == "block":
        return {f"{prefix}.{{:{num_layers}}}": "full"}
    if num_layers > 1:
        raise ValueError(_MSG_UNIFORM_RUN.format(got=num_layers, model=type(model).__name__))
    return {f"{prefix}.*": "full"}


def _layers(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """Rule 1: the name of the longest ``ModuleList`` and its children."""
    best: tuple[str, list[nn.Module]] | None = None
    lists: list[str] = []
    for name, module in model.named_modules():  # parents before children
        if not isinstance(module, nn.ModuleList) or not name:
            continue
        if any(name.startswith(f"{outer}.") for outer in lists):
            continue  # a list inside a layer (experts), not the layers
        lists.append(name)
        if len(module) > 0 and (best is None or len(module) > len(best[1])):
            best = (name, list(module))
    if best is None:
        raise ValueError(_MSG_NO_LAYERS.format(model=type(model).__name__))
    return best


_WHAT: Final = {
    "core_attn": "an attention child (a class named *Attention)",
    "mlp": "a dense MLP child (a class named *MLP)",
    "moe": "an MoE block (a child holding `experts`)",
    "moe_act": "an MoE block's experts",
    "layernorm": "a norm child (a class named *Norm*)",
    "shared_experts": "shared experts (an MoE block's `shared_expert(s)`)",
}


def _selected(name: str, layers: list[nn.Module]) -> dict[int, list[str]]:
    """Rule 1: per layer index, the paths (under the layer) of the modules ``name`` means."""
    found: dict[int, list[str]] = {}
    for index, layer in enumerate(layers):
        paths = list(_paths(name, layer))
        if paths:
            found[index] = paths
    return found


def _paths(name: str, layer: nn.Module) -> Iterable[str]:
    children = list(layer.named_children())
    moe = [(n, c) for n, c in children if hasattr(c, "experts")]
    if name == "core_attn":
        yield from (n for n, c in children if type(c).__name__.endswith("Attention"))
    elif name == "mlp":
        yield from (
            n for n, c in children if type(c).__name__.endswith("MLP") and not hasattr(c, "experts")
        )
    elif name == "moe":
        yield from (n for n, _ in moe)
    elif name == "moe_act":
        yield from (f"{n}.experts" for n, _ in moe)
    elif name == "layernorm":
        yield from (n for n, c in children if "Norm" in type(c).__name__)
    else:  # shared_experts
        for n, c in moe:
            yield from (f"{n}.{s}" for s in ("shared_expert", "shared_experts") if hasattr(c, s))


def _value(name: str) -> str | Policy:
    """Rule 3: what the modules ``name`` means get."""
    if name == "core_attn":
        return save_ops(*_aten(_PROJECTIONS))
    if name == "moe":
        return "save_routing"
    if name == "moe_act":
        return save_ops(*_aten(_EXPERT_PRODUCTS))
    return "full"


def _aten(names: Iterable[str]) -> list[Any]:
    """The aten op packets of ``names`` that this torch build has."""
    return [getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)]


def _keys(
    prefix: str, count: int, found: dict[int, list[str]], value: str | Policy
) -> dict[str, Any]:
    """Spec keys for ``found``: ``*`` where every layer has the path, else an index list."""
    by_path: dict[str, list[int]] = {}
    for index, paths in found.items():
        for path in paths:
            by_path.setdefault(path, []).append(index)
    keys: dict[str, Any] = {}
    for path, indices in by_path.items():
        layers = "*" if len(indices) == count else "{" + ",".join(map(str, indices)) + "}"
        keys[f"{prefix}.{layers}.{path}"] = value
    return keys
