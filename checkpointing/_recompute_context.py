"""The recompute-context protocol: what a checkpoint's recompute context says about itself.

Owns ``RecomputeContext`` (the typed protocol: the answers the frame and kept spans read off a
checkpoint's recompute context), ``DeclaredContext`` (the base our recompute contexts derive
from, which gives each answer's default once), ``declared`` (the one probe) and
``hand_respect`` (the one write of ``respect_saved_tensors_hooks`` into a forward context), and
the two protocols a report's graph walk reads off a context (``ComposedContext``, whose parts it
reads one by one, and ``HoldsForReplay``, what a context keeps for the replay by reference).
Who reads which answer: the frame's recompute (``passes_detach_through``, NOTE [Nestable
checkpoint], Rule 9) and kept spans (``honours_kept_spans``, ``honours_kept_blocks``, NOTE
[Kept spans], Rule 6). Imports nothing of the package: every room may import it.

NOTE [Recompute context protocol]
  Rule 1. A context that does not derive from ``DeclaredContext`` (torch's selective modes, a
          user's ``context_fn``) says nothing and is read at the defaults: it does not pass
          ``detach`` through, does not honour kept spans (a span is a plain call, said once) and
          would honour ``with keeping():`` blocks. The defaults are the safe side of each
          answer; a context earns another answer only by deriving from the base and saying so.
  Rule 2. The answers are read through ``declared(context)``, typed against the protocol (a
          misspelt answer is a mypy error, not a ``getattr`` default), and said by a subclass
          as class attributes, type-checked against the base. A subclass attribute that starts
          like an answer's name and is none of them is refused when the class is made: a
          misspelt declaration would otherwise leave the default in force, silently.

Rejected: ``getattr(context, name, default)`` at each reader (the state before: three readers,
each with its own string and default); a ``runtime_checkable`` protocol with ``isinstance``
(structural: a few microseconds per probe, and a context declaring one answer of three would
not match).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "ComposedContext",
    "DeclaredContext",
    "HoldsForReplay",
    "RecomputeContext",
    "context_parts",
    "declared",
    "hand_respect",
]

_RESPECT: Final = "respect_saved_tensors_hooks"  # torch's name, on its selective forward mode too


class RecomputeContext(Protocol):
    """What a checkpoint's recompute context answers (NOTE [Recompute context protocol])."""

    @property
    def passes_detach_through(self) -> bool:
        """It is a dispatch mode that passes ``detach`` through unchanged, so the recompute
        may detach below the modes (NOTE [Nestable checkpoint], Rule 9)."""

    @property
    def honours_kept_spans(self) -> bool:
        """It stays in step when the replay skips a kept span (NOTE [Kept spans], Rule 6):
        the span's ops are invisible to it in forward and replay alike."""

    @property
    def honours_kept_blocks(self) -> bool:
        """With ``honours_kept_spans``: ``with keeping():`` blocks are spans too; ``False`` makes
        them plain calls (a context that answers ops without running them, NOTE [Kept spans],
        Rule 6)."""


class DeclaredContext:
    """Base of our recompute contexts: the protocol's defaults, which a subclass overrides with
    class attributes (``honours_kept_spans: Final = True``)."""

    __slots__ = ()

    @property
    def passes_detach_through(self) -> bool:
        return False

    @property
    def honours_kept_spans(self) -> bool:
        return False

    @property
    def honours_kept_blocks(self) -> bool:
        return True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in vars(cls):
            if name not in _ANSWERS and name.startswith(_STEMS):  # Rule 2
                answers = ", ".join(sorted(_ANSWERS))
                raise TypeError(
                    _MSG_MISSPELT.format(cls=cls.__qualname__, name=name, answers=answers)
                )


_ANSWERS: Final = frozenset(
    name for name, value in vars(DeclaredContext).items() if isinstance(value, property)
)
# How each answer's name starts ("honors" too: a spelling, not a different answer).
_STEMS: Final = (*sorted({name[:6] for name in _ANSWERS}), "honor")
_MSG_MISSPELT = (
    "{cls} derives from checkpointing's DeclaredContext and sets {name!r}, which is not one of "
    "the recompute-context protocol's answers ({answers}); the answer it was meant to be would "
    "keep its default. Fix: spell it as one of them."
)
_UNDECLARED: Final = DeclaredContext()


def declared(context: object) -> RecomputeContext:
    """``context``'s answers: its own if it derives from ``DeclaredContext``, else the defaults
    (Rule 1). Read once per recompute or span, never per tensor."""
    return context if isinstance(context, DeclaredContext) else _UNDECLARED


@runtime_checkable
class ComposedContext(Protocol):
    """A recompute context made of others (a planned region's draws mode under its selective
    mode): a report that walks the graph reads each part as if it stood alone."""

    @property
    def parts(self) -> tuple[object, ...]:
        """The contexts it is made of."""


@runtime_checkable
class HoldsForReplay(Protocol):
    """A recompute context that holds tensors for its region's replay by plain reference, out
    of every hook's sight (a planned region's kept random draws): a report that walks the graph
    asks it what it still holds."""

    def held_for_replay(self) -> Iterator[torch.Tensor]:
        """The tensors it holds for the replay that has not run yet."""


def context_parts(context: object) -> tuple[object, ...]:
    """The contexts ``context`` is made of (``ComposedContext``), or ``context`` alone. Read
    by a report's walk, never per op: the ``isinstance`` probe is structural."""
    return context.parts if isinstance(context, ComposedContext) else (context,)


def hand_respect(forward_context: object, respect: bool | None) -> None:
    """Tell a selective checkpoint's forward context (ours or torch's, which spells it the same)
    whether to route what it keeps through the user's saved-tensors hooks; other contexts have
    no such attribute and are left alone."""
    if hasattr(forward_context, _RESPECT):
        setattr(forward_context, _RESPECT, respect)
