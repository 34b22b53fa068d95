"""The non-reentrant frame: holders instead of tensors, recompute on first unpack.

Owns ``Frame`` (one per ``checkpoint(..., use_reentrant=False)`` call), ``Holder`` (what the
autograd graph stores in place of each saved tensor), the pack/unpack hooks of forward and of
recompute, early stop, the nesting rules, ``GraphExecGroup`` and the per-context early-stop switch.
``Holder`` and ``unpack_holder`` are shared with the scope API, which fills holders
by replaying a tape instead of re-running a function. Forward-time state capture belongs to
``_state``; what is compared after recompute, and the debug report, to ``_determinism``.

NOTE [Nestable checkpoint]
  Rule 1. A saved tensor belongs to the innermost checkpoint active when it is saved; outer
          checkpoints never see it (our pack hook is the top of the stack).
  Rule 2. An inner checkpoint's inputs are saved through ``make_saved_tensor`` before its hook is
          pushed, so they are saved tensors of its parent. Hence unpacking a tensor of a nested
          region first recomputes every region around it (each one's inputs live in its parent).
  Rule 3. Recompute starts as if no checkpoint were active: its hook goes on top of whatever
          stack the backward has, and checkpoints met while re-running still apply.
  Rule 4. Recomputed tensors belong to one backward (a graph task, or a ``GraphExecGroup``) and
          each is released the moment it is unpacked, even with ``retain_graph=True``; another
          backward recomputes again. The holder keeps, per backward, the tensor or ``None`` once
          consumed, so a second unpack in the same backward is the "unpacked twice" error.
  Rule 5. Early stop: recompute stops as soon as it has saved as many tensors as the forward
          did. ``set_checkpoint_early_stop`` active at forward time overrides ``early_stop=``.
  Rule 6. Backward inside the checkpointed function works: recompute also returns what it saves
          (detached) to its own graph, holders cleared by an earlier inner backward are skipped,
          and a forward that has not finished may save more during recompute than so far.
  Rule 7. Identical CPU RNG states of consecutive regions are kept once, not per region (see
          ``_state``, NOTE [RNG state shared when identical]); replay is always bit-identical.
  Rule 8. The forward phase is a generator that pushes the frame's hook at its first ``next()``
          and pops it when it ends, is closed or has an exception thrown in: whoever drives it
          (``checkpoint``, module hooks, third-party code), the hook stack is left as found.
  Rule 9. The recompute detaches each tensor it saves. When the only dispatch mode active is a
          recompute context that passes ``detach`` through unchanged (selective checkpoint's,
          which says so with ``passes_detach_through = True``) and the tensor is a plain one, the
          detach runs below the modes: the same tensor, without a trip through Python per saved
          tensor. With any other mode active (a torch-function mode included), or a tensor
          subclass, every mode sees the detach.
  Rule 10. Our hooks are checkpoint-internal (torch 2.14's protocol, kept on every release): the
          forward's pack hook (the frame) and the recompute's carry ``_checkpoint_internal`` and,
          only while they are on the stack, ``_user_hooks``, the user's saved-tensors hooks they
          shadow. Selective checkpointing (ours, and torch's from 2.14) reads the user's hooks
          through them: they never count as user hooks themselves, and what a policy keeps can be
          routed through the user's (``respect_saved_tensors_hooks``). The mark is dropped when
          the hook leaves the stack, because the graph holds pack hooks for as long as it lives.
  Rule 11. Besides its holders, a frame keeps until its backward, by plain reference and out of
          every saved-tensors hook's sight: its RNG states (the CPU one, shared per Rule 7, and
          one per accelerator tensor among the positional inputs; none without
          ``preserve_rng_state``), the tensors it received by keyword, and tensors inside
          containers among its positional inputs. A watching report is told of them
          (``announce_kept``); the planner counts them (NOTE [Planner apply], Rule A3).
  Rule 12. ``recompute_state_hooks`` (user state, NOTE [Kept spans], Rule 5): each hook is
          snapshotted when the frame starts; the recompute snapshots the caller's state,
          restores the forward's, runs, and puts the caller's back (as Rule 7's RNG). A frame
          also holds the kept spans its forward met (``_kept_span``'s records, made by ``_keep``,
          which imports this module, never the reverse); its recompute carries ``replaying``
          (the frame) and ``spans_seen`` on its pack hook, so that a span the replay reaches
          finds what to serve.

Rejected: torch's per-frame dicts keyed by graph task id and a ``WeakKeyDictionary`` of handles.
Keeping the recomputed tensor in the holder itself gives the same lifetimes (the holder dies with
its graph node, and with it the tensor) with no per-backward bookkeeping left on the frame.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any, Final, NoReturn, Protocol, Self

import torch

from . import _compat
from ._determinism import (
    Metadata,
    OpLogger,
    check_counts,
    check_metadata,
    check_values,
    debug_enabled,
    debug_error,
    holds_value,
    metadata_fn_for,
    note_recompute_error,
    recompute_site,
    too_many_saved,
)
from ._errors import CheckpointError, internal_assert, internal_error
from ._events import announce, announce_kept, current_region, listener
from ._hook_marks import mark_recompute, mark_unpack_frame, unmark_recompute
from ._kept_span import Span, held_outputs
from ._options import CheckpointOptions, options_of
from ._recompute_context import declared, hand_respect
from ._regions import region_label
from ._selective import replay_taint
from ._state import (
    ContextFn,
    ForwardState,
    RecomputeStateHook,
    exit_span,
    is_noop_context_fn,
    leave_spans,
    noop_context_fn,
    span_depth,
    state_hooks_from,
)

__all__ = [
    "NULL_CONTEXT",
    "Frame",
    "GraphExecGroup",
    "Holder",
    "Recomputes",
    "checkpoint_without_reentrant_generator",
    "checkpoint_without_reentrant_generator_impl",
    "early_stop_enabled",
    "frame_generator",
    "run_generator",
    "set_checkpoint_early_stop",
    "stop_recompute",
    "unpack_holder",
]

_early_stop_override: ContextVar[bool | None] = ContextVar("checkpointing_early_stop", default=None)

_MSG_UNPACKED_TWICE = (
    "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked "
    "once. {extra}If you are calling ctx.saved_tensors in backward, make sure to do so only "
    "once. Otherwise please open an issue with details on your use case."
)
_MSG_GROUP_OVERLAP = (
    "Performing two backward calls that overlap (i.e. require the same saved activation in "
    "order to compute gradients) is not allowed while under the "
    "torch.utils.checkpoint.GraphExecGroup context. "
)
_MSG_GROUP_NESTED = (
    "GraphExecGroup contexts cannot be nested. Already inside group {group}. Fix: leave the "
    "outer `with GraphExecGroup():` block before entering another one."
)
_MSG_DEVICE_INIT = (
    "PyTorch's device state was initialized in the forward pass of a Checkpoint, which is not "
    "allowed. Fix: initialise the device (e.g. move a tensor to it) before calling checkpoint, "
    "or pass preserve_rng_state=False if the region draws no random numbers on it."
)


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Turn early stop on or off for checkpoints whose forward runs in this thread/context.

    Only the forward needs to run under it; its backward may run anywhere. Unlike torch's
    process-global switch, other threads and asyncio tasks never see the value.
    """
    token = _early_stop_override.set(enable)
    try:
        yield
    finally:
        _early_stop_override.reset(token)


