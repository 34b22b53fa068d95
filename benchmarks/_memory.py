"""Memory of one training step on CPU, measured three independent ways.

1. **saved** — the bytes autograd keeps for backward, seen from *outside* the library: an outer
   ``torch.autograd.graph.saved_tensors_hooks`` is pushed around the forward; a checkpoint pushes
   its own hook *on top* of it while its region runs, so the outer hook only sees what is really
   kept in the graph (inputs a checkpoint saves, tensors a policy saves, everything of an
   un-checkpointed region). We sum the sizes of the *unique storages* it is handed (views of one
   buffer count once), leaving out the parameters' storages, which live whether or not anything
   is checkpointed. Blind spot: a tensor a library keeps by plain Python reference (a closure, a
   holder dict) never reaches the hook, which is why (2) exists. ``gradient_checkpoint_scope``
   defers to a foreign hook below it by design (its Rule 4: it does not linger above one, so
   tensors saved *after* the scope would go to this instrument and be kept); for the scope rows
   this pass runs the forward inside ``gradient_checkpoint_session()``, the scope API's explicit
   mode, which keeps its hook on top for the block and hands every other tensor down to ours.
2. **held** and **peak** — the CPU allocator's own account: under
   ``torch.profiler.profile(profile_memory=True)`` every allocation and free is an event with a
   signed byte count. Sorted by time and summed, they give the bytes allocated *during the step*
   at every instant (the profiler does not report frees of blocks allocated before it started,
   so a step that frees older memory is never credited for it). *held* is that sum at the end
   of the forward (everything the forward created and did not free: activations kept by any
   means, plus the loss); *peak* is its maximum over forward + backward, i.e. the peak above the
   memory in use when the step starts (gradients are set to ``None`` before the step, so
   gradient buffers count in the peak). Tensors that existed before the step (the input, the
   parameters) are not in these numbers.
3. **py held** — Python heap bytes still allocated at the end of the forward (``tracemalloc``,
   after a ``gc.collect()``): the per-call bookkeeping of a library (frames, holders, closures),
   which matters when the tensors are tiny (W3, W4).

``benchmarks/validate_memory.py`` checks (1) and (2) against counts known in advance on a chain of
equal layers: N activations without checkpoint, one per region with it, about √N with √N
segments. Each measurement runs its own step, so the instruments never see each other.
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import ProfilerActivity, profile, record_function

_FORWARD_MARK = "benchmarks::forward"


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one step: saved for backward, held after forward, peak, Python heap held."""

    saved: int
    saved_tensors: int
    held: int
    peak: int
    py_held: int | None  # None where the pass was skipped (--quick)


def _storage_key(tensor: Tensor) -> tuple[int, int]:
    """The (address, size) of the buffer behind ``tensor``."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_bytes(
    forward: Callable[[], Tensor],
    exclude: Iterable[Tensor],
    inside: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[int, int]:
    """Bytes and count of unique storages saved for backward by ``forward``, seen by an outer hook.

    ``forward`` runs in ``inside()``, entered under the outer hook. The saved tensors are kept
    alive until the count is done, so no address can be reused.
    """
    excluded = {_storage_key(t) for t in exclude}
    seen: dict[tuple[int, int], Tensor] = {}
    packed = 0

    def pack(tensor: Tensor) -> Tensor:
        nonlocal packed
        packed += 1
        key = _storage_key(tensor)
        if key not in excluded:
            seen.setdefault(key, tensor)
        # A detached alias: returning ``tensor`` itself could close a reference cycle.
        return tensor.detach()

    def unpack(tensor: Tensor) -> Tensor:
        return tensor

    # Selective checkpointing warns (torch 2.14's FutureWarning, ours on every release) that what
    # it keeps bypasses this hook: that is the behaviour this instrument relies on (what the
    # policy keeps is counted by the allocator pass), so the warning is noise here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "A saved_tensors_hooks context", FutureWarning)
        with saved_tensors_hooks(pack, unpack), inside():
            loss = forward()
    loss.backward()
    total = sum(size for _, size in seen)
    count = len(seen)
    del loss
    seen.clear()
    return total, count


def allocator_bytes(forward: Callable[[], Tensor]) -> tuple[int, int]:
    """(held after forward, peak over forward + backward), from the profiler's allocator events."""
    with warnings.catch_warnings():
        # torch 2.11-2.13 warn once per process that a profiler clears its events per cycle.
        warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function(_FORWARD_MARK):
                loss = forward()
            loss.backward()
            del loss
    results = prof.profiler.kineto_results  # set once profiling has ended
    events = results.events()
    forward_end = max(e.start_ns() + e.duration_ns() for e in events if e.name() == _FORWARD_MARK)
    changes = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU"
    )
    live = peak = held = 0
    for when, size in changes:
        live += size
        peak = max(peak, live)
        if when <= forward_end:
            held = live
    return held, peak


def python_heap_bytes(forward: Callable[[], Tensor]) -> int:
    """Python heap bytes allocated by ``forward`` and still alive when it returns."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        loss = forward()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    loss.backward()
    del loss
    return after - before


def measure(
    forward: Callable[[], Tensor],
    params: list[Tensor],
    zero_grads: Callable[[], None],
    saved_inside: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    python_heap: bool = True,
) -> StepMemory:
    """The measurements of one step of ``forward``, each on a fresh step (``saved_inside`` is
    the context of the saved-bytes pass, see the module docstring; ``python_heap`` False skips
    the slowest pass)."""
    zero_grads()
    saved, count = saved_bytes(forward, params, saved_inside)
    zero_grads()
    held, peak = allocator_bytes(forward)
    zero_grads()
    py_held = python_heap_bytes(forward) if python_heap else None
    zero_grads()
    return StepMemory(saved=saved, saved_tensors=count, held=held, peak=peak, py_held=py_held)
