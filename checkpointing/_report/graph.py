"""The report of a graph: ``saved_tensors_report(loss)`` after forward, no block needed.

Owns ``report_from_graph``: a walk of the autograd graph from its roots that reads what each node
saved without unpacking anything, and the classification of each packed value into a row. The
rows and totals are ``records``'; the watched form of the report is ``watch``'s. Both name rows
and count bytes the same way, so that one step gives the same kept bytes either way.

NOTE [Report from a graph]
  Rule 1. Nothing is unpacked: the walk reads each save's packed value and unpack hook through
          the raw accessors (``_compat.raw_saves``, ``_compat.raw_saved_input``). Unpacking a
          frame's holder would run its recompute, and a selective cache's entry would be
          consumed.
  Rule 2. A packed value is classified by what packed it:
            - a plain tensor, no hook: "saved", region "(outside any region)";
            - a frame's ``Holder`` (the frame is the unpack hook's: ``partial(unpack_holder,
              frame)``, or with debug loggers a closure carrying it): "recomputed", in the
              frame's region; shape, dtype and bytes from the frame's metadata (the determinism
              check's), so unknown with ``determinism_check="none"``;
            - a scope's holder: "recomputed" in "scope", from its own metadata;
            - a ``keep`` span's (the hook's owner carries ``region_label``): its tensor,
              "saved" (or "offloaded" for a host copy) in that region;
            - anything packed by other saved-tensors hooks: the tensors inside the packed
              value, "saved" in "(saved-tensors hooks)", with a note.
  Rule 3. Each frame met through a holder adds what it keeps outside the graph (NOTE [Nestable
          checkpoint], Rule 11): its saved inputs (classified as in Rule 2, so a nested
          region's inputs are its parent's holders), its RNG states, keyword and nested inputs,
          the outputs its kept spans hold for the replay ("span output", NOTE [Kept spans],
          Rule 3); and, when its recompute context is a selective checkpoint's, the cache's live
          entries: "saved" and "offloaded" rows in the frame's region, as the watched report
          names them; a context that holds tensors for the replay by reference (a planned
          region's kept draws) gives "kept draw" rows; a context made of others is read part by
          part. Entries already handed out to a recompute are gone, and not listed.
  Rule 4. Bytes: each storage counts once (``records.Tally``). Every kept storage is an
          activation except those of leaf tensors that require grad (and views of them: the
          transposed weight ``linear`` saves shares the parameter's storage) and, with
          ``model`` given, those of its parameters and buffers (views of them too: the slice of
          a RoPE table a block saves). The walk cannot tell when a tensor was made, so a
          tensor made before the step without grad that is not the model's (token ids; a
          buffer when no ``model`` is given, counted by its whole storage) counts as an
          activation here, not in the watched report.
  Rule 5. Ops: a save of a node's own output (``result*``) is that node's op; a saved input
          that has a ``grad_fn`` is that node's op; a leaf that requires grad is "(input or
          parameter)"; otherwise (a recomputed input, a tensor made without grad) the row says
          which op saved it: "(saved by mm)". Op names are aten's spelled from the node's
          (``MmBackward0`` is "mm"), as the watched report names ops.
  Rule 6. Rows come in forward order (the nodes' sequence numbers): each frame's own rows
          first, then its tensors, then its selective cache's.
  Rule 7. Regions are labelled as NOTE [Region names] says, with one naming for the whole walk
          (the model given, or numbers). Nodes are read in forward order (their sequence
          numbers), so that the numbers count regions as the watched report does.

What the walk cannot see: recompute cost (nothing runs: ``recompute_counted`` is False); the
names of recomputed tensors (no tensor exists) and of tensors copied to the host (the copy is
new memory); user state snapshots of ``recompute_state_hooks``; what torch's own checkpoint or a
reentrant checkpoint keeps by plain reference (their RNG states: a note says so); and anything
saved by a graph no root reaches.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch
from torch import nn

from .. import _compat
from .._chain import chain_constants
from .._compression import Packed
from .._errors import describe_value
from .._events import Decision, Kept, tag_name
from .._frame import Frame, Holder, unpack_holder
from .._hook_marks import span_region, unpack_frame
from .._keep import held_outputs
from .._recompute_context import HoldsForReplay, context_parts
from .._regions import RegionNames, naming
from .._scope.router import _Delegated, _Passed
from .._scope.tape import _ScopeHolder
from .._selective.cache import _HostAlias, _HostCopy, _Packed, _Saved, _Shrunk, _Tree
from .._selective.collectives import is_collective
from .._selective.ops import _op_facts
from .._selective.recompute import _CachedMode
from .._trees import StorageKey, storage_key, tensors
from .records import LEAF, OUTSIDE, SavedTensorRecord, SavedTensorsReport, Tally, record_of
from .watch import watcher_unpack

__all__ = ["report_from_graph", "roots_of"]

_HOOKS: Final = "(saved-tensors hooks)"
_UNKNOWN_CHECKPOINT: Final = "(a checkpoint the report does not know)"
_REGION_INPUT: Final = "(region input)"  # the op of a region's input that nothing traces

_MSG_NOT_TENSORS = (
    "checkpointing.saved_tensors_report: expected the loss after forward (a tensor) or a "
    "sequence of tensors, got {got}. Fix: pass the loss, `report = saved_tensors_report(loss)`, "
    "or watch the whole step with `with saved_tensors_report() as report:`."
)
_MSG_EMPTY = (
    "checkpointing.saved_tensors_report: expected at least one tensor to walk the graph from, "
    "got an empty {kind}. Fix: pass the loss after forward, `saved_tensors_report(loss)`."
)
_MSG_NO_GRAD_FN = (
    "checkpointing.saved_tensors_report: expected tensors that forward made with grad enabled "
    "(with a grad_fn), got {got} at position {index} with grad_fn=None and requires_grad="
    "{requires_grad}: no graph, so nothing saved for backward hangs from it. Fix: pass the "
    "loss itself (not a `.detach()`ed copy, not one computed under `torch.no_grad()`), before "
    "backward."
)
_NOTE_NOT_COUNTED = (
    "built from the graph after forward: recompute cost is not counted (nothing ran); use "
    "`with saved_tensors_report() as report:` around forward and backward to count it"
)
_NOTE_FREED = (
    "the graph holds no saved tensors: if backward already ran it freed them (build the report "
    "after forward and before backward, or run backward with retain_graph=True)"
)
_NOTE_NO_METADATA = (
    "regions checkpointed with determinism_check='none' record no shapes: their recomputed "
    "rows show shape [] and 0 bytes"
)
_NOTE_FOREIGN_HOOKS = (
    "some tensors were packed by saved-tensors hooks the report does not know (e.g. "
    "save_on_cpu, or torch.utils.checkpoint's own): what their pack hook returned is listed in "
    "region '(saved-tensors hooks)', and a torch checkpoint's recomputed tensors are not listed"
)
_NOTE_REENTRANT = (
    "use_reentrant=True checkpoints are in the graph: the RNG states each keeps for its re-run "
    "are held by plain reference and not counted"
)

_Key = tuple[int, int]  # (sequence number, position): the order rows are listed in (Rule 6)


def roots_of(outputs: torch.Tensor | Sequence[torch.Tensor]) -> list[Any]:
    """The graph nodes to walk from: each output's ``grad_fn`` (checked, with our message)."""
    if isinstance(outputs, torch.Tensor):
        tensors: Sequence[object] = [outputs]
    elif isinstance(outputs, (list, tuple)):
        if not outputs:
            raise ValueError(_MSG_EMPTY.format(kind=type(outputs).__name__))
        tensors = outputs
    else:
        raise TypeError(_MSG_NOT_TENSORS.format(got=describe_value(outputs)))
    nodes = []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            got = f"{describe_value(tensor)} at position {index}"
            raise TypeError(_MSG_NOT_TENSORS.format(got=got))
        if tensor.grad_fn is None:
            raise ValueError(
                _MSG_NO_GRAD_FN.format(
                    got=describe_value(tensor), index=index, requires_grad=tensor.requires_grad
                )
            )
        nodes.append(tensor.grad_fn)
    return nodes


