"""Selective activation checkpointing (SAC): which op outputs a checkpointed region keeps.

Owns the parity names ``CheckpointPolicy``, ``SelectiveCheckpointContext``, ``SAC_IGNORED_OPS``
and ``create_selective_checkpoint_contexts``; our ``OffloadStats`` and the ``Policy`` protocol;
the ``checkpointing::tag`` op through which policies see tensor names; and below them the two
dispatch modes (the forward one asks the policy and fills the cache, the recompute one replays
from it) and the cache entries (a saved alias, a host copy). Entering the modes around forward
and recompute is the frame's job (``_frame``, through ``context_fn``); ready-made policies live
in ``policies``.

NOTE [Selective checkpoint cache]
  Rule 1. The policy is asked once per op of the original forward, after the op ran, with
          ``SelectiveCheckpointContext(is_recompute=False, op_output=out)``; recompute never
          asks (it replays what the forward decided). A policy whose answer depends on the op
          alone and says so (``OpPolicy``: it also has ``answer_for_op(op)``) is asked through
          ``answer_for_op`` once per op overload instead, at that op's first call (and about
          the tag op, once, to know whether recomputed outputs may take a tag's decision), and
          what its answer means for the op (Rules 8 and 10 included) is worked out then and
          remembered: per region, and for good when the policy is ours (``OpPolicyBase``). No
          context built, no call per op. ``tests/test_selective.py`` checks that this decides
          exactly as asking per call does.
  Rule 2. An answer is a ``CheckpointPolicy`` (ours, or torch's member of the same name) or a
          ``bool`` (True is MUST_SAVE, False is PREFER_RECOMPUTE). Anything else is a
          ``CheckpointError`` naming the policy, the op and the value (torch silently
          recomputes). Not a ``TypeError``: tensor operators (``@``, ``+``, ...) turn a
          ``TypeError`` raised under them into ``NotImplemented``, and the user would read
          "unsupported operand type(s) for @" instead of our message.
  Rule 3. Entries are keyed by op (an inductor-compiled region by its callable) and by that
          key's call index within the region. Recompute walks the same (key, index) sequence;
          a step it cannot find is an error naming the op and the index. Only kept calls have
          an entry: a key's forward call count marks every other index below it "recompute",
          so an op that is recomputed costs one counter, not an entry per call, and the check
          is torch's (a key the forward never called, or called fewer times, is an error).
  Rule 4. ``SAC_IGNORED_OPS`` are neither counted nor cached: they run as they are, both times.
  Rule 5. A saved entry is a detached alias sharing the output's version counter, plus the
          version seen when it was cached; handing it out after an in-place change raises
          unless ``allow_cache_entry_mutation=True``.
  Rule 6. A cached entry is handed out once, then its slot reads "consumed": the cache holds
          nothing after recompute, and a second backward through the region raises "backward an
          extra time". Recompute slots are never consumed. The recompute mode restarts its
          counters on every ``__enter__``, so a retained graph meets that error, not a "not
          found" one.
  Rule 7. Offload (``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``; torch recomputes these in
          eager mode): a device output is copied to host memory (pinned and non-blocking on
          CUDA) and only the host copy is cached; recompute gets a fresh tensor on the original
          device with the original dtype, layout and (dense) strides. The copy is a snapshot,
          so it needs no version check. A host tensor is kept as an alias, like save; if it was
          changed in place since, recompute runs the op instead (torch's own treatment of these
          values), never raising. ``OffloadStats`` counts both directions.
  Rule 8. A kept ``tag(x, name)`` hands its decision to the op that produced ``x``: that op's
          slot gets ``x`` (saved or offloaded, as the tag's answer says) and the tag itself is
          recomputed, which is free. This needs the producer to have run out of place in this
          region, returned ``x`` alone, been marked for recompute, not be random (Rule 10),
          and ``x`` to be unchanged since; otherwise the tag keeps nothing and ``x`` follows
          its producer's decision. Without the hand-over, eager recompute would re-run the
          producer anyway, so a named tensor would cost its memory and its recompute both.
  Rule 9. Under a tracing compiler (a proxy mode is active, as in AOTAutograd), every output is
          cached and the traced nodes are tagged with the policy (as torch's enum) and
          ``ac_graph_id``, as torch does, so that the partitioner decides; offload is its call.
  Rule 10. Random ops (tagged ``nondeterministic_seeded``: dropout, ``rand_like``, ...) are
          recomputed whatever the policy answers (it is still asked, Rule 1), and never take a
          tag's decision (Rule 8). Recompute restores the RNG state of the region's start and
          replays the draws in order, so a kept random op would shift what every later one
          draws: torch caches them and, with two ``rand_like`` and the first kept, gets wrong
          gradients. Recomputing a random op is cheap. An op with a ``dropout_p`` argument
          (the fused attention kernels) draws only when it is not 0, so attention without
          dropout is kept as the policy says.
  Rule 12. An op registered with an ordered side effect (``aten::_print``, a torchbind call, ...;
          ``c10d`` launches excepted) must not run twice: recompute would repeat the effect. Its
          output is kept whatever the policy answers, unless the answer is ``MUST_RECOMPUTE``,
          the one explicit request to replay it (torch 2.15's rule, on every release; an
          offload answer keeps it in host memory, as offload does). Rule 10 comes first: a
          random op is recomputed regardless. The effect registry is read at an op's first call
          and remembered (an effect registered later is not seen).
  Rule 13. What a policy saves is held by the cache, not by autograd, so the user's
          saved-tensors hooks (``save_on_cpu`` and the like) never see it unless the checkpoint
          says ``respect_saved_tensors_hooks=True``: then each saved output goes through the
          user's pack hook in forward and its unpack hook at recompute (the user's hooks are
          found past our frame's and torch's, NOTE [Nestable checkpoint], Rule 10). ``None``,
          the default, keeps them out and warns (``FutureWarning``, torch 2.14's) when such
          hooks are active; ``False`` keeps them out silently. Offloaded outputs are in host
          memory already and never go through them.
  Rule 11. Dynamo never traces the modes' ``__torch_dispatch__`` nor what it calls (a policy,
          the op's own Python kernels). This matters when a ``torch.compile``d function runs
          inside a region and breaks its graph: the eager ops between its graphs reach our
          modes with dynamo's frame hook set, and dynamo would compile our dispatch code.
          Torch keeps it out with a wrapper around every mode's ``__torch_dispatch__`` (a
          Python call and two eval-frame switches per op); ours opt out of the wrapper and mark
          the code objects once instead (``_compat.skip_dynamo_in_code``), same protection,
          no cost per op. Under AOTAutograd tracing (Rule 9) dynamo's hook is already off.

Rejected: wrapping every output through a pytree map like torch (a tree walk per op); single
tensors, the common case, are wrapped directly and only containers are mapped. Keeping the
device tensor next to its host copy to version-check it (it would keep the memory offload frees).
Entering the recompute mode only when the forward kept something: on the benchmark's W3/W4
(nothing kept there) SAC's overhead would fall from about 0.52/0.57 of torch's to 0.34/0.43,
but a region that kept nothing would lose torch's op-sequence check (Rule 3). The two modes
themselves are the floor there: a pair of do-nothing Python modes costs 0.49/0.52 of torch's
SAC overhead, and ours add 0.03-0.05 to that (2026-11-23, CPU time, interleaved).
"""

