"""Thread-safe settings: ``set_checkpoint_early_stop`` and ``set_checkpoint_debug_enabled``.

Ours are context variables: a value set in one thread (or asyncio task) is never seen by another,
while the value active when a checkpoint's forward runs still governs its backward, wherever and
whenever that backward runs. torch 2.13 keeps both switches in process globals, so a thread that
enters one changes every other thread's checkpoints too; the tests below that run ours only say so,
and one test shows the difference side by side.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import torch
from frame_support import BOTH, OURS, PLAIN, TORCH, Variant, assert_tensors_equal, leaf

_FULL = ["sin1", "sin2", "scale", "done"]
_STOPPED = ["sin1", "sin2"]  # early stop ends recompute at the second sin (its last save)


def _logged_region(log: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        log.append("sin1")
        a = x.sin()
        log.append("sin2")
        b = a.sin()
        log.append("scale")
        c = b * 2
        log.append("done")
        return c

    return fn


def _run_threads(*targets: Callable[[], Any]) -> list[Any]:
    """Run each target in its own thread; return their results, re-raising the first error."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def runner(i: int) -> None:
        try:
            results[i] = targets[i]()
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def _recompute_log_with_setting(
    v: Variant, setting: bool, barrier: threading.Barrier
) -> Callable[[], list[str]]:
    """A thread body: enter the setting, meet the other thread, forward, meet again, backward."""

    def body() -> list[str]:
        log: list[str] = []
        x = leaf(4)
        with v.set_checkpoint_early_stop(setting):
            barrier.wait()  # both threads are inside their own setting now
            out = v.checkpoint(_logged_region(log), x, early_stop=not setting)
            barrier.wait()
        log.clear()
        out.sum().backward()
        return log

    return body


def test_early_stop_setting_is_per_thread() -> None:
    """Two threads inside opposite early-stop settings at once each get their own (ours only)."""
    barrier = threading.Barrier(2, timeout=30)
    off, on = _run_threads(
        _recompute_log_with_setting(OURS, False, barrier),
        _recompute_log_with_setting(OURS, True, barrier),
    )
    assert off == _FULL
    assert on == _STOPPED


def test_debug_setting_is_per_thread() -> None:
    """Two threads inside opposite debug settings at once: only one gets the report (ours only)."""
    barrier = threading.Barrier(2, timeout=30)

    def body(setting: bool) -> Callable[[], str]:
        def run() -> str:
            changed = {"on": False}

            def fn(x: torch.Tensor) -> torch.Tensor:
                y = x.sin()
                if not changed["on"]:
                    y = y.sin()
                return y.sin()

            x = leaf(3)
            with OURS.set_checkpoint_debug_enabled(setting):
                barrier.wait()
                out = OURS.checkpoint(fn, x, debug=not setting)
                barrier.wait()
            changed["on"] = True
            try:
                out.sum().backward()
            except OURS.checkpoint_error as exc:
                return str(exc)
            raise AssertionError("no CheckpointError")

        return run

    with_report, without = _run_threads(body(True), body(False))
    assert "Operations executed during the original forward" in with_report
    assert "Operations executed during the original forward" not in without
    assert "A different number of tensors was saved" in without


def test_torch_settings_leak_between_threads_ours_do_not() -> None:
    """Another thread inside set_checkpoint_early_stop(False): torch's checkpoints here obey it."""

    def main_thread_log(v: Variant) -> list[str]:
        entered, done = threading.Event(), threading.Event()

        def other() -> None:
            with v.set_checkpoint_early_stop(False):
                entered.set()
                done.wait(timeout=30)

        thread = threading.Thread(target=other)
        thread.start()
        try:
            entered.wait(timeout=30)
            log: list[str] = []
            out = v.checkpoint(_logged_region(log), leaf(4))  # early_stop=True by argument
            log.clear()
            out.sum().backward()
        finally:
            done.set()
            thread.join(timeout=30)
        return log

    assert main_thread_log(TORCH) == _FULL  # torch: a process global, set by the other thread
    assert main_thread_log(OURS) == _STOPPED


