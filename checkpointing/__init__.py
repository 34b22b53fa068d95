"""Activation checkpointing for PyTorch.

A drop-in for ``torch.utils.checkpoint`` (every public name, same behaviour) plus what it lacks:
the ``gradient_checkpoint_scope`` API, selective policies that really offload to host memory,
ready-made ``checkpointing.policies``, and reports of what is saved for backward.
"""

from __future__ import annotations

from ._checkpoint import checkpoint
from ._determinism import set_checkpoint_debug_enabled
from ._errors import CheckpointError
from ._frame import GraphExecGroup, set_checkpoint_early_stop
from ._reentrant import CheckpointFunction
from ._report import SavedTensorRecord, SavedTensorsReport, saved_tensors_report
from ._sequential import checkpoint_sequential
from ._state import (
    DefaultDeviceType,
    check_backward_validity,
    detach_variable,
    get_device_states,
    is_recomputing,
    noop_context_fn,
    set_device_states,
)

__all__ = [
    "CheckpointError",
    "CheckpointFunction",
    "DefaultDeviceType",
    "GraphExecGroup",
    "SavedTensorRecord",
    "SavedTensorsReport",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_sequential",
    "detach_variable",
    "get_device_states",
    "is_recomputing",
    "noop_context_fn",
    "saved_tensors_report",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
]