from __future__ import annotations

import abc
import enum
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeAlias, TypeGuard

import torch
from torch.utils.checkpoint import CheckpointPolicy as _TorchCheckpointPolicy

from . import _compat
from ._compat import (
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    TorchDispatchMode,
    tree_map,
)
from ._errors import CheckpointError, internal_error
from ._events import announce

__all__ = [
    "SAC_IGNORED_OPS",
    "TAG_OP",
    "CheckpointPolicy",
    "OffloadStats",
    "Op",
    "OpPolicy",
    "OpPolicyBase",
    "Policy",
    "SelectiveCheckpointContext",
    "answers_by_op",
    "as_checkpoint_policy",
    "create_selective_checkpoint_contexts",
    "policy_from",
    "tag",
]

Op: TypeAlias = OpOverload | HigherOrderOperator

_REGION: Final = "sac"


class CheckpointPolicy(enum.Enum):
    """What selective checkpointing does with one op's output (parity with torch).

    - ``MUST_SAVE`` / ``PREFER_SAVE``: keep the output from the forward; recompute reuses it.
    - ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``: drop it; recompute runs the op again.
    - ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``: keep it in host memory and bring it back
      to its device for recompute (torch recomputes these in eager mode; we really offload).

    ``MUST_*`` asks a compiler (``torch.compile``'s partitioner) not to override the choice; in
    eager mode MUST and PREFER act the same. A member equals torch's member of the same name
    (and hashes alike), so a policy written against either enum works with either library.
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_CPU_OFFLOAD = 4
    PREFER_CPU_OFFLOAD = 5

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _TorchCheckpointPolicy):
            return self._name_ == other._name_
        return self is other

    def __hash__(self) -> int:
        return hash(self._name_)


class SelectiveCheckpointContext:
    """What a policy is told about the op it decides on (parity with torch).

    Attributes:
        is_recompute: always False: policies are asked only in the original forward (NOTE
            [Selective checkpoint cache], Rule 1); kept for compatibility.
        op_output: the op's output: a tensor, a tuple or list of them, or None (``tag``).
    """

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, *, is_recompute: bool, op_output: Any = None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output


class Policy(Protocol):
    """A selective-checkpoint policy: called once per op of the forward, after the op, with the
    op's arguments; returns what to do with its output (a ``CheckpointPolicy`` or a bool).

    A policy whose answer depends on the op alone (not on the context, the arguments or its
    earlier calls) can say so by also defining ``answer_for_op(op)`` with that same answer
    (``OpPolicy``); it is then asked once per op overload instead of once per op call.
    """

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | bool: ...


class OpPolicy(Policy, Protocol):
    """A ``Policy`` whose answer depends on the op alone: ``answer_for_op(op)`` gives, without
    arguments, what calling the policy for any call of ``op`` returns (NOTE [Selective
    checkpoint cache], Rule 1). Every policy of ``checkpointing.policies`` is one, except the
    name-based ones and combinations including them."""

    def answer_for_op(self, op: Op, /) -> CheckpointPolicy | bool: ...


class OpPolicyBase(abc.ABC):
    """Base of our op-only policies: calling one asks ``answer_for_op``; each instance holds
    what the forward mode worked out per op from its answers, for every region using it."""

    __slots__ = ("_op_plans",)

    def __init__(self) -> None:
        self._op_plans: dict[object, _OpPlan] = {}

    @abc.abstractmethod
    def answer_for_op(self, op: Op, /) -> CheckpointPolicy: ...

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy:
        return self.answer_for_op(op)


def answers_by_op(policy: object) -> TypeGuard[OpPolicy]:
    """Whether ``policy`` says its answer depends on the op alone (has ``answer_for_op``)."""
    return callable(getattr(policy, "answer_for_op", None))


_aten = torch.ops.aten
# Ops selective checkpointing runs as they are, never counting or caching them (Rule 4): the
# number of detaches differs between forward and recompute, and the metadata queries (which the
# determinism check adds in forward, and which dispatch for tensor subclasses) would shift every
# later call index. The same set as torch 2.15's; a mutable set like torch's, which also keeps
# the ids of its members: the modes test ``id(func) in SAC_IGNORED_OPS.ids`` per op, where
# ``func in SAC_IGNORED_OPS`` would call ``OpOverload.__hash__``, a Python method (~0.5 us).


class _OpSet(set[OpOverload]):
    """A ``set`` of ops whose ``ids`` follow every change to it."""

    __slots__ = ("ids",)

    def __init__(self, ops: Iterable[OpOverload] = ()) -> None:
        super().__init__(ops)
        self.ids: frozenset[int] = frozenset(map(id, self))

    def _changed(self) -> None:
        self.ids = frozenset(map(id, self))


def _then_refresh(name: str) -> Callable[..., Any]:
    """``set.<name>``, followed by a refresh of ``ids``."""
    method = getattr(set, name)

    def changing(self: _OpSet, *args: Any) -> Any:
        result = method(self, *args)
        self._changed()
        return result

    changing.__name__ = changing.__qualname__ = name
    return changing


for _name in (
    "add",
    "clear",
    "discard",
    "pop",
    "remove",
    "update",
    "difference_update",
    "intersection_update",
    "symmetric_difference_update",
    "__ior__",
    "__iand__",
    "__isub__",
    "__ixor__",
):
    setattr(_OpSet, _name, _then_refresh(_name))
del _name


_IGNORED: Final = _OpSet(
    {
        _aten.detach.default,
        torch.ops.prim.device.default,
        _aten.dim.default,
        _aten.is_contiguous.default,
        _aten.is_contiguous.memory_format,
        _aten.is_non_overlapping_and_dense.default,
        _aten.is_strides_like_format.default,
        _aten.numel.default,
        _aten.size.default,
        _aten.storage_offset.default,
        _aten.stride.default,
        _aten.sym_numel.default,
        _aten.sym_size.default,
        _aten.sym_storage_offset.default,
        _aten.sym_stride.default,
        torch.ops.prim.layout.default,  # torch 2.15 added it; ours has it on every release
    }
)
SAC_IGNORED_OPS: set[OpOverload] = _IGNORED


# --- The tag op: names that policies can see --------------------------------------------------

# torch.library's registration API is public but untyped in 2.13.
_LIBRARY = torch.library.Library("checkpointing", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIBRARY.define("tag(Tensor x, str name) -> ()")  # type: ignore[no-untyped-call]


def _tag_kernel(x: torch.Tensor, name: str) -> None:
    """Nothing to compute: the op exists so that dispatch modes (and policies) see the name."""


_LIBRARY.impl("tag", _tag_kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
TAG_OP: Final[OpOverload] = torch.ops.checkpointing.tag.default

_MSG_TAG_TENSOR = (
    "checkpointing.policies.tag: expected a torch.Tensor as the first argument, got {got!r} of "
    "type {type}. Fix: tag the tensor itself, e.g. `h = tag(h, 'attn_out')`."
)
_MSG_TAG_NAME = (
    "checkpointing.policies.tag: expected the name to be a str, got {got!r} of type {type}. "
    "Fix: pass the name policies will look for, e.g. `tag(h, 'attn_out')`."
)


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Name ``tensor`` for policies; returns ``tensor`` itself (no copy, no autograd node).

    The name is visible to policies as the op ``torch.ops.checkpointing.tag.default`` with
    arguments ``(tensor, name)``. ``save_only_these_names`` and ``offload_these_names`` keep
    tagged tensors; the decision is handed to the op that produced the tensor, so that op is not
    recomputed either (NOTE [Selective checkpoint cache], Rule 8). Outside a selective
    checkpoint it costs one no-op dispatch.

    Example:
        >>> import functools, torch, checkpointing
        >>> from checkpointing.policies import as_context_fn, save_only_these_names, tag
        >>> def block(x, w):
        ...     return torch.relu(tag(x @ w, "proj")).sum()
        >>> x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
        >>> ctx = as_context_fn(save_only_these_names("proj"))
        >>> checkpointing.checkpoint(block, x, w, use_reentrant=False, context_fn=ctx).backward()
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(_MSG_TAG_TENSOR.format(got=tensor, type=type(tensor).__name__))
    if not isinstance(name, str):
        raise TypeError(_MSG_TAG_NAME.format(got=name, type=type(name).__name__))
    TAG_OP(tensor, name)
    return tensor


# --- Offload accounting -----------------------------------------------------------------------


@dataclass
class OffloadStats:
    """Bytes selective checkpointing moved to host memory in forward and back for recompute.

    Pass one to ``create_selective_checkpoint_contexts(..., offload_stats=stats)`` or
    ``policies.as_context_fn(..., offload_stats=stats)`` to add up many regions and steps; each
    pair of modes also exposes its own as ``.offload_stats``. A host (CPU) tensor under an
    offload decision stays where it is (like save) and is still counted, so the numbers follow
    the policy's decisions on any device. Safe to update from forward and backward threads.

    Example:
        >>> import torch, checkpointing
        >>> from checkpointing.policies import as_context_fn, offload_ops
        >>> stats = checkpointing.OffloadStats()
        >>> ctx = as_context_fn(offload_ops(torch.ops.aten.mm.default), offload_stats=stats)
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> y = checkpointing.checkpoint(lambda t: (t @ t).relu(), x, use_reentrant=False,
        ...                              context_fn=ctx)
        >>> y.sum().backward()
        >>> (stats.offloaded_bytes, stats.restored_bytes)
        (256, 256)
    """

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    restored_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def reset(self) -> None:
        """Set every counter back to zero (e.g. between training steps)."""
        with self._lock:
            self.offloaded_tensors = self.offloaded_bytes = 0
            self.restored_tensors = self.restored_bytes = 0

    def _count_offload(self, nbytes: int) -> None:
        with self._lock:
            self.offloaded_tensors += 1
            self.offloaded_bytes += nbytes

    def _count_restore(self, nbytes: int) -> None:
        with self._lock:
            self.restored_tensors += 1
            self.restored_bytes += nbytes


# --- Cache entries ----------------------------------------------------------------------------


class _Action(enum.Enum):
    """What the forward mode does with an output, once the policy's answer is understood."""

    RECOMPUTE = enum.auto()
    SAVE = enum.auto()
    OFFLOAD = enum.auto()


