"""Ground floor: the marks our saved-tensors hooks carry, on the stack and in the graph.

What checkpoint machinery must know about the pack hook on top of the stack, and what a report
must know about the unpack hook a graph node holds, travels as attributes of that hook (or of the
object whose bound method it is). This module names each mark once (``MARKS``), with who sets it
and who reads it, and gives the typed accessors through which the rest of the package reads
them: no other module probes a hook with ``getattr(hook, "<mark>", default)``
(``tests/test_house.py`` checks it). It imports nothing of the package but ``_compat``, so any
floor may use it.

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
- ``frame``, ``region_label``: on unpack hooks the graph holds, for the report that walks it
  without unpacking (NOTE [Report from a graph], Rule 2), read through ``unpack_frame`` and
  ``span_region``. ``frame`` is the frame whose holders the hook hands out: set by
  ``mark_unpack_frame`` on a frame's unpack hook with debug loggers (a closure; without them the
  hook is ``partial(unpack_holder, frame)``, which names the frame itself), and carried by a kept
  span's hook pair (``_keep._SpanHooks``, whose bound ``unpack`` is the hook), which also
  carries ``region_label``, how reports name the span.

Rejected: a registry of our hooks (a dict from hook to role): the stack already holds the hook,
and a registry would need its own clean-up when a hook leaves the stack or dies with the graph.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Final, Protocol, cast

from . import _compat

__all__ = [
    "MARKS",
    "CheckpointInternal",
    "FrameUnpack",
    "RecomputePack",
    "guards_replay_skips",
    "mark_recompute",
    "mark_unpack_frame",
    "replaying_pack",
    "span_region",
    "unmark_recompute",
    "unpack_frame",
    "watches_kept_spans",
]

# Every mark's name: read by getattr here only (tests/test_house.py holds the rest to it).
MARKS: Final = frozenset(
    {
        "_checkpoint_internal",
        "_user_hooks",
        "frame",
        "guards_replay_skips",
        "region_label",
        "replaying",
        "spans_seen",
        "watches_kept_spans",
    }
)


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


class FrameUnpack(Protocol):
    """An unpack hook that names the frame whose holders it hands out (``mark_unpack_frame``)."""

    frame: Any  # the ``_frame.Frame`` (typed loosely: floor 0)

    def __call__(self, packed: Any, /) -> Any: ...


def mark_unpack_frame(unpack: Callable[[Any], Any], frame: object) -> FrameUnpack:
    """Name ``frame`` on its unpack hook ``unpack``, for reports that walk the graph."""
    marked = cast(FrameUnpack, unpack)
    marked.frame = frame
    return marked


def _carriers(hook: object) -> tuple[object, ...]:
    """Where an unpack hook's marks sit: on the hook, and on the object it is a bound method of
    (a kept span's hook pair unpacks with its ``unpack`` method)."""
    if isinstance(hook, types.MethodType):
        return (hook, hook.__self__)
    return (hook,)


def unpack_frame(hook: object) -> object | None:
    """The ``frame`` mark of unpack hook ``hook`` (or of its bound owner), else None; the caller
    checks that it is a frame."""
    for carrier in _carriers(hook):
        frame: object = getattr(carrier, "frame", None)
        if frame is not None:
            return frame
    return None


def span_region(hook: object) -> str | None:
    """The ``region_label`` mark of a kept span's unpack hook (on its hook pair), else None."""
    for carrier in _carriers(hook):
        label = getattr(carrier, "region_label", None)
        if isinstance(label, str):
            return label
    return None
