"""Error types and the one helper for impossible states.

``CheckpointError`` is the parity exception type: a subclass of torch's own
``torch.utils.checkpoint.CheckpointError`` (a ``RuntimeError``), so ``except`` clauses written
for torch catch ours. Every module that raises a user-facing checkpoint error imports it from
here; ``internal_assert`` is the single way to state an invariant of our own, so that a broken
one always says it is our bug.
``describe_value`` is how a message shows what the user passed ("got ... of type ...").
"""

from __future__ import annotations

import reprlib
from typing import NoReturn

import torch
import torch.utils.checkpoint as _torch_checkpoint

__all__ = ["CheckpointError", "describe_value", "internal_assert", "internal_error"]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """A checkpointed region could not be recomputed faithfully: torch's ``CheckpointError``
    (a ``RuntimeError``), raised by checkpointing."""


_MSG_INTERNAL = (
    "checkpointing: internal invariant violated: {what}. "
    "This is a bug in checkpointing, please report it with the code that triggered it."
)


def internal_error(what: str) -> NoReturn:
    """Raise the "this is our bug" error for an impossible state described by ``what``."""
    raise AssertionError(_MSG_INTERNAL.format(what=what))


def internal_assert(cond: bool, what: str) -> None:
    """Check an invariant of ours; never use this on user input."""
    if not cond:
        internal_error(what)


_SHORT = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
_SHORT.maxstring = _SHORT.maxother = 60


def describe_value(value: object) -> str:
    """What the user passed, for "got {...}": a tensor by shape and dtype (never its truth value
    or its data), anything else by a short repr and its type."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{_SHORT.repr(value)} of type {type(value).__qualname__}"
