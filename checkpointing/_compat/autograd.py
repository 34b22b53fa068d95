"""Autograd's private corners: saved tensors, saved-tensor hooks, the engine.

How a region's inputs are saved (as autograd saves an op's inputs), which backward is running, the
saved-tensor hook stack and the checkpoint-internal marks on it, and the engine calls of the
reentrant checkpoint. Each name is checked against torch 2.11-2.15.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._autograd import SavedTensor as SavedTensor
from torch.autograd.graph import _engine_run_backward
from torch.utils._python_dispatch import _disable_current_modes

# --- Saving a region's inputs (``_frame``, NOTE [Nestable checkpoint], Rule 2) -----------------
# A region's tensor inputs are saved the way autograd saves an op's inputs: through the hooks
# active at the call (a parent checkpoint's, so nesting works), and with the version check that
# turns an in-place change before backward into autograd's usual error.

if hasattr(torch._C._autograd, "_make_saved_tensor"):  # 2.12 and newer
    _make_saved_tensor = torch._C._autograd._make_saved_tensor

    def save_inputs(args: Sequence[Any]) -> list[Any]:
        """``args`` with each tensor replaced by a ``SavedTensor`` (2.12-2.15:
        ``torch._C._autograd._make_saved_tensor(t, is_output=False)``)."""
        return [
            _make_saved_tensor(a, is_output=False) if isinstance(a, torch.Tensor) else a
            for a in args
        ]

    def unpack_inputs(saved: list[Any]) -> list[Any]:
        """The inputs ``save_inputs`` saved, unpacked (the version check runs here)."""
        return [a.unpack() if isinstance(a, SavedTensor) else a for a in saved]

else:  # 2.11: no way to make a SavedTensor from Python

    class _KeepInputs(torch.autograd.Function):
        """Saves its tensor arguments for a backward that never runs: autograd then holds
        them as saved inputs (hooks and version check included), as torch 2.11's own
        checkpoint does. The first argument is an anchor that requires grad, so that a node
        exists to hold them. It runs below the dispatch modes (``save_inputs``): as on newer
        releases, a mode sees only the region's own ops (torch 2.11's checkpoint shows it two
        ``aten.empty`` per region)."""

        @staticmethod
        def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(*tensors)
            return torch.empty((0,))

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> Any:
            raise RuntimeError("checkpointing: the node that keeps a region's inputs ran")

    class _InputSlot:
        """Where a saved input sits: the node's output that keeps it alive, and its index."""

        __slots__ = ("index", "keeper")

        def __init__(self, keeper: torch.Tensor, index: int) -> None:
            self.keeper = keeper
            self.index = index

    def save_inputs(args: Sequence[Any]) -> list[Any]:
        """``args`` with each tensor replaced by its slot in one node that saved them all
        (2.11: a no-op ``autograd.Function``; the caller has grad mode on)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            return list(args)
        with _disable_current_modes():
            anchor = torch.empty((0,), requires_grad=True)
            keeper = _KeepInputs.apply(anchor, *tensors)  # type: ignore[no-untyped-call]  # untyped
        saved: list[Any] = []
        count = 0
        for a in args:
            if isinstance(a, torch.Tensor):
                saved.append(_InputSlot(keeper, count))
                count += 1
            else:
                saved.append(a)
        return saved

    def unpack_inputs(saved: list[Any]) -> list[Any]:
        """The inputs ``save_inputs`` saved: the node's saved tensors are unpacked once, all
        together (a parent checkpoint hands each one out once per backward)."""
        values: tuple[torch.Tensor, ...] | None = None
        out: list[Any] = []
        for a in saved:
            if type(a) is _InputSlot:
                if values is None:
                    values = a.keeper.grad_fn.saved_tensors  # type: ignore[union-attr]
                out.append(values[a.index])
            else:
                out.append(a)
        return out


# Direct aliases, not wrappers: both run on every unpack of a saved tensor.
current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""Id of the backward graph task running on this thread, -1 outside backward (2.11-2.15)."""

get_graph_exec_group: Callable[[], object | None] = torch._C._get_graph_exec_group
"""The active ``GraphExecGroup`` (a thread-local kept by autograd's C++ side, 2.11-2.15)."""