def early_stop_enabled(argument: bool) -> bool:
    """The effective early-stop setting: the context override if set, else the argument."""
    override = _early_stop_override.get()
    return argument if override is None else override


class GraphExecGroup:
    """Backward calls under one instance recompute each checkpointed region at most once.

    Those backward calls must not overlap (no saved activation may be needed by two of them),
    even with ``retain_graph=True``. Groups do not nest. Only affects the non-reentrant variant.
    """

    def __enter__(self) -> Self:
        current = _compat.get_graph_exec_group()
        if current is not None:
            raise RuntimeError(_MSG_GROUP_NESTED.format(group=current))
        _compat.set_graph_exec_group(self)
        return self

    def __exit__(self, *args: object) -> None:
        _compat.set_graph_exec_group(None)

    @classmethod
    def _get_current_group(cls) -> GraphExecGroup | None:
        group = _compat.get_graph_exec_group()
        return group if isinstance(group, GraphExecGroup) else None


_MISSING: Final = object()
# The forward and recompute context of a checkpoint without ``context_fn``: kept spans know by
# it that no recompute context needs keeping in step with a skipped span (NOTE [Kept spans]).
NULL_CONTEXT: Final = contextlib.nullcontext()
# Read per saved tensor: module globals rather than attributes of ``_compat``.
_weak: Final = weakref.ref
_partial: Final = functools.partial
_get_graph_exec_group: Final = _compat.get_graph_exec_group
_current_graph_task_id: Final = _compat.current_graph_task_id


