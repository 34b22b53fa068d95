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
def _seeded() -> None:
    """Every test starts from the same CPU RNG state."""
    torch.manual_seed(0)
