"""The one private torch API the planner reads: the profiler's raw memory events.

Owns ``cpu_allocation_peak``: the most bytes the CPU allocator held at once while a function
ran, above what it held before, read from ``torch.profiler``'s memory events through
``profile.profiler.kineto_results`` (private: torch 2.11-2.15 offer no public timeline of
allocations on CPU; ``export_memory_timeline`` needs a GPU and writes files). To move into
``checkpointing/_compat.py`` with its version gate when that module is next edited; nothing
else here touches a private torch name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

__all__ = ["cpu_allocation_peak"]


def cpu_allocation_peak(run: Callable[[], None]) -> int:
    """Bytes: the running sum of the CPU allocator's allocations and frees during ``run()``,
    at its highest (0 where the events cannot be read)."""
    with warnings.catch_warnings():
        # torch 2.11-2.13 warn once per process that a profiler clears its events per cycle.
        warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as watched:
            run()
    results = getattr(watched.profiler, "kineto_results", None)
    if results is None:  # torch 2.11-2.15 all have it; anything else reads as "unknown"
        return 0
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in results.events()
        if event.name() == "[memory]" and str(event.device_type()) == "DeviceType.CPU"
    )
    live = peak = 0
    for _when, size in changes:
        live += size
        peak = max(peak, live)
    return peak