_ACTIONS: Final[dict[object, _Action]] = {
    CheckpointPolicy.MUST_SAVE: _Action.SAVE,
    CheckpointPolicy.PREFER_SAVE: _Action.SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: _Action.RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: _Action.RECOMPUTE,
    CheckpointPolicy.MUST_CPU_OFFLOAD: _Action.OFFLOAD,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: _Action.OFFLOAD,
    True: _Action.SAVE,
    False: _Action.RECOMPUTE,
}
# Torch's members find ours in ``_ACTIONS`` (equal and same hash); an int must not find a bool.
_ANSWER_TYPES: Final = frozenset({CheckpointPolicy, _TorchCheckpointPolicy, bool})
# The same map keyed by identity, for the per-op path: every answer of an accepted type is one of
# these singletons, and ``id`` skips the Python-level ``__hash__`` of our members.
_ACTION_OF_ID: Final[dict[int, _Action]] = {
    **{id(member): _ACTIONS[member] for member in CheckpointPolicy},
    **{id(member): _ACTIONS[member] for member in _TorchCheckpointPolicy},
    id(True): _Action.SAVE,
    id(False): _Action.RECOMPUTE,
}


# Rule 12: the answers that keep an op with an ordered effect all the same (every "recompute"
# answer except MUST_RECOMPUTE), by identity; and, under a tracing compiler, torch's tags that
# stay as they are.
_PREFERS_RECOMPUTE: Final = frozenset(
    {id(CheckpointPolicy.PREFER_RECOMPUTE), id(_TorchCheckpointPolicy.PREFER_RECOMPUTE), id(False)}
)
_SAVE_OR_REPLAY: Final = frozenset(
    {
        _TorchCheckpointPolicy.MUST_SAVE,
        _TorchCheckpointPolicy.PREFER_SAVE,
        _TorchCheckpointPolicy.MUST_RECOMPUTE,
    }
)
_MSG_HOOKS_BYPASSED = (
    "A saved_tensors_hooks context (e.g. save_on_cpu) is active around a selective activation "
    "checkpoint region. Tensors that SAC saves currently bypass these hooks, but a future "
    "release will route them through the hooks like any other saved tensor. Silence this "
    "warning and choose the behavior explicitly by passing respect_saved_tensors_hooks=True|False "
    "to checkpointing.checkpoint (or checkpointing.checkpoint_module / checkpoint_wrapper)."
)


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

    def take(self, allow_mutation: bool, stats: OffloadStats) -> torch.Tensor:
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

    def take(self, allow_mutation: bool, stats: OffloadStats) -> Any:
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

    def take(self, allow_mutation: bool, stats: OffloadStats) -> torch.Tensor:
        if self.alias._version != self.version:
            raise _StaleHostAlias
        stats._count_restore(self.nbytes)
        return self.alias


