"""A planned region's random draws: kept as a group (NOTE [Planner solve], Rule S7), or watched
for where the plan says there are none (Rule A3).

Owns ``draw_contexts``: the pair of dispatch modes ``apply`` installs, below the selective
modes where the region also keeps op outputs, on a region whose plan keeps its draws. In
forward, the first keeps every random op's outputs (an out-of-place draw's output as it is, the
values an in-place draw wrote as a copy, since the region's later in-place ops change them) and
announces them to a watching report ("kept draw"); in recompute, the second hands them out in
order, one per random op, and draws nothing (and tells a report that walks the graph what it
still holds, ``held_for_replay``). Which ops draw is ``_selective``'s (``draws_random``); deciding
to keep the group is ``solver``'s.

Why below the selective modes: selective checkpointing recomputes random ops whatever its policy
says (NOTE [Selective checkpoint cache], Rule 10), so its recompute mode runs them again and the
call reaches this mode, which answers it from the forward; the selective modes count and check
the op sequence as always. All or none: with every draw answered from the forward, the replay
draws nothing, so no later draw can shift. A kept span's draws (``checkpointing.keep``) are
neither kept nor answered: the replay skips the span, as the selective modes do (NOTE [Kept
spans], Rule 6), and the profile leaves its ops out of the group (NOTE [Planner measure], Rule M14).
A ``with keeping():`` block is a plain call under these modes (``honours_kept_blocks``): the replay
runs a block again, and its draws, answered by nobody, would come from an RNG state the answered
draws before it did not move on; as a plain call its draws are the group's, as the profile sees
them.

Owns ``DrawCall`` and ``guarded_replay`` too: the recompute context of one call of a region
planned without draws (checkpointed without an RNG state). Where that call's forward may have
drawn (``DrawCall.suspect``, set by the region's ``DrawGuard``), the recompute runs under an
alarm that raises at the first random op it runs: such an op would draw other numbers than the
forward did, since no state was kept. The alarm is the region's own ops on its own thread, so
another thread's draws never raise it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Final

import torch

from ... import _compat
from ..._errors import CheckpointError
from ..._events import announce_kept, current_region
from ..._recompute_context import DeclaredContext, declared
from ..._selective import draws_random
from ..._state import span_depth
from ..._trees import tensors

__all__ = ["DrawCall", "draw_contexts", "guarded_replay"]

_MSG_EXTRA_BACKWARD = (
    "checkpointing.ActivationPlan: a region whose plan keeps its random draws was recomputed a "
    "second time; its kept draws are handed out once. Fix: run the forward again before another "
    "backward, or re-plan with a budget that does not keep the region's draws."
)
_MSG_CHANGED = (
    "checkpointing.ActivationPlan: the output of {op}, kept for recompute because the plan keeps "
    "the region's random draws, was changed in place after the forward ({found}). Fix: re-plan "
    "(plan_checkpointing sees in-place writes inside a region), or do not modify the region's "
    "outputs in place."
)
_MSG_OTHER_DRAWS = (
    "checkpointing.ActivationPlan: recompute of a region that keeps its random draws ran {op} as "
    "draw {index}, but the forward made {count} draws. The region's op sequence must not depend "
    "on anything but its inputs. Fix: re-plan, or keep the region's draws no more."
)

# One kept output: ("arg", position of the written input among the call's tensors, its values
# then), ("out", the tensor, its version then), or ("value", a non-tensor output).
_Kept = tuple[str, Any, Any]


class _Draws:
    """One region call's draws, in order: per random op, its outputs and whether a tuple."""

    __slots__ = ("kept", "replayed")

    def __init__(self) -> None:
        self.kept: list[tuple[tuple[_Kept, ...], bool] | None] = []
        self.replayed = 0


class _KeepDraws(_compat.TorchDispatchMode, DeclaredContext):  # type: ignore[no-untyped-call]  # untyped base
    """Forward: runs every op; keeps what each random op outside a kept span produced."""

    honours_kept_spans: Final = True

    def __init__(self, draws: _Draws) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.draws = draws

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not span_depth() and draws_random(func, args, kwargs):
            inputs = list(tensors((args, kwargs)))
            outs = out if isinstance(out, tuple | list) else (out,)
            self.draws.kept.append((tuple(_keep(o, inputs) for o in outs), outs is out))
        return out


def _keep(out: Any, inputs: list[torch.Tensor]) -> _Kept:
    """One output of a random op, kept for the replay and announced to a watching report (a
    "kept draw" of the region whose forward runs)."""
    if not isinstance(out, torch.Tensor):
        return ("value", out, None)
    written = next((i for i, t in enumerate(inputs) if t is out), None)
    kept = out.detach().clone() if written is not None else out
    announce_kept(kept, current_region.get() or "sac", "kept draw")
    if written is not None:  # an in-place draw: its values now, before later writes
        return ("arg", written, kept)
    return ("out", out, out._version)


