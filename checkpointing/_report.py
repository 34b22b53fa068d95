"""The saved-tensor report: what autograd keeps for backward, and what recompute costs.

Owns ``saved_tensors_report`` (a context manager around a training step), its data
(``SavedTensorsReport``, ``SavedTensorRecord``) and its table. JAX's ``print_saved_residuals`` is
the model: one row per tensor, with the op that produced it, shape, dtype, bytes, the region it
belongs to and what happens to it (saved, recomputed, offloaded).

How it watches (no mechanism knows about the report; they only announce through ``_events``):
  1. An outer saved-tensors hook, pushed on entry, sees every tensor really kept: saved outside
     any region, or kept as a region's input. Checkpoint hooks sit above it, so tensors that a
     region drops never reach it.
  2. The mechanisms announce the tensors they take charge of: the frame and the scope those they
     will recompute, the selective modes those they save or offload. The frame also announces
     what it keeps by plain reference, which no hook sees (NOTE [Nestable checkpoint], Rule 11):
     its RNG states (op "rng state"; a state shared by consecutive regions is a row of each but
     its bytes count once) and the tensors it received by keyword ("keyword input") or inside a
     container ("nested input").
  3. A dispatch mode maps each tensor to the op that produced it, notes the storages ops make
     inside the block, and counts the ops (and, where ``torch.utils.flop_counter`` knows the
     op, the FLOPs) run while ``is_recomputing()``.
  4. What the outer hook sees while a backward runs is not counted: it is not kept between
     forward and backward. The re-run of a ``use_reentrant=True`` checkpoint saves its tensors
     there (no hook of a checkpoint sits above ours) and they are freed within that backward;
     a ``create_graph`` backward saves for the next backward. Counting the first made a
     reentrant step's bytes several times the allocator's, and different on every run (freed
     addresses are reused, and storages are keyed by address). A reentrant checkpoint's RNG
     states are kept by plain reference and announced by no one: ``notes`` says so.

Activations are the kept storages that ops made inside the block, except those of leaf tensors
that require grad (inputs and parameters created there). Whether a tensor requires grad does not
matter otherwise: a dropout mask or an attention mask made in forward and saved for backward is
memory the step keeps (the planner counts the same way: NOTE [Planner model], Rule 2), while
inputs and parameters made before the block, grad or not (token ids), are not activations. The
RNG states checkpoints keep are activations too: memory the step allocated (Rule 14 there). So
on CPU, after a forward run in the block, ``activation_bytes`` is what the allocator holds of
what the forward allocated, less what the caller still holds itself (the loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakTensorKeyDictionary

from . import _compat
from ._events import Decision, Kept, current_region, listener
from ._state import is_recomputing

__all__ = ["SavedTensorRecord", "SavedTensorsReport", "saved_tensors_report"]

_OUTSIDE = "(outside any region)"
_LEAF = "(input or parameter)"
_NOTE_REENTRANT = (
    "use_reentrant=True checkpoints ran: the RNG states each keeps for its re-run (with "
    "preserve_rng_state=True) are held by plain reference, out of any hook's sight, and are not "
    "counted in kept_bytes or activation_bytes; use_reentrant=False counts them "
    "(rng_state_bytes). What the re-run saves inside backward is freed there and not counted."
)


@dataclass(frozen=True, slots=True)
class SavedTensorRecord:
    """One tensor autograd needs for backward, and what happens to it until then."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    region: str
    decision: Decision


