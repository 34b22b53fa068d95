"""Activation checkpointing for PyTorch.

A drop-in for ``torch.utils.checkpoint`` (every public name, same behaviour) plus what it lacks:
the ``gradient_checkpoint_scope`` API, selective policies that really offload to host memory,
ready-made ``checkpointing.policies``, and reports of what is saved for backward.
"""

from __future__ import annotations

from ._errors import CheckpointError
from ._state import (
    DefaultDeviceType,
    check_backward_validity,
    detach_variable,
    get_device_states,
    noop_context_fn,
    set_device_states,
)

__all__ = [
    "CheckpointError",
    "DefaultDeviceType",
    "check_backward_validity",
    "detach_variable",
    "get_device_states",
    "noop_context_fn",
    "set_device_states",
]
