"""Shared test configuration: Hypothesis profiles and hygiene checks run around every test."""

from __future__ import annotations

import gc
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


# NOTE [Frozen imports]
# Once every test module is imported (torch, dynamo, transformers, hypothesis: several hundred
# thousand objects), they are moved out of the cyclic collector's reach (`gc.freeze`). Every
# collection, the leak tests' explicit ones and Python's own full collections, would otherwise
# scan them all again, and they are not garbage: they were alive before any test ran. What a test
# makes is never frozen, so its cyclic garbage is still collected, and found under
# `gc.DEBUG_SAVEALL`, as before; reference counting frees frozen objects as usual. A test that
# counts objects with `gc.get_objects()` compares counts taken within itself, which the frozen
# objects (left out of that list) do not change. They are handed back to the collector when the
# run ends: an extension that reports its objects still alive at exit (triton's nanobind, with
# torch's CUDA builds) would otherwise list each of them.
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()


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
