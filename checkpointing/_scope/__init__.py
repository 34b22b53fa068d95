"""The scope API: ``gradient_checkpoint_scope`` (after RETURNN's) and its session context.

Owns the op tape a scope records, the registry that maps scope tensors to their tape, the one
saved-tensors hook of ours per thread (a router shared by every scope), and the lifetime of that
hook. Holders, per-backward recompute, release on unpack and ``GraphExecGroup`` come from
``_frame`` (``Holder``, ``unpack_holder``); RNG/autocast/recompute marking from ``_state``; the
metadata comparison from ``_determinism``.

One concept per module, listed in import order (at run time each imports only modules above it):

- ``ops.py``: what a tape records of one op: the markers of its tensor arguments (``_Slot``,
  ``_Outside``), ``_Op``, the flattening of its arguments, the facts read from its schema.
- ``registry.py``: scope tensor -> (tape, slot), weakly, for all scopes (``_Entry``,
  ``_registry``, ``_scope_slot``).
- ``replay.py``: which chains replay together, and in which order (``_Chains``,
  ``_replay_linked``).
- ``tape.py``: one scope's tape (``_Tape``: recording, and running its share of a replay), its
  holders (``_ScopeHolder``) and the dispatch mode that records (``_TapeMode``).
- ``router.py``: the one hook of ours per thread and its lifetime (``_ThreadHooks``, ``_Claim``).
- ``scope.py``: the public ``gradient_checkpoint_scope`` and ``gradient_checkpoint_session``.

Why ``ops.py`` is not part of the tape module, and flattening not part of replay: the tape with
its op record was ~650 lines, and the op record (markers, ``_Op``, flattening, op facts) is the
vocabulary that recording and replay share; ``_Tape`` itself both flattens (recording) and
unflattens (its ``run``), so flattening lives with the ``_Op.spec`` it produces.

Cycles: three pairs of concepts refer to each other. An ``_Entry`` knows its ``_Tape`` and a tape
makes entries; ``_Chains`` are worked out from a tape and a tape caches its chains (and its
holders start the linked replay); a tape keeps its router ``_Claim`` and the router knows the open
tape. In each pair the lower module (``registry``, ``replay``, ``tape``) names the upper one's
class in annotations only, so it imports it under ``typing.TYPE_CHECKING`` at its top
(annotations are postponed by ``from __future__ import annotations``), and the upper module
imports the lower one at run time: no import inside a function, and no cycle at run time.

Mutable state exists once, in the module that owns it (``_slots`` and the op facts cache in
``ops``, ``_registry`` in ``registry``, ``_closing`` in ``tape``, the thread-local routers in
``router``); other modules import the objects, never rebind them, so the per-op and per-saved-
tensor paths find them as globals of their own module.

NOTE [Gradient checkpoint scope] is split over the modules that own its rules, numbers kept (grep
the name to find every block): Rules 1 and 2 in ``tape.py``; Rules 3 and 8 in ``registry.py``;
Rules 4 and 9 in ``router.py``; Rule 5 in ``ops.py``; Rules 6 and 10 in ``scope.py``; Rule 7 in
``replay.py``. A rule that spans modules lives where most of it is implemented, and its module
docstring says which clauses others implement; code that relies on a rule says "Rule k" as before.
"""

from __future__ import annotations

from .scope import gradient_checkpoint_scope, gradient_checkpoint_session, records_now

__all__ = ["gradient_checkpoint_scope", "gradient_checkpoint_session", "records_now"]
