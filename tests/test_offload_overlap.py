"""NOTE [Host copies off the critical path], on CPU: the offload engine over a fake backend
(``offload_support.FakeBackend``: streams as ordered queues, events as completion points, every
call logged), so the tests assert ordering, not timing. What these tests cannot show (how much
copy time the overlap hides on a real device) is measured by ``benchmarks/gpu.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from frame_support import assert_tensors_equal
from offload_support import FakeBackend
from torch import Tensor

import checkpointing
from checkpointing import CheckpointPolicy, OffloadStats, _offload, policies

aten = torch.ops.aten


@pytest.fixture
def fake() -> Iterator[tuple[FakeBackend, _offload.Engine]]:
    backend = FakeBackend()
    engine = _offload.Engine(backend, prefetch_bytes=1 << 30, pool_bytes=1 << 20)
    with _offload.installed(engine):
        yield backend, engine


def _issued_before_use(log: list[tuple[str, Any]]) -> bool:
    """Whether every restored tensor handed to the compute stream was issued before (ids are
    matched in log order: an id may be reused once its tensor is gone)."""
    issued: set[int] = set()
    for kind, item in log:
        if kind == "h2d issued":
            issued.add(item)
        elif kind == "used":
            if item not in issued:
                return False
            issued.discard(item)
    return True


def _settled(backend: FakeBackend, engine: _offload.Engine) -> dict[str, int]:
    backend.run_all()
    engine.poll()
    return engine.pending()


_CLEAN = {"in_flight": 0, "retiring": 0, "held_bytes": 0, "timings": 0}


def _leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_() for shape in shapes
    ]


def _three_matmuls(x: Tensor, w: Tensor) -> Tensor:
    return ((x @ w).relu() @ w).sigmoid() @ w


def _stack(
    x: Tensor, w: Tensor, regions: int, stats: OffloadStats | None, offload: bool = True
) -> Tensor:
    policy = policies.offload_ops(aten.mm.default) if offload else policies.save_nothing()
    h = x
    for _ in range(regions):
        if stats is None:
            h = _three_matmuls(h, w)
        else:
            ctx = policies.as_context_fn(policy, offload_stats=stats)
            h = checkpointing.checkpoint(_three_matmuls, h, w, use_reentrant=False, context_fn=ctx)
    return h.sum()


def _grads(run: Callable[[Tensor, Tensor], Tensor], n: int = 6) -> tuple[Tensor | None, ...]:
    x, w = _leaves((n, n), (n, n))
    run(x, w).backward()
    return (x.grad, w.grad)


# --- Rule 1 -----------------------------------------------------------------------------------


def test_rule1_device_to_host_copy_waits_for_the_producer_on_a_side_stream(fake: Any) -> None:
    """Each device->host copy is queued on the d2h side stream behind a wait for an event
    recorded on the compute stream at offload time; nothing is queued on the compute stream."""
    backend, engine = fake
    stats = OffloadStats()
    x, w = _leaves((6, 6), (6, 6))
    loss = _stack(x, w, 2, stats)
    d2h = backend.sides["d2h"]
    kinds = [kind for kind, _ in d2h.queue]
    assert kinds == ["wait", "d2h", "record"] * 6
    produced = [item for kind, item in d2h.queue if kind == "wait"]
    assert all(event.stream is None for event in produced)  # recorded on the compute stream
    assert not backend.compute.queue
    loss.backward()
    assert _settled(backend, engine) == _CLEAN


# --- Rule 2 -----------------------------------------------------------------------------------


def test_rule2_device_tensor_is_not_released_before_its_copy_completes(fake: Any) -> None:
    """The region's mm outputs die with the forward in the plain sense, but the engine keeps
    each until its copy is seen done: no copy reads freed memory, and once the copies ran and a
    later offload looked, the device tensors are let go."""
    backend, engine = fake
    stats = OffloadStats()
    x, w = _leaves((6, 6), (6, 6))
    loss = _stack(x, w, 2, stats)
    assert engine.pending()["in_flight"] == 6  # none seen done: all still referenced
    backend.run_all()
    assert not backend.violations
    engine.poll()
    assert engine.pending()["in_flight"] == 0
    loss.backward()
    assert not backend.violations
    assert _settled(backend, engine) == _CLEAN
    assert not backend.kept_by_record_stream


def test_rule2_a_copy_handed_out_in_flight_is_freed_stream_safely(fake: Any) -> None:
    """Backward right after forward (no copy has run): the restores wait for the copies, and the
    device tensors the engine lets go while their copies are queued are kept by record_stream
    until the d2h stream has run them."""
    backend, engine = fake
    stats = OffloadStats()
    grads = _grads(lambda x, w: _stack(x, w, 3, stats))
    assert not backend.violations
    assert_tensors_equal(grads, _grads(lambda x, w: _stack(x, w, 3, None)), "in flight")
    assert _settled(backend, engine) == _CLEAN
    assert not backend.kept_by_record_stream


def test_rule2_copies_two_regions_back_are_fenced_and_let_go(fake: Any) -> None:
    """With the side stream never advanced (the host far ahead of the device), making a
    region's group fences the copies of the region before the previous one: the compute stream
    waits for them and their device tensors are let go, so at most two regions' copies hold
    device memory; the gradients stay the plain run's."""
    backend, engine = fake
    stats = OffloadStats()
    x, w = _leaves((6, 6), (6, 6))
    loss = _stack(x, w, 4, stats)
    assert len(engine.in_flight) == 6  # regions 3 and 4
    stalls = [event for kind, event in backend.log if kind == "stall"]
    assert stalls
    assert all(event.done for event in stalls)
    assert not backend.kept_by_record_stream  # fenced on the producer's stream, not handed over
    loss.backward()
    plain = _grads(lambda x, w: _stack(x, w, 4, None))
    assert_tensors_equal((x.grad, w.grad), plain, "fenced")
    assert _settled(backend, engine) == _CLEAN


