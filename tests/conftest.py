"""Shared test configuration: Hypothesis profiles and hygiene checks run around every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from checkpointing import _compat

# CI: a small example budget and no deadline (shared, noisy machines). Locally: a few more.
settings.register_profile(
    "ci", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True)
def _no_saved_tensors_hook_left_behind() -> Iterator[None]:
    """Every test must leave this thread's saved-tensors hook stack as it found it (empty)."""
    before = _compat.top_saved_tensors_hooks()
    yield
    after = _compat.top_saved_tensors_hooks()
    assert after is before or after == before, f"saved-tensors hook left on the stack: {after}"


@pytest.fixture(autouse=True)
def _thread_counts_restored() -> Iterator[None]:
    """Every test leaves torch's thread counts as it found them. A test (or a benchmark's
    ``main`` run in-process) that calls ``torch.set_num_threads`` would otherwise change them
    for every later test: a thread started later takes the intra-op count at its first parallel
    op, so its first step could run other kernels than the steps before the change."""
    intra, interop = torch.get_num_threads(), torch.get_num_interop_threads()
    yield
    if torch.get_num_threads() != intra:
        torch.set_num_threads(intra)
    if torch.get_num_interop_threads() != interop:
        # torch refuses this once parallel work has started: the error then names the test.
        torch.set_num_interop_threads(interop)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module of tiny models (``pytest.mark.usefixtures``): they gain
    nothing from two, and on a busy machine the second thread's waiting costs more than the
    work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same CPU RNG state."""
    torch.manual_seed(0)
