"""The public scope API: ``gradient_checkpoint_scope`` (after RETURNN's) and
``gradient_checkpoint_session``.

Owns entering and leaving a scope or session, and whether a scope entered now records
(``_records_here``). A scope that records opens a tape (``tape.py``) with its dispatch mode and
takes a claim on its thread's router (``router.py``); everything after that is theirs.

Rule 10's ``skip_dynamo_in_code`` marks sit on what they mark: the router's hooks, the
registry's death callback and the tape mode's ``__torch_dispatch__``.

NOTE [Gradient checkpoint scope] (Rules 6 and 10 here; ``__init__`` says where the others are)
  Rule 6. Under ``torch.no_grad()`` or inference mode a scope records nothing and pushes
          nothing. Meta tensors work (they have no generator to restore).
  Rule 10. Dynamo never traces our machinery. Scope and session entry and exit, called from user
          code, are ``disable_dynamo``'d, so under ``torch.compile`` they break the graph (a frame
          that opens a scope runs eagerly: dynamo cannot resume inside that ``with`` block). What
          torch itself calls (our pack and unpack hooks, the registry's death callback, the tape
          mode's ``__torch_dispatch__``) has its code objects marked once
          (``skip_dynamo_in_code``): the same protection with no wrapper call per op or per saved
          tensor (these wrappers were a sixth of the scope's forward cost on W3). While a scope is
          open dynamo compiles nothing (it skips frames while a dispatch mode is active), so the
          block is recorded from eager ops. A graph compiled after the block saves scope tensors
          through our hook; an alias of one that autograd does not know as a view (AOTAutograd may
          save such an alias of a graph input) is stored, not replayed: correct, no saving.
"""

from __future__ import annotations

import threading
from typing import Literal, Self

import torch

from .._compat import (
    current_graph_task_id,
    disable_dynamo,
    is_torch_checkpoint_hook,
    top_saved_tensors_hooks,
)
from .._errors import CheckpointError
from .._frame import Frame
from .._state import is_recomputing
from .router import _Claim, _thread_hooks, _ThreadHooks
from .tape import _Tape, _TapeMode

__all__ = ["gradient_checkpoint_scope", "gradient_checkpoint_session", "records_now"]

_MSG_REUSED = (
    "checkpointing.gradient_checkpoint_scope: this scope object was already entered. A scope "
    "records one block. Fix: write `with gradient_checkpoint_scope():` for each block."
)
_MSG_NOT_OPEN = (
    "checkpointing.gradient_checkpoint_scope: __exit__ was called on a scope that is not open "
    "(state: {phase}). Fix: exit each scope exactly once, with the `with` statement."
)
_MSG_SESSION_OPEN = (
    "checkpointing.gradient_checkpoint_session: this session object is already open. Fix: "
    "leave it before entering it again, or use a new `with gradient_checkpoint_session():`."
)
_MSG_SESSION_NOT_OPEN = (
    "checkpointing.gradient_checkpoint_session: __exit__ was called on a session that is not "
    "open. Fix: leave each session exactly once, with the `with` statement."
)
_MSG_WRONG_THREAD = (
    "checkpointing.gradient_checkpoint_scope: {what} was called in thread {now}, but the scope "
    "(or session) was entered in thread {owner}. Saved-tensors hooks and dispatch modes are per "
    "thread. Fix: enter and leave a scope, and call its methods, in one thread."
)


