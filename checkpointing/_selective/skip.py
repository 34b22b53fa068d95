"""Skipping ops in the replay: when a call may be skipped, and the taint that guards the skip.

Owns what ``SKIP_IN_REPLAY`` (``policy``'s private answer, for the memory planner) means beyond
the cache entry it makes (``cache._Blank``): ``may_skip``, whether a call so answered may be
replayed by blanks; ``replay_guarded``, whether the replay that would take a blank checks what
it saves; and ``_Taint``, the storages of one replay that hold no real values, with the errors
raised when one of them is needed after all. The forward mode asks ``may_skip``; the recompute
mode hands blanks out and propagates the taint; the frame's recompute pack hook
(``_frame``) refuses a tainted tensor through ``replay_taint``.

NOTE [Selective checkpoint cache] (Rule 14, on skipping ops in the replay; the package docstring
says where the others live)
  Rule 14. A call answered ``SKIP_IN_REPLAY`` (the planner's answer for a call it proved
          backward never needs: its outputs are not saved, and feed only calls whose outputs
          are not needed either) runs in forward and keeps only its outputs' metadata (size,
          stride, dtype, device; other leaves as values); the replay hands out fresh
          uninitialized tensors of that metadata (``torch.empty_strided``) instead of running
          it. The entry is never consumed (Rule 6): a retained graph gets blanks again. Where a
          blank could be wrong the call is silently treated as answered PREFER_RECOMPUTE: a
          random op (Rule 10), the tag op, an op that writes an argument or whose output
          shares storage with an input (a view, in-place or ``out=`` result: the write or the
          alias would be lost), an output that is not a plain dense tensor (a subclass,
          sparse, quantized, a conjugate or negative view), a kept span's op (NOTE [Kept
          spans], Rule 6). And the replay runs the op rather than hand a blank out where what
          it saves would not go straight to our frame's recompute pack hook
          (``replay_guarded``: torch's checkpoint around our contexts, a user's hook or another
          frame on top), as that hook alone refuses tainted tensors. An op with an ordered
          effect is kept (Rule 12), and under a tracing compiler the answer is tagged
          PREFER_RECOMPUTE (Rule 9). A wrong skip never gives a silently wrong gradient: from
          its first blank on, a replay tracks tainted storages (the blanks', and those of
          every output of an op it runs with a tainted input; an op writing an argument
          taints it; the ``*_like`` and ``new_*`` factories read only metadata and taint
          nothing) and raises ``CheckpointError``, naming the skipped call, when the frame
          packs a tainted tensor for backward, or when an op reads a tainted tensor's values
          into Python or into an output's shape (``.item()``, ``torch.equal``, ``nonzero``:
          control flow on garbage). What a checkpoint nested in the replay keeps (its cache,
          its keyword inputs) is not checked: it belongs to the replay's own graph, which
          backward never uses (the nested region's original frame recomputes from what the
          forward gave it; its positional inputs reach the frame's pack, checked). A replay
          nested in another (a backward inside the region) chains its taint to the outer
          one's; each ends with its recompute mode. Cost while no blank was handed out: one
          ``is None`` per op the recompute mode runs, one type check per cached entry it
          hands out, one ``ContextVar.get`` per tensor the frame's recompute packs. A tainted
          storage leaves the taint when it is freed (a weak reference's callback); once none
          is alive (in the planner's plans, soon after a blank's last view is gone), an op of
          the replay costs one emptiness check more than without the taint. Reads
          that do not dispatch (``tolist()``, ``numpy()``, a data pointer given to C code)
          are not seen.

Rejected: tainting tensors by identity (a view made before an in-place write with a tainted
operand would escape); by data pointer (an address freed and reused would raise falsely);
holding the tainted tensors until the replay ends (the memory a skipped op's consumers free).
Storages are held weakly and compared by identity: torch keeps one Python object per live
storage (2.11-2.15), so ``untyped_storage()`` returns the same object for every view of it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Final

import torch

from .. import _compat
from .._compat import OpOverload
from .._errors import CheckpointError
from .._hook_marks import guards_replay_skips
from .ops import Op, _runner, _runners
from .policy import TAG_OP

_STRIDED: Final = torch.strided
# Tensor types whose storage is their own (a subclass may have none, or wrap another's).
_PLAIN: Final = (torch.Tensor, torch.nn.Parameter)

_aten = torch.ops.aten
# Ops that read only their tensor inputs' metadata: their outputs are as good as the forward's
# whatever the inputs hold (dropout's mask is ``empty_like(x).bernoulli_(p)``).
_SHAPE_ONLY: Final = frozenset(
    id(getattr(packet, name))
    for packet in (
        _aten.empty_like,
        _aten.zeros_like,
        _aten.ones_like,
        _aten.full_like,
        _aten.rand_like,
        _aten.randn_like,
        _aten.randint_like,
        _aten.new_empty,
        _aten.new_empty_strided,
        _aten.new_zeros,
        _aten.new_ones,
        _aten.new_full,
        _aten.is_same_size,
    )
    for name in packet.overloads()  # type: ignore[no-untyped-call]  # untyped in torch
)
_VALUE_TAGS: Final = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_reads_values: dict[int, bool] = {}  # by op id (ops are held by ``ops._op_facts``)

_MSG_SAVED = (
    "selective checkpoint (SKIP_IN_REPLAY): the recompute of {region} saved for backward a "
    "tensor (saved tensor #{index}) computed from the output of {origin}, which the plan "
    "skipped in the replay as unneeded. Backward does need it: the skipped op's replay gives "
    "uninitialized memory, so the gradient would be wrong, and checkpointing refuses. Fix: "
    "re-plan with plan_checkpointing (the model, its inputs or its code changed since the plan "
    "was made); report a bug if the plan is fresh."
)
_MSG_READ = (
    "selective checkpoint (SKIP_IN_REPLAY): during the recompute, {op} read the values of a "
    "tensor computed from the output of {origin}, which the plan skipped in the replay as "
    "unneeded (.item(), torch.equal, `if tensor:` or a data-dependent shape need real values; "
    "the skipped op's replay gives uninitialized memory). Fix: re-plan with plan_checkpointing "
    "(the model, its inputs or its code changed since the plan was made); report a bug if the "
    "plan is fresh."
)


def _tensors(value: Any) -> Iterator[Any]:
    """The tensors in an op's arguments or outputs (in tuples and lists, nested)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif type(value) is tuple or type(value) is list:
        for item in value:
            yield from _tensors(item)