@dataclass
class SavedTensorsReport:
    """What a step saved for backward. ``str(report)`` is a table; the fields are the data."""

    records: list[SavedTensorRecord] = field(default_factory=list)
    recompute_ops: int = 0
    recompute_flops: int = 0
    kept_bytes: int = 0
    """Bytes of the distinct storages kept between forward and backward (device memory)."""
    activation_bytes: int = 0
    """The part of ``kept_bytes`` that is activations: storages that ops made inside the block
    (saved masks included, though they do not require grad), not those of inputs and
    parameters, which stay in memory whether or not anything is checkpointed."""
    rng_state_bytes: int = 0
    """The part of ``activation_bytes`` that is RNG states our checkpoints keep for recompute
    (each distinct state once). torch's own checkpoint keeps one per region too, but out of
    sight of this report: subtract this to compare with a step checkpointed by torch."""
    notes: list[str] = field(default_factory=list)
    """What the report saw but could not count, and why (printed under the table)."""

    def bytes_by_decision(self) -> dict[Decision, int]:
        """Total tensor bytes per decision (a tensor saved twice counts twice here)."""
        totals: dict[Decision, int] = {"saved": 0, "recomputed": 0, "offloaded": 0}
        for record in self.records:
            totals[record.decision] += record.nbytes
        return totals

    def table(self) -> str:
        """A fixed-width table of the records, then the totals."""
        header = f"{'op':<34} {'shape':<20} {'dtype':<9} {'bytes':>12}  {'decision':<10} region"
        lines = [header, "-" * len(header)]
        for r in self.records:
            dtype = str(r.dtype).removeprefix("torch.")
            lines.append(
                f"{r.op[:34]:<34} {str(list(r.shape))[:20]:<20} {dtype:<9} {r.nbytes:>12,}  "
                f"{r.decision:<10} {r.region}"
            )
        totals = self.bytes_by_decision()
        lines.append("-" * len(header))
        lines.append(
            f"kept for backward: {self.kept_bytes:,} bytes in distinct storages, "
            f"{self.activation_bytes:,} of them activations; "
            + ", ".join(f"{k}: {v:,} bytes" for k, v in totals.items())
        )
        lines.append(
            f"recompute cost: {self.recompute_ops} ops, {self.recompute_flops:,} FLOPs "
            "(FLOPs only for ops torch.utils.flop_counter knows)"
        )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class _Watcher:
    """The listener, outer hook and dispatch mode of one report."""

    def __init__(self, report: SavedTensorsReport) -> None:
        self.report = report
        self.producers: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.made: set[tuple[int, torch.device]] = set()  # storages ops made inside the block
        self.kept_storages: dict[tuple[int, torch.device], int] = {}
        self.activation_storages: dict[tuple[int, torch.device], int] = {}
        self.rng_storages: dict[tuple[int, torch.device], int] = {}

    def record(self, tensor: torch.Tensor, region: str, decision: Decision) -> None:
        op: str = self.producers.get(tensor, _LEAF)  # type: ignore[no-untyped-call]  # untyped
        nbytes = tensor.numel() * tensor.element_size()
        self.report.records.append(
            SavedTensorRecord(op, tuple(tensor.shape), tensor.dtype, nbytes, region, decision)
        )

    def on_tensor(self, tensor: torch.Tensor, *, region: str, decision: Decision) -> None:
        """Listener protocol: a mechanism took charge of ``tensor``. What a selective cache
        saves is kept outside autograd's graph, so it counts towards ``kept_bytes`` here."""
        self.record(tensor, region, decision)
        if decision == "saved":
            self.keep(tensor, activation=True)  # an op's output, though the cache detached it

    def on_kept(self, tensor: torch.Tensor, *, region: str, what: Kept) -> None:
        """Listener protocol: ``region`` keeps ``tensor`` by plain reference. An RNG state is
        memory the step allocated; an input is an activation as the hook would judge it."""
        nbytes = tensor.numel() * tensor.element_size()
        self.report.records.append(
            SavedTensorRecord(what, tuple(tensor.shape), tensor.dtype, nbytes, region, "saved")
        )
        self.keep(tensor, activation=what == "rng state" or self.is_activation(tensor))
        if what == "rng state":
            key = _storage_key(tensor)
            if key is not None:
                self.rng_storages[key] = tensor.untyped_storage().nbytes()
                self.report.rng_state_bytes = sum(self.rng_storages.values())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Outer hook: ``tensor`` is really kept. Return a detached alias, never the object
        itself (that would be a reference cycle through its ``grad_fn``)."""
        if _compat.current_graph_task_id() != -1:  # See "How it watches", 4
            if is_recomputing() and _NOTE_REENTRANT not in self.report.notes:
                self.report.notes.append(_NOTE_REENTRANT)
            return tensor.detach()
        self.record(tensor, current_region.get() or _OUTSIDE, "saved")
        self.keep(tensor, activation=self.is_activation(tensor))
        return tensor.detach()

    def is_activation(self, tensor: torch.Tensor) -> bool:
        """Made by an op inside the block, and not a leaf that requires grad."""
        base = _compat.view_base(tensor)
        owner = tensor if base is None else base
        made = _storage_key(tensor) in self.made
        return made and not (owner.is_leaf and owner.requires_grad)

    def note_made(self, inputs: Any, outputs: Any) -> None:
        """Note the storages of ``outputs`` that are new: not shared with an input (a view or
        an in-place write makes nothing)."""
        read = {_storage_key(t) for t in _compat.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        for tensor in _compat.tree_leaves(outputs):
            if isinstance(tensor, torch.Tensor):
                key = _storage_key(tensor)
                if key is not None and key not in read:
                    self.made.add(key)

    def keep(self, tensor: torch.Tensor, activation: bool) -> None:
        """Count ``tensor``'s storage once in ``kept_bytes`` (and ``activation_bytes``)."""
        key = _storage_key(tensor)
        if key is None:
            return
        storage = tensor.untyped_storage()
        self.kept_storages[key] = storage.nbytes()
        self.report.kept_bytes = sum(self.kept_storages.values())
        if activation:
            self.activation_storages[key] = storage.nbytes()
            self.report.activation_bytes = sum(self.activation_storages.values())

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    # The watcher itself is the outer pack hook, marked checkpoint-internal (NOTE [Nestable
    # checkpoint], Rule 10) so that selective checkpointing in the block never takes it for a
    # user's hook. It shadows every hook below it (what it packs stays with it), so it names no
    # user hooks either.
    __call__ = pack
    _checkpoint_internal: Final = True
    _user_hooks: Final = None