def set_graph_exec_group(group: object | None) -> None:
    """Set or clear the active ``GraphExecGroup`` (2.11-2.15)."""
    # The stub names torch's own GraphExecGroup; the C++ side stores any object.
    torch._C._set_graph_exec_group(group)  # type: ignore[arg-type]


def is_checkpoint_valid() -> bool:
    """False inside ``torch.autograd.grad`` / ``backward(inputs=...)``, where reentrant
    checkpoint cannot work (2.11-2.15: ``torch.autograd._is_checkpoint_valid``)."""
    return bool(torch.autograd._is_checkpoint_valid())  # type: ignore[no-untyped-call]


def run_backward(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads)`` for the reentrant checkpoint's inner backward,
    where ``grads`` come from autograd itself, straight into the engine through torch's own
    helper (2.11-2.15: ``torch.autograd.graph._engine_run_backward``), skipping the argument
    processing that ``backward`` repeats in Python for every call. Anything that processing
    would act on goes through ``torch.autograd.backward`` itself: functorch transforms,
    ``__torch_function__`` tensors, and a grad whose shape is not its output's (its error)."""
    if (
        torch._C._are_functorch_transforms_active()
        or torch.overrides.has_torch_function(outputs)
        or any(out.shape != grad.shape for out, grad in zip(outputs, grads, strict=True))
    ):
        torch.autograd.backward(outputs, grads)
        return
    _engine_run_backward(
        tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


HookPair = tuple[Callable[..., Any], Callable[..., Any]]

top_saved_tensors_hooks: Callable[[], HookPair | None] = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False
)
"""The innermost default saved-tensors hook pair on this thread, or None (2.11-2.15). A C-level
call without a Python frame: it runs per checkpoint call (``user_saved_tensors_hooks``)."""


# Checkpoint-internal hooks (torch 2.14's protocol, which we follow on every release): a pack hook
# of checkpoint machinery says so with ``_checkpoint_internal = True`` and, while it is on the
# stack, names in ``_user_hooks`` the user's pair that was visible when it was pushed (or None).
# Selective checkpointing asks for the user's hooks through that chain: torch's own (2.14+) and
# ours, so neither mistakes the other's frame for a user hook. Torch 2.11-2.13 mark nothing; their
# checkpoint's hooks are recognised by their module, and what sits below them is unknown there.


def is_torch_checkpoint_hook(pack: object) -> bool:
    """Whether ``pack`` is a pack hook of ``torch.utils.checkpoint``'s own frames (its pack
    hooks are closures defined in that module, 2.11-2.15)."""
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint"


def resolve_user_hooks(hooks: HookPair | None) -> HookPair | None:
    """The user's pair behind ``hooks``: follow internal hooks down to the first user pair."""
    while hooks is not None:
        pack = hooks[0]
        if getattr(pack, "_checkpoint_internal", False):
            hooks = pack._user_hooks  # type: ignore[attr-defined]  # the protocol's mark
        elif is_torch_checkpoint_hook(pack):
            return None  # torch 2.11-2.13's checkpoint: no record of what is below it
        else:
            return hooks
    return None


def user_saved_tensors_hooks() -> HookPair | None:
    """The user's saved-tensors hook pair a tensor saved now would meet if checkpoint
    machinery were not in the way, or None. Runs per checkpoint call: the empty stack, the
    common case, costs one C call."""
    hooks = top_saved_tensors_hooks()
    if hooks is None:
        return None
    return resolve_user_hooks(hooks)


def push_saved_tensors_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
    """Push a default saved-tensors hook pair without a context manager (2.11-2.15)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    """Pop the innermost default saved-tensors hook pair (2.11-2.15)."""
    torch._C._autograd._pop_saved_tensors_default_hooks()


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward running in this thread ends; False outside a backward
    (2.11-2.15: ``Variable._execution_engine.queue_callback``, as FSDP uses it)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True


def has_gradient_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.register_hook`` hooks sit on ``tensor`` (2.11-2.15: the tensor's
    ``_backward_hooks`` dict, set by ``register_hook``)."""
    return bool(getattr(tensor, "_backward_hooks", None))
