"""Ground floor: the marks a pack hook of ours carries on autograd's saved-tensors stack.

What checkpoint machinery must know about the pack hook on top of the stack travels as attributes
of that hook. This module names each mark once, with who sets it and who reads it, and gives the
typed accessors through which the rest of the package reads them: no other module probes a hook
with ``getattr(pack, "<mark>", default)``. It imports nothing of the package but ``_compat``, so
any floor may use it.

The marks:

- ``_checkpoint_internal`` and ``_user_hooks`` (torch 2.14's protocol, NOTE [Nestable
  checkpoint], Rule 10): on every pack hook of our machinery (the frame, its recompute's pack
  hook, a kept span's hooks, the report's watch, the scope's router). Spelled as torch spells
  them, since torch's selective checkpoint reads ours too; read through ``CheckpointInternal``
  by ``_compat.resolve_user_hooks``, which also reads torch's own.
- ``replaying``, ``spans_seen``, ``guards_replay_skips``: on the pack hook of a frame's
  recompute (``mark_recompute``). ``replaying`` is the frame whose recompute runs, so that a kept
  span reached by the replay finds it (NOTE [Kept spans], Rule 1) and counts the spans it has
  met in ``spans_seen`` (Rule 5); ``guards_replay_skips`` says the hook refuses tainted tensors,
  so a selective replay under it may skip ops (NOTE [Selective checkpoint cache], Rule 14).
- ``watches_kept_spans``: on the planner's profile hook (``SpanWatch``): a kept span under it
  hands itself to the watch (NOTE [Kept spans], Rule 11).

Rejected: a registry of our hooks (a dict from hook to role): the stack already holds the hook,
and a registry would need its own clean-up when a hook leaves the stack or dies with the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

from . import _compat

__all__ = [
    "CheckpointInternal",
    "RecomputePack",
    "guards_replay_skips",
    "mark_recompute",
    "replaying_pack",
    "unmark_recompute",
    "watches_kept_spans",
]


class CheckpointInternal(Protocol):
    """A pack hook of checkpoint machinery (torch 2.14's protocol): never a user's hook; while
    on the stack, ``_user_hooks`` is the user's pair it shadows (or None)."""

    _checkpoint_internal: bool
    _user_hooks: _compat.HookPair | None


class RecomputePack(CheckpointInternal, Protocol):
    """The pack hook of a frame's recompute, with the marks ``mark_recompute`` gives it."""

    replaying: Any  # the ``_frame.Frame`` whose recompute runs (typed loosely: floor 0)
    spans_seen: int  # kept spans the replay has met so far
    guards_replay_skips: bool

    def __call__(self, tensor: Any, /) -> Any: ...


def mark_recompute(
    pack: Callable[[Any], Any], frame: object, user_hooks: _compat.HookPair | None
) -> RecomputePack:
    """Give the recompute pack hook of ``frame`` its marks, before it is pushed."""
    marked = cast(RecomputePack, pack)
    marked._checkpoint_internal = True
    marked._user_hooks = user_hooks
    marked.replaying = frame
    marked.spans_seen = 0
    marked.guards_replay_skips = True
    return marked


def unmark_recompute(pack: RecomputePack) -> None:
    """Drop the marks that name other objects once the hook has left the stack: the graph holds
    pack hooks for as long as it lives (NOTE [Nestable checkpoint], Rule 10)."""
    del pack._user_hooks
    del pack.replaying


def replaying_pack(pack: object) -> RecomputePack | None:
    """``pack`` if it is the pack hook of a frame's recompute, else None."""
    if getattr(pack, "replaying", None) is None:
        return None
    return cast(RecomputePack, pack)


def guards_replay_skips(pack: object) -> bool:
    """Whether ``pack`` refuses tainted tensors, so that a replay saving through it may skip
    ops (NOTE [Selective checkpoint cache], Rule 14)."""
    return getattr(pack, "guards_replay_skips", False) is True


def watches_kept_spans(pack: object) -> bool:
    """Whether ``pack`` is the planner's profile hook, to which kept spans hand themselves
    (NOTE [Kept spans], Rule 11)."""
    return getattr(pack, "watches_kept_spans", False) is True
