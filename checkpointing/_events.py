"""Observation points: mechanisms announce what they do with each tensor autograd saves.

Owns the one ``ContextVar`` that a report (``checkpointing``'s saved-tensor report) sets while it
watches a step. The frame, the scope and the selective modes call ``announce`` from their pack
paths; with no listener that costs one ``ContextVar.get``. This module knows nothing about how a
report is built or printed: that belongs to the report's own module.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Literal, Protocol

import torch

__all__ = ["Decision", "Listener", "announce", "current_region", "listener"]

Decision = Literal["saved", "recomputed", "offloaded"]


class Listener(Protocol):
    """Receives one call per tensor a mechanism of ours takes charge of."""

    def on_tensor(self, tensor: torch.Tensor, *, region: str, decision: Decision) -> None:
        """``tensor`` (the real one, not a holder) was saved, dropped for recompute, or moved."""


listener: ContextVar[Listener | None] = ContextVar("checkpointing_listener", default=None)

# The region whose forward is running, set by mechanisms only while a listener is active, so
# that a report can say which region a really-kept tensor (e.g. a region's input) belongs to.
current_region: ContextVar[str | None] = ContextVar("checkpointing_region", default=None)


def announce(tensor: torch.Tensor, region: str, decision: Decision) -> None:
    """Tell the active listener, if any, what happened to ``tensor`` in ``region``."""
    current = listener.get()
    if current is not None:
        current.on_tensor(tensor, region=region, decision=decision)
