"""The scope API: ``gradient_checkpoint_scope`` (after RETURNN's) and its session context.

Owns the op tape a scope records, the registry that maps scope tensors to their tape, the one
saved-tensors hook of ours per thread (a router shared by every scope), and the lifetime of that
hook. Holders, per-backward recompute, release on unpack and ``GraphExecGroup`` come from
``_frame`` (``Holder``, ``unpack_holder``); RNG/autocast/recompute marking from ``_state``; the
metadata comparison from ``_determinism``.

NOTE [Gradient checkpoint scope]
  Rule 1. While a scope is open, a dispatch mode records every aten op on a tape (function,
          arguments, which outputs are new tensors). Tensors created in the scope are the new
          outputs of taped ops; the tape refers to them by slot, never holds them.
  Rule 2. When autograd saves a scope tensor (inside the scope or after it) our pack hook stores a
          frame ``Holder``; the first unpack in a backward replays the tape and fills every live
          holder of that tape for that backward (NOTE [Nestable checkpoint], Rule 4: released on
          unpack, recomputed again by another backward, ``GraphExecGroup`` honoured); shapes,
          dtypes and devices are checked as for checkpoint (a factory op recorded without a
          dtype reads ``torch.get_default_dtype()`` again when replayed, so changing the default
          between forward and backward is caught there).
  Rule 3. One registry for all scopes: several scopes alive at once all drop their tensors, and
          a scope that reads another scope's tensor refers to that scope's tape instead of
          holding the tensor. A scope opened while one is open in this thread, inside a
          checkpointed region (a checkpoint's hook on top), during recompute or inside a
          backward records nothing.
  Rule 4. At most one hook of ours per thread; we only ever pop our own hook, and only when it is
          on top. If a foreign hook is on top when a scope opens, ours goes above it, hands every
          non-scope tensor to it, and leaves at scope exit (never lingers above a foreign hook,
          whose exit would pop ours). A foreign hook pushed above ours shadows it: tensors are
          then stored by that hook (correct, no saving).
  Rule 5. Tensors that are not a scope's are passed through detached (never the input object:
          a reference cycle), with autograd's version check. Outside inputs are held detached
          and version-checked at replay. An op that writes an outside tensor is replayed only if
          a needed tensor comes from it, and then on a clone: outside tensors never change twice.
  Rule 6. Under ``torch.no_grad()`` or inference mode a scope records nothing and pushes
          nothing. Meta tensors work (they have no generator to restore).
  Rule 7. Replay runs only the ops needed for the requested tensors, plus every random op in
          its original order, each generator (CPU, per device, explicit ``generator=``) set to
          its state before its first draw in the scope. Host syncs (``.item()``) produce no
          tensor and are never replayed.
  Rule 8. A view of a scope tensor saved after the scope (``nn.Linear`` saves ``weight.t()``)
          is a holder of its base, re-viewed with ``as_strided`` after replay.
  Rule 9. A scope claims our hook until its tensors are dead (lazy lingering) or until
          ``exit_saved_tensors_hooks_scope()``; a ``gradient_checkpoint_session()`` claims it
          for its block. With no claim left the hook is popped at once if on top, else at the
          next safe point in its thread (scope or session entry/exit, or our next pack). Never
          from another thread or inside a backward (which runs on a copy of the stack).
  Rule 10. Dynamo never traces our machinery: scope and session entry and exit, our pack and
          unpack hooks and the registry's death callback are ``disable_dynamo``'d, so under
          ``torch.compile`` they break the graph (a frame that opens a scope runs eagerly: dynamo
          cannot resume inside that ``with`` block). While a scope is open dynamo compiles
          nothing (it skips frames while a dispatch mode is active), so the block is recorded
          from eager ops. A graph compiled after the block saves scope tensors through our hook;
          an alias of one that autograd does not know as a view (AOTAutograd may save such an
          alias of a graph input) is stored, not replayed: correct, no saving.

Rejected: re-running the scope body (it is arbitrary code that already ran); holding outside
inputs as autograd ``SavedTensor``s (holding an output that way is a C++ reference cycle); a
second hook per scope (stacks of ours in arbitrary order could not be unwound safely); restoring
the default dtype for a replay (it is process-wide, so a backward in one thread would change it
for every thread: the metadata check reports the divergence instead, as for checkpoint); finding
scope tensors by storage (an alias that does not share the version counter, like ``.data`` or an
AOTAutograd output, can be written without a version bump, and the replay would silently differ).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection, Iterator
from typing import Any, Final, Literal, Self

import torch

from ._compat import (
    OpOverload,
    TorchDispatchMode,
    current_graph_task_id,
    detach_sharing_version,
    disable_dynamo,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    tensor_version,
    top_saved_tensors_hooks,
    tree_leaves,
    view_base,
    written_arguments,
)
from ._determinism import Metadata, check_metadata, metadata_of
from ._errors import CheckpointError, internal_assert
from ._events import announce
from ._frame import Frame, Holder, unpack_holder
from ._state import (
    GeneratorStates,
    autocast_disabled,
    default_generator,
    is_recomputing,
    marked_as_recompute,
)

__all__ = ["gradient_checkpoint_scope", "gradient_checkpoint_session"]

_MSG_REUSED = (
    "checkpointing.gradient_checkpoint_scope: this scope object was already entered. A scope "
    "records one block. Fix: write `with gradient_checkpoint_scope():` for each block."
)
_MSG_NOT_OPEN = (
    "checkpointing.gradient_checkpoint_scope: __exit__ was called on a scope that is not open "
    "(state: {phase}). Fix: exit each scope exactly once, with the `with` statement."
)
_MSG_SESSION_OPEN = (
    "checkpointing.gradient_checkpoint_session: this session object is already open. Fix: "
    "leave it before entering it again, or use a new `with gradient_checkpoint_session():`."
)
_MSG_SESSION_NOT_OPEN = (
    "checkpointing.gradient_checkpoint_session: __exit__ was called on a session that is not "
    "open. Fix: leave each session exactly once, with the `with` statement."
)
_MSG_WRONG_THREAD = (
    "checkpointing.gradient_checkpoint_scope: {what} was called in thread {now}, but the scope "
    "(or session) was entered in thread {owner}. Saved-tensors hooks and dispatch modes are per "
    "thread. Fix: enter and leave a scope, and call its methods, in one thread."
)
_MSG_INPUT_MODIFIED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [{kind} {shape}] is at version {now}; expected version {then} instead. It is an "
    "input of a gradient_checkpoint_scope, which replays the scope's ops from their inputs in "
    "backward. Fix: do not modify it in place before backward (use an out-of-place op, or pass "
    "a .clone() into the scope)."
)
_MSG_SAVED_MODIFIED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [{kind} {shape}] is at version {now}; expected version {then} instead. Hint: "
    "enable anomaly detection with torch.autograd.set_detect_anomaly(True) to find the "
    "operation that failed to compute its gradient."
)
_MSG_SCOPE_TENSOR_MODIFIED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor [{kind} {shape}] created in a gradient_checkpoint_scope was saved for "
    "backward and then changed in place inside the same scope, so its saved value cannot be "
    "replayed. Fix: use an out-of-place op after the tensor is used, or .clone() it first."
)

# Ops that write arguments their schema does not mark as written: batch norm in training mode
# updates running_mean and running_var (positions 3 and 4; ``training`` is position 5).
_HIDDEN_WRITES: Final = (
    torch.ops.aten.native_batch_norm,
    torch.ops.aten.cudnn_batch_norm,
    torch.ops.aten.miopen_batch_norm,
)


# -------------------------------------------------------------------------------------------
# Public API
# -------------------------------------------------------------------------------------------


class gradient_checkpoint_scope:
    """Tensors created inside this block are not stored for backward but recomputed.

    ``with gradient_checkpoint_scope(): x = a + b`` then ``y = x * c``: autograd saves ``x`` for
    ``y``'s backward, but only a small holder is kept; the first backward that needs ``x``
    replays ``a + b`` from the ops recorded in the block (the block itself is not re-run), with
    random ops drawing exactly what they drew the first time. See NOTE [Gradient checkpoint
    scope] in this module and the README for the rules and limits.
    """

    __slots__ = ("_claim", "_mode", "_phase", "_tape", "_thread")

    def __init__(self) -> None:
        self._phase: Literal["new", "open", "inert", "closed"] = "new"
        self._thread = 0
        self._tape: _Tape | None = None
        self._mode: _TapeMode | None = None
        self._claim: _Claim | None = None

    @disable_dynamo  # See NOTE [Gradient checkpoint scope], Rule 10
    def __enter__(self) -> Self:
        if self._phase != "new":
            raise CheckpointError(_MSG_REUSED)
        self._thread = threading.get_ident()
        hooks = _thread_hooks()
        if not _records_here(hooks):  # See NOTE [Gradient checkpoint scope], Rules 3 and 6
            self._phase = "inert"
            return self
        self._claim = hooks.claim()
        self._tape = _Tape(self._claim)
        hooks.open_tape = self._tape
        self._mode = _TapeMode(self._tape)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self._phase = "open"
        return self

    @disable_dynamo
    def __exit__(self, *exc: object) -> None:
        self._check_thread("__exit__")
        if self._phase not in ("open", "inert"):
            raise CheckpointError(_MSG_NOT_OPEN.format(phase=self._phase))
        tape, mode, self._tape, self._mode = self._tape, self._mode, None, None
        self._phase = "closed"
        if tape is None or mode is None or self._claim is None:
            return
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # torch's base is untyped
        hooks = self._claim.hooks
        hooks.open_tape = None
        tape.close()
        if hooks.below is not None:  # Rule 4: never linger above a foreign hook
            self._claim.release()
        hooks.settle()  # a safe point (Rule 9)

    @disable_dynamo
    def exit_saved_tensors_hooks_scope(self) -> None:
        """Give up this scope's claim on the saved-tensors hook now, if not done yet (RETURNN's
        method). Tensors of this scope saved from now on are stored as usual (Rule 9)."""
        self._check_thread("exit_saved_tensors_hooks_scope()")
        if self._claim is not None:
            self._claim.release()

    def _check_thread(self, what: str) -> None:
        now = threading.get_ident()
        if self._phase != "new" and now != self._thread:
            raise CheckpointError(_MSG_WRONG_THREAD.format(what=what, now=now, owner=self._thread))


class gradient_checkpoint_session:
    """Keep the scope API's saved-tensors hook on this thread's stack for the whole block.

    The robust mode around a training step: scopes inside it need no lazy lingering, and the
    hook leaves at the end of the block (or, if scope tensors outlive it, when they die).
    See NOTE [Gradient checkpoint scope], Rule 9. A session object can be entered again once
    it has been left, not while it is open.
    """

    __slots__ = ("_claim", "_thread")

    def __init__(self) -> None:
        self._thread = 0
        self._claim: _Claim | None = None

    @disable_dynamo  # See NOTE [Gradient checkpoint scope], Rule 10
    def __enter__(self) -> None:
        if self._claim is not None:
            raise CheckpointError(_MSG_SESSION_OPEN)
        self._thread = threading.get_ident()
        self._claim = _thread_hooks().claim()

    @disable_dynamo
    def __exit__(self, *exc: object) -> None:
        claim, now = self._claim, threading.get_ident()
        if claim is None:
            raise CheckpointError(_MSG_SESSION_NOT_OPEN)
        if now != self._thread:  # the session stays open: its owner can still leave it
            what = "gradient_checkpoint_session exit"
            raise CheckpointError(_MSG_WRONG_THREAD.format(what=what, now=now, owner=self._thread))
        self._claim = None
        claim.release()


def _records_here(hooks: _ThreadHooks) -> bool:
    """Whether a scope entered now records (Rules 3 and 6)."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    if is_recomputing() or hooks.open_tape is not None or current_graph_task_id() != -1:
        return False
    top = top_saved_tensors_hooks()
    if top is None:
        return True
    pack = top[0]
    in_checkpoint = isinstance(getattr(pack, "__self__", None), Frame) or (
        getattr(pack, "__module__", None) == "torch.utils.checkpoint"
    )
    return not in_checkpoint