def _leaves(value: Any) -> Iterator[Any]:
    """The leaves of an op's output: tuples and lists opened, anything else one leaf."""
    if type(value) is tuple or type(value) is list:
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _plain_dense(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is _STRIDED
        and not tensor.is_nested
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def reads_values(func: Op) -> bool:
    """Whether ``func`` reads its tensor arguments' values, as the taint counts it: the
    ``*_like`` and ``new_*`` factories and the tag op read only metadata. The planner's replay
    graph asks the same question (NOTE [Planner solve], Rule S8)."""
    return func is not TAG_OP and id(func) not in _SHAPE_ONLY


def may_skip(func: Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """Rule 14: whether blanks may stand for this call's outputs in the replay. The caller has
    ruled out random ops, the tag op and ops that write an argument; here: an output that may
    alias an input by the schema or shares storage with one, an odd output or input."""
    if not isinstance(func, OpOverload) or _compat.returns_alias(func):
        return False
    outputs = list(_tensors(out))
    if not all(_plain_dense(tensor) for tensor in outputs):
        return False
    inputs: set[int] = set()
    for tensor in _tensors((args, tuple(kwargs.values()))):
        if type(tensor) not in _PLAIN or tensor.layout is not _STRIDED:
            return False
        inputs.add(id(tensor.untyped_storage()))
    return not any(id(tensor.untyped_storage()) in inputs for tensor in outputs)


def replay_guarded() -> bool:
    """Rule 14: whether what is saved now goes straight to our frame's recompute pack hook,
    which refuses tainted tensors and says so with its ``guards_replay_skips`` mark."""
    hooks = _compat.top_saved_tensors_hooks()
    return hooks is not None and guards_replay_skips(hooks[0])


def _value_reader(func: Op) -> bool:
    """Whether ``func`` reads its inputs' values into Python or into its output's shape."""
    found = _reads_values.get(id(func))
    if found is None:
        tags = func.tags if isinstance(func, OpOverload) else ()
        found = _reads_values[id(func)] = any(tag in tags for tag in _VALUE_TAGS)
    return found


_StorageRef = weakref.ref[torch.UntypedStorage]


class _Taint:
    """One replay's tainted storages (Rule 14), each with the skipped call it comes from; made
    at the replay's first blank, which makes it the current taint until ``end``."""

    __slots__ = ("parent", "storages", "token")

    def __init__(self) -> None:
        self.parent = _replay_taint.get()  # a replay nested in another's sees its taint too
        self.storages: dict[int, tuple[_StorageRef, str]] = {}
        self.token = _replay_taint.set(self)

    def end(self) -> None:
        """The replay is over: its taint is no longer current."""
        _replay_taint.reset(self.token)
        self.storages.clear()

    def origin_of(self, value: object) -> str | None:
        """The skipped call a tensor's values come from, or None if they are real."""
        if type(value) not in _PLAIN or value.layout is not _STRIDED:  # type: ignore[attr-defined]
            return None
        storage = value.untyped_storage()  # type: ignore[attr-defined]  # a plain tensor's
        taint: _Taint | None = self
        while taint is not None:
            found = taint.storages.get(id(storage))
            if found is not None and found[0]() is storage:
                return found[1]
            taint = taint.parent
        return None

    def mark(self, value: Any, origin: str) -> None:
        """Taint the storages of the tensors in ``value`` as coming from ``origin``; each
        leaves the taint when it is freed."""
        storages = self.storages
        for tensor in _tensors(value):
            if type(tensor) in _PLAIN and tensor.layout is _STRIDED:
                storage = tensor.untyped_storage()
                key = id(storage)
                storages[key] = (weakref.ref(storage, _forgetter(storages, key)), origin)

    def origin_in(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The origin of the first tainted tensor among an op's arguments, or None. Runs for
        every op of a replay after its first blank: plain tensors are looked at inline, lists
        and tuples of them (``cat``'s) through ``_tensors``."""
        for value in (*args, *kwargs.values()) if kwargs else args:
            kind = type(value)
            if kind in _PLAIN:
                origin = self.origin_of(value)
            elif kind is tuple or kind is list:
                origin = next(
                    (o for t in _tensors(value) if (o := self.origin_of(t)) is not None), None
                )
            else:
                continue
            if origin is not None:
                return origin
        return None

    def run(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run an op of the replay, tainting what it computes from tainted inputs; refuse one
        that would read tainted values. An op that reads no values taints nothing."""
        run: Callable[..., Any] = _runners.get(id(func)) or _runner(func)
        if (not self.storages and self.parent is None) or not reads_values(func):
            return run(*args, **kwargs)  # nothing tainted is alive, or no value is read
        origin = self.origin_in(args, kwargs)
        if origin is None:
            return run(*args, **kwargs)
        if _value_reader(func):
            raise CheckpointError(_MSG_READ.format(op=func, origin=origin))
        out = run(*args, **kwargs)
        for leaf in _leaves(out):
            if leaf is not None and not isinstance(leaf, torch.Tensor):
                raise CheckpointError(_MSG_READ.format(op=func, origin=origin))
        self.mark(out, origin)
        if isinstance(func, OpOverload):
            for position, name in _compat.written_arguments(func):
                self.mark(args[position] if position < len(args) else kwargs.get(name), origin)
        return out

    def refuse_saved(self, tensor: torch.Tensor, region: Callable[[], str], index: int) -> None:
        """The frame's recompute packs ``tensor`` for backward: refuse it if tainted."""
        origin = self.origin_of(tensor)
        if origin is not None:
            raise CheckpointError(_MSG_SAVED.format(region=region(), index=index, origin=origin))


def _forgetter(
    storages: dict[int, tuple[_StorageRef, str]], key: int
) -> Callable[[_StorageRef], None]:
    """The callback that takes a freed storage out of ``storages`` (not a newer one that got
    its id: that entry holds another reference)."""

    def forget(ref: _StorageRef) -> None:
        entry = storages.get(key)
        if entry is not None and entry[0] is ref:
            storages.pop(key, None)  # the replay's end may have cleared it meanwhile

    return forget


_replay_taint: ContextVar[_Taint | None] = ContextVar("checkpointing_replay_taint", default=None)

replay_taint: Callable[[], _Taint | None] = _replay_taint.get
"""The taint of the innermost replay that handed out a blank in this context, or None (Rule
14). One C-level call, for per-tensor paths."""
