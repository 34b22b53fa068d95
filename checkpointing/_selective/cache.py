"""What a selectively checkpointed region keeps: its cache, the entries in it, host copies.

Owns the cache entries (``_Saved``, a detached alias; ``_Packed``, a saved
output through the user's saved-tensors hooks; ``_HostAlias`` and ``_HostCopy`` for offload;
``_Tree`` for an op that returned a container; ``_Blank``, the metadata of a call skipped in the
replay, Rule 14) and the consumed slot; a region's ``_Cache`` of per-key ``_OpRecord``s;
``_CacheMode``, the base of the pair of modes that share one; and ``_keep``, which makes the
entry for an output under an action.
Deciding what to keep is ``forward``'s job, handing entries out ``recompute``'s; what offload
counts (``OffloadStats``) is the offload engine's (``_offload``), which never imports this.

NOTE [Selective checkpoint cache] (Rules 3, 5, 7 and 13, on what the cache holds; the package
docstring says where the others live)
  Rule 3. Entries are keyed by op (an inductor-compiled region by its callable) and by that
          key's call index within the region. Recompute walks the same (key, index) sequence;
          a step it cannot find is an error naming the op and the index. Only kept calls have
          an entry: a key's forward call count marks every other index below it "recompute",
          so an op that is recomputed costs one counter, not an entry per call, and the check
          is torch's (a key the forward never called, or called fewer times, is an error).
  Rule 5. A saved entry is a detached alias sharing the output's version counter, plus the
          version seen when it was cached; handing it out after an in-place change raises
          unless ``allow_cache_entry_mutation=True``.
  Rule 7. Offload (``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``; torch recomputes these in
          eager mode): a device output is copied to host memory and only the host copy is
          cached; recompute gets a fresh tensor on the original device with the original dtype,
          layout and (dense) strides. On CUDA the copies run off the compute stream and restores
          are prefetched when the recompute starts (NOTE [Host copies off the critical path]);
          other devices copy the plain way. The copy is a snapshot: an in-place change of the
          output before its copy was seen done makes it stale, and recompute runs the op
          instead. A host tensor is kept as an alias, like save; if it was changed in place
          since, recompute runs the op instead (torch's own treatment of these values), never
          raising. ``OffloadStats`` counts both directions, and the restores that waited.
  Rule 13. What a policy saves is held by the cache, not by autograd, so the user's
          saved-tensors hooks (``save_on_cpu`` and the like) never see it unless the checkpoint
          says ``respect_saved_tensors_hooks=True``: then each saved output goes through the
          user's pack hook in forward and its unpack hook at recompute (the user's hooks are
          found past our frame's and torch's, NOTE [Nestable checkpoint], Rule 10). ``None``,
          the default, keeps them out and warns (``FutureWarning``, torch 2.14's) when such
          hooks are active; ``False`` keeps them out silently. Offloaded outputs are in host
          memory already and never go through them.

Rejected: wrapping every output through a pytree map like torch (a tree walk per op); single
tensors, the common case, are wrapped directly and only containers are mapped, by ``_map_leaves``
rather than torch's ``tree_map``, which leaves 7 cyclic objects per call: garbage made per op
wakes the cyclic collector mid-step (a Llama attention layer under ``save_matmuls()`` left 14 per
call, a map to keep and one to take).
Keeping the device tensor next to its host copy to version-check it until recompute (it would
keep the memory offload frees); it is kept only while its copy is in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeAlias

import torch

from .. import _compat, _offload
from .._compat import TorchDispatchMode
from .._compiled import say_once
from .._compression import Compress, Packed, check_packable, pack, unpack
from .._errors import internal_error
from .._events import announce
from .._host_copy import HostCopy
from .._offload import OffloadStats
from .._recompute_context import DeclaredContext
from .ops import _OpFacts
from .policy import _Action, _Keep, _OpPlan

_REGION: Final = "sac"
# Whether torch.compile traces (also in AOTAutograd's passes where no proxy mode is active).
_compile_tracing: Final = torch.compiler.is_compiling
_OFFLOAD: Final = _Action.OFFLOAD


# --- Cache entries ----------------------------------------------------------------------------


class _CacheEntryMutated(Exception):
    """A saved alias changed in place after it was cached (becomes the user-facing error)."""


class _StaleHostAlias(Exception):
    """A host tensor kept for offload changed in place; recompute runs the op (Rule 7)."""


class _Saved:
    """A saved output: a detached alias sharing the version counter, and that version (Rule 5)."""

    __slots__ = ("alias", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.alias = _compat.detach_sharing_version(tensor)
        self.version = tensor._version

    def take(self, allow_mutation: bool, stats: OffloadStats, consume: bool = True) -> torch.Tensor:
        if not allow_mutation and self.alias._version != self.version:
            raise _CacheEntryMutated
        return self.alias


class _Packed:
    """A saved output routed through the user's saved-tensors hooks (Rule 13): what their pack
    hook returned, their unpack hook, and the version check of Rule 5 when that is a tensor."""

    __slots__ = ("packed", "unpack", "version")

    def __init__(self, tensor: torch.Tensor, hooks: _compat.HookPair) -> None:
        pack, self.unpack = hooks
        self.packed = pack(_compat.detach_sharing_version(tensor))
        packed = self.packed
        self.version = packed._version if isinstance(packed, torch.Tensor) else None

    def take(self, allow_mutation: bool, stats: OffloadStats, consume: bool = True) -> Any:
        version = self.version
        if version is not None and not allow_mutation and self.packed._version != version:
            raise _CacheEntryMutated
        return self.unpack(self.packed)


class _HostAlias:
    """An offloaded output that already lives in host memory: kept in place (Rule 7)."""

    __slots__ = ("alias", "nbytes", "version")

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        self.alias = _compat.detach_sharing_version(tensor)
        self.version = tensor._version
        self.nbytes = nbytes

    def take(self, allow_mutation: bool, stats: OffloadStats, consume: bool = True) -> torch.Tensor:
        if self.alias._version != self.version:
            raise _StaleHostAlias
        stats._count_restore(self.nbytes)
        return self.alias


class _HostCopy(HostCopy):
    """An offloaded device output: only its host copy is kept (Rule 7; the record is
    ``_host_copy``'s, shared with kept spans and ``offload_wrapper``)."""

    __slots__ = ()

    def take(self, allow_mutation: bool, stats: OffloadStats, consume: bool = True) -> torch.Tensor:
        try:
            # NOTE [Selective checkpoint cache], Rule 6: under split_backward() the host copy
            # stays for the next pass (``consume=False``), freed with the graph.
            return self.restore(stats, consume=consume)
        except _offload.Stale:
            raise _StaleHostAlias from None


class _Shrunk:
    """A compressed output (NOTE [Compressed saves]): the packed tensor, and with ``offload``
    the host copy of its payload and scale (one buffer, Rule 6), which a restore brings back
    before unpacking."""

    __slots__ = ("host", "packed")

    def __init__(self, packed: Packed, host: _HostAlias | _HostCopy | None) -> None:
        self.packed = packed
        self.host = host

    def take(self, allow_mutation: bool, stats: OffloadStats, consume: bool = True) -> torch.Tensor:
        host = self.host
        payload = None if host is None else host.take(allow_mutation, stats, consume)
        return unpack(self.packed, payload)


class _Tree:
    """Cached outputs of an op that returned a container: the container with each tensor
    replaced by its entry (other leaves kept as they are)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def take(self, allow_mutation: bool, stats: OffloadStats, consume: bool = True) -> Any:
        return _map_leaves(self.value, _LEAVES, _take, allow_mutation, stats, consume)


def _take(entry: _Leaf, allow_mutation: bool, stats: OffloadStats, consume: bool) -> Any:
    return entry.take(allow_mutation, stats, consume)


def _map_leaves(
    value: Any, leaf: type | tuple[type, ...], fn: Callable[..., Any], *args: Any
) -> Any:
    """``value`` with each instance of ``leaf`` replaced by ``fn(it, *args)``, in tuples and
    lists rebuilt (nested); anything else is kept as it is. An op's output nests nothing else:
    the dispatcher hands modes plain tuples and lists (``torch.return_types`` are made above
    it). No closure and no tree spec: nothing cyclic is left behind (the module docstring)."""
    if isinstance(value, leaf):
        return fn(value, *args)
    kind = type(value)
    if kind is tuple:
        return tuple([_map_leaves(item, leaf, fn, *args) for item in value])
    if kind is list:
        return [_map_leaves(item, leaf, fn, *args) for item in value]
    return value


class _Spec:
    """What a blank is made from: one output tensor's size, stride, dtype and device."""

    __slots__ = ("device", "dtype", "size", "stride")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.device = tensor.device


def _fresh(spec: _Spec) -> torch.Tensor:
    return torch.empty_strided(spec.size, spec.stride, dtype=spec.dtype, device=spec.device)


class _Blank:
    """The outputs of a call answered ``SKIP_IN_REPLAY`` (NOTE [Selective checkpoint cache],
    Rule 14, in ``skip``): the output with each tensor replaced by its ``_Spec`` (other leaves
    kept as they are). Handing it out makes fresh uninitialized tensors; it holds no tensor, so
    it is never consumed."""

    __slots__ = ("value",)

    def __init__(self, out: Any) -> None:
        self.value = _map_leaves(out, torch.Tensor, _Spec)

    def take(self) -> Any:
        return _map_leaves(self.value, _Spec, _fresh)


_Leaf: TypeAlias = _Saved | _Packed | _HostAlias | _HostCopy | _Shrunk
_LEAVES: Final = (_Saved, _Packed, _HostAlias, _HostCopy, _Shrunk)
_Entry: TypeAlias = _Leaf | _Tree | _Blank


class _Consumed:
    """The slot of an entry already handed out to a recompute (Rule 6)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<consumed>"


_CONSUMED: Final = _Consumed()

_Slot: TypeAlias = _Entry | _Consumed


class _OpRecord:
    """One cache key of a region (Rule 3): how often the forward called it and the entries
    kept, by call index (kept calls only); with the op's plan and facts, so that later calls
    in the region look nothing else up. Keys of the COUNT plan have a bare count instead."""

    __slots__ = ("action", "calls", "draw_rule", "effect", "kept", "plan", "pure")

    def __init__(self, op_plan: _OpPlan, facts: _OpFacts) -> None:
        self.calls = 0
        self.kept: dict[int, _Slot] | None = None
        self.plan, self.action = op_plan  # the action of an op-only answer (unused by ASK)
        _, self.draw_rule, self.pure, self.effect = facts

    def keep(self, index: int, entry: _Entry) -> None:
        kept = self.kept
        if kept is None:
            kept = self.kept = {}
        kept[index] = entry


class _Cache:
    """A region's cache, shared by its two modes (Rule 3): by key, a record, or for keys of
    the COUNT plan only the forward's call count; the pair's ``OffloadStats``; and the group of
    its offload transfers, made at its first (NOTE [Host copies off the critical path])."""

    __slots__ = ("_stats", "counts", "offload_group", "records")

    def __init__(self, stats: OffloadStats | None) -> None:
        self.records: dict[object, _OpRecord] = {}
        self.counts: dict[object, int] = {}
        self._stats = stats
        self.offload_group: _offload.Group | None = None

    def group(self) -> _offload.Group:
        """This region's offload group, made (and linked to the last region's) on first need."""
        group = self.offload_group
        if group is None:
            group = self.offload_group = _offload.engine().new_group()
        return group

    @property
    def stats(self) -> OffloadStats:
        """The stats given to the pair, or its own, made on first need (most pairs never
        offload, and a pair is built for every checkpoint call)."""
        stats = self._stats
        if stats is None:
            stats = self._stats = OffloadStats()
        return stats


class _CacheMode(TorchDispatchMode, DeclaredContext):  # type: ignore[no-untyped-call]  # untyped base
    """What the forward mode and the recompute mode of a pair share: their ``_Cache``, its
    ``OffloadStats`` and how torch treats them (they see higher-order ops; compile internals
    and dynamo's per-op wrapper pass them by, NOTE [Selective checkpoint cache], Rule 11)."""

    supports_higher_order_operators = True
    # The ops of a kept span pass both modes untouched (NOTE [Kept spans], Rule 6).
    honours_kept_spans: Final = True
    cache: _Cache

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no per-op wrapper: Rule 11 marks __torch_dispatch__ once instead

    @property
    def offload_stats(self) -> OffloadStats:
        return self.cache.stats


def _keep_tensor(
    tensor: torch.Tensor,
    action: _Keep,
    stats: OffloadStats,
    hooks: _compat.HookPair | None,
    cache: _Cache | None,
    op: object = None,
) -> _Leaf:
    """The entry for one output tensor (of ``op``) under a save, offload or compress decision,
    announced; a saved one goes through the user's saved-tensors ``hooks`` when given (Rule
    13); an offloaded one joins the offload group of the region's ``cache``."""
    if action is _Action.SAVE:
        announce(tensor, _REGION, "saved")
        return _Saved(tensor) if hooks is None else _Packed(tensor, hooks)
    if type(action) is Compress:
        return _keep_compressed(tensor, action, stats, cache, op)
    announce(tensor, _REGION, "offloaded")
    return _offloaded(tensor, tensor.numel() * tensor.element_size(), stats, cache)


def _keep_compressed(
    tensor: torch.Tensor, how: Compress, stats: OffloadStats, cache: _Cache | None, op: object
) -> _Leaf:
    """NOTE [Compressed saves]: ``tensor`` packed (Rule 4 refuses an exact value), its payload
    offloaded with ``how.offload`` (Rule 6); kept as a plain save where it is in the target
    dtype already (Rule 3), offloaded as it is with ``how.offload``."""
    # The compiler keeps it uncompressed (Rule 9), said once; torch 2.11's AOTAutograd can trace
    # with is_compiling() false, so a traced (functional) tensor counts as tracing too.
    if _compile_tracing() or _compat.is_traced_tensor(tensor):
        say_once("compress")
        return _keep_tensor(tensor, _Action.SAVE, stats, None, cache)
    check_packable(tensor, "Compress", op)
    packed = pack(tensor, how)
    if packed is None:
        return _keep_tensor(tensor, _OFFLOAD if how.offload else _Action.SAVE, stats, None, cache)
    payload = packed.payload
    if payload is None:
        internal_error("a freshly packed tensor without its payload")
    announce(tensor, _REGION, "offloaded" if how.offload else "compressed", packed.nbytes)
    if not how.offload:
        return _Shrunk(packed, None)
    packed.payload = None  # the host copy holds it now (Rule 6)
    return _Shrunk(packed, _offloaded(payload, payload.nbytes, stats, cache))


def _offloaded(
    tensor: torch.Tensor, nbytes: int, stats: OffloadStats, cache: _Cache | None
) -> _HostAlias | _HostCopy:
    """Rule 7: ``tensor``'s host copy (an alias where it lives in host memory already),
    counted as ``nbytes``."""
    stats._count_offload(nbytes)
    if _offload.claims(tensor):
        group = cache.group() if cache is not None else _offload.engine().new_group()
        return _HostCopy(tensor, nbytes, group)
    if tensor.device.type in ("cpu", "meta"):
        return _HostAlias(tensor, nbytes)
    return _HostCopy(tensor, nbytes, None)


def _keep(
    out: Any,
    action: _Keep,
    stats: OffloadStats,
    hooks: _compat.HookPair | None = None,
    cache: _Cache | None = None,
    op: object = None,
) -> _Entry:
    """The entry for an op's output (a tensor, or a container of them) under ``action``, in the
    region whose cache is ``cache``."""
    if isinstance(out, torch.Tensor):
        return _keep_tensor(out, action, stats, hooks, cache, op)
    return _Tree(_map_leaves(out, torch.Tensor, _keep_tensor, action, stats, hooks, cache, op))


def _save_traced(out: Any) -> _Entry:
    """Under a tracing compiler every output is cached as saved, unannounced (Rule 9)."""
    if isinstance(out, torch.Tensor):
        return _Saved(out)
    return _Tree(_map_leaves(out, torch.Tensor, _Saved))
