"""The router: the one saved-tensors hook of ours per thread, shared by every scope, and its
lifetime.

Owns ``_ThreadHooks`` (a thread's router; itself the pack hook), the claims that keep it on the
stack (``_Claim``) and what it stores for tensors that are not a scope's (``_Passed``,
``_Delegated``). For a scope tensor it asks the registry (``registry.py``) and stores the tape's
holder (``tape.py``); the public scope and session (``scope.py``) take and release claims.

NOTE [Gradient checkpoint scope] (Rules 4 and 9 here; ``__init__`` says where the others are)
  Rule 4. At most one hook of ours per thread; we only ever pop our own hook, and only when it is
          on top. If a foreign hook is on top when a scope opens, ours goes above it, hands every
          non-scope tensor to it, and leaves at scope exit (never lingers above a foreign hook,
          whose exit would pop ours). A foreign hook pushed above ours shadows it: tensors are
          then stored by that hook (correct, no saving).
  Rule 9. A scope claims our hook until its tensors are dead (lazy lingering: at its exit it
          watches the deaths of the tensors still alive; those that died inside it cost no
          callback) or until ``exit_saved_tensors_hooks_scope()``; a
          ``gradient_checkpoint_session()`` claims it for its block. With no claim left the hook is
          popped at once if on top, else at the next safe point in its thread (scope or session
          entry/exit, or our next pack). Never from another thread or inside a backward (which runs
          on a copy of the stack).

Rejected: a second hook per scope (stacks of ours in arbitrary order could not be unwound safely).
"""

from __future__ import annotations

import threading
from typing import Any, Final

import torch

from .._compat import (
    HookPair,
    current_graph_task_id,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    resolve_user_hooks,
    skip_dynamo_in_code,
    tensor_version,
    top_saved_tensors_hooks,
)
from .._events import announce, listener
from .._frame import unpack_holder
from .registry import _registry, _scope_slot
from .tape import _ScopeHolder, _Tape

_MSG_SAVED_MODIFIED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [{kind} {shape}] is at version {now}; expected version {then} instead. Hint: "
    "enable anomaly detection with torch.autograd.set_detect_anomaly(True) to find the "
    "operation that failed to compute its gradient."
)


class _Passed:
    """A non-scope tensor passed through detached, with the version autograd would check. A
    leaf is held as it is: it has no ``grad_fn``, so it cannot close a reference cycle, and
    detaching it would cost an op through the tape's dispatch mode while a scope is open."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor if tensor.is_leaf else tensor.detach()
        self.version = tensor_version(tensor)

    def unpack(self) -> torch.Tensor:
        now = tensor_version(self.tensor)
        if now != self.version:
            kind, shape = self.tensor.type(), list(self.tensor.shape)
            raise RuntimeError(
                _MSG_SAVED_MODIFIED.format(kind=kind, shape=shape, now=now, then=self.version)
            )
        return self.tensor


class _Delegated:
    """A non-scope tensor handed to the foreign hook below ours (Rule 4)."""

    __slots__ = ("packed", "unpack_fn")

    def __init__(self, packed: Any, unpack_fn: Any) -> None:
        self.packed = packed
        self.unpack_fn = unpack_fn


class _Claim:
    """One reason to keep our hook on a thread's stack; released at most once."""

    __slots__ = ("held", "hooks")

    def __init__(self, hooks: _ThreadHooks) -> None:
        self.hooks = hooks
        self.held = True

    def release(self) -> None:
        hooks = self.hooks
        with hooks.lock:
            if not self.held:
                return
            self.held = False
            hooks.claims -= 1
        hooks.settle()