class _HostCopy:
    """An offloaded device output: only its host copy is kept (Rule 7)."""

    __slots__ = ("device", "host", "nbytes", "ready")

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        self.device = tensor.device
        self.nbytes = nbytes
        self.ready: torch.cuda.Event | None = None
        host = _pinned_copy(tensor) if _can_pin(tensor) else None
        if host is not None:
            # The copy is queued on the current stream; recompute waits for this event.
            self.ready = torch.cuda.current_stream(tensor.device).record_event()
        else:
            host = tensor.to("cpu")
        self.host = host

    def take(self, allow_mutation: bool, stats: OffloadStats) -> torch.Tensor:
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            restored = torch.empty_like(self.host, device=self.device)
            restored.copy_(self.host, non_blocking=True)
        else:
            restored = self.host.to(self.device)
        stats._count_restore(self.nbytes)
        return restored


def _can_pin(tensor: torch.Tensor) -> bool:
    """Pinned, non-blocking copies for plain dense CUDA tensors; others copy the plain way."""
    return (
        tensor.device.type == "cuda"
        and tensor.layout is torch.strided
        and type(tensor) is torch.Tensor
    )


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """A pinned host tensor with ``tensor``'s strides, filled by a non-blocking copy; None where
    pinned memory cannot be had (then the caller falls back to a plain copy)."""
    try:
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
    except RuntimeError:
        return None
    return host.copy_(tensor, non_blocking=True)


class _Tree:
    """Cached outputs of an op that returned a container: the container with each tensor
    replaced by its entry (other leaves kept as they are)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def take(self, allow_mutation: bool, stats: OffloadStats) -> Any:
        return tree_map(
            lambda leaf: leaf.take(allow_mutation, stats) if isinstance(leaf, _LEAVES) else leaf,
            self.value,
        )


_Leaf: TypeAlias = _Saved | _Packed | _HostAlias | _HostCopy
_LEAVES: Final = (_Saved, _Packed, _HostAlias, _HostCopy)
_Entry: TypeAlias = _Leaf | _Tree


class _Consumed:
    """The slot of an entry already handed out to a recompute (Rule 6)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<consumed>"


_CONSUMED: Final = _Consumed()

_Slot: TypeAlias = _Entry | _Consumed


class _Plan(enum.Enum):
    """What the forward mode does with each call of an op (Rule 1: fixed per op for an
    op-only policy; ASK for any other policy)."""

    COUNT = enum.auto()  # keep nothing and note nothing: the call count is all (Rule 3)
    NOTE = enum.auto()  # keep nothing, note the output for a later tag (Rule 8)
    KEEP = enum.auto()  # keep every output as the op-only answer says (save or offload)
    CHECK = enum.auto()  # the op-only answer keeps, but the call decides: a tag hands its
    # decision over (Rule 8), an op with ``dropout_p`` may draw (Rule 10)
    ASK = enum.auto()  # ask the policy, then decide (Rules 2, 8, 10)


