"""Accelerators: the runtime's init flag, CUDA's out-of-memory observer, streams and pinned memory.

Each name is checked against torch 2.11-2.15.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def accelerator_initialized(device_module: Any) -> bool:
    """Whether an accelerator's runtime is already initialised, without initialising it (each
    device module keeps a private ``_initialized`` flag in 2.11-2.15; ``torch.cpu`` has none)."""
    return bool(getattr(device_module, "_initialized", False))


def attach_cuda_oom_observer(observer: Callable[[int, int, int, int], None]) -> bool:
    """Have CUDA's caching allocator call ``observer(device, requested, allocated, free)`` just
    before it raises an out-of-memory error; False where there is no CUDA (a CPU build, or no
    device). torch offers no way to detach one (2.11-2.15:
    ``torch._C._cuda_attach_out_of_memory_observer``): attach once and dispatch from there."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
        return False
    attach(observer)
    return True


# --- Host copies off the critical path (``_offload``'s CUDA backend) ------------------------------
# The stream, event and pinned-memory calls of offload, each in one place (2.11-2.15). All are
# public ``torch.cuda`` APIs except the end-of-backward callback; they live here so that
# ``_offload`` names no CUDA call itself and its tests can swap the whole set for a fake.


def cuda_current_stream(device: torch.device) -> Any:
    """The stream work on ``device`` is queued on now (``torch.cuda.current_stream``)."""
    return torch.cuda.current_stream(device)


def cuda_new_stream(device: torch.device) -> Any:
    """A side stream of ``device`` (``torch.cuda.Stream``), for copies off the compute stream."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch's stub is untyped


def cuda_record_event(stream: Any, timing: bool = False) -> Any:
    """An event recorded on ``stream`` now; ``timing`` makes it usable by ``cuda_elapsed``."""
    event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]  # untyped
    event.record(stream)
    return event


def cuda_wait_event(stream: Any, event: Any) -> None:
    """Work queued on ``stream`` from now on starts after ``event`` (never blocks the host)."""
    stream.wait_event(event)


def cuda_event_done(event: Any) -> bool:
    """Whether the device has passed ``event`` (a query: never blocks)."""
    return bool(event.query())


def cuda_elapsed_seconds(start: Any, end: Any) -> float:
    """Seconds between two timing events, waiting for ``end`` on the host (read after a step)."""
    end.synchronize()
    return float(start.elapsed_time(end)) / 1000.0


def cuda_pinned_bytes(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer of ``nbytes`` bytes (uint8), for non-blocking copies."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def cuda_copy_to_host(host: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
    """Queue ``host.copy_(source)`` on ``stream`` without blocking the host."""
    with torch.cuda.stream(stream):
        host.copy_(source, non_blocking=True)


def cuda_copy_to_device(host: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
    """A new ``device`` tensor with ``host``'s strides, allocated for ``stream`` and filled on it
    by a non-blocking copy (the caller makes other streams wait and records their use)."""
    with torch.cuda.stream(stream):
        restored = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        restored.copy_(host, non_blocking=True)
    return restored


def cuda_record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator ``stream`` uses ``tensor``: its block is not reused before the
    work queued on ``stream`` at the time it is freed has run (``Tensor.record_stream``)."""
    tensor.record_stream(stream)