# -------------------------------------------------------------------------------------------
# The tape (Rules 1, 5, 7)
# -------------------------------------------------------------------------------------------


class _Slot:
    """A tape argument that is a tensor created earlier in the same scope."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class _Outside:
    """A tape argument from outside any scope: a detached alias and the version it was read at."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


class _Foreign:
    """A tape argument that another (closed) scope's tape can replay (Rule 3)."""

    __slots__ = ("slot", "tape")

    def __init__(self, tape: _Tape, slot: int) -> None:
        self.tape = tape
        self.slot = slot


class _Op:
    """One taped op: its function, flattened arguments (tensors replaced by markers), the slot
    of each new tensor output, the groups it creates or writes, and the groups it reads."""

    __slots__ = (
        "clones",
        "func",
        "is_view",
        "leaves",
        "outs",
        "random",
        "reads",
        "spec",
        "touches",
    )

    def __init__(
        self, func: OpOverload, leaves: list[Any], spec: Any, random: bool, is_view: bool
    ) -> None:
        self.func = func
        self.leaves = leaves
        self.spec = spec
        self.random = random
        self.is_view = is_view
        self.outs: tuple[int | None, ...] = ()
        self.reads: set[int] = set()
        self.touches: set[int] = set()
        self.clones: set[int] = set()  # leaf positions of outside tensors the op writes


