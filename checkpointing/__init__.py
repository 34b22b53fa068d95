"""Activation checkpointing for PyTorch.

A drop-in for ``torch.utils.checkpoint`` (every public name, same behaviour) plus what it lacks:
the ``gradient_checkpoint_scope`` API, selective policies that really offload to host memory,
ready-made ``checkpointing.policies``, and reports of what is saved for backward.

This file is the front door: it re-exports the public names (``__all__``); ``policies`` is the
one public submodule and everything else is private. The map of the house, by floor (a module
imports only from its own floor or a lower one; docs/architecture.md has one line per module, a
glossary of the words the code uses, and a check of the map against the imports):

0. Ground: ``_compat`` (every private torch API, behind the release gate), ``_errors``,
   ``_events``, ``_recompute_context``, ``_hook_marks`` (what our saved-tensor hooks carry),
   ``_regions``, ``_units``, ``_trees``, ``_untouched``, ``_kv_caches``.
1. State and transport: ``_state`` (RNG, autocast, device state), ``_determinism``, ``_offload``
   (the transfers) and ``_host_copy`` (the record of a host copy), ``_compiled``, the kept spans'
   records (``_kept_span*``), ``_schedule``.
2. Mechanisms: ``_reentrant``, ``_selective`` and ``policies``, ``_context_fn``, ``_frame`` (the
   non-reentrant checkpoint), ``_host_saves``, ``_keep``, ``_scope``, the tiled regions
   (``_tiled_run``, ``_tiling``, ``_tiled_grads``, ``_tiled_gated``, ``_tiled_head``).
3. Front doors: ``_checkpoint``, ``_module``, ``_sequential``, ``_wrappers``, ``_auto_wrap``,
   ``_tiled_recipes``, ``_report``.
4. The planner, ``_planning``: imported on first use of ``ActivationPlan``,
   ``plan_checkpointing`` or ``plan_sweep`` (most programs never plan, and it is a quarter of
   the package).
5. ``integrations``.

Where a new policy, planner objective, release shim or model-family quirk goes, and how to test
it: docs/contributing.md.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

# _compat first: its release gate runs before any module that needs a supported torch.
from . import _compat as _compat
from . import _frame
from . import policies as policies
from ._auto_wrap import apply_activation_checkpointing
from ._checkpoint import checkpoint
from ._compression import Compress
from ._determinism import set_checkpoint_debug_enabled
from ._errors import CheckpointError
from ._frame import GraphExecGroup, set_checkpoint_early_stop
from ._keep import keep, keeping
from ._megatron import megatron_spec
from ._module import checkpoint_module, remove_checkpoint_module
from ._options import Tiling
from ._reentrant import CheckpointFunction
from ._report import (
    SavedTensorRecord,
    SavedTensorsReport,
    report_on_oom,
    saved_tensors_report,
)
from ._schedule import LayerCost, SequentialSchedule
from ._scope import gradient_checkpoint_scope, gradient_checkpoint_session
from ._selective import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    OffloadStats,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
    split_backward,
)
from ._sequential import checkpoint_sequential, sequential_schedule
from ._spec import AppliedSpec, apply_spec
from ._spec_grammar import load_spec
from ._state import (
    DefaultDeviceType,
    RecomputeStateHook,
    check_backward_validity,
    detach_variable,
    get_device_states,
    is_recomputing,
    noop_context_fn,
    set_device_states,
)
from ._tiled_head import tiled_lm_head_loss
from ._tiled_recipes import tiled_experts, tiled_mlp
from ._tiling import tiled
from ._wrappers import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    checkpoint_wrapper,
    offload_wrapper,
)

if _typing.TYPE_CHECKING:  # imported on first use, below
    from ._planning import ActivationPlan, DeviceCosts, plan_checkpointing, plan_sweep

# Not in __all__: torch's private names, for code written against torch's generator (README,
# "For library authors"): the positional form of 2.13 and the ``fn, args, kwargs`` form of 2.14.
_checkpoint_without_reentrant_generator = _frame.checkpoint_without_reentrant_generator
_checkpoint_without_reentrant_generator_impl = _frame.checkpoint_without_reentrant_generator_impl

__all__ = [
    "SAC_IGNORED_OPS",
    "ActivationPlan",
    "ActivationWrapper",
    "AppliedSpec",
    "CheckpointError",
    "CheckpointFunction",
    "CheckpointImpl",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "Compress",
    "DefaultDeviceType",
    "DeviceCosts",
    "GraphExecGroup",
    "LayerCost",
    "OffloadStats",
    "OffloadWrapper",
    "RecomputeStateHook",
    "SavedTensorRecord",
    "SavedTensorsReport",
    "SelectiveCheckpointContext",
    "SequentialSchedule",
    "Tiling",
    "apply_activation_checkpointing",
    "apply_spec",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_module",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "create_selective_checkpoint_contexts",
    "detach_variable",
    "get_device_states",
    "gradient_checkpoint_scope",
    "gradient_checkpoint_session",
    "is_recomputing",
    "keep",
    "keeping",
    "load_spec",
    "megatron_spec",
    "noop_context_fn",
    "offload_wrapper",
    "plan_checkpointing",
    "plan_sweep",
    "remove_checkpoint_module",
    "report_on_oom",
    "saved_tensors_report",
    "sequential_schedule",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
    "split_backward",
    "tiled",
    "tiled_experts",
    "tiled_lm_head_loss",
    "tiled_mlp",
]

# The planner is imported on first use: it is a quarter of the package and most programs never
# plan, so ``import checkpointing`` leaves it out (benchmarks/import_cost.py measures the import;
# tests/test_import.py checks that the planner stays out of it).
_LAZY: dict[str, str] = {
    "ActivationPlan": "._planning",
    "DeviceCosts": "._planning",
    "plan_checkpointing": "._planning",
    "plan_sweep": "._planning",
}


def __getattr__(name: str) -> _typing.Any:
    """``checkpointing.ActivationPlan``, ``checkpointing.DeviceCosts``,
    ``checkpointing.plan_checkpointing`` and ``checkpointing.plan_sweep``, imported from the
    planner the first time one is asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups find it without calling this function again
    return value


def __dir__() -> list[str]:
    """The module's names, the planner's included before it is imported."""
    return sorted({*globals(), *_LAZY})