def report_from_graph(roots: Iterable[Any], model: nn.Module | None = None) -> SavedTensorsReport:
    """Walk the graph from ``roots`` (autograd nodes) and report what it saved (the NOTE);
    ``model`` names module regions by path (Rule 7)."""
    report = SavedTensorsReport(recompute_counted=False)
    walk = _Walk(Tally(report), _state_of(model))
    token = naming.set(RegionNames(model))
    try:
        walk.run(roots)
    finally:
        naming.reset(token)
    walk.tally.note(_NOTE_NOT_COUNTED)
    return report


class _FrameRows:
    """What the walk knows of one frame: where its holders sit, its first and last node."""

    __slots__ = ("first", "frame", "holder_index", "last")

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.holder_index = {
            id(holder): i
            for i, ref in enumerate(frame.weak_holders)
            if (holder := ref()) is not None  # an empty dict until backward: test identity
        }
        self.first = self.last = -1

    def saw(self, sequence: int) -> None:
        self.first = sequence if self.first < 0 else min(self.first, sequence)
        self.last = max(self.last, sequence)


class _Walk:
    """One walk: nodes seen, frames met, rows found (sorted into forward order at the end)."""

    def __init__(self, tally: Tally, state: frozenset[StorageKey]) -> None:
        self.tally = tally
        self.state = state  # Rule 4: the storages of the model's parameters and buffers
        self.frames: dict[int, _FrameRows] = {}
        self.rows: list[tuple[_Key, int, SavedTensorRecord]] = []  # (key, tie-break, row)
        self.slots = 0  # raw saves met, freed or not
        self.found = 0  # of those, holding something

    def run(self, roots: Iterable[Any]) -> None:
        seen: set[Any] = set()
        todo = [node for node in roots if node is not None]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
        for node in sorted(seen, key=_compat.node_sequence_number):  # Rule 7: forward order
            self.node(node)
        for rows in list(self.frames.values()):
            self.frame_rows(rows)
        self.rows.sort(key=lambda row: (row[0], row[1]))
        self.tally.report.records.extend(record for _, _, record in self.rows)
        if self.slots and not self.found:
            self.tally.note(_NOTE_FREED)

    # -- nodes ------------------------------------------------------------------------------------

    def node(self, node: Any) -> None:
        sequence = _compat.node_sequence_number(node)
        op = _op_of_node(node)
        if op == "CheckpointFunction":
            self.tally.note(_NOTE_REENTRANT)
        for position, (what, packed, hook) in enumerate(_compat.raw_saves(node)):
            self.slots += 1
            if packed is None:
                continue
            self.found += 1
            producer = op if what.startswith("result") else None
            self.packed(packed, hook, (sequence, position), op, producer, OUTSIDE)

    def packed(
        self,
        packed: Any,
        hook: Any,
        key: _Key,
        saver: str,
        producer: str | None,
        plain_region: str,
    ) -> None:
        """Rule 2: one packed value. ``saver``: the op that saved it; ``producer``: the op that
        made it when known; ``plain_region``: the region of a plain tensor (no hook)."""
        if isinstance(packed, _ScopeHolder):
            shape, dtype, _ = packed.meta
            self.add_meta(key, shape, dtype, "scope", _saved_by(saver, producer))
            return
        label = span_region(hook)
        if isinstance(packed, Holder):
            found = _frame_of(hook)
            if found is None:
                self.tally.note(_NOTE_FOREIGN_HOOKS)
                self.add_meta(key, (), torch.uint8, _UNKNOWN_CHECKPOINT, _saved_by(saver, producer))
                return
            self.holder(found, packed, key, _saved_by(saver, producer))
            return
        if (hook is None or hook is watcher_unpack) and isinstance(packed, torch.Tensor):
            self.tensor(packed, key, plain_region, "saved", saver, producer)
            return
        if label is not None:
            self.span_value(packed, key, label, saver, producer)
            return
        if isinstance(packed, _Passed):  # a scope's pass-through: as if no hook
            self.tensor(packed.tensor, key, plain_region, "saved", saver, producer)
            return
        if isinstance(packed, _Delegated):
            packed = packed.packed
        self.tally.note(_NOTE_FOREIGN_HOOKS)
        for tensor in tensors(packed):
            self.tensor(tensor, key, _HOOKS, "saved", saver, producer)

    def holder(self, frame: Frame, holder: Holder, key: _Key, op: str) -> None:
        rows = self.frame_of(frame)
        rows.saw(key[0])
        index = rows.holder_index.get(id(holder))
        metadata = frame.metadata
        if metadata is None or index is None or index >= len(metadata):
            self.tally.note(_NOTE_NO_METADATA)
            self.add_meta(key, (), torch.uint8, frame.region(), op, nbytes=0)
            return
        shape, dtype, _ = metadata[index]
        self.add_meta(key, tuple(shape), dtype, frame.region(), op)

    def span_value(
        self, packed: Any, key: _Key, label: str, saver: str, producer: str | None
    ) -> None:
        """A ``keep`` span's packed value: the tensor itself, an alias, a host copy, or a
        compressed tensor."""
        if isinstance(packed, torch.Tensor):
            self.tensor(packed, key, label, "saved", saver, producer)
            return
        compressed = getattr(packed, "packed", None)
        if isinstance(compressed, Packed):
            on_host = getattr(packed, "host", None) is not None
            self.compressed(compressed, on_host, key, label, _saved_by(saver, producer))
            return
        alias = getattr(packed, "alias", None)
        if isinstance(alias, torch.Tensor):
            self.tensor(alias, key, label, "saved", saver, producer)
            return
        host = getattr(packed, "host", None)
        if isinstance(host, torch.Tensor):
            self.tensor(host, key, label, "offloaded", saver, producer)
            return
        self.tally.note(_NOTE_FOREIGN_HOOKS)

    # -- rows -------------------------------------------------------------------------------------

    def tensor(
        self,
        tensor: torch.Tensor,
        key: _Key,
        region: str,
        decision: Decision,
        saver: str,
        producer: str | None,
        nbytes: int | None = None,
    ) -> None:
        """A row for a tensor that exists; count it when it is kept in place (Rule 4)."""
        op = _op_of_tensor(tensor, saver, producer)
        self.add(key, record_of(op, tensor, region, decision, tag_name(tensor), nbytes))
        if decision == "saved":
            self.tally.keep(tensor, activation=self.is_activation(tensor))

    def is_activation(self, tensor: torch.Tensor) -> bool:
        """Rule 4: not a leaf that requires grad, nor a view of one, nor the model's state."""
        return _is_activation(tensor) and storage_key(tensor) not in self.state

    def compressed(self, packed: Packed, on_host: bool, key: _Key, region: str, op: str) -> None:
        """A row for a compressed tensor (NOTE [Compressed saves]): its packed bytes, counted
        as kept where they stay on the device."""
        decision: Decision = "offloaded" if on_host else "compressed"
        shape = tuple(packed.shape)
        self.add(key, SavedTensorRecord(op, shape, packed.dtype, packed.nbytes, region, decision))
        if not on_host:
            self.tally.keep_bytes(packed.device, packed.nbytes)

    def kept(self, tensor: torch.Tensor, key: _Key, region: str, what: Kept) -> None:
        """A row for what a frame keeps by plain reference (Rule 3)."""
        self.add(key, record_of(what, tensor, region, "saved", tag_name(tensor)))
        rng = what == "rng state"
        self.tally.keep(tensor, activation=not rng and self.is_activation(tensor), rng=rng)

    def add_meta(
        self,
        key: _Key,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        region: str,
        op: str,
        nbytes: int | None = None,
    ) -> None:
        """A row for a tensor that does not exist now (recomputed in backward)."""
        size = math.prod(shape) * dtype.itemsize if nbytes is None else nbytes
        self.add(key, SavedTensorRecord(op, tuple(shape), dtype, size, region, "recomputed"))

    def add(self, key: _Key, record: SavedTensorRecord) -> None:
        """Hold ``record`` until the walk ends, to be listed by ``key`` (Rule 6)."""
        self.rows.append((key, len(self.rows), record))

    # -- frames (Rule 3) --------------------------------------------------------------------------

    def frame_of(self, frame: Frame) -> _FrameRows:
        rows = self.frames.get(id(frame))
        if rows is None:
            rows = self.frames[id(frame)] = _FrameRows(frame)
        return rows

    def frame_rows(self, rows: _FrameRows) -> None:
        """What ``rows.frame`` keeps outside the graph, listed before its tensors (Rule 6)."""
        frame = rows.frame
        region = frame.region()
        first, last = rows.first, rows.last
        for position, entry in enumerate(frame.saved_args):
            key = (first, -1000 + position)
            raw = _compat.raw_saved_input(entry)
            if raw is not None:
                self.packed(raw[0], raw[1], key, _REGION_INPUT, None, f"inputs of {region}")
            elif not isinstance(entry, torch.Tensor):
                for tensor in tensors(entry):
                    self.kept(tensor, key, region, "nested input")
        state = frame.state
        for rng_state in (state.cpu_rng, *state.device_rng):
            if rng_state is not None:
                self.kept(rng_state, (first, -500), region, "rng state")
        for tensor in tensors(frame.kwargs):
            self.kept(tensor, (first, -400), region, "keyword input")
        positional, keyword = chain_constants(frame.fn)  # NOTE [Checkpoint chains], Rule 2
        for tensor in positional:
            self.kept(tensor, (first, -450), region, "nested input")
        for tensor in keyword:
            self.kept(tensor, (first, -400), region, "keyword input")
        for span in frame.spans or ():
            for tensor in held_outputs(span):
                self.kept(tensor, (first, -300), f"keep({span.name}) in {region}", "span output")
        for context in context_parts(frame.recompute_context):
            if isinstance(context, _CachedMode):
                self.cache_rows(context, (last, 1_000_000), region)
            elif isinstance(context, HoldsForReplay):
                for tensor in context.held_for_replay():
                    self.kept(tensor, (last, 900_000), region, "kept draw")

    def cache_rows(self, context: _CachedMode, key: _Key, region: str) -> None:
        """The live entries of a selective checkpoint's cache (Rule 3)."""
        for cache_key, record in context.cache.records.items():
            if not record.kept:
                continue
            op = _op_of_cache_key(cache_key)
            for _, slot in sorted(record.kept.items(), key=lambda item: item[0]):
                for entry in _entries(slot):
                    self.cache_entry(entry, op, key, region)

    def cache_entry(self, entry: Any, op: str, key: _Key, region: str) -> None:
        if isinstance(entry, _Saved):
            self.tensor(entry.alias, key, region, "saved", op, op)
        elif isinstance(entry, _HostAlias):
            self.tensor(entry.alias, key, region, "offloaded", op, op, nbytes=entry.nbytes)
        elif isinstance(entry, _HostCopy):
            self.tensor(entry.host, key, region, "offloaded", op, op, nbytes=entry.nbytes)
        elif isinstance(entry, _Shrunk):
            self.compressed(entry.packed, entry.host is not None, key, region, op)
        elif isinstance(entry, _Packed):
            self.tally.note(_NOTE_FOREIGN_HOOKS)
            for tensor in tensors(entry.packed):
                self.tensor(tensor, key, region, "saved", op, op)


