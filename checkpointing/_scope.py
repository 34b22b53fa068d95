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
          frame ``Holder``; the first unpack of a holder in a backward replays the holder's chain
          (Rule 7) and fills every live holder of that chain for that backward (NOTE [Nestable
          checkpoint], Rule 4: released on unpack, recomputed again by another backward,
          ``GraphExecGroup`` honoured); shapes,
          dtypes and devices are checked as for checkpoint (a factory op recorded without a
          dtype reads ``torch.get_default_dtype()`` again when replayed, so changing the default
          between forward and backward is caught there).
  Rule 3. One registry for all scopes: several scopes alive at once all drop their tensors, and
          a scope that reads a closed scope's tensor refers to that scope's tape instead of
          holding the tensor. The chains so linked, in both directions, replay together: each
          tape once per backward, whichever holder that backward unpacks first, planned from
          the last tape back (what it needs of the tapes it reads) and run in the order the
          tapes closed. A scope opened while one is open in this thread, inside a
          checkpointed region (a checkpoint's hook on top), during recompute or inside a
          backward records nothing.
  Rule 4. At most one hook of ours per thread; we only ever pop our own hook, and only when it is
          on top. If a foreign hook is on top when a scope opens, ours goes above it, hands every
          non-scope tensor to it, and leaves at scope exit (never lingers above a foreign hook,
          whose exit would pop ours). A foreign hook pushed above ours shadows it: tensors are
          then stored by that hook (correct, no saving).
  Rule 5. Tensors that are not a scope's are passed through detached (never the input object: a
          reference cycle; a leaf, which has no ``grad_fn`` to close one, is kept as it is), with
          autograd's version check. Outside inputs are held detached and version-checked at replay.
          An op that writes an outside tensor is replayed only if a needed tensor comes from it,
          and then on a clone: outside tensors never change twice.
  Rule 6. Under ``torch.no_grad()`` or inference mode a scope records nothing and pushes
          nothing. Meta tensors work (they have no generator to restore).
  Rule 7. A tape splits into chains: tensors linked by an op that reads one and makes or
          writes the other. A backward replays only the chains whose holders it unpacks (with
          ``torch.autograd.grad(loss_1, p1)``, not the chain only ``loss_2`` needs), and in them
          only the ops live holders need. Each random op replays from the state its generator
          (CPU, per device, explicit ``generator=``) had just before it drew, so every draw is
          bit-identical whichever others are replayed, and each generator is back where the
          caller had it afterwards. Host syncs (``.item()``) produce no tensor and are never
          replayed.
  Rule 8. A view of a scope tensor saved after the scope (``nn.Linear`` saves ``weight.t()``)
          is a holder of its base, re-viewed with ``as_strided`` after replay.
  Rule 9. A scope claims our hook until its tensors are dead (lazy lingering: at its exit it
          watches the deaths of the tensors still alive; those that died inside it cost no
          callback) or until ``exit_saved_tensors_hooks_scope()``; a
          ``gradient_checkpoint_session()`` claims it for its block. With no claim left the hook is
          popped at once if on top, else at the next safe point in its thread (scope or session
          entry/exit, or our next pack). Never from another thread or inside a backward (which runs
          on a copy of the stack).
  Rule 10. Dynamo never traces our machinery. Scope and session entry and exit, called from user
          code, are ``disable_dynamo``'d, so under ``torch.compile`` they break the graph (a frame
          that opens a scope runs eagerly: dynamo cannot resume inside that ``with`` block). What
          torch itself calls (our pack and unpack hooks, the registry's death callback, the tape
          mode's ``__torch_dispatch__``) has its code objects marked once
          (``skip_dynamo_in_code``): the same protection with no wrapper call per op or per saved
          tensor (these wrappers were a sixth of the scope's forward cost on W3). While a scope is
          open dynamo compiles nothing (it skips frames while a dispatch mode is active), so the
          block is recorded from eager ops. A graph compiled after the block saves scope tensors
          through our hook; an alias of one that autograd does not know as a view (AOTAutograd may
          save such an alias of a graph input) is stored, not replayed: correct, no saving.

Rejected: replaying every random op in its original order from each generator's first state (it
pulled every chain with a random op into every replay); noting chains while recording (a cost per
op in forward; they are worked out once per tape at its first replay instead); re-running the scope
body (it is arbitrary code that already ran); holding outside inputs as autograd ``SavedTensor``s
(holding an output that way is a C++ reference cycle); a second hook per scope (stacks of ours in
arbitrary order could not be unwound safely); restoring the default dtype for a replay (it is
process-wide, so a backward in one thread would change it for every thread: the metadata check
reports the divergence instead, as for checkpoint); finding scope tensors by storage (an alias that
does not share the version counter, like ``.data`` or an AOTAutograd output, can be written without
a version bump, and the replay would silently differ); replaying (and recording) ops through
torch's Python bindings (``torch.sin``) instead of ``OpOverload._op`` (850 against 1,020 ns per op
on W3's tensors, but a binding picks its overload from the argument types: ``aten.mul.Scalar``
would replay as ``mul.Tensor``); binding loop methods and globals to locals in the replay loops
(``run`` 282 -> 274 us and ``needed_ops`` 20 -> 18 us per W3 replay: within the step's noise).
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal, Self

import torch

from ._compat import (
    HookPair,
    OpOverload,
    TorchDispatchMode,
    current_graph_task_id,
    detach_sharing_version,
    disable_dynamo,
    op_runner,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    resolve_user_hooks,
    returns_alias,
    skip_dynamo_in_code,
    tensor_version,
    top_saved_tensors_hooks,
    tree_leaves,
    view_base,
    written_arguments,
)
from ._determinism import Metadata, check_metadata
from ._errors import CheckpointError, internal_error
from ._events import announce, listener
from ._frame import Frame, Holder, unpack_holder
from ._state import (
    GeneratorStates,
    autocast_disabled,
    default_generator,
    is_recomputing,
    marked_as_recompute,
    recompute_depth,
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
    in_checkpoint = isinstance(pack, Frame) or (
        getattr(pack, "__module__", None) == "torch.utils.checkpoint"
    )
    return not in_checkpoint


# -------------------------------------------------------------------------------------------
# The tape (Rules 1, 5, 7)
# -------------------------------------------------------------------------------------------


class _Slot:
    """A tape argument that is a tensor made earlier in the same scope. It does not refer to
    the tape (an ``_Entry`` would: a reference cycle); one shared object per slot number."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


_slots: list[_Slot] = []  # _slots[n] is the marker for slot n, in every tape


class _Outside:
    """A tape argument from outside any scope: a detached alias and the version it was read at.
    One per tensor and version in a tape: every op that reads it shares it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version

    def value(self, written: bool) -> torch.Tensor:
        """The replay value (See NOTE [Gradient checkpoint scope], Rule 5)."""
        if written:
            return self.tensor.clone()  # written by this op: the real tensor changes only once
        now = tensor_version(self.tensor)
        if now != self.version:
            kind, shape = self.tensor.type(), list(self.tensor.shape)
            raise RuntimeError(
                _MSG_INPUT_MODIFIED.format(kind=kind, shape=shape, now=now, then=self.version)
            )
        return self.tensor


_Draw = tuple[torch.Generator, torch.Tensor]  # a generator and its state just before one draw
_Flat = list[Any] | tuple[Any, ...]  # an op's arguments, flattened


class _Op:
    """One taped op: what runs it (``_compat.op_runner``), its flattened arguments (tensors
    replaced by markers: ``_Slot`` for this scope's tensors, ``_Entry`` for another scope's,
    ``_Outside`` otherwise), the argument positions it writes, the slot of each new tensor
    output, the groups of this tape it reads and those it creates or writes, and for a random
    op the state it drew from (Rule 7). Built in one call, after the op ran."""

    __slots__ = ("draw", "leaves", "outs", "reads", "run", "spec", "touches", "writes")

    def __init__(
        self,
        run: Callable[..., Any],
        leaves: list[Any],
        spec: _Spec,
        writes: tuple[int, ...],
        outs: tuple[int | None, ...],
        reads: tuple[int, ...],
        touches: tuple[int, ...],
        draw: _Draw | None,
    ) -> None:
        self.run = run
        self.leaves = leaves
        self.spec = spec
        self.writes = writes
        self.outs = outs
        self.reads = reads
        self.touches = touches
        self.draw = draw


class _ScopeHolder(Holder):
    """A frame ``Holder`` that knows its tape, slot, view and when it was packed (Rules 2, 8).

    Made by ``_Tape.holder_for`` only, which sets the fields: one is made per saved tensor, and
    a constructor taking them would add a Python call to each."""

    __slots__ = ("meta", "position", "slot", "tape", "view")

    tape: _Tape
    slot: int
    view: _View | None
    position: int  # how many ops the tape had when the tensor was saved
    meta: Metadata

    def recompute(self, key: object) -> None:
        """Fill this holder, and every holder replayed with it, for backward ``key``."""
        _replay_linked(self.tape, self.slot, key)


_View = tuple[torch.Size, tuple[int, ...], int]  # size, stride, storage offset for as_strided
_closing = itertools.count()  # the order in which tapes close (a tape reads only closed ones)


class _Tape:
    """The ops of one scope and how to replay the ones a backward needs."""

    __slots__ = (
        "__weakref__",
        "_chains",
        "claim",
        "closed",
        "device_types",
        "died",
        "entries",
        "exit_versions",
        "group_of",
        "holders",
        "last_write",
        "ops",
        "order",
        "outside",
        "paused",
        "readers",
        "reads_others",
        "rng",
        "watched",
    )

    def __init__(self, claim: _Claim) -> None:
        self.claim = claim
        self.ops: list[_Op] = []
        self.group_of: list[int] = []  # slot -> alias group (the slot that owns the memory)
        self.last_write: dict[int, int] = {}  # group -> index of the last op writing it
        self.entries: list[_Entry] = []  # slot -> its registry entry, until the scope closes
        self.outside: dict[int, tuple[weakref.ref[torch.Tensor], _Outside]] = {}  # until close
        self.exit_versions: dict[int, int] = {}
        self.holders: list[weakref.ref[_ScopeHolder]] = []
        self.readers: list[weakref.ref[_Tape]] = []  # later tapes that read this one's tensors
        self.rng = GeneratorStates()
        self.device_types = {"cpu"}  # autocast is turned off for these while replaying
        self.watched = 0  # tensors alive at close, whose deaths end the claim (Rule 9)
        self.died = 0  # how many of them died
        self.order = math.inf  # when it closed, among all tapes
        self._chains: _Chains | None = None
        self.reads_others = False  # whether an op reads another tape's tensor (Rule 3)
        self.closed = False
        self.paused = False

    # -- recording (Rule 1) ---------------------------------------------------------------------

    def record(self, facts: _OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one op and append it: the long path, for all but plain ops with flat positional
        arguments (``record_plain``). Its arguments become markers before it runs, so that an
        outside input carries the version it was read at."""
        run, written, random, is_view, hidden_writes, _ = facts
        flat: _Flat = args
        spec: _Spec = _FLAT
        nested = bool(kwargs)
        for arg in args:  # loops, not any(): a generator costs more than two arguments do
            if isinstance(arg, _CONTAINERS):
                nested = True
                break
        if nested:
            flat = []
            spec = _flatten((args, kwargs), flat)
        marked = self._markers(flat)
        if marked is None:
            internal_error("a flattened argument of a scope op is a container")
        leaves, reads = marked
        writes: tuple[int, ...] = ()
        if written or hidden_writes:
            ids = _written_ids(written, hidden_writes, args, kwargs)
            writes = tuple(i for i, leaf in enumerate(flat) if id(leaf) in ids)
        draw = self._draw(flat, kwargs) if random else None
        out = run(*args, **kwargs)
        fresh = type(out) is torch.Tensor and not writes
        for arg in flat if fresh else ():
            if arg is out:  # an op that hands back its input (``lift_fresh``)
                fresh = False
                break
        if fresh:
            first = leaves[0] if is_view and leaves else None  # views join their base's group
            slot = self._new_slot(out, first.slot if type(first) is _Slot else None)
            touches = (self.group_of[slot],)
            self.ops.append(_Op(run, leaves, spec, writes, (slot,), reads, touches, draw))
        else:
            op = _Op(run, leaves, spec, writes, (), reads, (), draw)
            self._add_outputs(op, flat, out, is_view)
        return out

    def record_plain(self, run: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``record`` for a plain op (``_OpFacts``) without kwargs: nothing written, nothing
        drawn, no output that is or views an input. Returns ``_NESTED``, having done nothing,
        if an argument is a container (``record`` flattens it)."""
        marked = self._markers(args)
        if marked is None:
            return _NESTED
        leaves, reads = marked
        out = run(*args)
        if type(out) is not torch.Tensor:  # several outputs, or none
            self._add_outputs(_Op(run, leaves, _FLAT, (), (), reads, (), None), args, out, False)
            return out
        outs = (self._new_slot(out, None),)  # a group of its own: numbered as its slot
        self.ops.append(_Op(run, leaves, _FLAT, (), outs, reads, outs, None))
        return out

    def _markers(self, flat: _Flat) -> tuple[list[Any], tuple[int, ...]] | None:
        """The op's arguments with tensors replaced by markers, and the groups it reads; None
        if an argument is a container (``flat`` not flat: ``record_plain``'s unflattened
        arguments)."""
        leaves: list[Any] = []
        reads: list[int] = []
        registry, group_of = _registry, self.group_of
        for leaf in flat:
            if not isinstance(leaf, torch.Tensor):
                if isinstance(leaf, _CONTAINERS):
                    return None
                leaves.append(leaf)
                continue
            entry = registry.get(id(leaf))
            if entry is not None and entry.tape is self and entry() is leaf:
                slot = entry.slot
                leaves.append(_slots[slot])  # made with the slot
                reads.append(group_of[slot])
            else:
                leaves.append(self._other_marker(leaf, entry))
        return leaves, tuple(reads)

    def _other_marker(self, tensor: torch.Tensor, entry: _Entry | None) -> _Entry | _Outside:
        """The marker of an argument that is not this tape's: a closed scope's tensor is read
        through its entry (Rule 3), any other through an ``_Outside``. ``entry`` is the
        registry's entry for the tensor's id, if any."""
        if entry is not None and entry() is tensor:
            owner = entry.tape
            if owner.closed and owner.reproduces(entry.slot, tensor):
                owner.read_by(self)
                self.reads_others = True
                return entry
        return self._outside_marker(tensor)

    def _outside_marker(self, tensor: torch.Tensor) -> _Outside:
        key, version = id(tensor), tensor_version(tensor)
        known = self.outside.get(key)
        if known is not None and known[0]() is tensor and known[1].version == version:
            return known[1]
        marker = _Outside(detach_sharing_version(tensor), version)
        self.outside[key] = (weakref.ref(tensor), marker)
        return marker

    def _add_outputs(self, op: _Op, flat: _Flat, out: Any, view: bool) -> None:
        """The long path of ``record``: give each new tensor output a slot (views of a scope
        tensor join its group), note what the op writes, and append it."""
        first = op.leaves[0] if view and op.leaves else None
        group = first.slot if type(first) is _Slot else None
        outs: tuple[int | None, ...]
        if type(out) is torch.Tensor:  # the common case: one plain tensor
            outs = (None,) if any(out is a for a in flat) else (self._new_slot(out, group),)
        else:
            outs = tuple(
                None  # not a tensor, or an input written in place
                if not isinstance(t, torch.Tensor) or any(t is a for a in flat)
                else self._new_slot(t, group)
                for t in tree_leaves(out)
            )
        touches = [self.group_of[slot] for slot in outs if slot is not None]
        for position in op.writes:
            leaf = op.leaves[position]
            if type(leaf) is _Slot:
                touches.append(self.group_of[leaf.slot])
                self.last_write[self.group_of[leaf.slot]] = len(self.ops)
        op.outs, op.touches = outs, tuple(touches)
        self.ops.append(op)

    def _new_slot(self, tensor: torch.Tensor, base: int | None) -> int:
        """A slot for a new tensor, in its own group or (a view) in the group of slot ``base``.
        Its registry entry watches no death yet: most tensors of a scope die inside it, and
        ``close`` watches the survivors (Rule 9)."""
        group_of = self.group_of
        slot = len(group_of)
        group_of.append(slot if base is None else group_of[base])
        entry = _Entry(tensor)
        entry.key, entry.tape, entry.slot = id(tensor), self, slot
        self.entries.append(entry)
        _registry[entry.key] = entry
        if slot == len(_slots):
            _slots.append(_Slot(slot))
        if not tensor.is_cpu:
            self.device_types.add(tensor.device.type)
        return slot

    def _draw(self, flat: _Flat, kwargs: dict[str, Any]) -> _Draw | None:
        """The generator a random op draws from and its state now (Rule 7)."""
        generator = kwargs.get("generator")
        if generator is None:
            device = kwargs.get("device")
            if device is None:
                device = next((t.device for t in flat if isinstance(t, torch.Tensor)), "cpu")
            generator = default_generator(torch.device(device))
        return None if generator is None else (generator, self.rng.note(generator))

    def close(self) -> None:
        """End recording: drop the entries of tensors that died in the scope; for each live one
        note its version (a later in-place change outside the tape is then seen, and such a
        tensor stored, not replayed) and watch its death (Rule 9)."""
        watched = 0
        for slot, entry in enumerate(self.entries):
            tensor = entry()
            if _registry.get(entry.key) is not entry:
                continue
            if tensor is None:
                del _registry[entry.key]
                continue
            self.exit_versions[slot] = tensor_version(tensor)
            watcher = _Entry(tensor, _entry_died)
            watcher.key, watcher.tape, watcher.slot = entry.key, self, slot
            _registry[entry.key] = watcher
            watched += 1
        self.entries, self.outside = [], {}
        with self.claim.hooks.lock:
            self.closed = True
            self.order = next(_closing)
            self.watched = watched
            dead = self.died == watched
        if dead:
            self.claim.release()

    def slot_died(self) -> None:
        """A watched scope tensor died; once all have, give up the claim (Rule 9)."""
        with self.claim.hooks.lock:
            self.died += 1
            dead = self.closed and self.died == self.watched
        if dead:
            self.claim.release()

    def read_by(self, reader: _Tape) -> None:
        """Note that ``reader`` (a later scope) reads tensors of this one (Rule 3)."""
        if all(ref() is not reader for ref in self.readers):
            self.readers.append(weakref.ref(reader))

    def reproduces(self, slot: int, tensor: torch.Tensor) -> bool:
        """Whether replaying gives ``tensor``'s current value (not changed since the scope)."""
        return not self.closed or self.exit_versions.get(slot) == tensor_version(tensor)

    def holder_for(self, tensor: torch.Tensor, slot: int, view: _View | None) -> _ScopeHolder:
        """A holder that autograd stores instead of ``tensor`` (Rules 2 and 8). The caller
        tells a listening report (``announce``)."""
        holder = _ScopeHolder()
        holder.tape, holder.slot, holder.view, holder.position = self, slot, view, len(self.ops)
        holder.meta = (tensor.shape, tensor.dtype, tensor.device)  # ``metadata_of``, inline
        self.holders.append(weakref.ref(holder))
        return holder

    # -- replay (Rules 2, 3, 5 and 7) -----------------------------------------------------------

    def chains(self) -> _Chains:
        """This tape's chains, worked out again only when ops were added since."""
        chains = self._chains
        if chains is None or chains.size != len(self.ops):
            chains = self._chains = _Chains(self)
        return chains

    def waiting(self, chains: set[int], key: object) -> list[_ScopeHolder]:
        """The live holders of ``chains`` with nothing yet for backward ``key``; checks that
        none was changed in place inside the scope after it was saved."""
        known = self.chains()
        of_group, group_of, last_write = known.of_group, self.group_of, self.last_write
        every_chain = len(chains) == known.count
        waiting = []
        for ref in self.holders:
            holder = ref()
            if holder is None or key in holder:
                continue
            group = group_of[holder.slot]
            if not every_chain and of_group[group] not in chains:
                continue
            if last_write and last_write.get(group, -1) >= holder.position:
                kind, shape = holder.meta[1], list(holder.meta[0])
                raise RuntimeError(_MSG_SCOPE_TENSOR_MODIFIED.format(kind=kind, shape=shape))
            waiting.append(holder)
        return waiting

    def needed_ops(self, groups: set[int]) -> list[_Op]:
        """Walk back from the wanted groups: an op is needed if it creates or writes a needed
        group; what it reads is then needed too (Rule 7)."""
        needed: list[_Op] = []
        for op in reversed(self.ops):
            if not groups.isdisjoint(op.touches):
                needed.append(op)
                groups.update(op.reads)
        needed.reverse()
        return needed

    def run(self, ops: list[_Op], foreign: _Values) -> dict[int, torch.Tensor]:
        """Replay ``ops`` in order; values of other tapes' tensors come from ``foreign``. One
        loop, no call per op: it runs for every replayed op."""
        values: dict[int, torch.Tensor] = {}
        with (
            torch.no_grad(),
            self.rng.restored(),
            autocast_disabled(self.device_types),
            marked_as_recompute(),
        ):
            for op in ops:
                args = []
                for leaf in op.leaves:
                    kind = type(leaf)
                    if kind is _Slot:
                        args.append(values[leaf.slot])
                    elif kind is _Outside:
                        written = bool(op.writes) and any(op.leaves[p] is leaf for p in op.writes)
                        args.append(leaf.value(written))
                    elif kind is _Entry:
                        args.append(foreign[leaf.tape, leaf.slot])
                    else:
                        args.append(leaf)
                if op.draw is not None:
                    generator, state = op.draw
                    generator.set_state(state)  # this draw's place in its stream (Rule 7)
                if op.spec is _FLAT:
                    result = op.run(*args)
                else:
                    rebuilt, kwargs = _unflatten(op.spec, iter(args))
                    result = op.run(*rebuilt, **kwargs)
                if type(result) is torch.Tensor:
                    if op.outs[0] is not None:
                        values[op.outs[0]] = result
                else:
                    for slot, tensor in zip(op.outs, tree_leaves(result), strict=True):
                        if slot is not None:
                            values[slot] = tensor
        return values

    def fill(
        self, holders: list[_ScopeHolder], values: dict[int, torch.Tensor], key: object
    ) -> None:
        """Hand each holder its value for backward ``key``; check shapes, dtypes and devices
        (``check_metadata`` reports the ones that differ)."""
        differing = []
        for index, holder in enumerate(holders):
            value = values.get(holder.slot)
            if value is None:
                internal_error("replay missed a requested slot")
            if holder.view is not None:
                value = value.as_strided(*holder.view)
            holder[key] = value
            shape, dtype, device = holder.meta
            if value.dtype is not dtype or value.shape != shape or value.device != device:
                differing.append((index, holder.meta, value))
        check_metadata(differing)


_Values = dict[tuple[_Tape, int], torch.Tensor]  # other tapes' replayed tensors, by slot


class _Chains:
    """A tape's groups split into chains: two groups are in one chain when an op links them
    (reads one and creates or writes the other). Per chain, the other tapes' tensors it reads.
    Worked out at the first replay, from the tape, not while recording."""

    __slots__ = ("count", "foreign", "group_of", "of_group", "size")

    def __init__(self, tape: _Tape) -> None:
        # Union-find where a chain's root is its lowest group (``parent[g] <= g``), so that
        # the roots come out in one pass below; the walks are inline (no call per op).
        parent = list(range(len(tape.group_of)))
        for op in tape.ops:
            linked = op.reads + op.touches
            if len(linked) < 2:
                continue
            top = linked[0]
            while parent[top] != top:
                parent[top] = top = parent[parent[top]]
            for group in linked[1:]:
                while parent[group] != group:  # none for a group this op made
                    parent[group] = group = parent[parent[group]]
                if group > top:
                    parent[group] = top
                elif group < top:
                    parent[top] = top = group
        for group, up in enumerate(parent):  # ``up`` is done: ``up <= group``
            parent[group] = parent[up]
        self.of_group = parent
        self.count = len(set(self.of_group))
        self.foreign: dict[int, list[tuple[_Tape, int]]] = {}
        for op in tape.ops if tape.reads_others else ():
            linked = op.reads + op.touches
            for leaf in op.leaves:
                if type(leaf) is _Entry and linked:
                    chain = self.of_group[linked[0]]
                    self.foreign.setdefault(chain, []).append((leaf.tape, leaf.slot))
        self.size = len(tape.ops)
        self.group_of = tape.group_of

    def chain_of(self, slot: int) -> int:
        return self.of_group[self.group_of[slot]]


def _linked_chains(tape: _Tape, slot: int) -> dict[_Tape, set[int]]:
    """The chains replayed together with the one of ``tape``'s ``slot``: the chains of other
    tapes it reads, and those of later tapes that read it, transitively (Rule 3)."""
    found = {tape: {tape.chains().chain_of(slot)}}
    todo = [(tape, chain) for chain in found[tape]]
    while todo:
        current, chain = todo.pop()
        chains = current.chains()
        links = [(t, t.chains().chain_of(s)) for t, s in chains.foreign.get(chain, ())]
        for ref in current.readers:
            reader = ref()
            if reader is None:
                continue
            links += [
                (reader, reading)
                for reading, reads in reader.chains().foreign.items()
                if any(t is current and chains.chain_of(s) == chain for t, s in reads)
            ]
        for other, other_chain in links:
            known = found.setdefault(other, set())
            if other_chain not in known:
                known.add(other_chain)
                todo.append((other, other_chain))
    return found


def _replay_linked(tape: _Tape, slot: int, key: object) -> None:
    """Fill, for backward ``key``, every waiting holder of the chains linked to ``slot``,
    replaying each tape involved once (Rules 2, 3 and 7). Tapes are planned from the last to
    close back (what each needs of the tapes it reads), then run in the order they closed."""
    linked = _linked_chains(tape, slot)
    wanted: dict[_Tape, set[int]] = {}  # slots that later tapes read
    plans = []
    for current in sorted(linked, key=lambda t: t.order, reverse=True):
        holders = current.waiting(linked[current], key)
        groups = {current.group_of[h.slot] for h in holders}
        groups.update(current.group_of[s] for s in wanted.get(current, ()))
        ops = current.needed_ops(groups)
        for op in ops:
            for leaf in op.leaves:
                if type(leaf) is _Entry:
                    wanted.setdefault(leaf.tape, set()).add(leaf.slot)
        plans.append((current, holders, ops))
    foreign: _Values = {}
    for current, holders, ops in reversed(plans):
        values = current.run(ops, foreign)
        foreign.update({(current, s): values[s] for s in wanted.get(current, ())})
        current.fill(holders, values, key)


# Op arguments are flattened by hand: torch's ``tree_flatten``/``tree_unflatten`` leave a few
# cyclic objects per call, and the tape records every op of a scope (SPEC §6, "No garbage").
_Spec = Any  # None for a leaf; (container type, [child specs]) or (dict, [(key, spec)])
_FLAT: Final = "flat"  # the spec of ``(args, {})`` where no argument is a container
_NESTED: Final = object()  # ``record_plain``'s answer for an argument that is a container
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


# Per op, worked out once from its schema: what runs it, the (position, name) of each argument it
# writes, whether it draws random numbers, whether it returns a view, whether it has hidden
# writes, and whether it is plain: none of these, and no output aliases an input (so an output
# is never an argument itself). Keyed by the op's id; ``_known_ops`` keeps each op alive so that
# its id stays its own.
_OpFacts = tuple[Callable[..., Any], tuple[tuple[int, str], ...], bool, bool, bool, bool]
_op_facts: dict[int, _OpFacts] = {}
_known_ops: list[OpOverload] = []


def _learn_facts(func: OpOverload) -> _OpFacts:
    _known_ops.append(func)
    written = written_arguments(func)
    random = torch.Tag.nondeterministic_seeded in func.tags
    is_view = bool(func.is_view)
    hidden_writes = func.overloadpacket in _HIDDEN_WRITES
    plain = not (written or random or is_view or hidden_writes or returns_alias(func))
    facts = _op_facts[id(func)] = (op_runner(func), written, random, is_view, hidden_writes, plain)
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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no wrapper per op: Rule 10 marks __torch_dispatch__ once instead

    def __init__(self, tape: _Tape) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.tape = tape

    @skip_dynamo_in_code  # Rule 10
    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        tape = self.tape
        if tape.paused or recompute_depth():  # our own hook's work, or a replay
            return func(*args, **(kwargs or {}))
        facts = _op_facts.get(id(func))  # by id: ``OpOverload.__hash__`` is a Python method
        if facts is None:
            facts = _learn_facts(func)
        if facts[5] and not kwargs:  # a plain op: the short path, unless an argument nests
            out = tape.record_plain(facts[0], args)
            if out is not _NESTED:
                return out
        return tape.record(facts, args, kwargs or {})


# -------------------------------------------------------------------------------------------
# Registry: scope tensor -> (tape, slot), weakly (Rule 3)
# -------------------------------------------------------------------------------------------


class _Entry(weakref.ref[torch.Tensor]):
    """A weak reference to a scope tensor that knows its tape and slot: the registry's value,
    and the tape's marker wherever an op reads that tensor. Its death is counted (Rule 9)."""

    __slots__ = ("key", "slot", "tape")

    key: int
    tape: _Tape
    slot: int


_registry: dict[int, _Entry] = {}


@skip_dynamo_in_code  # Rule 10: a tensor may die inside compiled code
def _entry_died(entry: weakref.ref[torch.Tensor]) -> None:
    if not isinstance(entry, _Entry):
        internal_error("registry callback got a foreign reference")
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
    """A non-scope tensor passed through detached, with the version autograd would check. A
    leaf is held as it is: it has no ``grad_fn``, so it cannot close a reference cycle, and
    detaching it would cost an op through the tape's dispatch mode while a scope is open."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor if tensor.is_leaf else tensor.detach()
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
                push_saved_tensors_hooks(self, self.unpack)  # raises if hooks are disabled
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
                    if top is not None and top[0] is self:
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

    @skip_dynamo_in_code  # Rule 10: runs wherever autograd saves, compiled code included
    def pack(self, tensor: torch.Tensor) -> Any:
        """Our pack hook: a holder for a scope tensor, else a detached pass-through."""
        entry = _registry.get(id(tensor))
        packed: Any = None
        if entry is not None and entry() is tensor and listener.get() is None:
            owner, slot = entry.tape, entry.slot  # the common case: a scope tensor itself, no
            if not owner.closed or owner.reproduces(slot, tensor):  # report listening
                packed = owner.holder_for(tensor, slot, None)  # no op runs here
        if packed is None:
            tape = self.open_tape
            if tape is not None:
                tape.paused = True  # our own ops here (detach, a report) are not the user's
            try:
                packed = self._pack_other(tensor)
            finally:
                if tape is not None:
                    tape.paused = False
        if self.pending:
            self.settle()
        return packed

    # The router itself is the pack hook, so that it can carry the checkpoint-internal marks
    # (NOTE [Nestable checkpoint], Rule 10): selective checkpointing inside a scope or session
    # never takes it for a user's hook, and finds the user's below it.
    __call__ = pack
    _checkpoint_internal: Final = True

    @property
    def _user_hooks(self) -> HookPair | None:
        """The user's saved-tensors hooks ours sits on (those it hands other tensors to)."""
        return resolve_user_hooks(self.below)

    def _pack_other(self, tensor: torch.Tensor) -> Any:
        """``pack`` for all but its common case: a view of a scope tensor, a scope tensor seen
        by a report, a tensor handed to the hook below ours, or one passed through."""
        found = _scope_slot(tensor)
        if found is not None:
            owner, slot, view = found
            holder = owner.holder_for(tensor, slot, view)
            announce(tensor, "scope", "recomputed")
            return holder
        if self.below is not None:
            return _Delegated(self.below[0](tensor), self.below[1])
        return _Passed(tensor)  # Rule 5

    @staticmethod
    @skip_dynamo_in_code
    def unpack(packed: Any) -> torch.Tensor:
        """Our unpack hook (any thread): recompute a holder, or hand back what was kept."""
        if isinstance(packed, _ScopeHolder):
            return unpack_holder(packed, packed)
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
