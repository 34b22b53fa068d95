"""The most memory held at once while a step runs (NOTE [Planner solve], Rule S6).

Owns ``step_peaks`` (CUDA: the allocator's peak) and ``cpu_peak``. On CPU a dispatch mode notes
the storage of every tensor an op returns that shares no storage with the op's inputs (a new
allocation; a view or an in-place result is not one), adds its bytes, and subtracts them when a
weak reference to the storage says it was freed. It reads the tensors, not the allocator: no
profiler session is opened, so any number of threads may measure at once, and a caller's own
``torch.profiler`` session is left alone (a second session would end it). What the mode cannot
see is not counted: memory a kernel allocates and frees inside one op, except where ``scratch``
knows the kernel (Rule 4), and a tensor made with dispatch disabled (an RNG state).

NOTE [Live bytes]
  Rule 1. A storage is counted once, from the op that returned it first (keyed by its data
          pointer while it lives), until it is freed; memory made before the run is never counted
          and never subtracted, so the number is the peak above what was held before.
  Rule 2. The mode is per thread (torch's dispatch-mode stack is), and a storage can be freed in
          any thread: its count changes under a lock. After the run the mode stops counting, and
          a late free of a storage it counted changes nothing anyone reads.
  Rule 3. A region's backward window opens when the gradient of an output of one of its calls
          is computed and closes when that of one of its inputs is (tensor hooks, made by
          forward hooks that are removed after the run); a window left open ends where the next
          opens. The most bytes live in a region's windows is what the planner's peak model
          compares with that region's working set (NOTE [Planner solve], Rule S6).
  Rule 4. An op whose kernel holds work buffers while it runs (``scratch``: the CPU attention
          kernels) is counted at its outputs plus those buffers, at that instant only.
  Rule 5. A step of fake tensors (NOTE [Planning without memory]) is counted by the same mode,
          on any device, a storage keyed by its storage object instead of its pointer (NOTE
          [Storage keys], Rule 4): the bytes its storages would take while they live, no
          allocator read.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..._compat import TorchDispatchMode, storage_identity, tree_leaves
from ..._trees import storage_of
from .scratch import scratch_bytes

__all__ = ["Peaks", "cpu_peak", "step_peaks"]


def _storage(leaf: object) -> torch.UntypedStorage | None:
    """The CPU storage behind ``leaf`` if it is a dense CPU tensor with memory, else None."""
    if not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu":
        return None
    if leaf.layout != torch.strided:
        return None
    return storage_of(leaf)  # a DTensor's local shard's; None for an invalid python storage


def _shape_storage(leaf: object) -> torch.UntypedStorage | None:
    """Rule 5: the storage object behind a dense tensor of a step of shapes, else None."""
    if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
        return None
    return leaf.untyped_storage()


def _pointer(storage: torch.UntypedStorage) -> int:
    return storage.data_ptr()


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops return, while they live (See NOTE [Live bytes])."""

    def __init__(self, regions: int = 0, shapes: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        # Rule 5: a step of shapes keys its storages by their objects, on any device.
        self._storage = _shape_storage if shapes else _storage
        self._pointer = storage_identity if shapes else _pointer
        self._lock = threading.Lock()
        # data pointer -> (bytes, the weak reference that reports its free): Rule 1.
        self._counted: dict[int, tuple[int, weakref.ref[torch.UntypedStorage]]] = {}
        self.live = 0
        self.peak = 0
        self.windows = [0] * regions  # Rule 3
        self._window: int | None = None

    def enters(self, index: int) -> Callable[..., None]:
        """Rule 3: a forward hook of region ``index``: the gradient of an output of its call
        opens its window."""

        def enter(_module: nn.Module, _args: object, output: object) -> None:
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    hook = functools.partial(self._open, index)
                    leaf.register_hook(hook)  # type: ignore[no-untyped-call]  # torch's is untyped

        return enter

    def leaves(self, index: int) -> Callable[..., None]:
        """Rule 3: a forward pre-hook of region ``index``: the gradient of an input of its call
        closes its window."""

        def leave(_module: nn.Module, args: object, kwargs: object) -> None:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    hook = functools.partial(self._close, index)
                    leaf.register_hook(hook)  # type: ignore[no-untyped-call]  # torch's is untyped

        return leave

    def _open(self, index: int, _grad: torch.Tensor) -> None:
        with self._lock:
            self._window = index
            self.windows[index] = max(self.windows[index], self.live)

    def _close(self, index: int, _grad: torch.Tensor) -> None:
        with self._lock:
            if self._window == index:
                self._window = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        found = self._storage
        inputs = {self._pointer(s) for leaf in tree_leaves((args, kwargs)) if (s := found(leaf))}
        for leaf in tree_leaves(out):
            storage = found(leaf)
            if storage is not None and self._pointer(storage) not in inputs:
                self._count(storage)
        scratch = scratch_bytes(func, args, kwargs or {})
        if scratch:  # Rule 4: held inside the call, with its outputs
            self._count_at(self.live + scratch)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        pointer, size = self._pointer(storage), storage.nbytes()
        with self._lock:
            if pointer in self._counted:
                return
            self._counted[pointer] = (size, weakref.ref(storage, self._freed_at(pointer)))
            self.live += size
            held = self.live
        self._count_at(held)

    def _count_at(self, held: int) -> None:
        """``held`` bytes were live at once: the peak, and the open window's (Rule 3)."""
        with self._lock:
            self.peak = max(self.peak, held)
            if self._window is not None:
                self.windows[self._window] = max(self.windows[self._window], held)

    def _freed_at(self, pointer: int) -> Callable[[object], None]:
        def freed(_reference: object) -> None:
            with self._lock:  # Rule 2: any thread may free it
                entry = self._counted.pop(pointer, None)
                if entry is not None:
                    self.live -= entry[0]

        return freed

    def stop(self) -> None:
        """Rule 2: forget every storage; their frees after this change nothing."""
        with self._lock:
            self._counted.clear()


def cpu_peak(run: Callable[[], None]) -> int:
    """Bytes: the most CPU tensor memory ``run()`` held at once above what was held before
    (See NOTE [Live bytes]); safe in any thread and inside a caller's profiler session."""
    return step_peaks(run, torch.device("cpu"), ()).step


@dataclass(frozen=True)
class Peaks:
    """A step's peak above what was held before, and per region the most held while backward
    ran it (Rule 3; empty where not measured)."""

    step: int
    regions: tuple[int, ...] = ()


def step_peaks(
    run: Callable[[], None],
    device: torch.device,
    regions: Sequence[nn.Module],
    shapes: bool = False,
) -> Peaks:
    """The peaks of the training step ``run()`` on ``device``: CPU, counted by the mode (with
    ``regions``' backward windows, Rule 3); CUDA, the allocator's peak; other devices, 0. A
    step of shapes (``shapes``) is counted by the mode on any device (Rule 5)."""
    if device.type == "cuda" and not shapes:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return Peaks(max(0, torch.cuda.max_memory_allocated(device) - before))
    if device.type != "cpu" and not shapes:
        return Peaks(0)
    mode = _LiveBytes(len(regions), shapes)
    handles = []
    try:
        for index, module in enumerate(regions):
            handles.append(module.register_forward_pre_hook(mode.leaves(index), with_kwargs=True))
            handles.append(module.register_forward_hook(mode.enters(index)))
        with mode:
            run()
    finally:
        for handle in handles:
            handle.remove()
        mode.stop()
    return Peaks(mode.peak, tuple(mode.windows))