def _entries(slot: object) -> list[Any]:
    """The leaf entries of a cache slot (a container's one by one; none once consumed)."""
    if isinstance(slot, _Tree):
        found: list[Any] = []
        stack = [slot.value]
        while stack:
            value = stack.pop()
            if isinstance(value, (tuple, list)):
                stack.extend(reversed(value))
            else:
                found.append(value)
        return found
    return [slot]


def _frame_of(hook: Any) -> Frame | None:
    """The frame a holder's unpack hook recomputes with (Rule 2): ``partial(unpack_holder,
    frame)``, else the hook's ``frame`` mark (``_hook_marks``: a frame's unpack hook with debug
    loggers, a ``keep`` span's hooks)."""
    if isinstance(hook, functools.partial) and hook.func is unpack_holder and hook.args:
        owner = hook.args[0]
    else:
        owner = unpack_frame(hook)
    return owner if isinstance(owner, Frame) else None


def _state_of(model: nn.Module | None) -> frozenset[StorageKey]:
    """Rule 4: the storages of ``model``'s parameters and buffers (none without a model)."""
    if model is None:
        return frozenset()
    held = (*model.parameters(), *model.buffers())
    return frozenset(key for tensor in held if (key := storage_key(tensor)) is not None)


def _is_activation(tensor: torch.Tensor) -> bool:
    """Rule 4: not a leaf that requires grad, nor a view of one."""
    base = _compat.view_base(tensor)
    owner = tensor if base is None else base
    return not (owner.is_leaf and owner.requires_grad)