class _ScopeHolder(Holder):
    """A frame ``Holder`` that knows its tape, slot, view and when it was packed (Rules 2, 8)."""

    __slots__ = ("meta", "position", "slot", "tape", "view")

    def __init__(
        self, tape: _Tape, slot: int, view: _View | None, position: int, meta: Metadata
    ) -> None:
        super().__init__()
        self.tape = tape
        self.slot = slot
        self.view = view
        self.position = position
        self.meta = meta


_View = tuple[torch.Size, tuple[int, ...], int]  # size, stride, storage offset for as_strided


class _Tape:
    """The ops of one scope and how to replay the ones a backward needs."""

    __slots__ = (
        "alive",
        "claim",
        "closed",
        "device_types",
        "exit_versions",
        "group_of",
        "holders",
        "last_write",
        "ops",
        "paused",
        "rng",
        "slot_refs",
    )

    def __init__(self, claim: _Claim) -> None:
        self.claim = claim
        self.ops: list[_Op] = []
        self.group_of: list[int] = []  # slot -> alias group (the slot that owns the memory)
        self.last_write: dict[int, int] = {}  # group -> index of the last op writing it
        self.slot_refs: list[weakref.ref[torch.Tensor]] = []
        self.exit_versions: dict[int, int] = {}
        self.holders: list[weakref.ref[_ScopeHolder]] = []
        self.rng = GeneratorStates()
        self.device_types: set[str] = set()
        self.alive = 0
        self.closed = False
        self.paused = False

    # -- recording (Rule 1) ---------------------------------------------------------------------

    def begin(
        self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Op, list[Any]]:
        """Turn an op's arguments into markers before it runs (versions as read)."""
        facts = _op_facts.get(func)
        if facts is None:
            facts = _learn_facts(func)
        written_positions, random, is_view, hidden_writes = facts
        flat: list[Any]
        if not kwargs and not any(isinstance(a, _CONTAINERS) for a in args):
            flat = list(args)  # the common case: flat positional arguments
            spec: _Spec = _FLAT
        else:
            flat = []
            spec = _flatten((args, kwargs), flat)
        written = (
            _written_ids(written_positions, hidden_writes, args, kwargs)
            if written_positions or hidden_writes
            else _NO_IDS
        )
        op = _Op(func, [self._marker(leaf) for leaf in flat], spec, random, is_view)
        for position, leaf in enumerate(op.leaves):
            if isinstance(leaf, _Slot):
                group = self.group_of[leaf.slot]
                op.reads.add(group)
                if written and id(flat[position]) in written:
                    op.touches.add(group)
                    self.last_write[group] = len(self.ops)
            elif isinstance(leaf, _Outside | _Foreign) and id(flat[position]) in written:
                op.clones.add(position)
        if random:
            self._note_generator(flat, kwargs)
        return op, flat

    def finish(self, op: _Op, flat_args: list[Any], out: Any) -> None:
        """Give each new tensor output a slot (views join their base's group) and append."""
        first = op.leaves[0] if op.leaves else None
        view_group = self.group_of[first.slot] if isinstance(first, _Slot) else None
        group = view_group if op.is_view else None
        if type(out) is torch.Tensor:  # the common case: one plain tensor
            if any(out is a for a in flat_args):
                op.outs = (None,)  # an input written in place
            else:
                slot = self._new_slot(out, group)
                op.touches.add(self.group_of[slot])
                op.outs = (slot,)
            self.ops.append(op)
            return
        outs: list[int | None] = []
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or any(tensor is a for a in flat_args):
                outs.append(None)  # not a tensor, or an input written in place
                continue
            slot = self._new_slot(tensor, group)
            op.touches.add(self.group_of[slot])
            outs.append(slot)
        op.outs = tuple(outs)
        self.ops.append(op)

    def _marker(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        entry = _registry.get(id(leaf))
        if entry is not None and entry() is leaf:
            if entry.tape is self:
                return _Slot(entry.slot)
            if entry.tape.reproduces(entry.slot, leaf):
                return _Foreign(entry.tape, entry.slot)
        return _Outside(detach_sharing_version(leaf), tensor_version(leaf))

    def _new_slot(self, tensor: torch.Tensor, group: int | None) -> int:
        slot = len(self.group_of)
        self.group_of.append(slot if group is None else group)
        self.slot_refs.append(weakref.ref(tensor))
        self.device_types.add(tensor.device.type)
        _registry[id(tensor)] = _Entry(tensor, self, slot)
        with self.claim.hooks.lock:
            self.alive += 1
        return slot

    def _note_generator(self, flat: list[Any], kwargs: dict[str, Any]) -> None:
        """Remember the state of the generator a random op draws from (Rule 7)."""
        generator = kwargs.get("generator")
        if generator is None:
            device = kwargs.get("device")
            if device is None:
                device = next((t.device for t in flat if isinstance(t, torch.Tensor)), "cpu")
            generator = default_generator(torch.device(device))
        if generator is not None:
            self.rng.note(generator)

    def close(self) -> None:
        """End recording: note each live tensor's version, so a later in-place change outside
        the tape is seen (such a tensor is then stored, not replayed)."""
        self.closed = True
        for slot, ref in enumerate(self.slot_refs):
            tensor = ref()
            if tensor is not None:
                self.exit_versions[slot] = tensor_version(tensor)
        self.slot_refs = []
        with self.claim.hooks.lock:
            dead = self.alive == 0
        if dead:
            self.claim.release()

    def slot_died(self) -> None:
        """A scope tensor died; once all have, after the scope, give up the claim (Rule 9)."""
        with self.claim.hooks.lock:
            self.alive -= 1
            dead = self.closed and self.alive == 0
        if dead:
            self.claim.release()

    def reproduces(self, slot: int, tensor: torch.Tensor) -> bool:
        """Whether replaying gives ``tensor``'s current value (not changed since the scope)."""
        return not self.closed or self.exit_versions.get(slot) == tensor_version(tensor)

    # -- holders (Rules 2 and 8) ----------------------------------------------------------------

    def holder_for(self, tensor: torch.Tensor, slot: int, view: _View | None) -> _ScopeHolder:
        """A holder that autograd stores instead of ``tensor``."""
        holder = _ScopeHolder(self, slot, view, len(self.ops), metadata_of(tensor))
        self.holders.append(weakref.ref(holder))
        announce(tensor, "scope", "recomputed")
        return holder

    def recompute(self, key: object) -> None:
        """Fill every live holder of this tape that has nothing yet for backward ``key``."""
        live = [h for ref in self.holders if (h := ref()) is not None and key not in h.values]
        for holder in live:
            if self.last_write.get(self.group_of[holder.slot], -1) >= holder.position:
                kind, shape = holder.meta[1], list(holder.meta[0])
                raise RuntimeError(_MSG_SCOPE_TENSOR_MODIFIED.format(kind=kind, shape=shape))
        values = self.compute({holder.slot for holder in live})
        pairs = []
        for index, holder in enumerate(live):
            value = values[holder.slot]
            if holder.view is not None:
                value = value.as_strided(*holder.view)
            holder.values[key] = value
            pairs.append((index, holder.meta, value))
        check_metadata(pairs)

    # -- replay (Rules 5 and 7) -----------------------------------------------------------------

    def compute(self, slots: Collection[int]) -> dict[int, torch.Tensor]:
        """Replay what ``slots`` need and return their values (fresh tensors, no history)."""
        values: dict[int, torch.Tensor] = {}
        foreign: dict[tuple[int, int], torch.Tensor] = {}
        with (
            torch.no_grad(),
            self.rng.restored(),
            autocast_disabled(self.device_types),
            marked_as_recompute(),
        ):
            for op in self._needed_ops({self.group_of[slot] for slot in slots}):
                self._replay(op, values, foreign)
        internal_assert(all(slot in values for slot in slots), "replay missed a requested slot")
        return {slot: values[slot] for slot in slots}

    def _needed_ops(self, groups: set[int]) -> list[_Op]:
        """Walk back from the wanted groups: an op is needed if it creates or writes a needed
        group, or is random (Rule 7); what it reads is then needed too."""
        needed: list[_Op] = []
        for op in reversed(self.ops):
            if op.random or not groups.isdisjoint(op.touches):
                needed.append(op)
                groups |= op.reads
        needed.reverse()
        return needed

    def _replay(
        self,
        op: _Op,
        values: dict[int, torch.Tensor],
        foreign: dict[tuple[int, int], torch.Tensor],
    ) -> None:
        leaves = [
            _materialize(leaf, position in op.clones, values, foreign)
            for position, leaf in enumerate(op.leaves)
        ]
        if op.spec is _FLAT:
            result = op.func(*leaves)
        else:
            args, kwargs = _unflatten(op.spec, iter(leaves))
            result = op.func(*args, **kwargs)
        if any(slot is not None for slot in op.outs):
            for slot, tensor in zip(op.outs, tree_leaves(result), strict=True):
                if slot is not None:
                    values[slot] = tensor


# Op arguments are flattened by hand: torch's ``tree_flatten``/``tree_unflatten`` leave a few
# cyclic objects per call, and the tape records every op of a scope (SPEC §6, "No garbage").
_Spec = Any  # None for a leaf; (container type, [child specs]) or (dict, [(key, spec)])
_FLAT: Final = "flat"  # the spec of ``(args, {})`` where no argument is a container
_CONTAINERS: Final = (tuple, list, dict)


def _flatten(obj: Any, leaves: list[Any]) -> _Spec:
    """Append ``obj``'s leaves to ``leaves`` and return how to rebuild it (aten arguments nest
    only tuples, lists and the kwargs dict)."""
    if isinstance(obj, (tuple, list)):
        return (type(obj), [_flatten(item, leaves) for item in obj])
    if isinstance(obj, dict):
        return (dict, [(key, _flatten(value, leaves)) for key, value in obj.items()])
    leaves.append(obj)
    return None


def _unflatten(spec: _Spec, leaves: Iterator[Any]) -> Any:
    """Rebuild what ``_flatten`` took apart, taking leaves in order."""
    if spec is None:
        return next(leaves)
    kind, children = spec
    if kind is dict:
        return {key: _unflatten(child, leaves) for key, child in children}
    return kind([_unflatten(child, leaves) for child in children])


def _materialize(
    leaf: Any,
    clone: bool,
    values: dict[int, torch.Tensor],
    foreign: dict[tuple[int, int], torch.Tensor],
) -> Any:
    """The replay value of one taped argument (See NOTE [Gradient checkpoint scope], Rule 5)."""
    if isinstance(leaf, _Slot):
        return values[leaf.slot]
    if isinstance(leaf, _Outside):
        if clone:
            return leaf.tensor.clone()  # written by this op: the real tensor changes only once
        now = tensor_version(leaf.tensor)
        if now != leaf.version:
            kind, shape = leaf.tensor.type(), list(leaf.tensor.shape)
            raise RuntimeError(
                _MSG_INPUT_MODIFIED.format(kind=kind, shape=shape, now=now, then=leaf.version)
            )
        return leaf.tensor
    if isinstance(leaf, _Foreign):
        key = (id(leaf.tape), leaf.slot)
        if key not in foreign:
            foreign[key] = leaf.tape.compute([leaf.slot])[leaf.slot]
        return foreign[key]
    return leaf


# Per op, worked out once from its schema: the (position, name) of each argument it writes,
# whether it draws random numbers, whether it returns a view, and whether it has hidden writes.
_OpFacts = tuple[tuple[tuple[int, str], ...], bool, bool, bool]
_op_facts: dict[OpOverload, _OpFacts] = {}
_NO_IDS: Final[frozenset[int]] = frozenset()


def _learn_facts(func: OpOverload) -> _OpFacts:
    facts = _op_facts[func] = (
        written_arguments(func),
        torch.Tag.nondeterministic_seeded in func.tags,
        bool(func.is_view),
        func.overloadpacket in _HIDDEN_WRITES,
    )
    return facts


def _written_ids(
    written: tuple[tuple[int, str], ...],
    hidden_writes: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> set[int]:
    """Ids of the tensors an op writes: schema-marked arguments plus hidden writes."""
    ids: set[int] = set()
    for position, name in written:
        value = args[position] if position < len(args) else kwargs.get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                ids.add(id(tensor))
    if hidden_writes and len(args) > 5 and args[5] is True:
        ids.update(id(t) for t in args[3:5] if isinstance(t, torch.Tensor))
    return ids


class _TapeMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Records each op run while its scope is open (Rule 1)."""

    def __init__(self, tape: _Tape) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.tape = tape

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tape = self.tape
        if tape.paused or is_recomputing():  # our own hook's work, or a replay
            return func(*args, **kwargs)
        op, flat = tape.begin(func, args, kwargs)
        out = func(*args, **kwargs)
        tape.finish(op, flat, out)
        return out


# -------------------------------------------------------------------------------------------
# Registry: scope tensor -> (tape, slot), weakly (Rule 3)
# -------------------------------------------------------------------------------------------


class _Entry(weakref.ref[torch.Tensor]):
    """A weak reference to a scope tensor that knows its tape and slot; its death is counted."""

    __slots__ = ("key", "slot", "tape")

    key: int
    tape: _Tape
    slot: int

    def __new__(cls, tensor: torch.Tensor, tape: _Tape, slot: int) -> Self:
        entry = super().__new__(cls, tensor, _entry_died)
        entry.key, entry.tape, entry.slot = id(tensor), tape, slot
        return entry

    def __init__(self, tensor: torch.Tensor, tape: _Tape, slot: int) -> None:
        super().__init__(tensor, _entry_died)  # type: ignore[call-arg]  # weakref.ref takes these


_registry: dict[int, _Entry] = {}


@disable_dynamo  # Rule 10: a tensor may die inside compiled code
def _entry_died(entry: weakref.ref[torch.Tensor]) -> None:
    internal_assert(isinstance(entry, _Entry), "registry callback got a foreign reference")
    assert isinstance(entry, _Entry)  # for mypy; checked just above
    if _registry.get(entry.key) is entry:
        del _registry[entry.key]
    entry.tape.slot_died()


def _scope_slot(tensor: torch.Tensor) -> tuple[_Tape, int, _View | None] | None:
    """The tape and slot that can replay ``tensor``, directly or as a view of its base."""
    entry = _registry.get(id(tensor))
    if entry is not None and entry() is tensor:
        return (entry.tape, entry.slot, None) if entry.tape.reproduces(entry.slot, tensor) else None
    base = view_base(tensor)
    if base is None:
        return None
    entry = _registry.get(id(base))
    if entry is None or entry() is not base or not entry.tape.reproduces(entry.slot, base):
        return None
    view = (tensor.shape, tensor.stride(), int(tensor.storage_offset()))  # Rule 8
    return entry.tape, entry.slot, view


# -------------------------------------------------------------------------------------------
# The router: one hook of ours per thread, and its lifetime (Rules 2, 4, 5, 9)
# -------------------------------------------------------------------------------------------


class _Passed:
    """A non-scope tensor passed through detached, with the version autograd would check."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor_version(tensor)

    def unpack(self) -> torch.Tensor:
        now = tensor_version(self.tensor)
        if now != self.version:
            kind, shape = self.tensor.type(), list(self.tensor.shape)
            raise RuntimeError(
                _MSG_SAVED_MODIFIED.format(kind=kind, shape=shape, now=now, then=self.version)
            )
        return self.tensor


class _Delegated:
    """A non-scope tensor handed to the foreign hook below ours (Rule 4)."""

    __slots__ = ("packed", "unpack_fn")

    def __init__(self, packed: Any, unpack_fn: Any) -> None:
        self.packed = packed
        self.unpack_fn = unpack_fn


class _Claim:
    """One reason to keep our hook on a thread's stack; released at most once."""

    __slots__ = ("held", "hooks")

    def __init__(self, hooks: _ThreadHooks) -> None:
        self.hooks = hooks
        self.held = True

    def release(self) -> None:
        hooks = self.hooks
        with hooks.lock:
            if not self.held:
                return
            self.held = False
            hooks.claims -= 1
        hooks.settle()


class _ThreadHooks:
    """A thread's router: its pack/unpack are our one hook on that thread's stack.

    Per thread (``threading.local``), not per context: autograd's hook stack is thread state.
    """

    __slots__ = ("below", "busy", "claims", "lock", "on_stack", "open_tape", "pending", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.lock = threading.RLock()  # death callbacks may fire in any thread, or re-enter
        self.claims = 0
        self.on_stack = False
        self.below: tuple[Any, Any] | None = None  # the foreign hook ours sits on, if any
        self.open_tape: _Tape | None = None
        self.pending = False
        self.busy = False

    def claim(self) -> _Claim:
        """Take a claim and make sure our hook is on the stack (Rule 9)."""
        with self.lock:
            if not self.on_stack:
                below = top_saved_tensors_hooks()
                push_saved_tensors_hooks(self.pack, self.unpack)  # raises if hooks are disabled
                self.below, self.on_stack = below, True
            self.claims += 1  # only once the hook is there: a failed push leaves no claim
        return _Claim(self)

    def settle(self) -> None:
        """Pop our hook if nothing claims it and it is on top; else try again at the next safe
        point (Rule 9). Only the owning thread touches its stack."""
        with self.lock:
            if self.busy or not self._may_touch_stack():
                self.pending = True
                return
            self.busy = True
            try:
                self.pending = False
                if self.on_stack and self.claims == 0:
                    top = top_saved_tensors_hooks()
                    if top is not None and getattr(top[0], "__self__", None) is self:
                        pop_saved_tensors_hooks()
                        self.on_stack, self.below = False, None
                    else:
                        self.pending = True  # a foreign hook is above ours
            finally:
                self.busy = False

    def _may_touch_stack(self) -> bool:
        """Only the owning thread, outside backward: a backward runs on a copy of the thread's
        hook stack, which is put back when it ends."""
        return threading.get_ident() == self.thread and current_graph_task_id() == -1

    @disable_dynamo  # Rule 10: runs wherever autograd saves, compiled code included
    def pack(self, tensor: torch.Tensor) -> Any:
        """Our pack hook: a holder for a scope tensor, else a detached pass-through."""
        tape = self.open_tape
        if tape is not None:
            tape.paused = True  # our own ops here are not the user's
        try:
            found = _scope_slot(tensor)
            if found is not None:
                owner, slot, view = found
                packed: Any = owner.holder_for(tensor, slot, view)
            elif self.below is not None:
                packed = _Delegated(self.below[0](tensor), self.below[1])
            else:
                packed = _Passed(tensor)  # Rule 5
        finally:
            if tape is not None:
                tape.paused = False
        if self.pending:
            self.settle()
        return packed

    @staticmethod
    @disable_dynamo
    def unpack(packed: Any) -> torch.Tensor:
        """Our unpack hook (any thread): recompute a holder, or hand back what was kept."""
        if isinstance(packed, _ScopeHolder):
            return unpack_holder(packed, packed.tape.recompute)
        if isinstance(packed, _Passed):
            return packed.unpack()
        result: torch.Tensor = packed.unpack_fn(packed.packed)
        return result


_local = threading.local()


def _thread_hooks() -> _ThreadHooks:
    hooks: _ThreadHooks | None = getattr(_local, "hooks", None)
    if hooks is None:
        hooks = _local.hooks = _ThreadHooks()
    return hooks
