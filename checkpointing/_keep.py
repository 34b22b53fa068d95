"""Keep by code: spans of a checkpointed region whose saved tensors are kept, not recomputed.

Owns ``keep(fn, *args, **kwargs)`` and ``keeping()`` (its context-manager and decorator form),
the hooks of a span in forward and the replay side that skips a span. The frame (``_frame``)
owns holders, recompute and early stop; this module only adds a saved-tensors hook on top of the
frame's while a span runs, and tells the replay what to serve in its place. The per-span record
the frame holds (``Span``, its held outputs) is ``_kept_span``'s, below both; what is known of
a span's arguments (their views, the write check) is ``_kept_span_args``'; tensors a span keeps
in host memory are ``_kept_span_offload``'s. This module imports the frame; the frame never
imports it.

NOTE [Kept spans]
  Rule 1. A span belongs to the checkpoint whose frame is the top saved-tensors hook when it
          starts (NOTE [Nestable checkpoint], Rule 1). With anything else on top (the user's
          hooks, the scope, torch's checkpoint, an outer span) the span is a plain call: a span
          inside a span is inert, and outside any checkpoint ``keep(fn, x)`` is ``fn(x)``.
  Rule 2. While a span runs in forward, a tensor it saves that is one of its tensor arguments,
          or a view of one, goes to the frame like any saved tensor (a holder, recomputed): the
          replay reaches the span with those arguments in hand and fills the holder from them
          (the view rebuilt with ``as_strided``). So keeping a matmul costs its output, as a
          selective policy keeping it does. Every other tensor the span saves is kept: a
          detached alias and its version, compared when backward unpacks it (an in-place change
          since then raises autograd's error instead of giving a wrong gradient).
  Rule 3. The frame holds each span's outputs for the replay, which is served detached aliases
          (``requires_grad`` as in forward) instead of running ``fn``: code after the span
          needs no annotation. An output changed in place after the span raises at replay.
          Outputs that are arguments or views of them are rebuilt from the replay's arguments,
          not held. With early stop, a span the replay cannot reach (no holder was made at or
          after its start) drops its outputs when the forward ends; so a watching report is
          told what the frame holds then, not when the span returns.
  Rule 4. With ``preserve_rng_state`` the CPU generator (and those of the devices the frame
          preserves) is read before and after the span; only a span that drew keeps its after
          states, and the replay sets them once it has skipped the span. Draws after a span
          replay identically whether or not it drew.
  Rule 5. ``recompute_state_hooks``: each hook is snapshotted when a span ends and restored
          after the replay skips it (the frame restores the entry snapshots, NOTE [Nestable
          checkpoint], Rule 12).
  Rule 6. Ops inside a span are invisible to selective checkpointing's modes, in forward and in
          the replay alike (neither cached nor counted), so a policy and spans compose. What
          the replay does on a skipped span's behalf (views of its arguments rebuilt with
          ``as_strided``, its outputs served) runs inside the span's marker too: the forward
          never ran those ops outside a span. A checkpoint whose recompute context does not
          say ``honours_kept_spans`` (torch's selective contexts, a user's mode: NOTE
          [Recompute context protocol]) makes every span a plain call, said once by a warning:
          skipping ops a foreign recompute context counted would desynchronise it. One that
          says ``honours_kept_blocks = False`` (the planner's draws modes, which answer draws
          without drawing) makes ``with keeping():`` blocks plain calls, silently.
  Rule 7. ``with keeping():`` cannot skip its body (Python runs a ``with`` block whatever its
          context manager does). In forward everything the block saves is kept; the replay
          runs the block again under a hook that stores nothing, and early stop ends the replay
          before a block that nothing after it needs. To skip the work as well, give the span
          as a function: ``keep(fn, *args)`` or ``@keeping()``.
  Rule 8. Under ``torch.compile`` a span's traced nodes become the partitioner's "must save"
          (NOTE [Compiled regions], Rule 6), whatever the region's ``context_fn``; an offload
          policy is kept on the device and said once. A ``with keeping():`` block is not a
          function the compiler can be handed: there it is part of the region, recomputed.
  Rule 9. A span given as a function must not write its tensor arguments in place: the replay
          skips it, and gets arguments made in the region afresh, unwritten, so what reads them
          after the span (and the holders Rule 2 fills from them) would see the values from
          before the write. The forward refuses such a span when it returns, by the arguments'
          version counters (every in-place write through an argument, a view of it or a
          detached alias, metadata writes included, moves its counter; autograd's own checks
          rest on the same counters). Refusing is provably correct; replaying the write is not:
          the replay would need a copy of what the span wrote (the argument's bytes), could not
          redo a write reaching past the argument (an ``as_strided`` view) nor its autograd
          effect (an argument that starts requiring grad), and would write again into an
          argument that is the same tensor in the replay (a buffer), moving a version autograd
          checks. Writes to tensors a span does not take as arguments are not seen: for state
          made outside the region (a module's buffers, batch norm's running statistics) that is
          right, the write happens once, in forward; a tensor made in the region must reach a
          span that writes it as an argument. A ``with keeping():`` block replays its writes.
  Rule 10. A ``keeping`` instance holds no state of its use: the blocks open in a thread or
          asyncio task are a stack in a ``ContextVar``, so one instance may be shared by threads
          and nested in itself, as ``torch.no_grad()`` may. A block ends in the thread or task
          that began it, innermost first; ``__exit__`` anywhere else says so.
  Rule 11. A pack hook on top that says ``watches_kept_spans`` (the planner's profile, which
          runs the model without checkpointing) is handed each span as ``kept_span(fn, args,
          kwargs)`` and runs it: the profile must number, price and offer the ops outside
          spans only, as the selective modes see them under Rule 6, or a plan's op keys would
          name other ops at run time (NOTE [Planner measure], Rule M14). ``with keeping():``
          blocks are plain calls there, told to the watch (``kept_block``): the planner runs
          a region holding one plainly, where what it keeps is what autograd saves.

Rejected: a dispatch mode recording each op's outputs (what selective checkpointing does, ~12
us per op); marking saved tensors through their autograd nodes' sequence numbers (a view of an
argument made inside the span would be kept, and a mask made inside has no node).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Final, TypeVar

import torch

from . import _compat, _compiled, _offload
from ._compression import Compress
from ._errors import CheckpointError, internal_error
from ._events import announce
from ._frame import NULL_CONTEXT, Frame
from ._hook_marks import RecomputePack, replaying_pack, watches_kept_spans
from ._host_copy import HostCopy
from ._kept_span import Held, Span, held_outputs, hold_outputs, map_tensors
from ._kept_span_args import (
    ArgumentVersions,
    rebuild,
    recipe_for,
    storage_ranges,
    tensor_leaves,
)
from ._kept_span_compress import (
    KeptCompressed,
    RefusingExactOps,
    compress_kept,
    restore_compressed,
)
from ._kept_span_offload import offload_kept, restore
from ._offload import OffloadStats
from ._recompute_context import declared
from ._selective import CheckpointPolicy
from ._state import enter_span, exit_span, set_device_states

__all__ = ["held_outputs", "keep", "keeping", "replay_span"]  # held_outputs: for reports

_F = TypeVar("_F", bound=Callable[..., Any])

_MSG_NOT_CALLABLE = (
    "checkpointing.keep: expected a callable as the first argument (the span to keep), got "
    "{type_name}. Fix: keep(fn, *inputs), e.g. keep(torch.matmul, x, w)."
)
_MSG_POLICY = (
    "checkpointing.keeping: policy must be CheckpointPolicy.MUST_SAVE or PREFER_SAVE (keep on "
    "the device) or MUST_CPU_OFFLOAD or PREFER_CPU_OFFLOAD (keep in host memory), got "
    "{policy!r}. Fix: for a span to be recomputed, do not mark it: the checkpoint recomputes "
    "everything else."
)
_MSG_COMPRESS = (
    "checkpointing.keeping: compress must be a checkpointing.Compress or None, got {got!r} of "
    "type {type}. Fix: keeping(compress=Compress('bf16')), or Compress('fp8', scale='row')."
)
_MSG_COMPRESS_POLICY = (
    "checkpointing.keeping: compress={how!r} keeps the span's tensors compressed on the device, "
    "and policy={policy!r} asks to keep them in host memory. Fix: to do both, pass "
    "compress=Compress(..., offload=True) and leave policy out."
)
_MSG_NAME = (
    "checkpointing.keeping: name must be a non-empty str, got {name!r}. Fix: keeping('attn')."
)
_MSG_FOREIGN_CONTEXT = (
    "checkpointing.keep: the checkpoint around this span has a context_fn that is not "
    "checkpointing's ({what}); skipping the span in the replay would desynchronise its "
    "recompute context, so the span is recomputed with the rest of the region. Fix: build "
    "selective policies with checkpointing.create_selective_checkpoint_contexts or "
    "checkpointing.policies.as_context_fn."
)
_MSG_REPLAY_MISMATCH = (
    "checkpointing.keep: the replay of {region} reached {found}, but the forward's span number "
    "{index} was {expected}. The region must take the same path in replay as in forward. Fix: "
    "make the control flow around keep(...) depend only on the region's inputs (not on "
    "is_recomputing(), globals or random numbers drawn outside the region)."
)
_MSG_OUTPUT_MUTATED = (
    "checkpointing.keep: an output of the span {name} in {region} was modified in place "
    "after the span returned it (version {then} -> {now}); the replay needs it as the span "
    "returned it. Fix: make the in-place operation out of place (e.g. `y = y.relu()` instead "
    "of `y.relu_()`), or move it inside the span."
)
_MSG_SAVED_MUTATED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor saved by the kept span {name} is at version {now}; expected version "
    "{then} instead. (checkpointing.keep keeps what a span saves for backward. Fix: make the "
    "in-place operation after the span out of place, or clone the tensor inside the span.)"
)

_warned_foreign: set[str] = set()


class _Kept:
    """A tensor a span keeps for backward: a detached alias and the version it was saved at."""

    __slots__ = ("alias", "counted", "version")

    def __init__(self, alias: torch.Tensor, version: int, counted: bool = False) -> None:
        self.alias = alias
        self.version = version
        self.counted = counted  # a host tensor under an offload policy: counted as offloaded


def _rng_states(frame: Frame) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    state = frame.state
    cpu = torch.get_rng_state() if state.cpu_rng is not None else None
    device: list[torch.Tensor] = []
    if state.device_rng:
        module = getattr(torch, state.device_type)
        device = [module.get_rng_state(index) for index in state.device_ids]
    return cpu, device


def _same_states(
    a: tuple[torch.Tensor | None, list[torch.Tensor]],
    b: tuple[torch.Tensor | None, list[torch.Tensor]],
) -> bool:
    if (a[0] is None) != (b[0] is None):
        return False
    if (
        a[0] is not None
        and b[0] is not None
        and _compat.storage_bytes(a[0]) != _compat.storage_bytes(b[0])
    ):
        return False
    return all(
        _compat.storage_bytes(x) == _compat.storage_bytes(y)
        for x, y in zip(a[1], b[1], strict=True)
    )


class _SpanHooks:
    """The saved-tensors hook pair of one span in forward (Rule 2): the object itself packs,
    and is checkpoint-internal (NOTE [Nestable checkpoint], Rule 10) so that a checkpoint or a
    selective policy inside the span sees the user's hooks, not ours. ``frame`` and
    ``region_label`` (the span's name in reports) are marks of its unpack hook (``_hook_marks``):
    ``saved_tensors_report`` reads them from the graph."""

    __slots__ = (
        "_user_hooks",
        "compress",
        "frame",
        "frame_unpack",
        "leaves",
        "offload",
        "ranges",
        "span",
    )
    _checkpoint_internal: Final = True

    def __init__(
        self,
        frame: Frame,
        span: Span,
        leaves: list[torch.Tensor],
        offload: OffloadStats | bool,
        compress: Compress | None = None,
    ) -> None:
        self.frame = frame
        self.span = span
        self.leaves = leaves
        self.ranges = storage_ranges(leaves) if leaves else []
        self.offload = offload
        self.compress = compress  # NOTE [Compressed spans]
        self.frame_unpack = frame.unpack_hook()
        self._user_hooks = frame._user_hooks

    @property
    def region_label(self) -> str:
        """How reports name the span; worked out when asked, not per span."""
        return f"keep({self.span.name}) in {self.frame.region()}"

    def __call__(self, x: torch.Tensor) -> object:
        return self.pack(x)

    def pack(self, x: torch.Tensor) -> object:
        if self.leaves:
            recipe = recipe_for(x, self.leaves, self.ranges)
            if recipe is not None:
                self.span.routed.append(recipe)
                return self.frame(x)  # a holder: recomputed, filled by the replay
        alias = x.detach()
        offload = self.offload
        parameter = x.is_leaf and x.requires_grad
        if self.compress is not None and not parameter:  # NOTE [Compressed spans], Rule 1
            kept = compress_kept(alias, self.compress, offload, self)
            if kept is not None:
                if self.frame.observed:
                    on_host = self.compress.offload
                    announce(
                        x,
                        self.region_label,
                        "offloaded" if on_host else "compressed",
                        kept.packed.nbytes,
                    )
                return kept
        offloading = offload is not False and not parameter
        if self.frame.observed:
            announce(x, self.region_label, "offloaded" if offloading else "saved")
        if offloading:
            if alias.device.type != "cpu" or _offload.claims(alias):
                return offload_kept(alias, offload, self)
            if isinstance(offload, OffloadStats):  # a host tensor stays, and is counted
                offload._count_offload(alias.nbytes)
                return _Kept(alias, alias._version, True)
        return _Kept(alias, alias._version)

    def unpack(self, packed: object) -> torch.Tensor:
        if type(packed) is _Kept:
            now = packed.alias._version
            if now != packed.version:
                raise RuntimeError(
                    _MSG_SAVED_MUTATED.format(name=self.span.name, now=now, then=packed.version)
                )
            if packed.counted and isinstance(self.offload, OffloadStats):
                self.offload._count_restore(packed.alias.nbytes)
            return packed.alias
        if type(packed) is HostCopy:
            return restore(packed, self.offload)
        if type(packed) is KeptCompressed:
            return restore_compressed(packed, self.offload)
        return self.frame_unpack(packed)  # type: ignore[arg-type]  # a holder of the frame


def _discard(x: torch.Tensor) -> None:
    return None


def _never_unpacked(packed: object) -> torch.Tensor:
    raise CheckpointError(
        "checkpointing.keeping: a tensor saved while a `with keeping():` block was replayed "
        "was unpacked; the forward kept its own. Fix: call backward outside the block."
    )


def _span_name(fn: object, name: str | None) -> str:
    if name is not None:
        return name
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def _foreign_context(frame: Frame, block: bool = False) -> bool:
    """Rule 6: a recompute context we cannot keep in step with a skipped span (or block)."""
    context = frame.recompute_context
    answers = declared(context)  # NOTE [Recompute context protocol]
    if context is NULL_CONTEXT or answers.honours_kept_spans:
        return block and not answers.honours_kept_blocks
    what = type(context).__name__
    if what not in _warned_foreign:
        _warned_foreign.add(what)
        warnings.warn(_MSG_FOREIGN_CONTEXT.format(what=what), UserWarning, stacklevel=4)
    return True


def _frame_on_top() -> tuple[str, Any]:
    """Which phase a span starting now is in (Rule 1): ("forward", frame), ("replay", pack of
    the frame's recompute), ("watched", a watching pack hook: Rule 11), or ("plain", None)."""
    hooks = _compat.top_saved_tensors_hooks()
    if hooks is None:
        return "plain", None
    pack = hooks[0]
    if type(pack) is Frame:
        return "forward", pack
    if replaying_pack(pack) is not None:
        return "replay", pack
    if watches_kept_spans(pack):
        return "watched", pack
    return "plain", None


def keep(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` and keep what it saves for backward: inside a checkpoint the
    replay skips it and is served its outputs.

    The mirror of ``checkpoint(fn, *args)``: inside any non-reentrant checkpoint (``checkpoint``,
    the decorator, ``checkpoint_module``, the wrappers, ``checkpoint_sequential``, a plan) the
    span runs once; the tensors it saves for backward are kept, except its own arguments (and
    views of them), which are recomputed like the rest of the region; the replay does not run
    ``fn`` and code after it reads the forward's outputs. Random draws after the span replay
    identically, early stop still ends the replay early, and no dispatch mode is involved.
    Outside any checkpoint it is ``fn(*args, **kwargs)``. A span that writes one of its tensor
    arguments in place is refused (the replay, which skips it, could not write it again).

    Example:
        >>> import torch, checkpointing
        >>> w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        >>> def block(x):
        ...     h = checkpointing.keep(torch.matmul, x, w1)  # kept: not recomputed
        ...     return (h.relu() @ w2).tanh()                  # recomputed in backward
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> checkpointing.checkpoint(block, x, use_reentrant=False).sum().backward()
    """
    if not callable(fn):
        raise TypeError(_MSG_NOT_CALLABLE.format(type_name=type(fn).__name__))
    return _run_span(fn, args, kwargs, None, False)


def _run_span(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str | None,
    offload: OffloadStats | bool,
    compress: Compress | None = None,
) -> Any:
    if _compiled.compiling():
        if offload is not False:
            _compiled.say_once("kept offload")  # the compiler keeps it on the device
        if compress is not None:
            _compiled.say_once("compress")  # nor does it compress
        return _compiled.kept_region(fn, args, kwargs)
    phase, owner = _frame_on_top()
    if phase == "forward":
        if _foreign_context(owner):
            return fn(*args, **kwargs)
        return _forward_span(owner, fn, args, kwargs, _span_name(fn, name), offload, compress)
    if phase == "replay":
        if _foreign_context(owner.replaying):
            return fn(*args, **kwargs)
        return replay_span(owner, args, kwargs, _span_name(fn, name))
    if phase == "watched":  # Rule 11: the planner's profile runs it
        return owner.kept_span(fn, args, kwargs)
    return fn(*args, **kwargs)


def _forward_span(
    frame: Frame,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
    offload: OffloadStats | bool,
    compress: Compress | None = None,
) -> Any:
    span = Span(name, len(frame.weak_holders))
    leaves = tensor_leaves(args, kwargs)
    hooks = _SpanHooks(frame, span, leaves, offload, compress)
    versions = ArgumentVersions(leaves) if leaves else None
    before = _rng_states(frame) if frame.state.preserve_rng_state else None
    _compat.push_saved_tensors_hooks(hooks, hooks.unpack)
    token = enter_span()
    try:
        if compress is None:
            outputs = fn(*args, **kwargs)
        else:
            with RefusingExactOps(name):  # NOTE [Compressed spans], Rule 2
                outputs = fn(*args, **kwargs)
    finally:
        exit_span(token)
        _compat.pop_saved_tensors_hooks()
        hooks.leaves = []  # the graph holds the unpack hook: not the span's arguments
        hooks._user_hooks = None  # Rule 10's mark lives while the hook is on the stack
    if versions is not None:  # See NOTE [Kept spans], Rule 9: the replay cannot write them again
        versions.refuse_writes(leaves, name, frame.region)
    if before is not None:
        after = _rng_states(frame)
        if not _same_states(before, after):  # Rule 4: only a span that drew
            span.rng_after = after
    if frame.state_hooks:
        span.state_after = tuple(hook.snapshot() for hook in frame.state_hooks)  # Rule 5
    hold_outputs(span, outputs, leaves, hooks.ranges)
    frame.add_span(span)
    if frame.observed:  # the frame announces what it holds once its forward ends (Rule 3)
        span.label = hooks.region_label
    return outputs


def replay_span(
    pack: RecomputePack, args: tuple[Any, ...], kwargs: dict[str, Any], name: str
) -> Any:
    """The replay reached a span: fill its argument holders, skip it, serve its outputs. What
    it does on the span's behalf runs inside the span's marker, as the span's own ops did in
    forward (Rule 6)."""
    frame: Frame = pack.replaying
    index = pack.spans_seen
    spans = frame.spans or []
    if index >= len(spans) or spans[index].name != name:
        expected = f"the span {spans[index].name}" if index < len(spans) else "no span"
        raise CheckpointError(
            _MSG_REPLAY_MISMATCH.format(
                region=frame.region(), found=f"the span {name}", index=index, expected=expected
            )
        )
    pack.spans_seen = index + 1
    span = spans[index]
    leaves = tensor_leaves(args, kwargs)
    token = enter_span()
    try:
        for recipe in span.routed:  # may end the replay here (early stop)
            pack(rebuild(recipe, leaves))
        _restore_after(frame, span)
        return map_tensors(span.outputs, functools.partial(_serve, frame, span, leaves), Held)
    finally:
        exit_span(token)


def _restore_after(frame: Frame, span: Span) -> None:
    """Put the generators (Rule 4) and the user's state (Rule 5) where the span left them."""
    if span.rng_after is not None:  # Rule 4
        cpu, device = span.rng_after
        if cpu is not None:
            torch.set_rng_state(cpu)
        if device:
            set_device_states(frame.state.device_ids, device, device_type=frame.state.device_type)
    if span.state_after is not None and frame.state_hooks:  # Rule 5
        for hook, snapshot in zip(frame.state_hooks, span.state_after, strict=True):
            hook.restore(snapshot)
    if span.released:
        internal_error(
            f"the replay of {frame.region()} reached the span {span.name}, whose outputs the "
            "forward released as unreachable"
        )


def _serve(frame: Frame, span: Span, leaves: list[torch.Tensor], held: Held) -> torch.Tensor:
    """One output of a skipped span, as the replay is served it (Rule 3)."""
    if held.recipe is not None:
        tensor = rebuild(held.recipe, leaves).detach()
    else:
        alias = held.alias
        if alias is None:
            internal_error("a held output with neither an alias nor a recipe")
        if alias._version != held.version:
            raise CheckpointError(
                _MSG_OUTPUT_MUTATED.format(
                    name=span.name, region=frame.region(), then=held.version, now=alias._version
                )
            )
        tensor = alias.detach()
    return tensor.requires_grad_(True) if held.requires_grad else tensor


class keeping:  # a context manager named like a function, as torch's no_grad
    """Keep what a span saves for backward: ``with keeping():`` around a block, or
    ``@keeping()`` on a function (then the replay skips it, as ``keep``).

    Args:
        name: how reports and errors name the span (default: the function's name, or
            "block").
        policy: ``CheckpointPolicy.MUST_SAVE`` (default) or ``PREFER_SAVE`` keep the tensors on
            their device; ``MUST_CPU_OFFLOAD`` or ``PREFER_CPU_OFFLOAD`` keep them in host memory
            (a host tensor stays where it is).
        offload_stats: counts the bytes offloaded and restored (offload policies only).
        compress: a ``Compress`` to keep the span's floating-point tensors compressed (NOTE
            [Compressed saves]); ``Compress(..., offload=True)`` also moves them to host
            memory. Integer and boolean tensors stay exact; an op whose backward compares its
            input with its result (``max``, ``amax``, ``median``) inside the span is refused.

    As a ``with`` block the body cannot be skipped (Python runs a ``with`` block whatever its
    context manager does): the replay runs it again but stores nothing; everything it saved in
    forward is kept, its inputs included. Give the span as a function to skip its work in the
    replay and recompute its inputs. One instance may be shared by threads and nested in itself,
    as ``torch.no_grad()`` can.

    Example:
        >>> import torch, checkpointing
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> @checkpointing.keeping("proj")
        ... def project(x):
        ...     return x @ w
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = checkpointing.checkpoint(lambda t: project(t.sin()).relu(), x, use_reentrant=False)
        >>> y.sum().backward()
    """

    __slots__ = ("compress", "name", "offload")

    def __init__(
        self,
        name: str | None = None,
        *,
        policy: CheckpointPolicy = CheckpointPolicy.MUST_SAVE,
        offload_stats: OffloadStats | None = None,
        compress: Compress | None = None,
    ) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(_MSG_NAME.format(name=name))
        if compress is not None and not isinstance(compress, Compress):
            raise TypeError(_MSG_COMPRESS.format(got=compress, type=type(compress).__name__))
        on_host = compress is not None and compress.offload
        if policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE) and not on_host:
            self.offload: OffloadStats | bool = False
        elif policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE) or (
            compress is None
            and policy in (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)
        ):
            self.offload = offload_stats if offload_stats is not None else True
        elif compress is not None:
            raise ValueError(_MSG_COMPRESS_POLICY.format(policy=policy, how=compress))
        else:
            raise ValueError(_MSG_POLICY.format(policy=policy))
        self.name = name
        self.compress = compress

    def __call__(self, fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(_MSG_NOT_CALLABLE.format(type_name=type(fn).__name__))
        name, offload, compress = self.name, self.offload, self.compress

        @functools.wraps(fn)
        def kept(*args: Any, **kwargs: Any) -> Any:
            return _run_span(fn, args, kwargs, name, offload, compress)

        return kept  # type: ignore[return-value]  # same signature as fn

    def __enter__(self) -> None:
        if _compiled.compiling():
            return  # Rule 8: part of the region; nothing to end
        end = _enter_block(self.name or "block", self.offload, self.compress)
        _open_blocks.set((*_open_blocks.get(), (self, end)))  # Rule 10

    def __exit__(self, *exc: object) -> None:
        if _compiled.compiling():
            return
        blocks = _open_blocks.get()
        if not blocks or blocks[-1][0] is not self:
            raise RuntimeError(_MSG_EXIT_UNMATCHED.format(name=self.name or "block"))
        _open_blocks.set(blocks[:-1])
        blocks[-1][1]()


# Rule 10: the blocks open in this thread or asyncio task, innermost last, each with what ends
# it; a ``keeping`` instance holds no state of its own use, so one may be shared.
_open_blocks: ContextVar[tuple[tuple[keeping, Callable[[], None]], ...]] = ContextVar(
    "checkpointing_open_keeping_blocks", default=()
)
_MSG_EXIT_UNMATCHED = (
    "checkpointing.keeping: __exit__ of the block {name!r} was called, but the innermost "
    "`with keeping():` block open in this thread (or asyncio task) is not that instance's. "
    "A block must end in the thread or task that began it, innermost first. Fix: use "
    "`with keeping(...):` rather than calling __enter__/__exit__ by hand."
)


def _enter_block(
    name: str, offload: OffloadStats | bool, compress: Compress | None = None
) -> Callable[[], None]:
    """Start a ``with keeping():`` block (Rule 7); returns what ends it."""
    phase, owner = _frame_on_top()
    if phase == "watched":
        owner.kept_block(name)  # Rule 11: the planner's profile plans the region plainly
    if phase in ("plain", "watched") or _foreign_context(
        owner if phase == "forward" else owner.replaying, block=True
    ):
        return _nothing
    if phase == "replay":
        _compat.push_saved_tensors_hooks(_discard, _never_unpacked)
        token = enter_span()

        def end_replay() -> None:
            exit_span(token)
            _compat.pop_saved_tensors_hooks()

        return end_replay
    span = Span(name, len(owner.weak_holders))
    hooks = _SpanHooks(owner, span, [], offload, compress)
    _compat.push_saved_tensors_hooks(hooks, hooks.unpack)
    token = enter_span()
    refusing = None if compress is None else RefusingExactOps(name)  # NOTE [Compressed spans]
    if refusing is not None:
        refusing.__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped

    def end_forward() -> None:
        if refusing is not None:
            refusing.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # untyped base
        exit_span(token)
        _compat.pop_saved_tensors_hooks()
        hooks._user_hooks = None

    return end_forward


def _nothing() -> None:
    return None
