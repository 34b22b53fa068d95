"""The hooks that record a plan's spans in a planned model (NOTE [Planner measure], Rule M11).

Owns ``SpanHooks`` (a ``gradient_checkpoint_scope`` opened and closed by forward hooks, in a
session that spans the model's call), ``span_hook_mark`` and ``take_off_spans`` (a plan's span
hooks found on any model through the hooks themselves). What a span is and what recording it
saves belong to ``measure.recorded_spans``; which spans a plan records to ``plan``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ... import _compat
from ..._scope import gradient_checkpoint_scope, gradient_checkpoint_session, records_now

__all__ = ["SpanHooks", "span_hook_mark", "take_off_spans"]


class _Open:
    """What one thread has open of a model call: its session, the span recording now, and the
    spans recorded so far (their claims on our hook end with the call)."""

    __slots__ = ("off", "recorded", "scope", "session")

    def __init__(self) -> None:
        self.off = False  # this call records nothing: no grad, or inside a checkpoint's frame
        self.session: gradient_checkpoint_session | None = None
        self.scope: gradient_checkpoint_scope | None = None
        self.recorded: list[gradient_checkpoint_scope] = []


class _Recorder:
    """What records a planned model's spans, per thread (a model may run in several). A session
    for the model's call keeps our saved-tensors hook on the stack to its end, whatever hook the
    caller has pushed (a report, ``save_on_cpu``): the head's tensors are saved after its scope
    closed, as the blocks' inputs (NOTE [Gradient checkpoint scope], Rules 4 and 9). At the
    call's end every span gives up its claim on the hook, so that no hook of ours stays on the
    caller's stack after the step (the tensors saved until then are holders already; those saved
    later are kept, as the profile counts them). Ending what is not open does nothing. Pickles
    as its plan's mark (between calls nothing is open; NOTE [Installed plan], Rule 1)."""

    def __init__(self, mark: str = "") -> None:
        self.mark = mark
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"mark": self.mark}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.mark = state.get("mark", "")
        self._local = threading.local()

    def _open(self) -> _Open:
        found: _Open | None = getattr(self._local, "open", None)
        if found is None:
            found = self._local.open = _Open()
        return found

    def start(self, *_hook_args: object) -> None:
        """The model's start: the session, where autograd saves and no checkpoint encloses the
        model (its frame takes what the model saves, in forward and in recompute alike)."""
        state = self._open()
        if state.session is not None:
            return
        state.off = not records_now()  # no grad, a recompute, inside a checkpoint's frame
        if not state.off:
            state.session = gradient_checkpoint_session()
            state.session.__enter__()

    def begin(self, *_hook_args: object) -> None:
        """A span's start: its scope (not in a recompute, nor inside a frame a trail's region
        did not end, Rule M13)."""
        state = self._open()
        if state.scope is None and not state.off and records_now():
            scope = gradient_checkpoint_scope()
            scope.__enter__()
            state.scope = scope

    def end(self, *_hook_args: object) -> None:
        """A span's end."""
        state = self._open()
        scope = state.scope
        if scope is not None:
            state.scope = None
            scope.__exit__(None, None, None)
            state.recorded.append(scope)

    def finish(self, *_hook_args: object) -> None:
        """The model's end (also after an exception): what is open, closed; the hook given up."""
        self.end()
        state = self._open()
        while state.recorded:
            state.recorded.pop().exit_saved_tensors_hooks_scope()
        session, state.session = state.session, None
        if session is not None:
            session.__exit__(None, None, None)


class SpanHooks:
    """The forward hooks that record a plan's spans (Rule M11): the head from the model's start
    to the first block's (prepended, so that it ends before the block's checkpoint starts), the
    tail from its first module's start to its last module's end, each trail over its module
    (Rule M13); the model's end closes what an exception left open."""

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module | None,
        tail: tuple[nn.Module, nn.Module] | None,
        trails: Sequence[nn.Module] = (),
        mark: str = "",
    ) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        if head is None and tail is None and not trails:
            return
        recorder = _Recorder(mark)
        self.handles.append(model.register_forward_pre_hook(recorder.start))
        if head is not None:
            self.handles.append(model.register_forward_pre_hook(recorder.begin))
            self.handles.append(head.register_forward_pre_hook(recorder.end, prepend=True))
        if tail is not None:
            first, last = tail
            self.handles.append(first.register_forward_pre_hook(recorder.begin, prepend=True))
            self.handles.append(last.register_forward_hook(recorder.end, always_call=True))
        for child in trails:  # Rule M13: after the hook that ends its region's frame
            self.handles.append(child.register_forward_pre_hook(recorder.begin))
            self.handles.append(child.register_forward_hook(recorder.end, always_call=True))
        self.handles.append(model.register_forward_hook(recorder.finish, always_call=True))

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()


def span_hook_mark(hook: object) -> str | None:
    """The mark of the plan whose span recorder ``hook`` belongs to; None: not a span hook."""
    owner = getattr(hook, "__self__", None)
    return owner.mark if isinstance(owner, _Recorder) else None


def take_off_spans(model: nn.Module, mark: str) -> None:
    """Every span hook of the plan marked ``mark`` off every module of ``model`` (a copy of a
    planned model, whose hooks no handle reaches: NOTE [Installed plan], Rule 1)."""
    modules = list(model.modules())
    recorders = {
        id(owner): owner
        for module in modules
        for hook in _compat.forward_pre_hooks(module)
        if isinstance(owner := getattr(hook, "__self__", None), _Recorder) and owner.mark == mark
    }
    for recorder in recorders.values():
        for module in modules:  # each method may sit as a pre-hook or a hook: both are looked at
            for method in (recorder.start, recorder.begin, recorder.end, recorder.finish):
                _compat.remove_forward_hooks(module, method, method)
