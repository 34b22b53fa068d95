"""``report_on_oom``: the saved-tensor report printed when a step runs out of device memory.

On CPU the out-of-memory error is simulated: raised inside the block, or announced by calling
the observer the way CUDA's allocator does. ``tests/test_cuda.py`` runs out of real device
memory. See NOTE [Out-of-memory report].
"""

from __future__ import annotations

import io
import threading
import weakref
from typing import Any

import pytest
import torch
from garbage_support import gc_disabled  # noqa: F401  (a fixture)

import checkpointing
from checkpointing._report import oom
from checkpointing._units import format_bytes


def _region(t: torch.Tensor) -> torch.Tensor:
    return t.sin().exp()


def _forward(x: torch.Tensor) -> torch.Tensor:
    return checkpointing.checkpoint(_region, x, use_reentrant=False).cos()


def test_an_oom_error_leaving_the_block_prints_the_report_and_goes_on_unchanged() -> None:
    """The report names the region and what it holds; the error is the very one raised."""
    out = io.StringIO()
    x = torch.randn(4, 8, requires_grad=True)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with (  # noqa: PT012  # the block that raises is what is tested
        pytest.raises(torch.OutOfMemoryError) as raised,
        checkpointing.report_on_oom(file=out),
    ):
        y = _forward(x)
        raise error
    assert raised.value is error
    text = out.getvalue()
    assert text.startswith("checkpointing.report_on_oom: OutOfMemoryError: CUDA out of memory.")
    region = f"checkpoint({_region.__qualname__})"
    assert f"inputs of {region}" in text
    assert "recomputed" in text
    assert any(line.startswith(region) for line in text.splitlines())  # its summary line
    rng = format_bytes(torch.get_rng_state().nbytes)  # in binary units, as every printout
    held = [line for line in text.splitlines() if line.endswith(f"saved      {region}")]
    assert [rng in line for line in held] == [True]  # what the region holds: its RNG state
    del y


def test_the_observer_prints_once_for_the_error_that_follows() -> None:
    """CUDA's allocator calls the observer before raising: it prints (with the request and the
    free bytes), and the error leaving the block prints nothing more."""
    out = io.StringIO()
    x = torch.randn(4, 8, requires_grad=True)
    with (  # noqa: PT012  # the block that raises is what is tested
        pytest.raises(torch.OutOfMemoryError),
        checkpointing.report_on_oom(file=out),
    ):
        y = _forward(x)
        oom._on_cuda_oom(0, 2 << 30, 1 << 30, 1 << 20)  # as the allocator calls it
        raise torch.OutOfMemoryError("CUDA out of memory")
    text = out.getvalue()
    assert text.count("checkpointing.report_on_oom:") == 1
    assert "CUDA out of memory on device 0: 2.0 GiB requested" in text
    assert "1.0 MiB free" in text
    assert f"checkpoint({_region.__qualname__})" in text
    del y


def test_nested_blocks_print_once_and_other_errors_print_nothing() -> None:
    """Nested blocks print once, into the innermost; errors other than out-of-memory pass
    through unprinted; nothing is printed outside a block."""
    outer, inner = io.StringIO(), io.StringIO()
    with (
        pytest.raises(torch.OutOfMemoryError),
        checkpointing.report_on_oom(file=outer),
        checkpointing.report_on_oom(file=inner),
    ):
        raise torch.OutOfMemoryError("simulated")
    assert outer.getvalue() == ""
    assert inner.getvalue().count("report_on_oom:") == 1
    with pytest.raises(ValueError, match="not memory"), checkpointing.report_on_oom(file=outer):
        raise ValueError("not memory")
    assert outer.getvalue() == ""
    oom._on_cuda_oom(0, 1, 1, 0)  # no block active: nothing to print into
    assert oom._blocks == []


def test_observer_failure_is_printed_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while building the report is printed in its place; the error goes on."""
    out = io.StringIO()

    def broken(header: str) -> str:
        raise RuntimeError("walk failed")

    monkeypatch.setattr(oom, "oom_text", broken)
    with pytest.raises(torch.OutOfMemoryError), checkpointing.report_on_oom(file=out):
        raise torch.OutOfMemoryError("simulated")
    assert "the saved-tensor report failed" in out.getvalue()
    assert "RuntimeError: walk failed" in out.getvalue()


def test_default_file_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``file`` the report goes to ``sys.stderr`` (read when printing)."""
    with pytest.raises(torch.OutOfMemoryError), checkpointing.report_on_oom():
        raise torch.OutOfMemoryError("simulated")
    assert "checkpointing.report_on_oom: OutOfMemoryError: simulated" in capsys.readouterr().err


