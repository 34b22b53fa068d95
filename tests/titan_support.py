"""torchtitan's debug models for the torchtitan integration's tests, and both sides' modules.

Import only after ``pytest.importorskip("torchtitan")``: this module imports torchtitan (and
``checkpointing.integrations.torchtitan``) at once.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

# On torch 2.13, torchtitan's imports reach torch.utils.mkldnn, whose TorchScript decorators warn
# that they are deprecated (pytest turns warnings into errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from torchtitan.distributed import activation_checkpoint as theirs
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3
    from torchtitan.models.llama3 import model_registry as llama3

    from checkpointing.integrations import torchtitan as ours

__all__ = ["apply_fsdp_to_decoder", "build", "ours", "theirs"]

_REGISTRIES = {"llama3": llama3, "deepseek_v3": deepseek_v3}


@functools.cache
def build(family: str) -> nn.Module:
    """torchtitan's ``debugmodel`` of ``family`` (``"llama3"``, ``"deepseek_v3"``): 2 blocks,
    torchtitan's eager SDPA attention instead of its compiled FlexAttention (CPU, no compiler),
    seeded weights. Built once: run deep copies of it."""
    spec = _REGISTRIES[family]("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    return model