def test_rule2_fence_sees_a_write_queued_before_it(fake: Any) -> None:
    """An offloaded tensor written in place after its offload, before the fence: the fence
    sees the version move, the transfer is stale (never restored) and the op is recomputed."""
    backend, engine = fake
    stats = OffloadStats()

    def writes(x: Tensor, w: Tensor) -> Tensor:
        y = x @ w
        out = y.sigmoid() @ w
        y.mul_(2)  # after the offload of y, before any copy ran
        return out

    def run(x: Tensor, w: Tensor, offload: bool) -> Tensor:
        h = x
        for index in range(3):
            fn = writes if index == 0 else _three_matmuls
            if not offload:
                h = fn(h, w)
                continue
            ctx = policies.as_context_fn(policies.offload_ops(aten.mm.default), offload_stats=stats)
            h = checkpointing.checkpoint(fn, h, w, use_reentrant=False, context_fn=ctx)
        return h.sum()

    got = _grads(lambda x, w: run(x, w, True))
    assert_tensors_equal(got, _grads(lambda x, w: run(x, w, False)), "written then fenced")
    assert stats.restored_tensors < stats.offloaded_tensors
    assert _settled(backend, engine) == _CLEAN


# --- Rule 3 -----------------------------------------------------------------------------------


def _mutating_region(x: Tensor, w: Tensor) -> Tensor:
    h = x @ w  # offloaded
    h.mul_(2)  # an in-place write queued before the copy ran
    return (h.sin() @ w).sum()


def _mutating(stats: OffloadStats | None) -> Callable[[Tensor, Tensor], Tensor]:
    def run(x: Tensor, w: Tensor) -> Tensor:
        if stats is None:
            return _mutating_region(x, w)
        ctx = policies.as_context_fn(policies.offload_ops(aten.mm.default), offload_stats=stats)
        return checkpointing.checkpoint(_mutating_region, x, w, use_reentrant=False, context_fn=ctx)

    return run


def test_rule3_tensor_overwritten_in_place_before_its_copy_ran_restores_the_offload_value(
    fake: Any,
) -> None:
    """The copy runs after the write (the fake's d2h queue is not advanced), so it holds the
    written value; the engine sees the version change first, never restores it, and the
    recompute runs the mm: the gradients are the plain run's."""
    backend, engine = fake
    stats = OffloadStats()
    got = _grads(_mutating(stats))
    assert_tensors_equal(got, _grads(_mutating(None)), "in place")
    # The first mm is recomputed; the second's output is not needed (early stop).
    assert (stats.offloaded_tensors, stats.restored_tensors) == (2, 0)
    assert _settled(backend, engine) == _CLEAN


def test_rule3_a_copy_seen_done_before_the_write_is_a_snapshot(fake: Any) -> None:
    """Engine level: a copy seen complete (version unchanged) is trusted whatever happens to
    the device tensor afterwards; one not yet seen when the write came is stale."""
    backend, engine = fake
    stats = OffloadStats()
    group = engine.new_group()
    a, b = torch.arange(4.0), torch.arange(4.0)
    first = engine.offload(a, group)
    backend.run_all()
    engine.poll()  # seen done: a snapshot
    a.add_(100)
    second = engine.offload(b, group)
    b.add_(100)  # before its copy ran
    backend.run_all()
    assert torch.equal(engine.take(first, stats, consume=True), torch.arange(4.0))
    with pytest.raises(_offload.Stale):
        engine.take(second, stats, consume=True)
    del first, second
    assert _settled(backend, engine) == _CLEAN