class _ThreadHooks:
    """A thread's router: its pack/unpack are our one hook on that thread's stack.

    Per thread (``threading.local``), not per context: autograd's hook stack is thread state.
    """

    __slots__ = ("below", "busy", "claims", "lock", "on_stack", "open_tape", "pending", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.lock = threading.RLock()  # death callbacks may fire in any thread, or re-enter
        self.claims = 0
        self.on_stack = False
        self.below: tuple[Any, Any] | None = None  # the foreign hook ours sits on, if any
        self.open_tape: _Tape | None = None
        self.pending = False
        self.busy = False

    def claim(self) -> _Claim:
        """Take a claim and make sure our hook is on the stack (Rule 9)."""
        with self.lock:
            if not self.on_stack:
                below = top_saved_tensors_hooks()
                push_saved_tensors_hooks(self, self.unpack)  # raises if hooks are disabled
                self.below, self.on_stack = below, True
            self.claims += 1  # only once the hook is there: a failed push leaves no claim
        return _Claim(self)

    def settle(self) -> None:
        """Pop our hook if nothing claims it and it is on top; else try again at the next safe
        point (Rule 9). Only the owning thread touches its stack."""
        with self.lock:
            if self.busy or not self._may_touch_stack():
                self.pending = True
                return
            self.busy = True
            try:
                self.pending = False
                if self.on_stack and self.claims == 0:
                    top = top_saved_tensors_hooks()
                    if top is not None and top[0] is self:
                        pop_saved_tensors_hooks()
                        self.on_stack, self.below = False, None
                    else:
                        self.pending = True  # a foreign hook is above ours
            finally:
                self.busy = False

    def _may_touch_stack(self) -> bool:
        """Only the owning thread, outside backward: a backward runs on a copy of the thread's
        hook stack, which is put back when it ends."""
        return threading.get_ident() == self.thread and current_graph_task_id() == -1

    @skip_dynamo_in_code  # Rule 10: runs wherever autograd saves, compiled code included
    def pack(self, tensor: torch.Tensor) -> Any:
        """Our pack hook: a holder for a scope tensor, else a detached pass-through."""
        entry = _registry.get(id(tensor))
        packed: Any = None
        if entry is not None and entry() is tensor and listener.get() is None:
            owner, slot = entry.tape, entry.slot  # the common case: a scope tensor itself, no
            if not owner.closed or owner.reproduces(slot, tensor):  # report listening
                packed = owner.holder_for(tensor, slot, None)  # no op runs here
        if packed is None:
            tape = self.open_tape
            if tape is not None:
                tape.paused = True  # our own ops here (detach, a report) are not the user's
            try:
                packed = self._pack_other(tensor)
            finally:
                if tape is not None:
                    tape.paused = False
        if self.pending:
            self.settle()
        return packed

    # The router itself is the pack hook, so that it can carry the checkpoint-internal marks
    # (NOTE [Nestable checkpoint], Rule 10): selective checkpointing inside a scope or session
    # never takes it for a user's hook, and finds the user's below it.
    __call__ = pack
    _checkpoint_internal: Final = True

    @property
    def _user_hooks(self) -> HookPair | None:
        """The user's saved-tensors hooks ours sits on (those it hands other tensors to)."""
        return resolve_user_hooks(self.below)

    def _pack_other(self, tensor: torch.Tensor) -> Any:
        """``pack`` for all but its common case: a view of a scope tensor, a scope tensor seen
        by a report, a tensor handed to the hook below ours, or one passed through."""
        found = _scope_slot(tensor)
        if found is not None:
            owner, slot, view = found
            holder = owner.holder_for(tensor, slot, view)
            announce(tensor, "scope", "recomputed")
            return holder
        if self.below is not None:
            return _Delegated(self.below[0](tensor), self.below[1])
        return _Passed(tensor)  # Rule 5

    @staticmethod
    @skip_dynamo_in_code
    def unpack(packed: Any) -> torch.Tensor:
        """Our unpack hook (any thread): recompute a holder, or hand back what was kept."""
        if isinstance(packed, _ScopeHolder):
            return unpack_holder(packed, packed)
        if isinstance(packed, _Passed):
            return packed.unpack()
        result: torch.Tensor = packed.unpack_fn(packed.packed)
        return result


_local = threading.local()


def _thread_hooks() -> _ThreadHooks:
    hooks: _ThreadHooks | None = getattr(_local, "hooks", None)
    if hooks is None:
        hooks = _local.hooks = _ThreadHooks()
    return hooks
