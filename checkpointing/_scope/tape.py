"""The op tape of one scope: recording its ops, its holders, and running its share of a replay.

Owns ``_Tape`` (ops, slots and alias groups, outside inputs, the generator states its random ops
drew from, its holders, the claim it keeps on the hook until its tensors die), ``_ScopeHolder``
(the frame ``Holder`` autograd stores for a scope tensor) and ``_TapeMode`` (the dispatch mode
that records while the scope is open). How one op is described is ``ops.py``'s; which chains and
tapes a backward replays, and in which order, is ``replay.py``'s.

NOTE [Gradient checkpoint scope] (Rules 1 and 2 here; ``__init__`` says where the others are)
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

Rejected: re-running the scope body (it is arbitrary code that already ran); restoring the default
dtype for a replay (it is process-wide, so a backward in one thread would change it for every
thread: the metadata check reports the divergence instead, as for checkpoint); binding loop methods
and globals to locals in the replay loops (``run`` 282 -> 274 us and ``needed_ops`` 20 -> 18 us per
W3 replay: within the step's noise).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._compat import (
    OpOverload,
    TorchDispatchMode,
    detach_sharing_version,
    skip_dynamo_in_code,
    tensor_version,
    tree_leaves,
)
from .._determinism import Metadata, check_metadata
from .._errors import internal_error
from .._frame import Holder
from .._state import (
    GeneratorStates,
    autocast_disabled,
    default_generator,
    marked_as_recompute,
    recompute_depth,
)
from .ops import (
    _CONTAINERS,
    _FLAT,
    _NESTED,
    _Draw,
    _Flat,
    _flatten,
    _learn_facts,
    _Op,
    _op_facts,
    _OpFacts,
    _Outside,
    _Slot,
    _slots,
    _Spec,
    _unflatten,
    _written_ids,
)
from .registry import _Entry, _entry_died, _registry, _View
from .replay import _Chains, _replay_linked

if TYPE_CHECKING:  # annotations only: ``router`` imports this module (see ``__init__``)
    from .router import _Claim

_MSG_SCOPE_TENSOR_MODIFIED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor [{kind} {shape}] created in a gradient_checkpoint_scope was saved for "
    "backward and then changed in place inside the same scope, so its saved value cannot be "
    "replayed. Fix: use an out-of-place op after the tensor is used, or .clone() it first."
)


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
