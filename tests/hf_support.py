"""Tiny Hugging Face models built from a config (random weights, nothing downloaded), for the
tests that run one: a Llama, and the planner's zoo of model families."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

# The tiny Llama's vocabulary, and the batch and sequence length of the steps run on it.
VOCAB, BATCH, SEQ = 64, 2, 16


def tiny_llama(
    layers: int = 2, *, attention_dropout: float = 0.0, use_cache: bool = False
) -> transformers.PreTrainedModel:
    """A ``LlamaForCausalLM`` of hidden size 32 with ``layers`` layers, in training mode."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=attention_dropout,
        use_cache=use_cache,
    )
    return transformers.LlamaForCausalLM(config).train()


# The planner's zoo (tests/test_planner_zoo.py, issue 43 point 1): one tiny member of each family,
# random weights from a config, training mode, transformers' defaults kept where the zoo tests them
# (use_cache stays True: a decoder then hands each layer its key/value cache). Two layers, hidden
# size 32 to 64, dropout where the family has it, so that replays must draw as the forward drew.
_VOCAB = 96
_SEQ = 16
_BATCH = 2
# Special tokens inside the tiny vocabulary (the configs' defaults are GPT-2's 50256 and warn).
_TOKENS: dict[str, Any] = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


@dataclass(frozen=True)
class ZooMember:
    """A model, one step's inputs, its loss, and the planner's ``regions`` (None: the default)."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]
    regions: Callable[[nn.Module], bool] | None = None


def _hf_loss(output: Any) -> torch.Tensor:
    """The model's own loss (``labels`` given)."""
    loss: torch.Tensor = output.loss
    return loss


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, _VOCAB, shape, generator=torch.Generator().manual_seed(1))


def _tokens(model: nn.Module) -> ZooMember:
    """A language model's step: token ids as the input and the labels (a causal LM shifts them,
    a masked LM predicts them back)."""
    ids = _ids(_BATCH, _SEQ)
    return ZooMember(model.train(), (ids,), {"labels": ids.clone()}, _hf_loss)


def _seq2seq(model: nn.Module) -> ZooMember:
    """An encoder-decoder's step with its decoder's layers among the regions: decoder inputs
    given and no ``labels`` (with labels the model turns its cache off itself), so each decoder
    layer gets the EncoderDecoderCache; the loss on the logits against the inputs shifted."""
    ids = _ids(_BATCH, _SEQ)
    layer = transformers.modeling_layers.GradientCheckpointingLayer

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output.logits[:, :-1].flatten(0, 1)
        return nn.functional.cross_entropy(logits, ids[:, 1:].flatten())

    return ZooMember(
        model.train(),
        (ids,),
        {"decoder_input_ids": ids.clone()},
        loss_fn,
        lambda m: isinstance(m, layer),
    )


def _image(model: nn.Module) -> ZooMember:
    """An image classifier's step: 16x16 RGB pixels and one label per image."""
    pixels = torch.randn(_BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return ZooMember(model.train(), (pixels,), {"labels": torch.tensor([1, 3])}, _hf_loss)


def _family(
    config: str, model: str, *, step: Callable[[nn.Module], ZooMember] = _tokens, **fields: Any
) -> Callable[[], ZooMember]:
    """The builder of a family: ``transformers.<model>(transformers.<config>(**fields))`` handed
    to ``step``. The classes are looked up by name when the member is built, so that listing the
    zoo imports no modeling code."""

    def build() -> ZooMember:
        config_type = getattr(transformers, config)
        return step(getattr(transformers, model)(config_type(**fields)))

    return build


# The sizes of the families that use Llama's field names; each adds its own MLP and dropouts.
_SIZES: dict[str, Any] = {
    "vocab_size": _VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
_LLAMA: dict[str, Any] = {
    **_SIZES,
    "intermediate_size": 64,
    "num_key_value_heads": 2,
    "attention_dropout": 0.1,
}
# Encoder-decoders: two layers of width 32 on each side.
_BART: dict[str, Any] = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
}
_T5: dict[str, Any] = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "decoder_start_token_id": 0,
}
_VIT: dict[str, Any] = {
    "image_size": 16,
    "patch_size": 4,
    "num_channels": 3,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "num_labels": 5,
}
_MOE: dict[str, Any] = {"num_experts_per_tok": 2}


def _zoo_torch_encoder() -> ZooMember:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    x = torch.randn(_BATCH, _SEQ, 32, generator=torch.Generator().manual_seed(1))
    return ZooMember(model, (x,), {}, lambda out: out.square().mean())


ZOO: dict[str, Callable[[], ZooMember]] = {
    "gpt2": _family(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=_VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        **_TOKENS,
    ),
    "gpt_neox": _family(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        **_SIZES,
        intermediate_size=64,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
    "llama": _family("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
    "mistral": _family("MistralConfig", "MistralForCausalLM", **_LLAMA),
    "qwen2": _family("Qwen2Config", "Qwen2ForCausalLM", **_LLAMA),
    "phi": _family(
        "PhiConfig",
        "PhiForCausalLM",
        **_SIZES,
        intermediate_size=64,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attention_dropout=0.1,
    ),
    "opt": _family("OPTConfig", "OPTForCausalLM", **_SIZES, ffn_dim=64, word_embed_proj_dim=32),
    "bert": _family("BertConfig", "BertForMaskedLM", **_SIZES, intermediate_size=64),
    "bart": _family(
        "BartConfig",
        "BartForConditionalGeneration",
        step=_seq2seq,
        vocab_size=_VOCAB,
        **_BART,
        **_TOKENS,
    ),
    "t5": _family(
        "T5Config",
        "T5ForConditionalGeneration",
        step=_seq2seq,
        vocab_size=_VOCAB,
        **_T5,
        **_TOKENS,
    ),
    "vit": _family("ViTConfig", "ViTForImageClassification", step=_image, **_VIT),
    "mixtral": _family(
        "MixtralConfig", "MixtralForCausalLM", **_LLAMA, **_MOE, num_local_experts=4
    ),
    "qwen2_moe": _family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        **_SIZES,
        **_MOE,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_key_value_heads=2,
    ),
    "torch_encoder": _zoo_torch_encoder,
}
if hasattr(transformers, "Qwen3Config"):  # the config alone: no modeling import here
    ZOO["qwen3"] = _family("Qwen3Config", "Qwen3ForCausalLM", **_LLAMA, head_dim=8)


def zoo_member(name: str) -> ZooMember:
    """The zoo's ``name``, built with the weights seeded (the same model on every call)."""
    torch.manual_seed(0)
    return ZOO[name]()
