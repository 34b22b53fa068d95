"""Host copies off the critical path: the device<->host transfers of offload, on side streams.

Owns ``Transfer`` (one offloaded device tensor: its pinned host copy and the copies' events), the
``Engine`` that issues, prefetches and retires transfers, the bounded pool of pinned buffers, and
the ``Backend`` interface through which every stream, event and pinned-memory call goes: CUDA's
(``CudaBackend``, through ``_compat``) by default, a fake in the tests (streams as ordered queues,
events as completion points), installed with ``installed(engine)``, and ``OffloadStats``, what
the engine and its users count (bytes each way, restores that waited, unhidden copy time). What
to offload is the policies' business; the record that holds a transfer is ``_host_copy``'s
(``HostCopy``, used by selective checkpointing, kept spans and ``offload_wrapper``), which
imports this module.

NOTE [Host copies off the critical path]
  Rule 1. A device->host copy is queued on a side stream ("d2h") that first waits for an event
          recorded on the producer's (current) stream at offload time: the copy starts as soon as
          the tensor exists and never delays the compute stream.
  Rule 2. The device tensor stays referenced by its transfer until the host has seen the copy's
          event complete (checked lazily, never by blocking: at later offloads, at restores, at
          the end of a backward), or until the forward is two regions further on: when a
          region's group is made, the copies of the region before the previous one are fenced
          (the producer's stream waits for them; a version change seen then makes them stale,
          Rule 3; a later write is queued behind the copy) and their device tensors let go. So
          at most two regions' copies hold device memory while the host runs ahead of the
          device, and a forward never ends holding more. A transfer handed out or dropped
          before its copy is seen done gives its device tensor to the allocator with
          ``record_stream(d2h)``: its block is not reused before the copy has run. No early
          free, no use after free.
  Rule 3. The host copy is a snapshot only once the host has seen its copy complete with the
          device tensor's version unchanged. A version change seen first (an in-place write
          queued after the offload, possibly running before the copy) makes the transfer stale:
          it is never restored; selective checkpointing then recomputes the op (NOTE [Selective
          checkpoint cache], Rule 7), a kept span raises the in-place error.
  Rule 4. Host buffers come from a pool of pinned buffers by exact size; a buffer goes back to
          it only when every copy that used it has completed (a consumed transfer, or one whose
          graph died), and the pool keeps at most ``pool_bytes`` of free buffers.
  Rule 5. Restores are prefetched on a side stream ("h2d") in forward order: when backward
          reaches a region (``begin``: the selective recompute mode's ``__enter__``, or a kept
          span's first restore), every untaken transfer of that region, then those of the region
          made before it in the same forward thread (the one backward reaches next). The bytes
          restored by prefetch and not yet taken never exceed ``prefetch_bytes``; a transfer
          bigger than that is restored when taken. Each take tops the prefetch up.
  Rule 6. ``take`` makes the current stream wait for the restore's event (it never copies on the
          compute stream), records that stream's use of the restored tensor (it was allocated
          for "h2d"), and counts a wait as unhidden copy time (``OffloadStats``).
  Rule 7. Nothing outlives its graph: prefetch plans hold transfers weakly, a dead transfer
          returns its prefetch bytes and hands its buffer and device tensor to the retiring list
          (Rule 2 and 4), and the end of every backward that restored something settles what it
          can without blocking.

Rejected: copying on the compute stream with an event per copy (the old way: no copy overlaps
compute; an 8-layer bf16 transformer on an H200 took 2.31x the time of keeping the matmul outputs
on the device, issue 27). Keeping only an event and relying on ``record_stream`` for the device
tensor from the start: frees the memory sooner, but the version counter (Rule 3) needs the tensor
until the copy is seen done. Torch's caching host allocator alone for the pinned buffers: it is
unbounded and never gives memory back between steps.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import torch

from . import _compat

__all__ = [
    "Backend",
    "CudaBackend",
    "Engine",
    "Group",
    "OffloadStats",
    "Stale",
    "Transfer",
    "begin",
    "claims",
    "end",
    "engine",
    "installed",
    "poll_all",
]

Direction = Literal["d2h", "h2d"]

DEFAULT_PREFETCH_BYTES: Final = 1 << 30
DEFAULT_POOL_BYTES: Final = 2 << 30


@dataclass
class OffloadStats:
    """Bytes selective checkpointing moved to host memory in forward and back for recompute.

    Pass one to ``create_selective_checkpoint_contexts(..., offload_stats=stats)`` or
    ``policies.as_context_fn(..., offload_stats=stats)`` to add up many regions and steps; each
    pair of modes also exposes its own as ``.offload_stats``. A host (CPU) tensor under an
    offload decision stays where it is (like save) and is still counted, so the numbers follow
    the policy's decisions on any device. Safe to update from forward and backward threads.

    ``waited_restores`` counts the restores whose copy had not finished when the recompute
    needed the tensor (the compute stream waited for it); with ``time_copies=True`` CUDA events
    measure those waits, and ``unhidden_copy_seconds`` adds them up: the copy time the overlap
    did not hide. Read it once the device has finished the step (after
    ``torch.cuda.synchronize()``). Host tensors are never copied, so on CPU both stay 0.

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
    waited_restores: int = 0
    time_copies: bool = False
    _unhidden: float = field(default=0.0, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def unhidden_copy_seconds(self) -> float:
        """Seconds the compute stream waited for restores (``time_copies=True``; else 0)."""
        poll_all()
        return self._unhidden

    def reset(self) -> None:
        """Set every counter back to zero (e.g. between training steps)."""
        with self._lock:
            self.offloaded_tensors = self.offloaded_bytes = 0
            self.restored_tensors = self.restored_bytes = 0
            self.waited_restores = 0
            self._unhidden = 0.0

    def _count_wait(self) -> None:
        with self._lock:
            self.waited_restores += 1

    def _add_unhidden(self, seconds: float) -> None:
        with self._lock:
            self._unhidden += seconds

    def _count_offload(self, nbytes: int) -> None:
        with self._lock:
            self.offloaded_tensors += 1
            self.offloaded_bytes += nbytes

    def _count_restore(self, nbytes: int) -> None:
        with self._lock:
            self.restored_tensors += 1
            self.restored_bytes += nbytes


class Stale(Exception):
    """A transfer whose host copy cannot be trusted (Rule 3)."""


class Backend(Protocol):
    """The stream, event and pinned-memory calls of offload; streams and events are opaque."""

    def claims(self, tensor: torch.Tensor) -> bool:
        """Whether this backend moves ``tensor`` (else offload copies it the plain way)."""

    def current_stream(self, device: torch.device) -> Any: ...
    def side_stream(self, device: torch.device, direction: Direction) -> Any: ...
    def record_event(self, stream: Any, timing: bool = False) -> Any: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def event_done(self, event: Any) -> bool: ...
    def elapsed_seconds(self, start: Any, end: Any) -> float: ...
    def pinned_bytes(self, nbytes: int) -> torch.Tensor: ...
    def copy_to_host(self, host: torch.Tensor, source: torch.Tensor, stream: Any) -> None: ...
    def copy_to_device(
        self, host: torch.Tensor, device: torch.device, stream: Any
    ) -> torch.Tensor: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...


class CudaBackend:
    """The CUDA backend: plain dense CUDA tensors, one pair of side streams per device."""

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, Direction], Any] = {}
        self._lock = threading.Lock()

    def claims(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == "cuda"
            and tensor.layout is torch.strided
            and type(tensor) is torch.Tensor
        )

    def current_stream(self, device: torch.device) -> Any:
        return _compat.cuda_current_stream(device)

    def side_stream(self, device: torch.device, direction: Direction) -> Any:
        key = (device, direction)
        stream = self._streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._streams.setdefault(key, _compat.cuda_new_stream(device))
        return stream

    record_event = staticmethod(_compat.cuda_record_event)
    wait_event = staticmethod(_compat.cuda_wait_event)
    event_done = staticmethod(_compat.cuda_event_done)
    elapsed_seconds = staticmethod(_compat.cuda_elapsed_seconds)
    pinned_bytes = staticmethod(_compat.cuda_pinned_bytes)
    copy_to_host = staticmethod(_compat.cuda_copy_to_host)
    copy_to_device = staticmethod(_compat.cuda_copy_to_device)
    record_stream = staticmethod(_compat.cuda_record_stream)