_WORD_BREAK: Final = re.compile(r"(?<=[a-z])(?=[A-Z])|(?<=[0-9])(?=[A-Z][a-z])")
_BACKWARD_SUFFIX: Final = re.compile(r"Backward\d*$")


@functools.lru_cache(maxsize=1024)
def _op_of_name(name: str, custom: bool) -> str:
    """Rule 5: "MmBackward0" is "mm"; a custom Function's node keeps its class name."""
    stem = _BACKWARD_SUFFIX.sub("", name.rsplit("::", 1)[-1])
    return stem if custom else _WORD_BREAK.sub("_", stem).lower()


def _op_of_node(node: Any) -> str:
    return _op_of_name(node.name(), isinstance(node, torch.autograd.function.BackwardCFunction))


def _op_of_tensor(tensor: torch.Tensor, saver: str, producer: str | None) -> str:
    """Rule 5: the op that made ``tensor``, as far as the graph tells."""
    if producer is not None:
        return producer
    if tensor.grad_fn is not None:
        return _op_of_node(tensor.grad_fn)
    base = _compat.view_base(tensor)
    owner = tensor if base is None else base
    if owner.is_leaf and owner.requires_grad:
        return LEAF
    return _saved_by(saver, None)


def _saved_by(saver: str, producer: str | None) -> str:
    if producer is not None:
        return producer
    return saver if saver == _REGION_INPUT else f"(saved by {saver})"


def _op_of_cache_key(key: object) -> str:
    """The op a selective cache key stands for (``_selective.ops``: an op's id)."""
    facts = _op_facts.get(key) if isinstance(key, int) else None
    op = facts[0] if facts is not None else key
    packet = getattr(op, "overloadpacket", None)
    name = str(getattr(packet, "__name__", None) or getattr(op, "__name__", None) or op)
    return f"{op.namespace}::{name}" if is_collective(op) else name  # type: ignore[attr-defined]