# --- Rule 4 -----------------------------------------------------------------------------------


def test_rule4_pinned_buffers_are_reused_and_the_pool_is_bounded(fake: Any) -> None:
    """Five steps of the same stack allocate one step's buffers; the free list never holds more
    than its limit."""
    backend, engine = fake
    stats = OffloadStats()
    for _ in range(5):
        _grads(lambda x, w: _stack(x, w, 3, stats))
        assert _settled(backend, engine) == _CLEAN
        assert engine.pool.free_bytes <= engine.pool.limit
    assert backend.buffers_made == 9
    small = _offload.Engine(backend, pool_bytes=2 * 6 * 6 * 8)
    with _offload.installed(small):
        _grads(lambda x, w: _stack(x, w, 3, stats))
        assert _settled(backend, small) == _CLEAN
    assert small.pool.free_bytes == 2 * 6 * 6 * 8


# --- Rules 5 and 6 ----------------------------------------------------------------------------


def test_rule5_restores_are_issued_before_the_recompute_needs_them(fake: Any) -> None:
    """With the copies done (and run as soon as queued), every restore is issued (at its
    region's recompute start, or the one before) before the recompute uses it, and the compute
    stream never stalls."""
    backend, engine = fake
    stats = OffloadStats()
    x, w = _leaves((6, 6), (6, 6))
    loss = _stack(x, w, 4, stats)
    backend.run_all()
    engine.poll()
    backend.eager = True
    start = len(backend.log)
    loss.backward()
    log = backend.log[start:]
    assert len([kind for kind, _ in log if kind == "used"]) == stats.restored_tensors == 8
    assert _issued_before_use(log)
    # The first recompute issued its own two restores and the next region's two, at once.
    assert [kind for kind, _ in log[:4]] == ["h2d issued"] * 4
    assert not [kind for kind, _ in log if kind == "stall"]
    assert stats.waited_restores == 0
    assert _settled(backend, engine) == _CLEAN


@pytest.mark.parametrize("budget_tensors", [1, 2, 3])
def test_rule5_prefetch_stays_within_its_budget(fake: Any, budget_tensors: int) -> None:
    """The bytes restored ahead and not yet used never exceed the budget; each use tops the
    prefetch up, so every restore is still issued before it is needed."""
    backend, _ = fake
    nbytes = 6 * 6 * 8
    engine = _offload.Engine(backend, prefetch_bytes=budget_tensors * nbytes)
    stats = OffloadStats()
    with _offload.installed(engine):
        x, w = _leaves((6, 6), (6, 6))
        loss = _stack(x, w, 4, stats)
        backend.run_all()
        engine.poll()
        start = len(backend.log)
        loss.backward()
    assert engine.peak_held_bytes <= budget_tensors * nbytes
    assert backend.peak_prefetched_bytes <= budget_tensors * nbytes
    log = backend.log[start:]
    assert _issued_before_use(log)
    assert _settled(backend, engine) == _CLEAN


def test_rule5_a_tensor_above_the_budget_is_restored_when_taken(fake: Any) -> None:
    """A budget below one tensor prefetches nothing; the restores still come back right."""
    backend, _ = fake
    engine = _offload.Engine(backend, prefetch_bytes=8)
    stats = OffloadStats()
    with _offload.installed(engine):
        got = _grads(lambda x, w: _stack(x, w, 3, stats))
    assert engine.peak_held_bytes == 0
    assert_tensors_equal(got, _grads(lambda x, w: _stack(x, w, 3, None)), "budget 8")
    assert _settled(backend, engine) == _CLEAN


def test_rule6_a_restore_not_done_makes_the_compute_stream_wait_and_counts_it(fake: Any) -> None:
    """Backward before any copy ran: each first use stalls the compute stream on the restore's
    event (never a synchronous copy), counted in waited_restores and, timed, in
    unhidden_copy_seconds."""
    backend, engine = fake
    stats = OffloadStats(time_copies=True)
    got = _grads(lambda x, w: _stack(x, w, 2, stats))
    assert_tensors_equal(got, _grads(lambda x, w: _stack(x, w, 2, None)), "stalls")
    stalls = [kind for kind, _ in backend.log if kind == "stall"]
    assert stats.waited_restores == len(stalls) >= 1
    assert stats.unhidden_copy_seconds == pytest.approx(0.001 * len(stalls))
    assert _settled(backend, engine) == _CLEAN


