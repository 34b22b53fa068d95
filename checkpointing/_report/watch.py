"""The report of a watched step: ``with saved_tensors_report() as report:`` around forward and
backward.

Owns ``watch_step`` (the context manager behind that form), its watcher (listener, outer hook)
and its dispatch mode. The rows and totals are ``records``'; the other way to build a report, a
walk of the graph from a loss, is ``graph``'s.

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
     inside the block and the names ``policies.tag`` gives (``_events.note_tag``), and counts
     the ops (and, where ``torch.utils.flop_counter`` knows the op, the FLOPs) run while
     ``is_recomputing()``.
  4. What the outer hook sees, and what mechanisms announce, while a backward runs is not
     counted: it is not kept between forward and backward (a nested region re-run by its
     parent's recompute announces its holders, RNG state and selective cache anew). The re-run
     of a ``use_reentrant=True`` checkpoint saves its tensors there (no hook of a checkpoint
     sits above ours) and they are freed within that backward; a ``create_graph`` backward
     saves for the next backward. Counting the first made a reentrant step's bytes several
     times the allocator's, and different on every run (freed addresses are reused, and
     storages are keyed by address). A reentrant checkpoint's RNG states are kept by plain
     reference and announced by no one: ``notes`` says so.
  5. Regions are labelled as NOTE [Region names] says, with the report's naming (the model
     given, or numbers) lent to the mechanisms while the block runs. The selective modes
     announce their saved and offloaded outputs as region "sac" (they do not know the frame):
     the row takes the region whose forward runs, where one does (a selective context given to
     torch's own checkpoint runs in none, and keeps "sac").

Activations are the kept storages that ops made inside the block, except those of leaf tensors
that require grad (inputs and parameters created there). Whether a tensor requires grad does not
matter otherwise: a dropout mask or an attention mask made in forward and saved for backward is
memory the step keeps (the planner counts the same way: NOTE [Planner measure], Rule M2), while
inputs and parameters made before the block, grad or not (token ids), are not activations. The
RNG states checkpoints keep are activations too: memory the step allocated (Rule 14 there). So
on CPU, after a forward run in the block, ``activation_bytes`` is what the allocator holds of
what the forward allocated, less what the caller still holds itself (the loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakTensorKeyDictionary

from .. import _compat
from .._events import Decision, Kept, current_region, listener, note_tag, tag_name
from .._regions import RegionNames, naming
from .._selective import TAG_OP
from .._selective.collectives import is_collective
from .._state import is_recomputing
from .._trees import StorageKey, storage_key, tensors
from .records import LEAF, OUTSIDE, SELECTIVE, SavedTensorsReport, Tally

__all__ = ["watch_step", "watcher_unpack"]

_NOTE_REENTRANT = (
    "use_reentrant=True checkpoints ran: the RNG states each keeps for its re-run (with "
    "preserve_rng_state=True) are held by plain reference, out of any hook's sight, and are not "
    "counted in kept_bytes or activation_bytes; use_reentrant=False counts them "
    "(rng_state_bytes). What the re-run saves inside backward is freed there and not counted."
)


class _Watcher:
    """The listener, outer hook and dispatch mode of one report."""

    def __init__(self, report: SavedTensorsReport) -> None:
        self.report = report
        self.tally = Tally(report)
        self.producers: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.made: set[StorageKey] = set()  # storages ops made inside the block

    def record(
        self, tensor: torch.Tensor, region: str, decision: Decision, nbytes: int | None = None
    ) -> None:
        op: str = self.producers.get(tensor, LEAF)  # type: ignore[no-untyped-call]  # untyped
        self.tally.row(op, tensor, region, decision, tag_name(tensor), nbytes)

    def on_tensor(
        self, tensor: torch.Tensor, *, region: str, decision: Decision, nbytes: int | None = None
    ) -> None:
        """Listener protocol: a mechanism took charge of ``tensor``. What a selective cache
        saves is kept outside autograd's graph, so it counts towards ``kept_bytes`` here (a
        compressed tensor by its packed bytes)."""
        if _compat.current_graph_task_id() != -1:  # See "How it watches", 4
            return
        if region == SELECTIVE:  # See "How it watches", 5
            region = current_region.get() or region
        self.record(tensor, region, decision, nbytes)
        if decision == "saved":
            self.tally.keep(tensor, activation=True)  # an op's output, though detached
        elif decision == "compressed" and nbytes is not None:
            self.tally.keep_bytes(tensor.device, nbytes)

    def on_kept(self, tensor: torch.Tensor, *, region: str, what: Kept) -> None:
        """Listener protocol: ``region`` keeps ``tensor`` by plain reference. An RNG state is
        memory the step allocated; an input is an activation as the hook would judge it."""
        if _compat.current_graph_task_id() != -1:  # See "How it watches", 4
            return
        self.tally.row(what, tensor, region, "saved", tag_name(tensor))
        rng = what == "rng state"
        self.tally.keep(tensor, activation=not rng and self.is_activation(tensor), rng=rng)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Outer hook: ``tensor`` is really kept. Return a detached alias, never the object
        itself (that would be a reference cycle through its ``grad_fn``)."""
        if _compat.current_graph_task_id() != -1:  # See "How it watches", 4
            if is_recomputing():
                self.tally.note(_NOTE_REENTRANT)
            return tensor.detach()
        self.record(tensor, current_region.get() or OUTSIDE, "saved")
        self.tally.keep(tensor, activation=self.is_activation(tensor))
        return tensor.detach()

    def is_activation(self, tensor: torch.Tensor) -> bool:
        """Made by an op inside the block, and not a leaf that requires grad."""
        base = _compat.view_base(tensor)
        owner = tensor if base is None else base
        made = storage_key(tensor) in self.made
        return made and not (owner.is_leaf and owner.requires_grad)

    def note_made(self, inputs: Any, outputs: Any) -> None:
        """Note the storages of ``outputs`` that are new: not shared with an input (a view or
        an in-place write makes nothing)."""
        read = {storage_key(t) for t in tensors(inputs)}
        for tensor in tensors(outputs):
            key = storage_key(tensor)
            if key is not None and key not in read:
                self.made.add(key)

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
        if func is TAG_OP and args and isinstance(args[0], torch.Tensor):
            note_tag(args[0], args[1] if len(args) > 1 else kwargs["name"])
        self.watcher.note_made((args, kwargs), out)
        name = str(func.overloadpacket.__name__)
        if is_collective(func):  # records.COLLECTIVE_NAMESPACES
            name = f"{func.namespace}::{name}"
        for tensor in tensors(out):
            self.watcher.producers[tensor] = name
        if is_recomputing():
            report = self.watcher.report
            report.recompute_ops += 1
            count = flop_registry.get(func.overloadpacket)
            if count is not None:
                report.recompute_flops += int(count(*args, **kwargs, out_val=out))
        return out


@contextmanager
def watch_step(model: nn.Module | None = None) -> Iterator[SavedTensorsReport]:
    """``with saved_tensors_report() as report:``: watch the block; the report is filled while
    it runs and complete when it exits. ``model`` names module regions by path ("How it
    watches", 5)."""
    report = SavedTensorsReport()
    watcher = _Watcher(report)
    token = listener.set(watcher)
    names = naming.set(RegionNames(model))
    _compat.push_saved_tensors_hooks(watcher, watcher.unpack)
    try:
        with _ProducerMode(watcher):
            yield report
    finally:
        _compat.pop_saved_tensors_hooks()
        naming.reset(names)
        listener.reset(token)


watcher_unpack: Final = _Watcher.unpack
"""The unpack hook of what a watching report packed: a graph walk takes what it packed for a
plain save (a step run under ``with saved_tensors_report():`` can be walked too)."""