def test_a_file_without_write_is_refused() -> None:
    """``file`` must be a text stream: the error names the API, what came and the fix."""
    with (
        pytest.raises(TypeError, match=r"report_on_oom: expected file .* got 'log.txt'"),
        checkpointing.report_on_oom(file="log.txt"),  # type: ignore[arg-type]  # the mistake
    ):
        pass


def _failing_step(refs: list[weakref.ref[torch.Tensor]]) -> None:
    """A training step that runs out of memory: its activations live in this frame, which the
    error's traceback holds."""
    x = torch.randn(64, 64, requires_grad=True)
    y = _forward(x)
    refs.extend([weakref.ref(x), weakref.ref(y)])
    raise torch.OutOfMemoryError("simulated")


@pytest.mark.usefixtures("gc_disabled")
def test_a_handled_oom_error_is_not_kept_by_the_blocks_around_it() -> None:
    """Retry on OOM inside an outer block: once the error is handled, the failed step's tensors
    are gone (``gc`` off), though the outer block is still open; the inner block printed."""
    outer, inner = io.StringIO(), io.StringIO()
    refs: list[weakref.ref[torch.Tensor]] = []
    with checkpointing.report_on_oom(file=outer):
        try:
            with checkpointing.report_on_oom(file=inner):
                _failing_step(refs)
        except torch.OutOfMemoryError:
            pass
        assert len(refs) == 2
        assert [ref() is None for ref in refs] == [True, True]
    assert inner.getvalue().count("report_on_oom:") == 1
    assert outer.getvalue() == ""


@pytest.mark.usefixtures("gc_disabled")
def test_a_handled_oom_error_is_not_kept_by_a_block_in_another_thread() -> None:
    """A block open in another thread keeps nothing of this thread's handled error (``gc`` off)."""
    entered, release = threading.Event(), threading.Event()
    other = io.StringIO()

    def wait_in_a_block() -> None:
        with checkpointing.report_on_oom(file=other):
            entered.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=wait_in_a_block)
    thread.start()
    refs: list[weakref.ref[torch.Tensor]] = []
    try:
        assert entered.wait(timeout=30)
        try:
            with checkpointing.report_on_oom(file=io.StringIO()):
                _failing_step(refs)
        except torch.OutOfMemoryError:
            pass
        assert len(refs) == 2
        assert [ref() is None for ref in refs] == [True, True]
    finally:
        release.set()
        thread.join()
    assert other.getvalue() == ""


def test_an_error_printed_inside_and_raised_again_outside_prints_once() -> None:
    """The same error leaving two nested blocks prints once, though no block holds it."""
    outer, inner = io.StringIO(), io.StringIO()
    with (
        pytest.raises(torch.OutOfMemoryError),
        checkpointing.report_on_oom(file=outer),
        checkpointing.report_on_oom(file=inner),
    ):
        _failing_step([])
    assert inner.getvalue().count("report_on_oom:") == 1
    assert outer.getvalue() == ""


class _Double(torch.autograd.Function):
    """A custom Function: after backward, reading its saved tensors raises in torch."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return grad * 2 + a * 0


def test_a_live_graph_already_backwarded_through_a_custom_function_is_passed_by() -> None:
    """A graph kept alive after its backward (last step's loss, kept for logging) whose custom
    Function's saves were freed: the report reads past it instead of failing."""
    out = io.StringIO()
    x = torch.randn(4, 8, requires_grad=True)
    last_loss = _Double.apply(x).sum()
    last_loss.backward()
    with (  # noqa: PT012  # the block that raises is what is tested
        pytest.raises(torch.OutOfMemoryError),
        checkpointing.report_on_oom(file=out),
    ):
        y = _forward(x)
        raise torch.OutOfMemoryError("CUDA out of memory")
    text = out.getvalue()
    assert "the saved-tensor report failed" not in text
    assert f"checkpoint({_region.__qualname__})" in text
    del y, last_loss