# --- Rule 7 -----------------------------------------------------------------------------------


def test_rule7_nothing_held_after_backward(fake: Any) -> None:
    """After backward (and the queued copies), no transfer is alive, no bytes are prefetched and
    no device tensor is held by the engine or the fake's allocator."""
    backend, engine = fake
    stats = OffloadStats()
    x, w = _leaves((6, 6), (6, 6))
    loss = _stack(x, w, 3, stats)
    weak = [weakref.ref(t) for t in engine.in_flight]
    assert len(weak) == 6  # the first region's copies were fenced (Rule 2)
    backend.run_all()
    loss.backward()
    del loss
    assert _settled(backend, engine) == _CLEAN
    assert all(ref() is None for ref in weak)
    assert not backend.restored
    assert not backend.kept_by_record_stream


def test_rule7_exception_mid_backward_leaves_nothing_pending(fake: Any) -> None:
    """A hook raising after the last region's recompute started: once the graph is dropped,
    nothing is prefetched, in flight or retiring, and the pool is within its bound."""
    backend, engine = fake
    stats = OffloadStats()
    x, w = _leaves((6, 6), (6, 6))
    h = _stack(x, w, 2, stats)
    mid = checkpointing.checkpoint(
        _three_matmuls,
        h.reshape(1, 1).expand(6, 6) + x,
        w,
        use_reentrant=False,
        context_fn=policies.as_context_fn(
            policies.offload_ops(aten.mm.default), offload_stats=stats
        ),
    )

    def fail(grad: Tensor) -> Tensor:
        raise ValueError("boom")

    h.register_hook(fail)
    with pytest.raises(ValueError, match="boom"):
        mid.sum().backward()
    del h, mid
    assert _settled(backend, engine) == _CLEAN
    assert engine.pool.free_bytes <= engine.pool.limit
    assert not backend.restored
    assert not backend.kept_by_record_stream


def test_kept_span_offload_two_backwards_with_retain_graph(fake: Any) -> None:
    """keeping(policy=MUST_CPU_OFFLOAD) on the same machinery: a span's host copies stay for a
    second backward through a retained graph, gradients equal the plain run's twice over, and
    nothing is left once the graph is gone."""
    backend, engine = fake
    stats = OffloadStats()

    def region(x: Tensor, w: Tensor) -> Tensor:
        with checkpointing.keeping(
            "mm", policy=CheckpointPolicy.MUST_CPU_OFFLOAD, offload_stats=stats
        ):
            h = (x @ w).sin()
        return (h @ w).tanh()

    def run(checkpointed: bool) -> tuple[Tensor | None, ...]:
        x, w = _leaves((6, 6), (6, 6))
        h = x
        for _ in range(3):
            h = (
                checkpointing.checkpoint(region, h, w, use_reentrant=False)
                if checkpointed
                else region(h, w)
            )
        loss = h.sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return (x.grad, w.grad)

    got = run(True)
    assert_tensors_equal(got, run(False), "two backwards")
    assert stats.offloaded_tensors > 0
    assert stats.restored_tensors == 2 * stats.offloaded_tensors
    assert not backend.violations
    assert _settled(backend, engine) == _CLEAN


def test_selective_offload_second_backward_still_raises(fake: Any) -> None:
    """Rule 6 of NOTE [Selective checkpoint cache] is unchanged: a retained graph's second
    backward meets "backward an extra time", and the engine is left clean."""
    backend, engine = fake
    stats = OffloadStats()
    x, w = _leaves((6, 6), (6, 6))
    loss = _stack(x, w, 2, stats)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        loss.backward()
    del loss
    assert _settled(backend, engine) == _CLEAN


def test_host_tensors_keep_their_old_path_without_a_fake() -> None:
    """With no fake installed, a CPU tensor under an offload policy is an alias (no engine)."""
    stats = OffloadStats()
    before = _offload.engine().pending()
    got = _grads(lambda x, w: _stack(x, w, 2, stats))
    assert_tensors_equal(got, _grads(lambda x, w: _stack(x, w, 2, None)), "cpu")
    assert _offload.engine().pending() == before
    assert stats.waited_restores == 0
    assert stats.unhidden_copy_seconds == 0.0


def test_offload_stats_lives_with_the_engine() -> None:
    """``OffloadStats`` is the offload engine's (the engine imports no cache), its example runs,
    and the selective package hands out the same class."""
    import doctest

    from checkpointing import _selective

    assert OffloadStats is _offload.OffloadStats is _selective.OffloadStats
    assert OffloadStats.__module__ == "checkpointing._offload"
    result = doctest.testmod(_offload)
    assert result.failed == 0
    assert result.attempted >= 1
