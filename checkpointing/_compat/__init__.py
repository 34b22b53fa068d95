"""The only package that touches private PyTorch APIs.

Each name here wraps one private torch API, with a comment saying what it is for and the releases
it is checked against. The supported range is torch 2.11 to 2.15: older releases lack autograd and
dispatch internals we build on, and each newer release is checked before it is named here; where a
release in the range lacks an API, the wrapper says so and carries the fallback. Every other module
imports from here (``from checkpointing import _compat``, then ``_compat.name``) instead of
reaching into ``torch._C`` or ``torch.utils._*``; when torch moves one of these, this package is
the one place to fix. ``tests/test_house.py`` checks that no other module imports them.

One module per part of torch, each re-exported here:

- ``autograd``: saved tensors, the saved-tensor hook stack and its checkpoint-internal marks, the
  engine (which backward runs, the reentrant checkpoint's inner backward, end-of-backward
  callbacks).
- ``dispatch``: below autograd: dispatch and function modes, detached aliases, version counters and
  view bases, op schemas, pytrees.
- ``tracing``: compilers: keeping dynamo out, FX nodes traced by AOTAutograd, inductor's regions.
- ``modules``: ``nn.Module`` forward hooks, torch.distributed's wrappers and process groups.
- ``graph``: reading autograd's graph without unpacking it (the saved-tensor report).
- ``devices``: accelerators: CUDA streams, events, pinned memory, the out-of-memory observer.

The release gate runs here, before any of those modules is imported, so that an unsupported torch
meets our message and not an ``ImportError`` from deep inside torch.
"""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
"""The installed torch's (major, minor) release."""
OLDEST_SUPPORTED: tuple[int, int] = (2, 11)
NEWEST_CHECKED: tuple[int, int] = (2, 15)
_MSG_UNSUPPORTED_TORCH = (
    "checkpointing supports torch 2.11 to 2.15, but torch {found} is installed (checkpointing "
    "relies on autograd and dispatch internals that older releases lack or spell differently). "
    "Fix: upgrade PyTorch to 2.11 or newer with the wheel for your accelerator, e.g. "
    "`pip install --upgrade 'torch>=2.11'`."
)
if TORCH_VERSION < OLDEST_SUPPORTED:
    raise ImportError(_MSG_UNSUPPORTED_TORCH.format(found=torch.__version__))

# Every private import sits below the gate (ruff's E402 is off for this file for that reason).
from .autograd import (
    HookPair,
    SavedTensor,
    at_backward_end,
    current_graph_task_id,
    get_graph_exec_group,
    has_gradient_hooks,
    is_checkpoint_valid,
    is_torch_checkpoint_hook,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    resolve_user_hooks,
    run_backward,
    save_inputs,
    set_graph_exec_group,
    top_saved_tensors_hooks,
    unpack_inputs,
    user_saved_tensors_hooks,
)
from .devices import (
    accelerator_initialized,
    attach_cuda_oom_observer,
    cuda_copy_to_device,
    cuda_copy_to_host,
    cuda_current_stream,
    cuda_elapsed_seconds,
    cuda_event_done,
    cuda_new_stream,
    cuda_pinned_bytes,
    cuda_record_event,
    cuda_record_stream,
    cuda_wait_event,
)
from .dispatch import (
    DeviceContext,
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    TorchDispatchMode,
    active_device_context,
    argument_index,
    detach_below_modes,
    detach_sharing_version,
    dispatch_mode_depth,
    has_ordered_effect,
    has_torch_function_unary,
    op_mutates_inputs,
    op_runner,
    returns_alias,
    storage_bytes,
    tensor_version,
    top_dispatch_mode,
    tree_leaves,
    view_base,
    written_arguments,
)
from .graph import (
    node_sequence_number,
    raw_saved_input,
    raw_saves,
)
from .modules import (
    awaits_first_static_step,
    checkpoint_wrapper,
    default_store,
    forward_hooks,
    forward_pre_hooks,
    has_module_hooks,
    process_group_named,
    remove_forward_hooks,
    reparametrized,
    wrap_policy_targets,
)
from .tracing import (
    SHAPE_ONLY_ERRORS,
    assume_constant_result,
    compile_activation_memory_budget,
    disable_dynamo,
    dynamo_eval_frame_active,
    fake_mode_of,
    inductor_compiled_code,
    inductor_region_key,
    is_fake_tensor,
    is_traced_tensor,
    new_fake_mode,
    proxy_mode,
    proxy_tracing_active,
    run_when_traced,
    set_traced_node_meta,
    skip_dynamo_in_code,
    storage_identity,
    traced_node_count,
    traced_node_meta,
    traced_nodes_since,
)

__all__ = [
    "NEWEST_CHECKED",
    "OLDEST_SUPPORTED",
    "SHAPE_ONLY_ERRORS",
    "TORCH_VERSION",
    "DeviceContext",
    "HigherOrderOperator",
    "HookPair",
    "OpOverload",
    "OpOverloadPacket",
    "SavedTensor",
    "TorchDispatchMode",
    "accelerator_initialized",
    "active_device_context",
    "argument_index",
    "assume_constant_result",
    "at_backward_end",
    "attach_cuda_oom_observer",
    "awaits_first_static_step",
    "checkpoint_wrapper",
    "compile_activation_memory_budget",
    "cuda_copy_to_device",
    "cuda_copy_to_host",
    "cuda_current_stream",
    "cuda_elapsed_seconds",
    "cuda_event_done",
    "cuda_new_stream",
    "cuda_pinned_bytes",
    "cuda_record_event",
    "cuda_record_stream",
    "cuda_wait_event",
    "current_graph_task_id",
    "default_store",
    "detach_below_modes",
    "detach_sharing_version",
    "disable_dynamo",
    "dispatch_mode_depth",
    "dynamo_eval_frame_active",
    "fake_mode_of",
    "forward_hooks",
    "forward_pre_hooks",
    "get_graph_exec_group",
    "has_gradient_hooks",
    "has_module_hooks",
    "has_ordered_effect",
    "has_torch_function_unary",
    "inductor_compiled_code",
    "inductor_region_key",
    "is_checkpoint_valid",
    "is_fake_tensor",
    "is_torch_checkpoint_hook",
    "is_traced_tensor",
    "new_fake_mode",
    "node_sequence_number",
    "op_mutates_inputs",
    "op_runner",
    "pop_saved_tensors_hooks",
    "process_group_named",
    "proxy_mode",
    "proxy_tracing_active",
    "push_saved_tensors_hooks",
    "raw_saved_input",
    "raw_saves",
    "remove_forward_hooks",
    "reparametrized",
    "resolve_user_hooks",
    "returns_alias",
    "run_backward",
    "run_when_traced",
    "save_inputs",
    "set_graph_exec_group",
    "set_traced_node_meta",
    "skip_dynamo_in_code",
    "storage_bytes",
    "storage_identity",
    "tensor_version",
    "top_dispatch_mode",
    "top_saved_tensors_hooks",
    "traced_node_count",
    "traced_node_meta",
    "traced_nodes_since",
    "tree_leaves",
    "unpack_inputs",
    "user_saved_tensors_hooks",
    "view_base",
    "wrap_policy_targets",
    "written_arguments",
]