# An op-only policy's plan for one op, and the action of its answer.
_OpPlan: TypeAlias = tuple[_Plan, _Action]


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
    the COUNT plan only the forward's call count; and the pair's ``OffloadStats``."""

    __slots__ = ("_stats", "counts", "records")

    def __init__(self, stats: OffloadStats | None) -> None:
        self.records: dict[object, _OpRecord] = {}
        self.counts: dict[object, int] = {}
        self._stats = stats

    @property
    def stats(self) -> OffloadStats:
        """The stats given to the pair, or its own, made on first need (most pairs never
        offload, and a pair is built for every checkpoint call)."""
        stats = self._stats
        if stats is None:
            stats = self._stats = OffloadStats()
        return stats


def _keep_tensor(
    tensor: torch.Tensor, action: _Action, stats: OffloadStats, hooks: _compat.HookPair | None
) -> _Leaf:
    """The entry for one output tensor under a save or offload decision, announced; a saved
    one goes through the user's saved-tensors ``hooks`` when given (Rule 13)."""
    if action is _Action.SAVE:
        announce(tensor, _REGION, "saved")
        return _Saved(tensor) if hooks is None else _Packed(tensor, hooks)
    announce(tensor, _REGION, "offloaded")
    nbytes = tensor.numel() * tensor.element_size()
    stats._count_offload(nbytes)
    if tensor.device.type in ("cpu", "meta"):
        return _HostAlias(tensor, nbytes)
    return _HostCopy(tensor, nbytes)


def _keep(
    out: Any, action: _Action, stats: OffloadStats, hooks: _compat.HookPair | None = None
) -> _Entry:
    """The entry for an op's output (a tensor, or a container of them) under ``action``."""
    if isinstance(out, torch.Tensor):
        return _keep_tensor(out, action, stats, hooks)
    return _Tree(
        tree_map(
            lambda x: _keep_tensor(x, action, stats, hooks) if isinstance(x, torch.Tensor) else x,
            out,
        )
    )


def _save_traced(out: Any) -> _Entry:
    """Under a tracing compiler every output is cached as saved, unannounced (Rule 9)."""
    if isinstance(out, torch.Tensor):
        return _Saved(out)
    return _Tree(tree_map(lambda x: _Saved(x) if isinstance(x, torch.Tensor) else x, out))


# --- Policies: answers, and the list form -----------------------------------------------------

_MSG_BAD_ANSWER = (
    "selective checkpoint (create_selective_checkpoint_contexts): the policy {policy!r} "
    "returned {answer!r} (type {type}) for op {op}; expected a CheckpointPolicy member or a "
    "bool. torch.utils.checkpoint would silently recompute this op; checkpointing refuses to "
    "guess. Fix: return a CheckpointPolicy for every op, e.g. end the policy with "
    "`return CheckpointPolicy.PREFER_RECOMPUTE`."
)


def _bad_answer(answer: object, policy: object, op: object) -> CheckpointError:
    """Rule 2: the error for an answer that is neither a ``CheckpointPolicy`` nor a bool."""
    return CheckpointError(
        _MSG_BAD_ANSWER.format(policy=policy, answer=answer, type=type(answer).__name__, op=op)
    )


def _action_of(answer: object, policy: object, op: object) -> _Action:
    """Rule 2: map a policy's answer to an action, or explain why it is not one."""
    action = _ACTIONS.get(answer) if type(answer) in _ANSWER_TYPES else None
    if action is None:
        raise _bad_answer(answer, policy, op)
    return action


_POLICY_OF: Final[dict[object, CheckpointPolicy]] = {
    **{member: member for member in CheckpointPolicy},
    True: CheckpointPolicy.MUST_SAVE,
    False: CheckpointPolicy.PREFER_RECOMPUTE,
}


def as_checkpoint_policy(answer: object, policy: object, op: object) -> CheckpointPolicy:
    """Rule 2 for code that combines policies: the ``CheckpointPolicy`` an answer stands for
    (torch's members and bools included), or the ``CheckpointError`` saying why it is none."""
    result = _POLICY_OF.get(answer) if type(answer) in _ANSWER_TYPES else None
    if result is None:
        raise _bad_answer(answer, policy, op)
    return result


def _as_torch_policy(answer: object) -> _TorchCheckpointPolicy:
    """Torch's member for an answer (the partitioner reads node metadata with torch's enum)."""
    if isinstance(answer, bool):
        return (
            _TorchCheckpointPolicy.MUST_SAVE if answer else _TorchCheckpointPolicy.PREFER_RECOMPUTE
        )
    if not isinstance(answer, CheckpointPolicy | _TorchCheckpointPolicy):
        internal_error(f"{answer!r} reached _as_torch_policy without passing _action_of")
    return _TorchCheckpointPolicy[answer.name]


class _SaveListed(OpPolicyBase):
    """The list form of ``create_selective_checkpoint_contexts``: MUST_SAVE for the listed
    ops, PREFER_RECOMPUTE for every other op (parity with torch)."""

    __slots__ = ("ops",)

    def __init__(self, ops: frozenset[Op]) -> None:
        super().__init__()
        self.ops = ops

    def answer_for_op(self, op: Op, /) -> CheckpointPolicy:
        if op in self.ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"save_listed_ops({sorted(map(str, self.ops))})"


_MSG_NOT_AN_OP = (
    "Expected op in `op_list` to be an OpOverload but got: {op} of type {type}. "
    "(create_selective_checkpoint_contexts: a list means 'save these ops'; each element must be "
    "a torch.ops OpOverload such as torch.ops.aten.mm.default, or a HigherOrderOperator.) {hint}"
)
_HINT_PACKET = (
    "Please update the OpOverloadPacket to a specific OpOverload: for `{op}`, pass "
    "`{op}.default` (or the overload you mean)."
)
_MSG_NOT_A_POLICY = (
    "policy_fn_or_list must be either a function or a list of ops "
    "(create_selective_checkpoint_contexts got {got!r} of type {type}). Fix: pass a callable "
    "`policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`, or a list such as "
    "[torch.ops.aten.mm.default]."
)
_MSG_NOT_STATS = (
    "create_selective_checkpoint_contexts: offload_stats must be a checkpointing.OffloadStats or "
    "None, got {got!r} of type {type}. Fix: pass `checkpointing.OffloadStats()`."
)