# --- Transfers --------------------------------------------------------------------------------

HOST: Final = 0  # on the host, restorable
_PREFETCHED: Final = 1  # a restore issued, not yet taken
_CONSUMED: Final = 2  # taken for good (selective checkpointing hands an entry out once)


class Group:
    """The transfers of one region (a selective cache, or a kept span), in forward order, and
    the region made before it in the same forward thread (Rule 5). ``reverse``: backward
    restores them last first (a span's saved tensors, unpacked by autograd), not in forward
    order (a selective recompute, which replays the forward)."""

    __slots__ = ("__weakref__", "prev", "reverse", "transfers")

    def __init__(self, prev: Group | None, reverse: bool) -> None:
        self.transfers: list[weakref.ref[Transfer]] = []
        self.prev = weakref.ref(prev) if prev is not None else None
        self.reverse = reverse

    def in_restore_order(self) -> list[weakref.ref[Transfer]]:
        return self.transfers[::-1] if self.reverse else list(self.transfers)


class Transfer:
    """One offloaded device tensor: its pinned host copy and the events of its copies."""

    __slots__ = (
        "__weakref__",
        "buffer",
        "copied",
        "device",
        "engine",
        "group",
        "host",
        "nbytes",
        "restored",
        "restored_event",
        "source",
        "stale",
        "state",
        "stream",
        "version",
    )

    def __init__(self, engine: Engine, tensor: torch.Tensor, group: Group) -> None:
        self.copied: Any = None
        self.restored_event: Any = None
        self.buffer: torch.Tensor | None = None
        self.engine = engine
        self.group = group  # strong: a group lives while any of its transfers does
        self.device = tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.source: torch.Tensor | None = tensor  # Rule 2
        self.stream: Any = None  # the producer's stream (Rule 2's fence)
        self.version = tensor._version
        self.stale = False
        self.state = HOST
        self.restored: torch.Tensor | None = None
        self.buffer = buffer = engine.pool_get(self.nbytes)
        self.host = _host_view(buffer, tensor)

    def __del__(self) -> None:
        self.engine.retire(self)


