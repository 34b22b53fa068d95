"""The recompute mode of selective checkpointing: replays the forward's decisions from the cache.

Owns ``_CachedMode`` (the second context of ``create_selective_checkpoint_contexts``) and the
errors of a recompute that does not match its forward: per op it finds the forward's entry by
(key, call index), hands it out once, or runs the op again where the forward kept nothing; for a
call skipped in the replay it hands out blanks and, from the first on, runs ops through the
replay's taint (Rule 14, in ``skip``). The keys and runners are ``ops``', the entries and their
checks ``cache``'s. Its ``__enter__`` starts bringing the region's offloaded outputs back (NOTE
[Host copies off the critical path], Rule 5).

NOTE [Selective checkpoint cache] (Rule 6, on handing entries out; the package docstring says
where the others live)
  Rule 6. A cached entry is handed out once, then its slot reads "consumed": the cache holds
          nothing after recompute, and a second backward through the region raises "backward an
          extra time". Recompute slots are never consumed, nor are blanks (Rule 14). The
          recompute mode restarts its counters on every ``__enter__``, so a retained graph meets
          that error, not a "not found" one.
          Except for regions whose forward ran under ``split_backward()``: a graph that is
          backwarded in several passes (a zero-bubble pipeline's input-gradient pass, then its
          weight-gradient pass from the same outputs; both unpack every saved tensor of the
          nodes they run, so each pass recomputes) needs the kept entries in every pass. There
          no slot is consumed: each replay takes the same entries (version-checked, Rule 5),
          and they go when the graph is freed (the frame, hence this mode and its cache, dies
          with the graph's last holder), never later. Opt-in, because which backward is the last
          cannot be told while it runs: by default the entries' memory is freed at the first
          recompute, as torch frees it.

Rejected: entering the recompute mode only when the forward kept something: on the benchmark's
W3/W4 (nothing kept there) SAC's overhead would fall from about 0.52/0.57 of torch's to
0.34/0.43, but a region that kept nothing would lose torch's op-sequence check (Rule 3). The two
modes themselves are the floor there: a pair of do-nothing Python modes costs 0.49/0.52 of
torch's SAC overhead, and ours add 0.03-0.05 to that (2026-11-23, CPU time, interleaved).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, Final

import torch

from .. import _compat, _offload
from .._state import span_depth as _span_depth
from .cache import (
    _CONSUMED,
    _Blank,
    _Cache,
    _CacheEntryMutated,
    _CacheMode,
    _Consumed,
    _map_leaves,
    _StaleHostAlias,
)
from .ops import _IGNORED, _INDUCTOR_CODE, Op, _region_key, _runner, _runners
from .skip import _Taint, replay_guarded

_MSG_NOT_CACHED = (
    "{op} invocation index {index} encountered during backward but not found in storage "
    "(selective checkpoint: the recompute ran an op the forward did not run at this point). "
    "This can happen if the operations in the checkpointed region are nondeterministic or "
    "depend on global state that changed between forward and backward. Fix: make the region's "
    "op sequence depend only on its inputs (e.g. no branching on a global flag or on time)."
)
_MSG_EXTRA_BACKWARD = (
    "Trying to backward an extra time. You are only allowed to backward once on any region "
    "computed under selective activation checkpoint (it hands each cached output out once). "
    "Fix: run the forward again before another backward. If the graph is backwarded in "
    "several passes on purpose (retain_graph=True; a zero-bubble pipeline schedule's "
    "input-gradient then weight-gradient pass), run the forward under "
    "checkpointing.split_backward(): the kept outputs then serve every pass and are freed "
    "with the graph."
)
_MSG_MUTATED = (
    "Tensor cached during selective activation checkpoint has been mutated: the output of "
    "{op} (invocation index {index}) was changed in place after the forward cached it, so "
    "recompute would read the changed value. Fix: have the policy recompute this op (or clone "
    "before the in-place op); pass allow_cache_entry_mutation=True only if the change is "
    "harmless for backward."
)


_split_backward: ContextVar[bool] = ContextVar("checkpointing_split_backward", default=False)


@contextlib.contextmanager
def split_backward() -> Iterator[None]:
    """Selective checkpoints whose forward runs in this block keep their cached outputs for
    every backward pass over their graph, until the graph is freed (Rule 6).

    For schedules that backward one graph more than once: ``ScheduleInterleavedZeroBubble``
    and ``ScheduleZBVZeroBubble`` (``torch.distributed.pipelining``) run an input-gradient
    pass with ``retain_graph=True`` and later a weight-gradient pass; ``retain_graph=True``
    backwards in general. Each pass recomputes the region from the same kept outputs. Outside
    this block a region's second backward raises "backward an extra time", as torch's does.

    Memory: the outputs a policy keeps live until the graph is freed rather than until the
    first recompute; recomputed tensors are still freed as soon as they are used.

    Example:
        >>> import functools, torch, checkpointing
        >>> ctx = functools.partial(checkpointing.create_selective_checkpoint_contexts,
        ...                         [torch.ops.aten.mm.default])
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> with checkpointing.split_backward():
        ...     y = checkpointing.checkpoint(lambda a: (a @ w).sin(), x, use_reentrant=False,
        ...                                  context_fn=ctx)
        >>> (gx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        >>> (gw,) = torch.autograd.grad(y.sum(), w)
    """
    token = _split_backward.set(True)
    try:
        yield
    finally:
        _split_backward.reset(token)


class _CachedMode(_CacheMode):
    """Recompute: replays the forward's decisions from the cache (Rules 3-7, 14)."""

    # Rule 4: detach runs as it is; the frame may detach below this mode (NOTE [Nestable
    # checkpoint], Rule 9).
    passes_detach_through: Final = True

    def __init__(self, cache: _Cache, allow_cache_entry_mutation: bool) -> None:
        # No super().__init__(), as in _CachingMode.
        self.cache = cache
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self.replays: dict[object, int] = {}  # per key, the calls replayed so far
        self.taint: _Taint | None = None  # Rule 14: made at this replay's first blank
        # Rule 6: made with the forward (context_fn runs there), so the forward's block decides.
        self.consumes = not _split_backward.get()

    def __enter__(self) -> _CachedMode:
        self.replays.clear()  # Rule 6: every recompute starts from index 0.
        group = self.cache.offload_group
        if group is not None:  # NOTE [Host copies off the critical path], Rule 5
            _offload.begin(group)
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's base is untyped
        taint = self.taint
        if taint is not None:  # Rule 14: the replay's taint ends with it
            self.taint = None
            taint.end()
        group = self.cache.offload_group
        if group is not None:  # NOTE [Host copies off the critical path], Rule 5
            _offload.end(group)

    @_compat.skip_dynamo_in_code  # Rule 11
    def __torch_dispatch__(
        self,
        func: Op,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        op_id = id(func)
        if op_id in _IGNORED.ids:
            return func(*args, **kwargs)
        taint = self.taint  # Rule 14: None unless this replay handed out a blank
        if _span_depth():  # a kept span's op: NOTE [Kept spans], Rule 6
            return func(*args, **kwargs) if taint is None else taint.run(func, args, kwargs)
        key = op_id if func is not _INDUCTOR_CODE else _region_key(func, args)
        replays = self.replays
        index = replays.get(key, 0)
        replays[key] = index + 1
        record = self.cache.records.get(key)
        if record is None:  # a COUNT key: recompute, if the forward got this far (Rule 3)
            if index < self.cache.counts.get(key, 0):
                if taint is not None:
                    return taint.run(func, args, kwargs)
                return (_runners.get(op_id) or _runner(func))(*args, **kwargs)
        elif index < record.calls:
            kept = record.kept
            if kept is None or (slot := kept.get(index)) is None:
                # Rule 3: not kept, so recomputed
                if taint is not None:
                    return taint.run(func, args, kwargs)
                return (_runners.get(op_id) or _runner(func))(*args, **kwargs)
            if isinstance(slot, _Consumed):
                raise RuntimeError(_MSG_EXTRA_BACKWARD)
            if isinstance(slot, _Blank):
                return self._blank(slot, func, index, args, kwargs)
            if self.consumes:  # Rule 6
                kept[index] = _CONSUMED
            try:
                out = slot.take(self.allow_cache_entry_mutation, self.offload_stats, self.consumes)
            except _CacheEntryMutated:
                raise RuntimeError(_MSG_MUTATED.format(op=func, index=index)) from None
            except _StaleHostAlias:
                return func(*args, **kwargs) if taint is None else taint.run(func, args, kwargs)
            if self.consumes:
                return out
            # Rule 6: autograd gives the returned tensor this replay's history, whose saved
            # tensors lead back to the frame, and so to this cache: a kept entry handed out
            # itself would hold its graph alive for good. Each replay gets a fresh alias.
            return _map_leaves(out, torch.Tensor, _compat.detach_sharing_version)
        raise RuntimeError(_MSG_NOT_CACHED.format(op=func, index=index))

    def _blank(
        self, blank: _Blank, func: Op, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Rule 14: fresh tensors for a call skipped in the replay (the slot stays), tainted;
        the op runs instead where what the replay saves would not be checked."""
        taint = self.taint
        if not replay_guarded():
            if taint is not None:
                return taint.run(func, args, kwargs)
            return (_runners.get(id(func)) or _runner(func))(*args, **kwargs)
        if taint is None:
            taint = self.taint = _Taint()
        out = blank.take()
        taint.mark(out, f"{func} (its call #{index} in the region)")
        return out
