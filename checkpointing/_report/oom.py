"""Out-of-memory diagnostics: ``report_on_oom()`` prints the saved-tensor report when a step runs
out of device memory.

Owns ``report_on_oom`` and the one observer it attaches to CUDA's allocator. At the moment of an
out-of-memory error no loss is in hand, so the roots of the walk (``graph``) are found by a
``gc`` scan: every live plain tensor with a ``grad_fn``; the walk dedupes nodes and storages, so
roots that lie inside one graph cost nothing twice. The report is built and printed; nothing of
it is kept.

NOTE [Out-of-memory report]
  Rule 1. Two ways in, one print per error. On CUDA the allocator calls our observer just before
          it raises (the graph is whole then, and the report says what the allocator was
          asked for); on any device a ``torch.OutOfMemoryError`` leaving the block prints too,
          unless the observer already printed for it. The error is re-raised unchanged.
  Rule 2. torch cannot detach an allocator observer, so ours is attached once per process and
          dispatches to the blocks active at the time; leaving a block removes it from that
          list (the "detach"). The list is process-wide, not per thread or context: CUDA's
          backward runs on autograd's device threads, where the error is raised, and a
          block must hear of it. Nested blocks print once (the innermost).
  Rule 3. Printing must never hide the error: a failure while building or printing the report
          is printed in its place (``traceback``), and the out-of-memory error goes on.
  Rule 4. No block holds an error. The error's traceback holds the frames of the failed step,
          and with them its tensors: a block that kept it (the retry-on-OOM pattern: an outer
          block around a loop that catches the error) would keep the failed step alive until it
          exits, and a block of another thread until that thread's block exits. The block the
          error leaves holds it only while printing; what the blocks around it remember, so as
          not to print it again (Rule 1), is a weak reference to it.
"""

from __future__ import annotations

import gc
import sys
import threading
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final, TextIO

import torch

from .. import _compat
from .._units import format_bytes
from .graph import report_from_graph

__all__ = ["oom_text", "report_on_oom"]

_MSG_FILE = (
    "checkpointing.report_on_oom: expected file to be a text stream with a write() method "
    "(such as sys.stderr or an open text file) or None, got {got!r} of type {type}. Fix: pass "
    "`file=sys.stderr` or leave it out."
)


_OBSERVED: Final = object()  # the allocator's observer printed for the error about to come


class _Block:
    """One active ``report_on_oom`` block: where it prints, and what it has printed for
    (Rule 1): ``_OBSERVED``, a weak reference to an error an inner block printed for (Rule 4),
    or None."""

    __slots__ = ("file", "reported")

    def __init__(self, file: TextIO | None) -> None:
        self.file = file
        self.reported: object = None

    def write(self, text: str) -> None:
        out = sys.stderr if self.file is None else self.file
        out.write(text + "\n")
        out.flush()


_blocks: list[_Block] = []  # active blocks, innermost last (Rule 2)
_lock = threading.Lock()
_attached = False


def _live_roots() -> list[Any]:
    """The ``grad_fn`` of every live plain tensor that has one: the roots when no loss is in
    hand. Tensor subclasses (a compiler's fake tensors, DTensor) are left out."""
    roots = []
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor:
            grad_fn = obj.grad_fn
            if grad_fn is not None:
                roots.append(grad_fn)
    return roots


def oom_text(header: str) -> str:
    """The out-of-memory report: ``header``, one line per region, then one row per tensor."""
    report = report_from_graph(_live_roots())
    return "\n".join(
        [f"checkpointing.report_on_oom: {header}", report.summary(), "", report.table()]
    )


def _print_into(block: _Block, header: str) -> None:
    """Print the report into ``block``'s file (Rule 3: a failure is printed instead)."""
    try:
        text = oom_text(header)
    except Exception:  # Rule 3: never hide the out-of-memory error behind ours
        text = (
            f"checkpointing.report_on_oom: {header}\nthe saved-tensor report failed:\n"
            + traceback.format_exc()
        )
    try:
        block.write(text)
    except Exception:  # Rule 3: a file that cannot be written must not replace the error
        traceback.print_exc(file=sys.__stderr__)


def _mark(reported: object) -> None:
    """Every active block has printed, or need not print, for ``reported`` (Rules 1 and 2)."""
    with _lock:
        for block in _blocks:
            block.reported = reported


def _weak(error: BaseException) -> object:
    """What a block remembers of an error it need not print (Rule 4): a weak reference, or
    None for an error type without weak references (it may then print twice, never leak)."""
    try:
        return weakref.ref(error)
    except TypeError:
        return None


def _is_ref_to(reported: object, error: BaseException) -> bool:
    return isinstance(reported, weakref.ref) and reported() is error


def _on_cuda_oom(device: int, requested: int, allocated: int, free: int) -> None:
    """The allocator's observer (Rule 2): print for the blocks active now, any thread."""
    with _lock:
        innermost = _blocks[-1] if _blocks else None
    if innermost is None:
        return
    _print_into(
        innermost,
        f"CUDA out of memory on device {device}: {format_bytes(requested)} requested, "
        f"{format_bytes(allocated)} allocated on the device, {format_bytes(free)} free",
    )
    _mark(_OBSERVED)


def _attach_once() -> None:
    global _attached
    with _lock:
        if not _attached:
            _attached = _compat.attach_cuda_oom_observer(_on_cuda_oom)


@contextmanager
def report_on_oom(file: TextIO | None = None) -> Iterator[None]:
    """Print the saved-tensor report if the block runs out of device memory.

    What each live autograd graph keeps for backward, by region and row (the same report as
    ``saved_tensors_report(loss)``), is printed to ``file`` (``sys.stderr`` by default): on CUDA
    from the allocator's out-of-memory observer, just before the error is raised, with what was
    requested and free; on any device when a ``torch.OutOfMemoryError`` leaves the block. The
    error itself is re-raised unchanged. The report is printed once per error, by the innermost
    block, even when both ways see it or blocks nest; on CUDA, an error raised in another thread
    (backward's) is heard too. A failure while building or printing the report is printed in
    its place and never hides the error. No block keeps the error, so catching it and retrying
    inside an outer block does not keep the failed step's tensors alive.

    Example:
        >>> import io, torch, checkpointing
        >>> out = io.StringIO()
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> try:
        ...     with checkpointing.report_on_oom(file=out):
        ...         y = checkpointing.checkpoint(torch.sin, x, use_reentrant=False)
        ...         raise torch.OutOfMemoryError("simulated")
        ... except torch.OutOfMemoryError:
        ...     pass
        >>> print(out.getvalue().splitlines()[0])
        checkpointing.report_on_oom: OutOfMemoryError: simulated
    """
    if file is not None and not callable(getattr(file, "write", None)):
        raise TypeError(_MSG_FILE.format(got=file, type=type(file).__name__))
    _attach_once()
    block = _Block(file)
    with _lock:
        _blocks.append(block)
    try:
        yield
    except torch.OutOfMemoryError as error:
        reported = block.reported
        if reported is not _OBSERVED and not _is_ref_to(reported, error):
            _print_into(block, f"{type(error).__name__}: {error}")
        _mark(_weak(error))  # the blocks around this one see the same error (Rule 4)
        raise
    finally:
        block.reported = None  # no cycle through the error's traceback
        with _lock:
            _blocks.remove(block)