class _ReplayDraws(_compat.TorchDispatchMode, DeclaredContext):  # type: ignore[no-untyped-call]  # untyped base
    """Recompute: answers every random op outside a kept span from the forward, in order; runs
    the others."""

    honours_kept_spans: Final = True
    honours_kept_blocks: Final = False  # a block's draws are the group's: a plain call

    def __init__(self, draws: _Draws) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.draws = draws

    def __enter__(self) -> _ReplayDraws:
        self.draws.replayed = 0
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        return self

    def held_for_replay(self) -> Iterator[torch.Tensor]:
        """``HoldsForReplay``: the kept draws not handed out yet (a walking report's rows)."""
        for entry in self.draws.kept:
            for kind, value, extra in entry[0] if entry is not None else ():
                if kind != "value":
                    yield extra if kind == "arg" else value

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if span_depth() or not draws_random(func, args, kwargs):
            return func(*args, **kwargs)
        draws = self.draws
        index = draws.replayed
        draws.replayed = index + 1
        if index >= len(draws.kept):
            raise RuntimeError(_MSG_OTHER_DRAWS.format(op=func, index=index, count=len(draws.kept)))
        entry = draws.kept[index]
        if entry is None:
            raise RuntimeError(_MSG_EXTRA_BACKWARD)
        draws.kept[index] = None  # handed out once: recompute's tensors die as backward runs
        kept, is_tuple = entry
        inputs = list(tensors((args, kwargs)))
        outs = tuple(_restore(func, k, inputs) for k in kept)
        return outs if is_tuple else outs[0]


def _restore(func: Any, kept: _Kept, inputs: list[torch.Tensor]) -> Any:
    kind, value, extra = kept
    if kind == "value":
        return value
    if kind == "arg":
        target = inputs[value]
        with torch.no_grad():
            target.copy_(extra)
        return target
    if value._version != extra:
        raise RuntimeError(
            _MSG_CHANGED.format(op=func, found=f"version {extra} then, {value._version} now")
        )
    return value


class _Stacked(contextlib.ExitStack, DeclaredContext):
    """The draws mode with a selective checkpoint's mode on top of it; passes the frame's
    ``respect_saved_tensors_hooks`` on to the selective mode."""

    honours_kept_spans: Final = True  # both modes do
    honours_kept_blocks: Final = False

    def __init__(self, below: Any, above: Any) -> None:
        super().__init__()
        self.below, self.above = below, above

    @property
    def parts(self) -> tuple[object, ...]:
        """``ComposedContext``: the draws mode and the selective one."""
        return (self.below, self.above)

    @property
    def respect_saved_tensors_hooks(self) -> bool | None:
        value: bool | None = self.above.respect_saved_tensors_hooks
        return value

    @respect_saved_tensors_hooks.setter
    def respect_saved_tensors_hooks(self, value: bool | None) -> None:
        self.above.respect_saved_tensors_hooks = value

    def __enter__(self) -> _Stacked:
        super().__enter__()
        self.enter_context(self.below)
        self.enter_context(self.above)
        return self


def draw_contexts(selective: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """The forward and recompute contexts of one call of a region that keeps its draws: the
    draws modes alone, or under the ``selective`` pair when the region keeps outputs too."""
    draws = _Draws()
    forward, replay = _KeepDraws(draws), _ReplayDraws(draws)
    if selective is None:
        return forward, replay
    return _Stacked(forward, selective[0]), _Stacked(replay, selective[1])


_MSG_DREW = (
    "checkpointing.ActivationPlan: region {name!r} ran {op}, which draws random numbers, in its "
    "recompute, but the plan was profiled with the region drawing none, so it keeps no RNG state "
    "and the recompute would draw other numbers than its forward did (a wrong gradient). "
    "Typically: the model was planned in eval mode (dropout off) and trains in train mode. "
    "Fix: plan_checkpointing in the mode you train in (model.train()), then apply that plan."
)


class DrawCall:
    """One call of a region planned without draws: whether its forward may have drawn (a
    generator it may use moved while it ran, by its own draws or another thread's)."""

    __slots__ = ("suspect",)

    def __init__(self) -> None:
        self.suspect = False


class _Alarm(_compat.TorchDispatchMode, DeclaredContext):  # type: ignore[no-untyped-call]  # untyped base
    """Recompute of a suspect call: raises at the first op that draws random numbers."""

    supports_higher_order_operators = True

    def __init__(self, name: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.name = name

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if draws_random(func, args, kwargs):
            raise CheckpointError(_MSG_DREW.format(name=self.name, op=func))
        return func(*args, **kwargs)


class _GuardedReplay(contextlib.ExitStack, DeclaredContext):
    """The recompute context of one guarded call: the region's own (selective) recompute
    context, if any, over the alarm where the call is suspect; it answers the recompute-context
    protocol as its own context does (the frame reads the answers after the forward ended)."""

    honours_kept_spans: Final = True  # the alarm runs every op; the selective modes honour them

    def __init__(self, call: DrawCall, inner: Any, name: str) -> None:
        super().__init__()
        self.call, self.inner, self.name = call, inner, name

    @property
    def passes_detach_through(self) -> bool:
        return self.inner is not None and declared(self.inner).passes_detach_through

    @property
    def honours_kept_blocks(self) -> bool:
        return self.inner is None or declared(self.inner).honours_kept_blocks

    def __enter__(self) -> _GuardedReplay:
        super().__enter__()
        if self.call.suspect:
            self.enter_context(_Alarm(self.name))
        if self.inner is not None:
            self.enter_context(self.inner)
        return self


def guarded_replay(call: DrawCall, inner: Any, name: str) -> Any:
    """The recompute context of a call of region ``name`` planned without draws: ``inner`` (its
    selective recompute mode, or None) with the alarm beneath it where ``call`` is suspect."""
    return _GuardedReplay(call, inner, name)