def _host_view(buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``buffer`` seen as a tensor of ``tensor``'s dtype and shape, with its strides where it is
    dense (as ``empty_like`` would), else contiguous."""
    flat = buffer.view(tensor.dtype)
    if tensor.is_contiguous():
        return flat.view(tensor.shape)
    stride = torch.empty_like(tensor, device="meta").stride()  # no memory: strides only
    return flat.as_strided(tensor.shape, stride)


class _Pool:
    """Free pinned buffers by exact size, at most ``limit`` bytes of them (Rule 4)."""

    __slots__ = ("free", "free_bytes", "limit", "made")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free: dict[int, list[torch.Tensor]] = {}
        self.free_bytes = 0
        self.made = 0  # buffers allocated, for tests of reuse


class Engine:
    """Issues, prefetches and retires transfers for one backend (Rules 1-7). One per process
    (``engine()``); tests install their own with ``installed``. Thread-safe."""

    def __init__(
        self,
        backend: Backend,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        pool_bytes: int = DEFAULT_POOL_BYTES,
    ) -> None:
        self.backend = backend
        self.prefetch_bytes = prefetch_bytes
        self.pool = _Pool(pool_bytes)
        self.held_bytes = 0  # restored by prefetch, not yet taken (Rule 5)
        self.peak_held_bytes = 0
        self.in_flight: list[Transfer] = []  # device->host copies not yet seen done (Rule 2)
        # (events, device tensor, buffer) of dead or consumed transfers (Rules 4 and 7)
        self.retiring: list[tuple[tuple[Any, ...], torch.Tensor | None, torch.Tensor | None]] = []
        self.timings: list[tuple[Any, Any, OffloadStats]] = []
        self._lock = threading.RLock()
        self._forward = threading.local()  # the last group made in this thread (Rule 5)
        self._plans = threading.local()  # this thread's prefetch plan
        self._settling = threading.local()  # the backward whose end polls (Rule 7)
        self._owners = threading.local()  # the owner of the last group made (``group_for``)

    # -- pool (Rule 4) --------------------------------------------------------------------------

    def pool_get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self.pool.free.get(nbytes)
            if free:
                self.pool.free_bytes -= nbytes
                return free.pop()
            self.pool.made += 1
        return self.backend.pinned_bytes(nbytes)

    def _pool_put(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel()
        pool = self.pool
        if pool.free_bytes + nbytes <= pool.limit:
            pool.free.setdefault(nbytes, []).append(buffer)
            pool.free_bytes += nbytes

    # -- forward --------------------------------------------------------------------------------

    def new_group(self, reverse: bool = False) -> Group:
        """A region's group, linked to the one made before it in this thread (Rule 5)."""
        last = getattr(self._forward, "last", None)
        previous = last() if last is not None else None
        group = Group(previous, reverse)
        self._forward.last = weakref.ref(group)
        before = previous.prev() if previous is not None and previous.prev is not None else None
        if before is not None:
            self._fence(before)
        return group

    def _fence(self, group: Group) -> None:
        """Rule 2: let go of the device tensors of ``group``'s copies still in flight, the
        producer's stream made to wait for each copy first (nothing written or allocated there
        later can overtake it); a version changed by then makes the transfer stale (Rule 3)."""
        backend = self.backend
        with self._lock:
            fenced = False
            for ref in group.transfers:
                transfer = ref()
                if transfer is None or transfer.source is None:
                    continue
                source = transfer.source
                if source._version != transfer.version:
                    transfer.stale = True  # never restored; the d2h order protects the block
                    backend.record_stream(source, backend.side_stream(source.device, "d2h"))
                else:
                    backend.wait_event(transfer.stream, transfer.copied)
                transfer.source = None
                fenced = True
            if fenced:
                self.in_flight = [t for t in self.in_flight if t.source is not None]

    def group_for(self, owner: object) -> Group:
        """The group of ``owner`` (a kept span's hooks) if it made the last one in this thread,
        else a new one. Only its id is kept: the owner lives as long as the group's graph."""
        last: tuple[int, weakref.ref[Group]] | None = getattr(self._owners, "last", None)
        if last is not None and last[0] == id(owner):
            found = last[1]()
            if found is not None:
                return found
        group = self.new_group(reverse=True)
        self._owners.last = (id(owner), weakref.ref(group))
        return group

    def offload(self, tensor: torch.Tensor, group: Group) -> Transfer:
        """Start copying ``tensor`` to host memory off the compute stream (Rules 1 and 2)."""
        self.poll()
        backend = self.backend
        stream = backend.current_stream(tensor.device)
        produced = backend.record_event(stream)
        d2h = backend.side_stream(tensor.device, "d2h")
        transfer = Transfer(self, tensor, group)
        transfer.stream = stream
        backend.wait_event(d2h, produced)  # Rule 1
        backend.copy_to_host(transfer.host, tensor, d2h)
        transfer.copied = backend.record_event(d2h)
        with self._lock:
            self.in_flight.append(transfer)
            group.transfers.append(weakref.ref(transfer))
        return transfer

    # -- lazily seen completions ----------------------------------------------------------------

    def poll(self) -> None:
        """Settle what the device has finished, without blocking (Rules 2, 3, 4, 7)."""
        done = self.backend.event_done
        with self._lock:
            if self.in_flight:  # a comprehension: no loop variable keeps a transfer alive
                self.in_flight = [t for t in self.in_flight if not self._seen_done(t)]
            if self.retiring:
                keep = []
                for item in self.retiring:
                    if all(done(event) for event in item[0]):
                        if item[2] is not None:
                            self._pool_put(item[2])
                    else:
                        keep.append(item)
                self.retiring = keep
            if self.timings:
                pending = []
                for start, end, stats in self.timings:
                    if done(end):
                        stats._add_unhidden(self.backend.elapsed_seconds(start, end))
                    else:
                        pending.append((start, end, stats))
                self.timings = pending

    def _seen_done(self, transfer: Transfer) -> bool:
        """Rules 2 and 3 for one in-flight copy; True once its device tensor is let go."""
        source = transfer.source
        if source is None:
            return True
        if source._version != transfer.version:
            transfer.stale = True  # Rule 3: a write queued before the copy was seen done
        if self.backend.event_done(transfer.copied):
            transfer.source = None  # Rule 2: the copy has run
            return True
        if transfer.stale:  # never restored: let go, stream-safely
            self.backend.record_stream(source, self.backend.side_stream(source.device, "d2h"))
            transfer.source = None
            return True
        return False

    def retire(self, transfer: Transfer) -> None:
        """A transfer died (its graph did, or its entry was consumed): Rule 7."""
        with self._lock:
            if transfer.state == _PREFETCHED:
                self.held_bytes -= transfer.nbytes
            source = transfer.source
            if source is not None:  # Rule 2: hand the device tensor over stream-safely
                self.backend.record_stream(source, self.backend.side_stream(source.device, "d2h"))
                transfer.source = None
            events = tuple(e for e in (transfer.copied, transfer.restored_event) if e is not None)
            if transfer.buffer is not None:
                self.retiring.append((events, None, transfer.buffer))
            transfer.restored = None

    # -- backward -------------------------------------------------------------------------------

    def begin(self, group: Group) -> None:
        """Backward reached ``group``'s region: prefetch it, then the next region (Rule 5)."""
        self.poll()
        plan = deque(group.in_restore_order())
        prev = group.prev() if group.prev is not None else None
        if prev is not None:
            plan.extend(prev.in_restore_order())
        self._plans.plan = plan
        self._settle_at_backward_end()
        self._top_up()

    def _top_up(self) -> None:
        plan: deque[weakref.ref[Transfer]] | None = getattr(self._plans, "plan", None)
        if not plan:
            return
        with self._lock:
            while plan:
                transfer = plan[0]()
                if transfer is None or transfer.state != HOST or transfer.stale:
                    plan.popleft()
                    continue
                if transfer.nbytes > self.prefetch_bytes:
                    plan.popleft()  # restored when taken
                    continue
                if self.held_bytes + transfer.nbytes > self.prefetch_bytes:
                    return
                plan.popleft()
                self.held_bytes += transfer.nbytes
                self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
                self._restore(transfer)
                transfer.state = _PREFETCHED

    def end(self, group: Group) -> None:
        """The recompute of ``group``'s region ended: what it did not take, it will not in this
        backward (early stop); cancel those prefetches and top up (Rule 5)."""
        with self._lock:
            transfer = None
            for ref in group.transfers:
                transfer = ref()
                if transfer is not None and transfer.state == _PREFETCHED:
                    self.held_bytes -= transfer.nbytes
                    transfer.restored = None  # allocated for "h2d": freed in its order
                    transfer.state = HOST
            transfer = None  # let the last one go while the lock is held (``retire``)
        self._top_up()

    def _restore(self, transfer: Transfer) -> None:
        """Issue the host->device copy on "h2d", after the device->host one (Rule 5)."""
        backend = self.backend
        h2d = backend.side_stream(transfer.device, "h2d")
        backend.wait_event(h2d, transfer.copied)
        transfer.restored = backend.copy_to_device(transfer.host, transfer.device, h2d)
        transfer.restored_event = backend.record_event(h2d)

    def take(self, transfer: Transfer, stats: OffloadStats, consume: bool) -> torch.Tensor:
        """The restored device tensor, for the current stream (Rule 6); ``consume`` gives the
        host copy up (selective checkpointing), else it stays for another backward."""
        self.poll()
        with self._lock:
            if transfer.source is not None and self._seen_done(transfer):
                self.in_flight.remove(transfer)
            if transfer.stale:
                raise Stale
            if transfer.state == HOST:
                self._restore(transfer)
                self._settle_at_backward_end()
            elif transfer.state == _PREFETCHED:
                self.held_bytes -= transfer.nbytes
            restored, event = transfer.restored, transfer.restored_event
            if restored is None:
                raise Stale  # consumed already: the caller's error path
            transfer.restored = None
            transfer.state = _CONSUMED if consume else HOST
        self._wait(transfer.device, event, restored, stats)
        stats._count_restore(transfer.nbytes)
        if consume:
            source = transfer.source
            if source is not None:  # Rule 2: the copy was waited for; the allocator orders it
                self.backend.record_stream(source, self.backend.side_stream(source.device, "d2h"))
                transfer.source = None
        self._top_up()
        return restored

    def _wait(self, device: torch.device, event: Any, restored: torch.Tensor, stats: Any) -> None:
        backend = self.backend
        stream = backend.current_stream(device)
        if not backend.event_done(event):
            stats._count_wait()
            start = backend.record_event(stream, True) if stats.time_copies else None
            backend.wait_event(stream, event)
            if start is not None:
                end = backend.record_event(stream, True)
                with self._lock:
                    self.timings.append((start, end, stats))
        backend.record_stream(restored, stream)

    def _settle_at_backward_end(self) -> None:
        """Once per backward: poll again when it ends, and drop its plan (Rule 7)."""
        task = _compat.current_graph_task_id()
        if task == -1 or getattr(self._settling, "task", None) == task:
            return
        if _compat.at_backward_end(self._backward_ended):
            self._settling.task = task

    def _backward_ended(self) -> None:
        self._plans.plan = None
        self.poll()

    # -- for tests ------------------------------------------------------------------------------

    def pending(self) -> dict[str, int]:
        """What the engine still holds: copies in flight, retiring buffers, prefetched bytes."""
        with self._lock:
            return {
                "in_flight": len(self.in_flight),
                "retiring": len(self.retiring),
                "held_bytes": self.held_bytes,
                "timings": len(self.timings),
            }


_engine: list[Engine] = []
_engine_lock = threading.Lock()


def engine() -> Engine:
    """The process's engine (CUDA's, made on first use)."""
    if not _engine:
        with _engine_lock:
            if not _engine:
                _engine.append(Engine(CudaBackend()))
    return _engine[-1]


@contextlib.contextmanager
def installed(replacement: Engine) -> Iterator[Engine]:
    """Use ``replacement`` (e.g. over a fake backend) for offloads made inside the block; a
    transfer keeps the engine it was made by, so its restores use it too."""
    engine()
    with _engine_lock:
        _engine.append(replacement)
    try:
        yield replacement
    finally:
        with _engine_lock:
            _engine.remove(replacement)


def claims(tensor: torch.Tensor) -> bool:
    """Whether offloading ``tensor`` goes through the engine (else a plain copy or an alias)."""
    return (tensor.device.type == "cuda" or len(_engine) > 1) and engine().backend.claims(tensor)


def poll_all() -> None:
    """Settle, without blocking, what every engine's device has finished (Rules 2-4)."""
    for each in tuple(_engine):
        each.poll()


def end(group: Group) -> None:
    """The recompute of ``group``'s region ended (Rule 5)."""
    if group.transfers:
        alive = group.transfers[0]()
        (alive.engine if alive is not None else engine()).end(group)


def begin(group: Group) -> None:
    """Backward reached ``group``'s region (Rule 5)."""
    if group.transfers:
        alive = group.transfers[0]()
        (alive.engine if alive is not None else engine()).begin(group)
