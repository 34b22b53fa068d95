"""The registry of scope tensors: scope tensor -> (tape, slot), weakly, for all scopes.

Owns ``_Entry`` (a weak reference that knows its tape and slot), ``_registry`` (one dict for all
scopes and threads), the death callback that counts a watched tensor's death (``_entry_died``) and
the lookup the pack hook makes for a tensor or the base of a view (``_scope_slot``). Entries are
made by the tape (``tape.py``) and read by the router's pack hook (``router.py``).

Of Rule 3, the linked replay is ``replay.py``'s and when a scope records nothing is
``scope.py``'s (``_records_here``); of Rule 8, the ``as_strided`` is the tape's ``fill``.

NOTE [Gradient checkpoint scope] (Rules 3 and 8 here; ``__init__`` says where the others are)
  Rule 3. One registry for all scopes: several scopes alive at once all drop their tensors, and
          a scope that reads a closed scope's tensor refers to that scope's tape instead of
          holding the tensor. The chains so linked, in both directions, replay together: each
          tape once per backward, whichever holder that backward unpacks first, planned from
          the last tape back (what it needs of the tapes it reads) and run in the order the
          tapes closed. A scope opened while one is open in this thread, inside a
          checkpointed region (a checkpoint's hook on top), during recompute or inside a
          backward records nothing.
  Rule 8. A view of a scope tensor saved after the scope (``nn.Linear`` saves ``weight.t()``)
          is a holder of its base, re-viewed with ``as_strided`` after replay.

Rejected: finding scope tensors by storage (an alias that does not share the version counter, like
``.data`` or an AOTAutograd output, can be written without a version bump, and the replay would
silently differ).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from .._compat import skip_dynamo_in_code, view_base
from .._errors import internal_error

if TYPE_CHECKING:  # annotations only: ``tape`` imports this module (see ``__init__``)
    from .tape import _Tape

_View = tuple[torch.Size, tuple[int, ...], int]  # size, stride, storage offset for as_strided


class _Entry(weakref.ref[torch.Tensor]):
    """A weak reference to a scope tensor that knows its tape and slot: the registry's value,
    and the tape's marker wherever an op reads that tensor. Its death is counted (Rule 9)."""

    __slots__ = ("key", "slot", "tape")

    key: int
    tape: _Tape
    slot: int


_registry: dict[int, _Entry] = {}


@skip_dynamo_in_code  # Rule 10: a tensor may die inside compiled code
def _entry_died(entry: weakref.ref[torch.Tensor]) -> None:
    if not isinstance(entry, _Entry):
        internal_error("registry callback got a foreign reference")
    if _registry.get(entry.key) is entry:
        del _registry[entry.key]
    entry.tape.slot_died()


def _scope_slot(tensor: torch.Tensor) -> tuple[_Tape, int, _View | None] | None:
    """The tape and slot that can replay ``tensor``, directly or as a view of its base."""
    entry = _registry.get(id(tensor))
    if entry is not None and entry() is tensor:
        return (entry.tape, entry.slot, None) if entry.tape.reproduces(entry.slot, tensor) else None
    base = view_base(tensor)
    if base is None:
        return None
    entry = _registry.get(id(base))
    if entry is None or entry() is not base or not entry.tape.reproduces(entry.slot, base):
        return None
    view = (tensor.shape, tensor.stride(), int(tensor.storage_offset()))  # Rule 8
    return entry.tape, entry.slot, view
