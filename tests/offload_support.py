"""A fake device for the offload engine, on CPU (``tests/test_offload_overlap.py`` and the tests
that run the engine's device logic without a GPU).

The fake models a device the way the engine must assume one works: the compute stream runs
eagerly (CPU ops), each side stream is an ordered queue that runs only when the test advances it
or when another stream waits on one of its events, and events are completion points. Its "device
tensors" are CPU tensors; a copy reads its source when its queue runs, not when it is issued, so a
write issued after an offload but before its copy ran is seen, as on a GPU. The fake records
every call, so the tests assert ordering, not timing.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
from torch import Tensor


class FakeEvent:
    """A completion point on one stream."""

    def __init__(self, stream: FakeStream | None) -> None:
        self.stream = stream
        self.done = stream is None  # the compute stream runs eagerly


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque[tuple[str, Any]] = deque()


class FakeBackend:
    """Streams as ordered queues, events as completion points; logs every call (see module)."""

    def __init__(self) -> None:
        self.compute = FakeStream("compute")
        self.sides: dict[str, FakeStream] = {}
        self.log: list[tuple[str, Any]] = []
        self.violations: list[str] = []
        self.restored: dict[int, int] = {}  # id of a restored tensor -> its bytes, until used
        self.prefetched_bytes = 0
        self.peak_prefetched_bytes = 0
        self.buffers_made = 0
        self.kept_by_record_stream: list[Tensor] = []
        self.eager = False  # side streams run as soon as work is queued (copies fully hidden)

    # -- the Backend interface ------------------------------------------------------------------

    def claims(self, tensor: Tensor) -> bool:
        return tensor.device.type == "cpu" and type(tensor) is torch.Tensor

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.compute

    def side_stream(self, device: torch.device, direction: str) -> FakeStream:
        return self.sides.setdefault(direction, FakeStream(direction))

    def record_event(self, stream: FakeStream, timing: bool = False) -> FakeEvent:
        if stream is self.compute:
            event = FakeEvent(None)
            self.log.append(("record compute", event))
            return event
        event = FakeEvent(stream)
        stream.queue.append(("record", event))
        if self.eager:
            self.run(stream)
        return event

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        if stream is self.compute:
            if not event.done:
                self.log.append(("stall", event))
                assert event.stream is not None
                self.run(event.stream, until=event)
            return
        stream.queue.append(("wait", event))

    def event_done(self, event: FakeEvent) -> bool:
        return event.done

    def elapsed_seconds(self, start: FakeEvent, end: FakeEvent) -> float:
        return 0.001

    def pinned_bytes(self, nbytes: int) -> Tensor:
        self.buffers_made += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_to_host(self, host: Tensor, source: Tensor, stream: FakeStream) -> None:
        self.log.append(("d2h issued", stream))
        stream.queue.append(("d2h", (host, weakref.ref(source))))

    def copy_to_device(self, host: Tensor, device: torch.device, stream: FakeStream) -> Tensor:
        restored = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype)
        if restored.is_floating_point():
            restored.fill_(float("nan"))  # garbage until the copy runs
        stream.queue.append(("h2d", (weakref.ref(restored), host)))
        self.log.append(("h2d issued", id(restored)))
        self.restored[id(restored)] = host.nbytes
        self.prefetched_bytes += host.nbytes
        self.peak_prefetched_bytes = max(self.peak_prefetched_bytes, self.prefetched_bytes)
        weakref.finalize(restored, self._unused, id(restored))
        return restored

    def _unused(self, key: int) -> None:
        """A restored tensor died before it was handed out (a cancelled prefetch)."""
        nbytes = self.restored.pop(key, None)
        if nbytes is not None:
            self.prefetched_bytes -= nbytes

    def record_stream(self, tensor: Tensor, stream: FakeStream) -> None:
        if stream is self.compute:
            nbytes = self.restored.pop(id(tensor), None)
            if nbytes is None:
                self.violations.append("handed out a tensor the fake never restored")
            else:
                self.prefetched_bytes -= nbytes
            self.log.append(("used", id(tensor)))
            return
        # The allocator keeps the block until the work queued on ``stream`` now has run.
        self.kept_by_record_stream.append(tensor)
        stream.queue.append(("free", tensor))

    # -- running the side streams ---------------------------------------------------------------

    def run(self, stream: FakeStream, until: FakeEvent | None = None) -> None:
        while stream.queue:
            kind, item = stream.queue[0]
            if kind == "wait" and not item.done:
                assert item.stream is not None
                assert item.stream is not stream
                self.run(item.stream, until=item)
            stream.queue.popleft()
            if kind == "record":
                item.done = True
                if item is until:
                    return
            elif kind == "d2h":
                host, source_ref = item
                source = source_ref()
                if source is None:
                    self.violations.append("device->host copy read a freed tensor")
                else:
                    host.copy_(source)
                    self.log.append(("d2h ran", source_ref))
            elif kind == "h2d":
                restored_ref, host = item
                restored = restored_ref()
                if restored is not None:
                    restored.copy_(host)
            elif kind == "free":
                self.kept_by_record_stream.remove(item)

    def run_all(self) -> None:
        for stream in list(self.sides.values()):
            self.run(stream)

    def pending(self) -> int:
        return sum(len(stream.queue) for stream in self.sides.values())
