"""Below autograd: dispatch and function modes, tensor internals, op schemas, pytrees.

What selective checkpointing and the scope API read of an op or a tensor while they sit in a
dispatch mode: the mode stacks, detached aliases that no mode sees, version counters and view
bases, and what an op's schema says it writes or returns. Each name is checked against torch
2.11-2.15.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._higher_order_ops.effects import has_effects as _has_effects
from torch._ops import HigherOrderOperator as HigherOrderOperator
from torch._ops import OpOverload as OpOverload
from torch._ops import OpOverloadPacket as OpOverloadPacket
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext as DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._pytree import tree_leaves as tree_leaves

# Pytree helpers (2.11-2.15, ``torch.utils._pytree``): ``tree_leaves`` only. ``tree_flatten`` and
# ``tree_map`` leave a few cyclic objects per call (a self-referencing closure), which a hot path
# must not do: garbage made per step wakes the cyclic collector in the middle of training steps.
# Where a structure must be rebuilt, walk it by hand (``_selective.cache._map_leaves``,
# ``_scope.ops._flatten``).


def storage_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of a CPU tensor's storage as ``bytes``, invisible to dispatch and function modes
    (no aten op runs; the torch-function guard is entered only when a mode is active; 2.11-2.15:
    ``torch._C._is_torch_function_mode_enabled``)."""
    if torch._C._is_torch_function_mode_enabled():
        with torch._C.DisableTorchFunction():
            storage = tensor.untyped_storage()
    else:
        storage = tensor.untyped_storage()
    return ctypes.string_at(storage.data_ptr(), storage.nbytes())


def active_device_context() -> DeviceContext | None:
    """The innermost ``with torch.device(...)`` mode on the function-mode stack, if any (2.11-2.15:
    ``torch.overrides._get_current_function_mode_stack`` and ``torch.utils._device``)."""
    if not torch._C._len_torch_function_stack():
        return None  # the common case, per checkpoint call: no function mode at all
    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]  # untyped in torch
    for mode in reversed(stack):
        if isinstance(mode, DeviceContext):
            return mode
    return None


dispatch_mode_depth: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""How many Python dispatch modes are active in this thread, infra modes included (2.11-2.15)."""


def top_dispatch_mode() -> object | None:
    """The innermost Python dispatch mode active in this thread (the next to see an op), or
    None (2.11-2.15: ``torch._C._get_dispatch_stack_at``)."""
    depth = torch._C._len_torch_dispatch_stack()
    return torch._C._get_dispatch_stack_at(depth - 1) if depth else None


has_torch_function_unary: Callable[[object], bool] = torch._C._has_torch_function_unary
"""Whether a call on this object would reach ``__torch_function__``: a subclass that overrides
it, or an active torch-function mode (2.11-2.15)."""

detach_below_modes: Callable[[torch.Tensor], torch.Tensor] = functools.partial(
    torch.Tensor._make_subclass, torch.Tensor
)
"""``tensor.detach()`` that no dispatch mode sees: the same alias (version counter shared,
``requires_grad`` off) as a mode that passes ``detach`` through unchanged would give, without
the ~2 us of a round trip into Python, and no Python frame of its own. Callers make sure that
is the only mode, no torch-function override or mode could see the call, and ``tensor`` is a
plain ``torch.Tensor`` (2.11-2.15: ``Tensor._make_subclass`` stashes the dispatch-mode stack and
turns the Python dispatcher off around its detach)."""


def detach_sharing_version(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``tensor`` that shares its version counter even when called below
    autograd, inside ``__torch_dispatch__`` (2.11-2.15: re-include the ADInplaceOrView key)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


def op_mutates_inputs(op: OpOverload | HigherOrderOperator) -> bool:
    """Whether ``op`` writes to any of its arguments (in-place and ``out=`` ops); higher-order
    operators are assumed to (2.11-2.15: ``OpOverload._schema.is_mutable``)."""
    if isinstance(op, OpOverload):
        return bool(op._schema.is_mutable)
    return True


def argument_index(op: OpOverload, name: str) -> int | None:
    """Position of the argument called ``name`` in ``op``'s schema, None if it has none
    (2.11-2.15: ``OpOverload._schema.arguments``)."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            return index
    return None


def has_ordered_effect(op: object) -> bool:
    """Whether ``op`` is registered with a side effect that must not run twice (printing, a
    torchbind call, ...), outside the ``c10d`` namespace, whose launches return a work handle
    that cannot stand in for running them (2.11-2.15: ``torch._higher_order_ops.effects``).
    Each release registers its own set of ops."""
    if getattr(op, "namespace", None) == "c10d":
        return False
    return bool(_has_effects(op))


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter, bumped by every in-place write (2.11-2.15:
    ``Tensor._version``)."""
    return int(tensor._version)


def op_runner(op: OpOverload) -> Callable[..., Any]:
    """What ``op(...)`` calls: same arguments and result, one Python frame fewer per call, for
    the scope's tape, which runs every op of a scope and replays it, and for selective
    checkpointing's two modes, which run every op of a region (2.11-2.15: ``OpOverload._op``)."""
    runner: Callable[..., Any] = op._op
    return runner


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor an autograd view was taken from (always a non-view), else None
    (2.11-2.15: ``Tensor._base``)."""
    return tensor._base


def written_arguments(op: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``op``'s schema marks as written, e.g. ``self`` of an
    in-place op or ``out`` (2.11-2.15: ``OpOverload._schema``)."""
    return tuple(
        (index, argument.name)
        for index, argument in enumerate(op._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def returns_alias(op: OpOverload) -> bool:
    """Whether ``op``'s schema lets an output alias an argument (``Tensor(a)``): a view, or the
    argument itself, as ``lift_fresh`` and in-place ops return (2.11-2.15:
    ``OpOverload._schema``)."""
    return any(result.alias_info is not None for result in op._schema.returns)