class gradient_checkpoint_scope:
    """Tensors created inside this block are not stored for backward but recomputed.

    ``with gradient_checkpoint_scope(): x = a + b`` then ``y = x * c``: autograd saves ``x`` for
    ``y``'s backward, but only a small holder is kept; the first backward that needs ``x``
    replays ``a + b`` from the ops recorded in the block (the block itself is not re-run), with
    random ops drawing exactly what they drew the first time. The documentation's page "The
    scope API" gives the rules and the limits.
    """

    __slots__ = ("_claim", "_mode", "_phase", "_tape", "_thread")

    def __init__(self) -> None:
        self._phase: Literal["new", "open", "inert", "closed"] = "new"
        self._thread = 0
        self._tape: _Tape | None = None
        self._mode: _TapeMode | None = None
        self._claim: _Claim | None = None

    @disable_dynamo  # See NOTE [Gradient checkpoint scope], Rule 10
    def __enter__(self) -> Self:
        if self._phase != "new":
            raise CheckpointError(_MSG_REUSED)
        self._thread = threading.get_ident()
        hooks = _thread_hooks()
        if not _records_here(hooks):  # See NOTE [Gradient checkpoint scope], Rules 3 and 6
            self._phase = "inert"
            return self
        self._claim = hooks.claim()
        self._tape = _Tape(self._claim)
        hooks.open_tape = self._tape
        self._mode = _TapeMode(self._tape)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self._phase = "open"
        return self

    @disable_dynamo
    def __exit__(self, *exc: object) -> None:
        self._check_thread("__exit__")
        if self._phase not in ("open", "inert"):
            raise CheckpointError(_MSG_NOT_OPEN.format(phase=self._phase))
        tape, mode, self._tape, self._mode = self._tape, self._mode, None, None
        self._phase = "closed"
        if tape is None or mode is None or self._claim is None:
            return
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # torch's base is untyped
        hooks = self._claim.hooks
        hooks.open_tape = None
        tape.close()
        if hooks.below is not None:  # Rule 4: never linger above a foreign hook
            self._claim.release()
        hooks.settle()  # a safe point (Rule 9)

    @disable_dynamo
    def exit_saved_tensors_hooks_scope(self) -> None:
        """Give up this scope's claim on the saved-tensors hook now, if not done yet (RETURNN's
        method). Tensors of this scope saved from now on are stored as usual; by default the
        hook leaves by itself once the scope's tensors are dead."""
        self._check_thread("exit_saved_tensors_hooks_scope()")
        if self._claim is not None:
            self._claim.release()

    def _check_thread(self, what: str) -> None:
        now = threading.get_ident()
        if self._phase != "new" and now != self._thread:
            raise CheckpointError(_MSG_WRONG_THREAD.format(what=what, now=now, owner=self._thread))


class gradient_checkpoint_session:
    """Keep the scope API's saved-tensors hook on this thread's stack for the whole block.

    The robust mode around a training step: scopes inside it need no lazy lingering, and the
    hook leaves at the end of the block (or, if scope tensors outlive it, when they die).
    A session object can be entered again once it has been left, not while it is open.
    """

    __slots__ = ("_claim", "_thread")

    def __init__(self) -> None:
        self._thread = 0
        self._claim: _Claim | None = None

    @disable_dynamo  # See NOTE [Gradient checkpoint scope], Rule 10
    def __enter__(self) -> None:
        if self._claim is not None:
            raise CheckpointError(_MSG_SESSION_OPEN)
        self._thread = threading.get_ident()
        self._claim = _thread_hooks().claim()

    @disable_dynamo
    def __exit__(self, *exc: object) -> None:
        claim, now = self._claim, threading.get_ident()
        if claim is None:
            raise CheckpointError(_MSG_SESSION_NOT_OPEN)
        if now != self._thread:  # the session stays open: its owner can still leave it
            what = "gradient_checkpoint_session exit"
            raise CheckpointError(_MSG_WRONG_THREAD.format(what=what, now=now, owner=self._thread))
        self._claim = None
        claim.release()


def records_now() -> bool:
    """Whether a scope entered now in this thread would record (Rules 3 and 6): the planner's
    spans ask before they open their session (NOTE [Planner measure], Rule M11)."""
    return _records_here(_thread_hooks())


def _records_here(hooks: _ThreadHooks) -> bool:
    """Whether a scope entered now records (Rules 3 and 6)."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    if is_recomputing() or hooks.open_tape is not None or current_graph_task_id() != -1:
        return False
    top = top_saved_tensors_hooks()
    if top is None:
        return True
    pack = top[0]
    return not (isinstance(pack, Frame) or is_torch_checkpoint_hook(pack))