def test_forward_setting_governs_backward_in_another_thread() -> None:
    """The setting active at forward time holds for a backward run later in another thread."""
    for v in BOTH:
        for setting, expected in ((False, _FULL), (True, _STOPPED)):
            log: list[str] = []
            x = leaf(4)
            with v.set_checkpoint_early_stop(setting):
                out = v.checkpoint(_logged_region(log), x, early_stop=not setting)
            log.clear()
            _run_threads(lambda out=out: out.sum().backward())
            assert log == expected, (v.name, setting)
            assert_tensors_equal((x.grad,), (2 * x.detach().sin().cos() * x.detach().cos(),))


def test_forward_in_a_thread_backward_in_the_main_thread() -> None:
    """A forward run in a worker thread under its setting keeps it for a backward run here."""
    for v in BOTH:
        log: list[str] = []

        def forward(v: Variant = v, log: list[str] = log) -> torch.Tensor:
            with v.set_checkpoint_early_stop(False):
                return v.checkpoint(_logged_region(log), leaf(4))

        (out,) = _run_threads(forward)
        log.clear()
        out.sum().backward()
        assert log == _FULL, v.name


def test_debug_setting_at_forward_governs_backward_in_another_thread() -> None:
    """A region forwarded under set_checkpoint_debug_enabled(True) reports from any thread."""
    for v in BOTH:
        changed = {"on": False}

        def fn(x: torch.Tensor, changed: dict[str, bool] = changed) -> torch.Tensor:
            y = x.sin()
            if not changed["on"]:
                y = y.sin()
            return y.sin()

        with v.set_checkpoint_debug_enabled(True):
            out = v.checkpoint(fn, leaf(3))
        changed["on"] = True

        def backward(out: torch.Tensor = out, v: Variant = v) -> str:
            try:
                out.sum().backward()
            except v.checkpoint_error as exc:
                return str(exc)
            raise AssertionError("no CheckpointError")

        (message,) = _run_threads(backward)
        assert "Operations executed during the original forward" in message, v.name


def test_asyncio_tasks_do_not_share_settings() -> None:
    """Two asyncio tasks of one thread, interleaved inside opposite settings (ours only)."""

    class Meeting:
        """Both tasks wait at each point until the other one has reached it too."""

        def __init__(self) -> None:
            self.arrived: dict[str, int] = {}
            self.events: dict[str, asyncio.Event] = {}

        async def point(self, name: str) -> None:
            event = self.events.setdefault(name, asyncio.Event())
            self.arrived[name] = self.arrived.get(name, 0) + 1
            if self.arrived[name] == 2:
                event.set()
            await event.wait()

    async def task(setting: bool, meeting: Meeting) -> list[str]:
        log: list[str] = []
        x = leaf(4)
        with OURS.set_checkpoint_early_stop(setting):
            await meeting.point("both inside their setting")
            out = OURS.checkpoint(_logged_region(log), x, early_stop=not setting)
            await meeting.point("both forwarded")
        log.clear()
        out.sum().backward()
        return log

    async def main() -> list[list[str]]:
        meeting = Meeting()
        return list(await asyncio.gather(task(False, meeting), task(True, meeting)))

    off, on = asyncio.run(main())
    assert off == _FULL
    assert on == _STOPPED


def test_checkpoints_in_several_threads_at_once() -> None:
    """Four threads forward, meet, then backward: each gets the plain gradients (both libraries)."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).tanh().sin() * x

    for v in BOTH:
        barrier = threading.Barrier(4, timeout=30)

        def body(seed: int, v: Variant = v, barrier: threading.Barrier = barrier) -> Any:
            x, w = leaf(3, 3, seed=seed), leaf(3, 3, seed=seed + 100)
            out = v.checkpoint(fn, x, w)
            barrier.wait()
            out.sum().backward()
            barrier.wait()
            return x.grad, w.grad

        results = _run_threads(*(lambda s=s: body(s) for s in range(4)))
        for seed, grads in enumerate(results):
            x, w = leaf(3, 3, seed=seed), leaf(3, 3, seed=seed + 100)
            PLAIN.checkpoint(fn, x, w).sum().backward()
            assert_tensors_equal(grads, (x.grad, w.grad), f"{v.name} thread {seed}")
