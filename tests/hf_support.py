"""A tiny Hugging Face Llama built from a config (random weights, nothing downloaded), for the
tests that run one."""

from __future__ import annotations

import transformers


def tiny_llama(layers: int = 2) -> transformers.PreTrainedModel:
    """A ``LlamaForCausalLM`` of hidden size 32 with ``layers`` layers, in training mode."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()
