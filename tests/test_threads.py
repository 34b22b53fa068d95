"""Threads and asyncio tasks: correct gradients in parallel, settings that never leak.

4 threads x 20 steps run forward and backward at the same time (a barrier lines them up) and
must get, bit for bit, the gradients of a single-threaded run (float64, deterministic ops).
``set_checkpoint_early_stop`` and ``set_checkpoint_debug_enabled`` are contextvars: another
thread, or another asyncio task of the same thread, never sees them.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from mechanism_support import MECHANISMS, forward, make_params
from thread_support import run_threads

import checkpointing
from checkpointing._determinism import debug_enabled
from checkpointing._frame import early_stop_enabled

THREADS = 4
STEPS = 20
CHECKPOINTED = [m for m in MECHANISMS if m != "plain"]


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))


def _grads(mechanism: str, step: int) -> list[torch.Tensor]:
    params = make_params(seed=step % 3)
    forward(mechanism, params, _inputs(step)).pow(2).sum().backward()
    return [p.grad for p in params]  # type: ignore[misc]


def _available(mechanisms: list[str]) -> list[str]:
    """The mechanisms whose module exists (tried once in the main thread)."""
    found = []
    for mechanism in mechanisms:
        try:
            _grads(mechanism, 0)
        except pytest.skip.Exception:
            continue
        found.append(mechanism)
    return found


@pytest.mark.parametrize("mechanism", CHECKPOINTED)
def test_threads_match_single_threaded_gradients(mechanism: str) -> None:
    """4 threads x 20 steps of one mechanism give the single-threaded gradients exactly."""
    reference = {step: _grads(mechanism, step) for step in range(STEPS)}

    def train(index: int) -> int:
        for step in range(STEPS):
            got = _grads(mechanism, step)
            assert all(torch.equal(g, r) for g, r in zip(got, reference[step], strict=True))
        return STEPS

    assert sum(run_threads(train, THREADS)) == THREADS * STEPS


def test_threads_mixing_every_mechanism_at_once() -> None:
    """Each thread cycles through all mechanisms, so different ones overlap in time."""
    mechanisms = _available(CHECKPOINTED)
    reference = {(m, step): _grads(m, step) for m in mechanisms for step in range(STEPS)}

    def train(index: int) -> int:
        for step in range(STEPS):
            mechanism = mechanisms[(index + step) % len(mechanisms)]
            got = _grads(mechanism, step)
            want = reference[mechanism, step]
            assert all(torch.equal(g, r) for g, r in zip(got, want, strict=True)), mechanism
        return STEPS

    assert sum(run_threads(train, THREADS)) == THREADS * STEPS


def _settings() -> tuple[bool, bool]:
    """The effective (early stop, debug) settings for a call passing the defaults."""
    return early_stop_enabled(True), debug_enabled(False)


def test_settings_do_not_leak_between_threads() -> None:
    """A thread inside both settings changes nothing for the other threads, nor the reverse."""
    inside = threading.Event()
    checked = threading.Event()
    seen: dict[str, tuple[bool, bool]] = {}

    def setter() -> None:
        with (
            checkpointing.set_checkpoint_early_stop(False),
            checkpointing.set_checkpoint_debug_enabled(True),
        ):
            seen["setter"] = _settings()
            inside.set()
            checked.wait(timeout=10)

    def reader() -> None:
        inside.wait(timeout=10)
        seen["reader"] = _settings()
        checked.set()

    with checkpointing.set_checkpoint_early_stop(False):
        threads = [threading.Thread(target=setter), threading.Thread(target=reader)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert seen == {"setter": (False, True), "reader": (True, False)}


def _early_stop_ran_to_the_end() -> bool:
    """Checkpoint a function whose last line saves nothing: it re-runs only without early stop."""
    marks: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        marks.append(checkpointing.is_recomputing())
        return y + 1

    x = torch.randn(3, requires_grad=True)
    checkpointing.checkpoint(fn, x, use_reentrant=False).sum().backward()
    return marks == [False, True]


def test_early_stop_setting_is_per_thread_in_behaviour() -> None:
    """Threads alternately inside and outside ``set_checkpoint_early_stop(False)`` recompute
    each as their own setting says."""

    def run(index: int) -> list[bool]:
        results = []
        for step in range(STEPS):
            if (index + step) % 2:
                with checkpointing.set_checkpoint_early_stop(False):
                    results.append(_early_stop_ran_to_the_end())
            else:
                results.append(not _early_stop_ran_to_the_end())
        return results

    assert all(all(r) for r in run_threads(run, THREADS))


def test_settings_do_not_leak_between_asyncio_tasks() -> None:
    """Two tasks of one thread interleave; neither sees the other's settings."""

    async def setter(inside: asyncio.Event, checked: asyncio.Event) -> tuple[bool, bool]:
        with (
            checkpointing.set_checkpoint_early_stop(False),
            checkpointing.set_checkpoint_debug_enabled(True),
        ):
            inside.set()
            await checked.wait()
            return _settings()

    async def reader(inside: asyncio.Event, checked: asyncio.Event) -> tuple[bool, bool]:
        await inside.wait()
        seen = _settings()
        checked.set()
        return seen

    async def main() -> list[tuple[bool, bool]]:
        inside, checked = asyncio.Event(), asyncio.Event()
        return list(await asyncio.gather(setter(inside, checked), reader(inside, checked)))

    assert asyncio.run(main()) == [(False, True), (True, False)]
    assert _settings() == (True, False)