def _storage_key(tensor: torch.Tensor) -> tuple[int, torch.device] | None:
    """Where ``tensor``'s memory lives; None for tensors without memory (meta, sparse)."""
    if tensor.device.type == "meta" or tensor.is_sparse:
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.device)


class _ProducerMode(_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    def __init__(self, watcher: _Watcher) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.watcher = watcher

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.watcher.note_made((args, kwargs), out)
        name = str(func.overloadpacket.__name__)
        for tensor in _compat.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.watcher.producers[tensor] = name
        if is_recomputing():
            report = self.watcher.report
            report.recompute_ops += 1
            count = flop_registry.get(func.overloadpacket)
            if count is not None:
                report.recompute_flops += int(count(*args, **kwargs, out_val=out))
        return out


@contextmanager
def saved_tensors_report() -> Iterator[SavedTensorsReport]:
    """Watch a step and report every tensor kept for backward and what recompute costs.

    Run forward inside the block; run backward inside it too to count recompute ops and FLOPs.
    The report is filled while the block runs and complete when it exits.

    Example:
        >>> import torch, checkpointing
        >>> lin = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> with checkpointing.saved_tensors_report() as report:
        ...     y = checkpointing.checkpoint(lambda t: lin(t).relu(), x, use_reentrant=False)
        ...     y.sum().backward()
        >>> report.recompute_ops > 0
        True
    """
    report = SavedTensorsReport()
    watcher = _Watcher(report)
    token = listener.set(watcher)
    _compat.push_saved_tensors_hooks(watcher, watcher.unpack)
    try:
        with _ProducerMode(watcher):
            yield report
    finally:
        _compat.pop_saved_tensors_hooks()
        listener.reset(token)