class Holder(dict[object, torch.Tensor | None]):
    """What the graph stores for a saved tensor: a dict from each backward's key to the
    recomputed tensor, or ``None`` once consumed (Rule 4). It holds no tensor between forward
    and backward. A dict itself rather than an object with one: one allocation per saved
    tensor instead of two, and no Python ``__init__``. Compare holders with ``is`` only."""

    __slots__ = ("__weakref__",)


class Recomputes(Protocol):
    """What ``unpack_holder`` asks to fill holders: a frame, or a scope's holder itself."""

    def recompute(self, key: object) -> None:
        """Fill every live holder that waits for backward ``key`` (or raise)."""


def unpack_holder(owner: Recomputes, holder: Holder) -> torch.Tensor:
    """Hand out ``holder``'s tensor for the current backward, recomputing on first need and
    releasing it at once (Rule 4). ``owner.recompute(key)`` must fill every live holder for
    ``key``.

    The key of a backward: the active ``GraphExecGroup``, else the graph task; an unpack outside
    any backward gets a key of its own. Worked out inline: this runs per saved tensor."""
    key = _get_graph_exec_group()
    if key is None:
        key = _current_graph_task_id()
        if key == -1:
            key = object()
    value = holder.get(key, _MISSING)
    if value is _MISSING:
        owner.recompute(key)
        value = holder.get(key, _MISSING)
        internal_assert(value is not _MISSING, "recompute did not fill a live holder")
    if value is None:
        extra = _MSG_GROUP_OVERLAP if _get_graph_exec_group() is not None else ""
        raise CheckpointError(_MSG_UNPACKED_TWICE.format(extra=extra))
    holder[key] = None
    return value  # type: ignore[return-value]  # neither _MISSING nor None here


class _StopRecompute(BaseException):
    """Raised from the recompute pack hook to end recompute early (Rule 5).

    A ``BaseException`` so that a user's ``except Exception`` inside the region cannot swallow
    it (torch uses ``Exception`` and can be defeated that way)."""


def stop_recompute() -> NoReturn:
    """End the running recompute here, as early stop would: a region that ``end_at`` ended
    before a child ends its re-run there too (NOTE [Module checkpoint hooks], Rule 7); the
    holders must all be filled by then, as the count check after it verifies."""
    raise _StopRecompute


