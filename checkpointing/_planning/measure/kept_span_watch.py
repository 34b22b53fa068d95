"""Kept spans (``checkpointing.keep``) in a profiled step (NOTE [Planner measure], Rule M14).

Owns ``SpanWatch``: the saved-tensors pack hook of a profiled step, which ``keep(fn, *args)``
recognises and hands its span to (NOTE [Kept spans], Rule 11). The watch runs the span plainly,
under the span's marker, and tells the step which ops and saves are the span's: the step numbers
only the ops outside spans, as the selective modes do at run time, and the storages a span keeps
in a checkpointed region (what it saves that is not its arguments, the outputs the frame holds
for the replay) are the region's, kept whenever it is checkpointed. A region that runs a
``with keeping():`` block is planned without recompute (``RegionProfile.kept_blocks``). Profiling
the ops belongs to ``profile``; what a span keeps at run time is ``_keep``'s.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import torch

from ... import _compat
from ..._kept_span_args import recipe_for, storage_ranges, tensor_leaves
from ..._state import enter_span, exit_span

__all__ = ["SpanWatch"]


class _Step(Protocol):
    """What the watch needs of the profile's step (``profile._Step``)."""

    in_kept_span: int
    stack: list[Any]

    def activation(self, tensor: torch.Tensor) -> int | None: ...

    def on_saved(self, tensor: torch.Tensor, kept: bool = False) -> None: ...


class SpanWatch:
    """The profile's pack hook: every save goes to the step, a kept span's own saves (not its
    arguments nor views of them) marked kept; a span's outputs the frame would hold are the
    region's once a holder is made at or after the span's start (NOTE [Kept spans], Rule 3)."""

    __slots__ = ("holders", "leaves", "pending", "ranges", "step")
    watches_kept_spans: Final = True  # NOTE [Kept spans], Rule 11

    def __init__(self, step: _Step) -> None:
        self.step = step
        self.holders = 0  # saves a frame would hold as holders so far (every one in a region)
        self.leaves: list[torch.Tensor] | None = None  # the running span's tensor arguments
        self.ranges: list[tuple[int, int] | None] = []
        # Outputs of ended spans waiting for a holder: (region call, holders then, storage).
        self.pending: list[tuple[object, int, int]] = []

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        step = self.step
        leaves = self.leaves
        holder = leaves is None or recipe_for(tensor, leaves, self.ranges) is not None
        step.on_saved(tensor, kept=not holder)
        if step.stack:
            if holder:
                self.holders += 1
                self._reach(step.stack[-1])
            elif (storage := step.activation(tensor)) is not None:
                step.stack[-1][0].kept.add(storage)
        return tensor.detach()  # never the tensor itself: a cycle through its grad_fn

    def kept_span(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a span: plainly where the run time would (inside a span, outside every region:
        no frame there), else under the span's marker, its ops and saves told apart."""
        step = self.step
        if self.leaves is not None or not step.stack:
            return fn(*args, **kwargs)
        call, start = step.stack[-1], self.holders
        leaves = tensor_leaves(args, kwargs)
        self.leaves, self.ranges = leaves, storage_ranges(leaves) if leaves else []
        step.in_kept_span += 1
        token = enter_span()
        try:
            outputs = fn(*args, **kwargs)
        finally:
            exit_span(token)
            step.in_kept_span -= 1
            self.leaves, ranges = None, self.ranges
        for out in _compat.tree_leaves(outputs):
            if isinstance(out, torch.Tensor) and recipe_for(out, leaves, ranges) is None:
                storage = step.activation(out)
                if storage is not None:
                    self.pending.append((call, start, storage))
        self._reach(call)
        return outputs

    def kept_block(self, _name: str) -> None:
        """A ``with keeping():`` block began in the profiled step: every region running it is
        planned without recompute (NOTE [Planner measure], Rule M14), so what it keeps is what
        autograd saves there, as the profile counts it."""
        for running in self.step.stack:
            running[0].kept_blocks = True

    def _reach(self, call: Any) -> None:
        """The pending outputs of ``call``'s spans that a holder made since they started now
        reaches: the frame holds them; those of ended calls are dropped (released)."""
        waiting = []
        kept: set[int] = call[0].kept  # the running region's profile
        for owner, start, storage in self.pending:
            if owner is not call:
                continue
            if self.holders > start:
                kept.add(storage)
            else:
                waiting.append((owner, start, storage))
        self.pending = waiting
