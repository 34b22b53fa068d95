"""The CPU allocator's own account of one training step, for tests that check bytes.

Under ``torch.profiler.profile(profile_memory=True)`` every allocation and free is an event with
a signed byte count; sorted by time and summed, they give the bytes allocated during the step at
every instant (``benchmarks/_memory.py`` explains the method and ``validate_memory.py`` checks
it). Memory that existed before the step (inputs, parameters) is not in these numbers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass(frozen=True)
class AllocatorStep:
    """``held``: bytes allocated during the forward and still held at its end, the loss
    aside; ``peak``: the running sum's maximum over forward and backward."""

    held: int
    peak: int


def allocator_step(forward: Callable[[], torch.Tensor]) -> AllocatorStep:
    """Run ``forward()`` and the backward of its loss under the profiler; read the allocator."""
    with warnings.catch_warnings():
        # torch 2.11 and 2.12 warn, once per process, at a profiler's first cycle that events
        # are cleared at the end of each cycle (2.13 warns from the second); this one has one.
        warnings.filterwarnings(
            "ignore", "Warning: Profiler clears events at the end of each cycle", UserWarning
        )
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("forward"):
                loss = forward()
            loss_bytes = loss.untyped_storage().nbytes()
            loss.backward()
            del loss
    events = prof.profiler.kineto_results.events()
    forward_end = max(e.start_ns() + e.duration_ns() for e in events if e.name() == "forward")
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
    return AllocatorStep(held=held - loss_bytes, peak=peak)


def allocator_peak(run: Callable[[], object]) -> int:
    """The CPU allocator's most bytes held at once while ``run()`` ran, above what it held
    before (what it returns is held to the end)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "Warning: Profiler clears events at the end of each cycle", UserWarning
        )
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = run()
    del result
    changes = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU"
    )
    live = peak = 0
    for _when, size in changes:
        live += size
        peak = max(peak, live)
    return peak