@_compat.disable_dynamo
def _run_without_dynamo(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Module level with no closure: a decorated closure would keep its cells alive.
    return fn(*args, **kwargs)


class Frame:
    """One non-reentrant checkpoint call: its inputs, its holders and how to recompute them."""

    __slots__ = (
        "__weakref__",
        "_user_hooks",
        "early_stop",
        "fn",
        "forward_completed",
        "ignore_count_mismatch",
        "kwargs",
        "loggers",
        "metadata",
        "observed",
        "recompute_context",
        "saved_args",
        "spans",
        "state",
        "state_entry",
        "state_hooks",
        "values",
        "weak_holders",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: ForwardState,
        recompute_context: AbstractContextManager[Any],
        record_metadata: bool,
        early_stop: bool,
        loggers: tuple[OpLogger, OpLogger] | None,
        state_hooks: tuple[RecomputeStateHook, ...] = (),
    ) -> None:
        self.fn = fn
        self.kwargs = kwargs
        self.state = state
        self.recompute_context = recompute_context
        self.early_stop = early_stop
        self.loggers = loggers
        self.weak_holders: list[weakref.ref[Holder]] = []
        self.metadata: list[Metadata] | None = [] if record_metadata else None
        # NOTE [Determinism checks], Rule 6: with debug, integer and boolean saves by position.
        self.values: dict[int, tuple[torch.Tensor, int]] | None = None if loggers is None else {}
        self.forward_completed = False
        self.ignore_count_mismatch = False
        self.spans: list[Span] | None = None  # NOTE [Kept spans]
        self.state_hooks = state_hooks  # Rule 12
        self.state_entry = tuple(hook.snapshot() for hook in state_hooks) if state_hooks else ()
        self.observed = listener.get() is not None  # a report watches this frame
        token = current_region.set(f"inputs of {self.region(args)}") if self.observed else None
        # See NOTE [Nestable checkpoint], Rule 2: saved through the parent's hook, if any.
        self.saved_args = _compat.save_inputs(args)
        # See NOTE [Nestable checkpoint], Rule 10: set while the pack hook is on the stack.
        self._user_hooks: _compat.HookPair | None = None
        if token is not None:
            current_region.reset(token)
            _announce_kept(self.region(), state, args, kwargs)

    # -- forward ------------------------------------------------------------------------------

    def pack(self, x: torch.Tensor) -> Holder:
        """Forward pack hook: store a holder, never the tensor (Rule 1). The frame itself is
        the hook (``__call__``), so that it can carry Rule 10's marks."""
        holder = Holder()
        self.weak_holders.append(_weak(holder))
        metadata = self.metadata
        if metadata is not None:
            metadata.append((x.shape, x.dtype, x.device))
        values = self.values
        if values is not None and holds_value(x):  # NOTE [Determinism checks], Rule 6
            values[len(self.weak_holders) - 1] = (x, x._version)
        if self.observed:
            announce(x, self.region(), "recomputed")
        return holder

    def add_span(self, span: Span) -> None:
        """A kept span ended in this frame's forward (NOTE [Kept spans])."""
        if self.spans is None:
            self.spans = []
        self.spans.append(span)

    def region(self, args: Sequence[Any] | None = None) -> str:
        """How reports and messages name this region (NOTE [Region names]); ``args``: the
        positional inputs, before ``saved_args`` holds them."""
        return region_label(self.fn, self.saved_args if args is None else args)

    # The forward's pack hook is the frame itself: calling it runs ``pack``, one Python frame and
    # no bound method made per call; and the frame carries Rule 10's marks.
    __call__ = pack
    _checkpoint_internal: Final = True  # Rule 10

    def unpack_hook(self) -> Callable[[Holder], torch.Tensor]:
        """The forward's unpack hook: recompute on first need in this backward, then hand out;
        with debug loggers, a failure also reports the ops of forward and recompute."""
        loggers = self.loggers
        if loggers is None:
            return _partial(unpack_holder, self)  # C-level: no Python frame of its own

        def unpack_reporting(holder: Holder) -> torch.Tensor:
            try:
                return unpack_holder(self, holder)
            except CheckpointError as error:
                debug_error(error, *loggers)

        return mark_unpack_frame(unpack_reporting, self)  # reports find the frame

    # -- backward -----------------------------------------------------------------------------

    def recompute(self, key: object) -> None:
        """Re-run the function under the forward's state, filling this frame's live holders
        for backward ``key``; then check the recomputed tensors against the forward's.

        The pack hook below also compares each recomputed tensor's metadata with the forward's
        as it goes, so no second pass over the holders is needed. It is a closure over locals
        rather than a method reading attributes: it runs per saved tensor."""
        if self.loggers is not None:
            self.loggers[1].ops.clear()  # the report shows the failing recompute only
        args = _compat.unpack_inputs(self.saved_args)
        holders = self.weak_holders
        metadata = self.metadata
        early_stop = self.early_stop
        # Fixed once the forward has ended; a forward cut short by its own backward (Rule 6)
        # may still save more, so then the count is read per tensor.
        n_fixed = len(holders) if self.forward_completed else -1
        # Rule 9: a recompute mode that passes ``detach`` through need not see ours.
        quiet_detach = declared(self.recompute_context).passes_detach_through
        mismatches: list[tuple[int, Metadata, torch.Tensor]] = []
        sites: list[str] = []  # where the first mismatch was saved
        values = self.values
        recomputed: list[tuple[int, torch.Tensor, str]] = []  # NOTE [Determinism checks], Rule 6
        count = 0

        def pack(x: torch.Tensor) -> torch.Tensor:
            """Fill the holder at this position; stop once all are filled (Rules 4 and 5)."""
            nonlocal count
            taint = replay_taint()
            if taint is not None:  # NOTE [Selective checkpoint cache], Rule 14
                taint.refuse_saved(x, self.region, count)
            made = x  # NOTE [Determinism checks], Rule 5: a mismatch names its maker
            if x.requires_grad:
                if (
                    quiet_detach
                    and type(x) in _PLAIN
                    and _dispatch_mode_depth() == 1
                    and not _has_torch_function(x)
                ):
                    x = _detach_below_modes(x)  # Rule 9
                else:
                    x = x.detach()
            idx = count
            count = idx + 1
            n_saved = n_fixed if n_fixed >= 0 else len(holders)
            if idx >= n_saved:
                internal_assert(not early_stop, "early stop should have ended recompute")
                if not self.forward_completed:
                    self.ignore_count_mismatch = True  # Rule 6
                    return x
                too_many_saved(n_saved, recompute_site(made))
            holder = holders[idx]()
            if holder is not None:  # a holder cleared by an earlier inner backward is skipped
                if holder.setdefault(key, x) is not x:
                    internal_error("holder filled twice")
                if metadata is not None:
                    saved = metadata[idx]
                    # dtypes are singletons: ``is not`` spares a rich comparison
                    if saved[1] is not x.dtype or saved[0] != x.shape or saved[2] != x.device:
                        if not mismatches:  # NOTE [Determinism checks], Rule 5
                            sites.append(recompute_site(made))
                        mismatches.append((idx, saved, x))
                if values is not None and idx in values:  # debug only: the stack read is fine
                    recomputed.append((idx, x, recompute_site(made)))
            if early_stop and idx + 1 == n_saved:
                raise _StopRecompute
            return x  # Rule 6: a backward inside the re-run can use it

        # Rule 10 (internal, the user's hooks below), Rule 12 (kept spans find this frame) and
        # NOTE [Selective checkpoint cache], Rule 14 (it refuses tainted tensors, so a replay
        # saving through it may skip ops): the marks of ``_hook_marks``.
        marked = mark_recompute(pack, self, _compat.user_saved_tensors_hooks())
        state_hooks = self.state_hooks
        outer_state = tuple(hook.snapshot() for hook in state_hooks) if state_hooks else ()
        _compat.push_saved_tensors_hooks(marked, _identity)  # Rule 3: on top of the stack
        try:
            with torch.enable_grad(), self.state.restored(), self.recompute_context:
                if state_hooks:
                    for hook, snapshot in zip(state_hooks, self.state_entry, strict=True):
                        hook.restore(snapshot)  # Rule 12
                if _compat.dynamo_eval_frame_active():
                    _run_without_dynamo(self.fn, *args, **self.kwargs)
                else:  # the wrapper would be a no-op: skip its ~5 us
                    self.fn(*args, **self.kwargs)
        except _StopRecompute:
            pass
        except CheckpointError:
            raise
        except Exception as error:  # NOTE [Determinism checks], Rule 5
            note_recompute_error(error, self.region())
            raise
        finally:
            _compat.pop_saved_tensors_hooks()
            unmark_recompute(marked)  # Rule 10: no graph-held reference
            if state_hooks:
                for hook, snapshot in zip(state_hooks, outer_state, strict=True):
                    hook.restore(snapshot)  # Rule 12: the caller's state back
        if self.ignore_count_mismatch:
            return  # Rule 6: a forward cut short by its own backward saved fewer
        check_counts(len(holders), count)
        if mismatches:
            check_metadata(mismatches, sites[0])
        if recomputed and values is not None:
            check_values(values, recomputed)


def _announce_kept(
    region: str, state: ForwardState, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Rule 11: tell a watching report what the frame keeps by plain reference."""
    for rng_state in (state.cpu_rng, *state.device_rng):
        if rng_state is not None:
            announce_kept(rng_state, region, "rng state")
    for tensor in _compat.tree_leaves(kwargs):
        if isinstance(tensor, torch.Tensor):
            announce_kept(tensor, region, "keyword input")
    for arg in args:
        if not isinstance(arg, torch.Tensor):
            for tensor in _compat.tree_leaves(arg):
                if isinstance(tensor, torch.Tensor):
                    announce_kept(tensor, region, "nested input")


# Tensor types without a ``__torch_dispatch__`` of their own (Rule 9).
_PLAIN: Final = (torch.Tensor, torch.nn.Parameter)
_dispatch_mode_depth: Final = _compat.dispatch_mode_depth
_detach_below_modes: Final = _compat.detach_below_modes
_has_torch_function: Final = _compat.has_torch_function_unary


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def checkpoint_without_reentrant_generator(
    fn: Callable[..., Any],
    preserve_rng_state: bool = True,
    context_fn: ContextFn = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    *args: Any,
    respect_saved_tensors_hooks: bool | None = None,
    recompute_state_hooks: object = None,
    **kwargs: Any,
) -> Generator[None, None, None]:
    """Torch's positional form of the generator (``fn``, the options, then ``fn``'s arguments),
    kept for code written against torch 2.13 and older; see
    ``checkpoint_without_reentrant_generator_impl``."""
    options = options_of(
        False,
        preserve_rng_state,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        respect_saved_tensors_hooks,
        recompute_state_hooks,
        api="checkpointing._checkpoint_without_reentrant_generator",
    )
    return frame_generator(fn, args, kwargs, options)


def checkpoint_without_reentrant_generator_impl(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool = True,
    context_fn: ContextFn = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    recompute_state_hooks: object = None,
) -> Generator[None, None, None]:
    """The forward phase of a non-reentrant checkpoint, as a generator (torch 2.14's contract).

    The first ``next()`` validates, captures the forward state and pushes the frame's hooks; the
    caller then runs ``fn(*args, **kwargs)`` itself; the second ``next()`` pops the hooks, checks
    the forward and ends the generator (``StopIteration``). ``close()`` or ``throw()`` at the
    pause pops the hooks too, so the caller's hook stack is exactly as before (See NOTE
    [Nestable checkpoint], Rule 8). ``checkpoint_module``'s hooks and third-party code written
    against torch's generator drive it; ``checkpoint(..., use_reentrant=False)`` drives the
    same generator, ``frame_generator``, with its options record (NOTE [Checkpoint options]).
    ``recompute_state_hooks`` (ours): user state restored for recompute (Rule 12).
    ``respect_saved_tensors_hooks`` reaches a selective-checkpoint forward context (ours or
    torch's), which routes what it keeps through the user's saved-tensors hooks when True.
    """
    options = options_of(
        False,
        preserve_rng_state,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        respect_saved_tensors_hooks,
        recompute_state_hooks,
        api="checkpointing._checkpoint_without_reentrant_generator_impl",
    )
    yield from frame_generator(fn, args, kwargs, options)


def frame_generator(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: CheckpointOptions,
) -> Generator[None, None, None]:
    """``checkpoint_without_reentrant_generator_impl`` with its options as one record: what
    ``checkpoint`` and ``checkpoint_module`` drive (``options.use_reentrant`` is not read)."""
    debug = options.debug
    context_fn = options.context_fn
    recompute_state_hooks = options.recompute_state_hooks
    preserve_rng_state = options.preserve_rng_state
    loggers: tuple[OpLogger, OpLogger] | None = None
    if debug_enabled(debug):
        stand_in = getattr(context_fn, "stand_in", None)  # a plan's draw guard: its own contexts
        if not is_noop_context_fn(context_fn if stand_in is None else stand_in()):
            raise ValueError(_MSG_DEBUG_WITH_CONTEXT_FN)
        loggers = (OpLogger(), OpLogger())
    record_metadata = metadata_fn_for(options.determinism_check) is not None
    state_hooks = (
        ()
        if recompute_state_hooks is None
        else state_hooks_from(recompute_state_hooks, "checkpointing.checkpoint")
    )
    forward_context: AbstractContextManager[Any]
    recompute_context: AbstractContextManager[Any]
    if loggers is not None:
        forward_context, recompute_context = loggers[0].mode(), loggers[1].mode()
    elif is_noop_context_fn(context_fn):
        forward_context = recompute_context = NULL_CONTEXT
    else:
        forward_context, recompute_context = context_fn()  # called once per call, as torch
        hand_respect(forward_context, options.respect_saved_tensors_hooks)  # a selective one's
    if not torch.is_grad_enabled():
        yield  # nothing will be saved: no frame, no state capture
        return
    frame = Frame(
        fn,
        args,
        kwargs,
        ForwardState(args, preserve_rng_state),
        recompute_context,
        record_metadata,
        early_stop_enabled(options.early_stop),
        loggers,
        state_hooks,
    )
    completed = False
    token = current_region.set(frame.region()) if frame.observed else None
    # A checkpoint inside a kept span is a region of its own: its ops are not the span's.
    outside_spans = leave_spans() if span_depth() else None
    frame._user_hooks = _compat.user_saved_tensors_hooks()  # Rule 10
    _compat.push_saved_tensors_hooks(frame, frame.unpack_hook())  # Rule 1: the frame packs
    try:
        with forward_context:
            yield
            completed = True
    finally:
        _compat.pop_saved_tensors_hooks()  # Rule 8: also on close() and throw()
        frame._user_hooks = None  # Rule 10
        if token is not None:
            current_region.reset(token)
        if outside_spans is not None:
            exit_span(outside_spans)
    if not completed:
        raise RuntimeError(_MSG_CONTEXT_SUPPRESSED)
    frame.forward_completed = True
    if frame.spans is not None:
        n_holders = len(frame.weak_holders)
        for span in frame.spans:
            if frame.early_stop and span.start >= n_holders:  # NOTE [Kept spans], Rule 3
                span.release()
            elif span.label is not None:  # a watching report counts what is held for the replay
                for held in held_outputs(span):
                    announce_kept(held, span.label, "span output")
    if frame.state.device_initialized_during(preserve_rng_state):
        raise RuntimeError(_MSG_DEVICE_INIT)


def run_generator(
    gen: Generator[None, None, None], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Drive ``gen`` around ``fn(*args, **kwargs)``: what ``checkpoint`` does with it.

    An exception from ``fn`` is thrown into the generator, so the forward context sees it (and
    may not swallow it) and the hooks are popped before the exception leaves this call."""
    next(gen)
    try:
        out = fn(*args, **kwargs)
    except BaseException as error:
        gen.throw(error)
        raise  # not reached: the generator re-raises ``error`` or the suppression error
    for _ in gen:
        internal_error("the frame generator yielded twice")
    return out


_MSG_DEBUG_WITH_CONTEXT_FN = (
    "debug=True is incompatible with non-default context_fn (checkpointing.checkpoint: the "
    "debug report installs its own op loggers as the forward and recompute contexts). Fix: "
    "drop debug=True, or drop context_fn while debugging."
)
_MSG_CONTEXT_SUPPRESSED = (
    "torch.utils.checkpoint: the forward context provided by context_fn suppressed an "
    "exception raised during the checkpointed forward. This is not supported because "
    "checkpoint cannot return a value for a failed forward. Fix: let the context manager's "
    "__exit__ return False/None for exceptions."
)