def policy_from(policy_fn_or_list: object) -> Policy:
    """Validate the first argument of ``create_selective_checkpoint_contexts`` (torch's rules:
    a list of ops, or any callable)."""
    if isinstance(policy_fn_or_list, list):
        for op in policy_fn_or_list:
            if not isinstance(op, OpOverload | HigherOrderOperator):
                is_packet = isinstance(op, OpOverloadPacket)
                hint = _HINT_PACKET.format(op=op) if is_packet else ""
                raise ValueError(_MSG_NOT_AN_OP.format(op=op, type=type(op), hint=hint))
        return _SaveListed(frozenset(policy_fn_or_list))
    if callable(policy_fn_or_list):
        policy: Policy = policy_fn_or_list
        return policy
    raise TypeError(
        _MSG_NOT_A_POLICY.format(got=policy_fn_or_list, type=type(policy_fn_or_list).__name__)
    )


# --- The two modes ----------------------------------------------------------------------------

_INDUCTOR_CODE: Final = _compat.inductor_compiled_code
_proxy_mode: Final = _compat.proxy_mode

# Per op kind, worked out once. Rule 10: how to tell whether a call draws random numbers
# (_NEVER, _ALWAYS, or the position of its ``dropout_p`` argument). Rule 8: whether it leaves
# its inputs alone. Keyed by ``id(op)`` (an int hashes in C; an ``OpOverload`` in Python), the
# op itself held in the value, so that the id stays its own; the plans of op-only policies and
# the region caches use the same ids (their ops are all held here).
_NEVER: Final = -1
_ALWAYS: Final = -2
# Rule 12: whether it has an ordered side effect.
_OpFacts: TypeAlias = tuple[object, int, bool, bool]
_op_facts: dict[int, _OpFacts] = {}
# Per op id, what calling the op calls: for a plain ``OpOverload`` its C++ entry point (one Python
# frame fewer per call, ~0.2 us, in both modes), else the op itself. Filled by ``_runner``
# together with ``_op_facts``, which holds the op.
_runners: dict[int, Callable[..., Any]] = {}

_ASK: Final[_OpPlan] = (_Plan.ASK, _Action.RECOMPUTE)
# Plan members as module constants for the per-op path: reading an ``Enum`` member through its
# class costs ~50 ns, a global ~10 ns.
_PLAN_COUNT: Final = _Plan.COUNT
_PLAN_KEEP: Final = _Plan.KEEP
_PLAN_ASK: Final = _Plan.ASK
_dispatch_mode_depth: Final = _compat.dispatch_mode_depth


# Where the output of a recompute-marked op sits in the cache, for a later tag (Rule 8): a weak
# reference to the output, its record and call index, and its version then. A tuple, not a
# class: one is made per recomputed op of every forward that may keep a tag.
_Producer: TypeAlias = tuple[weakref.ref[torch.Tensor], _OpRecord, int, int]


