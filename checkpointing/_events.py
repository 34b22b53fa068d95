"""Observation points: mechanisms announce what they do with each tensor autograd saves.

Owns the one ``ContextVar`` that a report (``checkpointing``'s saved-tensor report) sets while it
watches a step. The frame, the scope and the selective modes call ``announce`` from their pack
paths; with no listener that costs one ``ContextVar.get``. The frame also calls ``announce_kept``
for what it keeps by plain reference, out of autograd's sight (RNG states, keyword inputs), only
while a listener watches it. ``note_tag`` remembers the names given with
``checkpointing.policies.tag`` by storage, for as long as the storage lives, so that a report
built from a loss after forward (no listener then) can still name the tensors it finds. This
module knows nothing about how a report is built or printed: that belongs to ``_report``.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Final, Literal, Protocol, runtime_checkable

import torch

__all__ = [
    "Decision",
    "Kept",
    "KeptListener",
    "Listener",
    "announce",
    "announce_kept",
    "current_region",
    "listener",
    "note_tag",
    "tag_name",
]

Decision = Literal["saved", "recomputed", "offloaded", "compressed"]
Kept = Literal["rng state", "keyword input", "nested input", "span output", "kept draw"]
"""What a region keeps by reference: an RNG state it captured, a tensor it received by keyword,
one inside a container among its positional arguments, the output of a kept span that its
replay will be served (``checkpointing.keep``), or what a random op drew in a planned region
that keeps its draws."""


class Listener(Protocol):
    """Receives one call per tensor a mechanism of ours takes charge of."""

    def on_tensor(
        self, tensor: torch.Tensor, *, region: str, decision: Decision, nbytes: int | None = None
    ) -> None:
        """``tensor`` (the real one, not a holder) was saved, dropped for recompute, moved or
        compressed; ``nbytes``: what is kept of it where that is not its own size (a
        compressed tensor's packed bytes)."""


@runtime_checkable
class KeptListener(Listener, Protocol):
    """A listener that also wants the tensors a region keeps by plain reference, which no
    saved-tensors hook sees (optional: ``announce_kept`` skips listeners without it)."""

    def on_kept(self, tensor: torch.Tensor, *, region: str, what: Kept) -> None:
        """``region`` keeps ``tensor`` alive until its backward."""


listener: ContextVar[Listener | None] = ContextVar("checkpointing_listener", default=None)

# The region whose forward is running, set by mechanisms only while a listener is active, so
# that a report can say which region a really-kept tensor (e.g. a region's input) belongs to.
current_region: ContextVar[str | None] = ContextVar("checkpointing_region", default=None)


def announce(
    tensor: torch.Tensor, region: str, decision: Decision, nbytes: int | None = None
) -> None:
    """Tell the active listener, if any, what happened to ``tensor`` in ``region`` (``nbytes``:
    what is kept of it, where that is not its own size)."""
    current = listener.get()
    if current is not None:
        if nbytes is None:
            current.on_tensor(tensor, region=region, decision=decision)
        else:
            current.on_tensor(tensor, region=region, decision=decision, nbytes=nbytes)


def announce_kept(tensor: torch.Tensor, region: str, what: Kept) -> None:
    """Tell the active listener, if it wants to know, that ``region`` keeps ``tensor``."""
    current = listener.get()
    if isinstance(current, KeptListener):
        current.on_kept(tensor, region=region, what=what)


# Tag names by storage: a weak key, so an entry lives exactly as long as the memory it names. The
# storage's Python object stands for the storage itself: torch keeps one per storage while it
# lives, so every tensor on that memory finds the entry (a view, the detached alias a selective
# checkpoint keeps, the copy autograd saves of an op's output).
_tag_names: Final[weakref.WeakKeyDictionary[torch.UntypedStorage, str]] = (
    weakref.WeakKeyDictionary()
)


def note_tag(tensor: torch.Tensor, name: str) -> None:
    """Remember that ``tensor``'s memory is named ``name`` (``policies.tag``; a report watching
    a step also notes every tag op it sees). Tensors without memory of their own (meta, sparse,
    subclasses such as a compiler's fake tensors) are not noted."""
    if type(tensor) in _PLAIN and tensor.device.type != "meta" and not tensor.is_sparse:
        _tag_names[tensor.untyped_storage()] = name


def tag_name(tensor: torch.Tensor) -> str | None:
    """The name ``note_tag`` gave ``tensor``'s memory, if any."""
    if type(tensor) not in _PLAIN or tensor.device.type == "meta" or tensor.is_sparse:
        return None
    return _tag_names.get(tensor.untyped_storage())


_PLAIN: Final = (torch.Tensor, torch.nn.Parameter)
