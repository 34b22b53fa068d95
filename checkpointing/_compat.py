"""The only module that touches private PyTorch APIs.

Each name here wraps one private torch API, with a comment saying what it is for and a version
gate: the code is checked against torch 2.13 (the floor in ``pyproject.toml``). Every other module
imports from here instead of reaching into ``torch._C`` or ``torch.utils._*``; when torch moves
one of these, this file is the one place to fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch._C._autograd import SavedTensor as SavedTensor
from torch._C._autograd import _make_saved_tensor
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext as DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._pytree import tree_flatten as tree_flatten
from torch.utils._pytree import tree_map as tree_map
from torch.utils._pytree import tree_unflatten as tree_unflatten

_F = TypeVar("_F", bound=Callable[..., Any])

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
# Version gate shared by every wrapper below: all of them exist with these signatures in 2.13.
if TORCH_VERSION < (2, 13):  # pragma: no cover - guarded by the dependency floor
    raise ImportError(
        f"checkpointing needs torch>=2.13, found {torch.__version__}. "
        "Fix: pip install 'torch>=2.13'."
    )


def make_saved_tensor(tensor: torch.Tensor) -> SavedTensor:
    """Save ``tensor`` the way autograd saves an input: through the active pack hooks, with a
    version-counter check on unpack (torch 2.13: ``torch._C._autograd._make_saved_tensor``)."""
    return _make_saved_tensor(tensor, is_output=False)


def current_graph_task_id() -> int:
    """Id of the backward graph task running on this thread, -1 outside backward (2.13)."""
    return int(torch._C._current_graph_task_id())


def get_graph_exec_group() -> object | None:
    """The active ``GraphExecGroup`` (a thread-local kept by autograd's C++ side, 2.13)."""
    return torch._C._get_graph_exec_group()


def set_graph_exec_group(group: object | None) -> None:
    """Set or clear the active ``GraphExecGroup`` (2.13)."""
    # The stub names torch's own GraphExecGroup; the C++ side stores any object.
    torch._C._set_graph_exec_group(group)  # type: ignore[arg-type]


def is_checkpoint_valid() -> bool:
    """False inside ``torch.autograd.grad`` / ``backward(inputs=...)``, where reentrant
    checkpoint cannot work (2.13: ``torch.autograd._is_checkpoint_valid``)."""
    return bool(torch.autograd._is_checkpoint_valid())  # type: ignore[no-untyped-call]


def disable_dynamo(fn: _F) -> _F:
    """Keep dynamo out of ``fn``: hook-based machinery breaks the graph instead of being traced
    (2.13: ``torch._disable_dynamo``)."""
    disable: Callable[[_F], _F] = torch._disable_dynamo  # type: ignore[attr-defined,assignment]  # private, overloaded
    return disable(fn)


def active_device_context() -> DeviceContext | None:
    """The innermost ``with torch.device(...)`` mode on the function-mode stack, if any (2.13:
    ``torch.overrides._get_current_function_mode_stack`` and ``torch.utils._device``)."""
    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]  # untyped in 2.13
    for mode in reversed(stack):
        if isinstance(mode, DeviceContext):
            return mode
    return None


def accelerator_initialized(device_module: Any) -> bool:
    """Whether an accelerator's runtime is already initialised, without initialising it (each
    device module keeps a private ``_initialized`` flag in 2.13; ``torch.cpu`` has none)."""
    return bool(getattr(device_module, "_initialized", False))


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost default saved-tensors hook pair on this thread, or None (2.13)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def push_saved_tensors_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
    """Push a default saved-tensors hook pair without a context manager (2.13)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    """Pop the innermost default saved-tensors hook pair (2.13)."""
    torch._C._autograd._pop_saved_tensors_default_hooks()