class _CachingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Forward: runs each op, asks the policy, caches what it keeps (Rules 1-5, 7-9)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no per-op wrapper: Rule 11 marks __torch_dispatch__ once instead

    def __init__(self, policy: Policy, cache: _Cache) -> None:
        # No super().__init__(), like torch's own SAC modes: the base's __enter__ creates what
        # it needs, and a pair of modes is built for every checkpoint call.
        self.policy = policy
        self.cache = cache
        # Set by torch.compile's activation-checkpoint lowering (Rule 9).
        self.ac_graph_id: int | None = None
        # Set by the checkpoint that enters this mode (Rule 13).
        self.respect_saved_tensors_hooks: bool | None = None
        self._producers: dict[int, _Producer] = {}
        # Rule 1: an op-only policy's plans by op id (kept on the policy when it is ours).
        self._plans: dict[int, _OpPlan] | None = None
        self._by_op: OpPolicy | None = None
        if answers_by_op(policy):
            self._by_op = policy
            plans: dict[int, _OpPlan] | None = getattr(policy, "_op_plans", None)
            self._plans = {} if plans is None else plans

    @property
    def offload_stats(self) -> OffloadStats:
        return self.cache.stats

    @_compat.skip_dynamo_in_code  # Rule 11
    def __torch_dispatch__(
        self,
        func: Op,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # The hot path: one call per op of every selectively checkpointed forward.
        if kwargs is None:
            kwargs = {}
        # A tracer's mode would be below this one (active modes are counted without it).
        if _dispatch_mode_depth() and _proxy_mode() is not None and _compat.proxy_tracing_active():
            return self._dispatch_traced(func, args, kwargs)
        op_id = id(func)
        if op_id in _IGNORED.ids:
            return func(*args, **kwargs)
        out = (_runners.get(op_id) or _runner(func))(*args, **kwargs)
        key = op_id if func is not _INDUCTOR_CODE else _region_key(func, args)
        plans = self._plans
        if plans is not None:
            op_plan = plans.get(op_id)
            if op_plan is None:
                op_plan = self._learn_plan(func, plans)
            if op_plan[0] is _PLAN_COUNT:  # Rule 3: a count is all that recompute needs
                counts = self.cache.counts
                counts[key] = counts.get(key, 0) + 1
                return out
        else:
            op_plan = _ASK
        records = self.cache.records
        record = records.get(key)
        if record is None:
            record = records[key] = _OpRecord(op_plan, _facts(func))
        index = record.calls
        record.calls = index + 1
        if op_plan[0] is _PLAN_KEEP:
            record.keep(index, self._entry(out, op_plan[1]))
            return out
        return self._decide(func, args, kwargs, out, record, index)

    def _decide(
        self,
        func: Op,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        record: _OpRecord,
        index: int,
    ) -> Any:
        """Rules 1, 2, 8 and 10 for one call: ask the policy (unless its answer for the op is
        known), keep or hand over what it says, note producers for later tags."""
        action = record.action
        if record.plan is _PLAN_ASK:
            ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
            answer = self.policy(ctx, func, *args, **kwargs)
            # Rule 2, inline: answers are singletons (enum members, bools): identity finds them.
            asked = _ACTION_OF_ID.get(id(answer)) if type(answer) in _ANSWER_TYPES else None
            if asked is None:
                raise _bad_answer(answer, self.policy, func)
            action = asked
            if record.effect and id(answer) in _PREFERS_RECOMPUTE:
                action = _Action.SAVE  # Rule 12
        draw_rule = record.draw_rule
        random = draw_rule == _ALWAYS or (draw_rule >= 0 and _draws_at(draw_rule, args, kwargs))
        if action is not _Action.RECOMPUTE and func is not TAG_OP and not random:
            record.keep(index, self._entry(out, action))
        elif func is TAG_OP:
            if action is not _Action.RECOMPUTE:
                self._hand_over(args[0] if args else kwargs["x"], action)
        elif record.pure and not random and type(out) is torch.Tensor:
            self._producers[id(out)] = (weakref.ref(out), record, index, out._version)
        return out

    def _learn_plan(self, func: Op, plans: dict[int, _OpPlan]) -> _OpPlan:
        """Rule 1: ask the op-only policy about ``func`` once, and remember its plan."""
        policy = self._by_op
        if policy is None:
            internal_error("an op plan was asked for a policy that answers per call")
        op_plan = plans[id(func)] = _plan_for(policy, func, plans)
        return op_plan

    def _hand_over(self, tensor: torch.Tensor, action: _Action) -> None:
        """Rule 8: give a kept tag's decision to the op that produced ``tensor``, if allowed."""
        producer = self._producers.pop(id(tensor), None)
        if producer is None:
            return
        ref, record, index, version = producer
        if ref() is not tensor or tensor._version != version:
            return
        record.keep(index, self._entry(tensor, action))

    def _entry(self, out: Any, action: _Action) -> _Entry:
        """The cache entry for ``out`` under a keep ``action`` (Rule 13 for saves)."""
        hooks = self._user_hooks() if action is _Action.SAVE else None
        return _keep(out, action, self.offload_stats, hooks)

    def _user_hooks(self) -> _compat.HookPair | None:
        """Rule 13: the user's saved-tensors hooks a save goes through, or None; warns when
        they are active and the checkpoint did not say whether to respect them."""
        hooks = _compat.user_saved_tensors_hooks()
        if hooks is None:
            return None
        respect = self.respect_saved_tensors_hooks
        if respect is None:
            # stacklevel 4: past this method, _entry and __torch_dispatch__, to the op's caller
            warnings.warn(_MSG_HOOKS_BYPASSED, FutureWarning, stacklevel=4)
        return hooks if respect else None

    def _dispatch_traced(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Rule 9: what torch does under AOTAutograd tracing, so the partitioner decides."""
        if self.ac_graph_id is not None:  # torch 2.11 sets the id itself and gives us none
            _compat.set_traced_node_meta("ac_graph_id", self.ac_graph_id)
        _compat.set_traced_node_meta("recompute", _TorchCheckpointPolicy.PREFER_RECOMPUTE)
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        count_before = _compat.traced_node_count()
        out = func(*args, **kwargs)
        key = _region_key(func, args)
        record = self.cache.records.get(key)
        if record is None:
            record = self.cache.records[key] = _OpRecord(_ASK, _facts(func))
        index = record.calls
        record.calls = index + 1
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        answer = self.policy(ctx, func, *args, **kwargs)
        _action_of(answer, self.policy, func)
        tag = _as_torch_policy(answer)
        if record.effect and tag not in _SAVE_OR_REPLAY:  # Rule 12, as torch 2.15 tags it
            tag = _TorchCheckpointPolicy.MUST_SAVE
        _compat.tag_traced_nodes(count_before, "recompute", tag)
        record.keep(index, _save_traced(out))
        return out


def _plan_for(policy: OpPolicy, func: Op, plans: dict[int, _OpPlan]) -> _OpPlan:
    """Rule 1: what an op-only policy's answer for ``func`` means for every call of it."""
    answer = policy.answer_for_op(func)
    action = _action_of(answer, policy, func)
    _, draw_rule, pure, effect = _facts(func)
    if effect and id(answer) in _PREFERS_RECOMPUTE:
        action = _Action.SAVE  # Rule 12
    if draw_rule == _ALWAYS:
        return _Plan.COUNT, _Action.RECOMPUTE  # Rule 10: a random op is never kept
    if func is TAG_OP or draw_rule >= 0:
        return _Plan.CHECK, action  # Rules 8 and 10: the call decides
    if action is not _Action.RECOMPUTE:
        return _Plan.KEEP, action
    if pure and _tags_may_keep(policy, plans):
        return _Plan.NOTE, action  # Rule 8: its output may take a later tag's decision
    return _Plan.COUNT, action


def _tags_may_keep(policy: OpPolicy, plans: dict[int, _OpPlan]) -> bool:
    """Whether an op-only policy keeps tags (else no output needs a producer note, Rule 8).
    An invalid answer for the tag op is left for a tag's first call to report (Rule 2)."""
    op_plan = plans.get(id(TAG_OP))
    if op_plan is None:
        try:
            op_plan = plans[id(TAG_OP)] = _plan_for(policy, TAG_OP, plans)
        except CheckpointError:
            return True
    return op_plan[1] is not _Action.RECOMPUTE


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
    "Fix: run the forward again before another backward, or use a policy that saves nothing "
    "if you need retain_graph=True."
)
_MSG_MUTATED = (
    "Tensor cached during selective activation checkpoint has been mutated: the output of "
    "{op} (invocation index {index}) was changed in place after the forward cached it, so "
    "recompute would read the changed value. Fix: have the policy recompute this op (or clone "
    "before the in-place op); pass allow_cache_entry_mutation=True only if the change is "
    "harmless for backward."
)


class _CachedMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Recompute: replays the forward's decisions from the cache (Rules 3-7)."""

    supports_higher_order_operators = True
    # Rule 4: detach runs as it is; the frame may detach below this mode (NOTE [Nestable
    # checkpoint], Rule 9).
    passes_detach_through: Final = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no per-op wrapper: Rule 11 marks __torch_dispatch__ once instead

    def __init__(self, cache: _Cache, allow_cache_entry_mutation: bool) -> None:
        # No super().__init__(), as in _CachingMode.
        self.cache = cache
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self.replays: dict[object, int] = {}  # per key, the calls replayed so far

    @property
    def offload_stats(self) -> OffloadStats:
        return self.cache.stats

    def __enter__(self) -> _CachedMode:
        self.replays.clear()  # Rule 6: every recompute starts from index 0.
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        return self

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
        key = op_id if func is not _INDUCTOR_CODE else _region_key(func, args)
        replays = self.replays
        index = replays.get(key, 0)
        replays[key] = index + 1
        record = self.cache.records.get(key)
        if record is None:  # a COUNT key: recompute, if the forward got this far (Rule 3)
            if index < self.cache.counts.get(key, 0):
                return (_runners.get(op_id) or _runner(func))(*args, **kwargs)
        elif index < record.calls:
            kept = record.kept
            if kept is None or (slot := kept.get(index)) is None:
                # Rule 3: not kept, so recomputed
                return (_runners.get(op_id) or _runner(func))(*args, **kwargs)
            if isinstance(slot, _Consumed):
                raise RuntimeError(_MSG_EXTRA_BACKWARD)
            kept[index] = _CONSUMED
            try:
                return slot.take(self.allow_cache_entry_mutation, self.offload_stats)
            except _CacheEntryMutated:
                raise RuntimeError(_MSG_MUTATED.format(op=func, index=index)) from None
            except _StaleHostAlias:
                return func(*args, **kwargs)
        raise RuntimeError(_MSG_NOT_CACHED.format(op=func, index=index))


def _region_key(func: object, args: tuple[Any, ...]) -> object:
    """Rule 3: the cache key of an op: its id (see ``_op_facts``), or for an inductor-compiled
    region the op and the region's callable."""
    if func is _INDUCTOR_CODE:
        return _compat.inductor_region_key(func, args)
    return id(func)


def _draws_random(func: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Rule 10: whether this call of ``func`` drew random numbers."""
    rule = _facts(func)[1]
    if rule < 0:
        return rule == _ALWAYS
    return _draws_at(rule, args, kwargs)


def _draws_at(rule: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Rule 10 for an op with a ``dropout_p`` argument at position ``rule``: draws unless 0."""
    dropout_p = args[rule] if len(args) > rule else kwargs.get("dropout_p", 0.0)
    return bool(dropout_p != 0)


def _facts(func: object) -> _OpFacts:
    """``func`` (held), its draw rule (Rule 10), whether it is pure (Rule 8) and whether it has
    an ordered side effect (Rule 12), worked out on its first call and remembered."""
    facts = _op_facts.get(id(func))
    if facts is None:
        facts = _op_facts[id(func)] = (
            func,
            _draw_rule(func),
            _is_pure(func),
            _compat.has_ordered_effect(func),
        )
    return facts


def _runner(func: Op) -> Callable[..., Any]:
    """What calling ``func`` calls (see ``_runners``), worked out on its first call."""
    _facts(func)  # holds ``func``, so that its id keys ``_runners`` for good
    run = _runners[id(func)] = _compat.op_runner(func) if type(func) is OpOverload else func
    return run


def _draw_rule(func: object) -> int:
    if not isinstance(func, OpOverload) or torch.Tag.nondeterministic_seeded not in func.tags:
        return _NEVER
    index = _compat.argument_index(func, "dropout_p")
    return _ALWAYS if index is None else index


def _is_pure(func: object) -> bool:
    """Rule 8: whether ``func`` leaves its inputs alone (then it may take a tag's decision)."""
    return isinstance(func, OpOverload) and not _compat.op_mutates_inputs(func)


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Policy | list[Op],
    allow_cache_entry_mutation: bool = False,
    *,
    offload_stats: OffloadStats | None = None,
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The two contexts of selective checkpointing, for ``checkpoint(..., context_fn=...)``.

    Same behaviour as ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, except
    that offload decisions really offload (to host memory and back) and that a policy answer
    which is neither a ``CheckpointPolicy`` nor a bool is a ``CheckpointError`` instead of a
    silent recompute. See NOTE [Selective checkpoint cache] for the rules.

    Args:
        policy_fn_or_list: a policy ``policy(ctx, op, *args, **kwargs)`` returning a
            ``CheckpointPolicy`` (or a bool: True saves, False recomputes), called once per op
            of the forward with ``ctx.op_output`` set; or a list of ``OpOverload``s, meaning
            MUST_SAVE for those ops and PREFER_RECOMPUTE for the rest.
        allow_cache_entry_mutation: do not raise when a saved output was changed in place
            after it was cached.
        offload_stats: where to add the bytes offloaded and restored (ours; a fresh
            ``OffloadStats`` per pair by default, reachable as ``.offload_stats`` on each mode).

    Returns:
        ``(forward_context, recompute_context)``: two ``TorchDispatchMode``s.

    Example:
        >>> import functools, torch, checkpointing
        >>> ops = [torch.ops.aten.mm.default]
        >>> ctx = functools.partial(checkpointing.create_selective_checkpoint_contexts, ops)
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = checkpointing.checkpoint(lambda t: (t @ t).sin(), x, use_reentrant=False,
        ...                              context_fn=ctx)
        >>> y.sum().backward()
    """
    policy = policy_from(policy_fn_or_list)
    if offload_stats is not None and not isinstance(offload_stats, OffloadStats):
        raise TypeError(_MSG_NOT_STATS.format(got=offload_stats, type=type(offload_stats).__name__))
    cache = _Cache(offload_stats)
    return _CachingMode(policy, cache), _CachedMode(cache, bool(allow_cache_entry_mutation))
