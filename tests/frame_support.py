"""Helpers for the non-reentrant frame tests: both checkpoints side by side, and an op counter.

``TORCH`` and ``OURS`` expose the same small surface (``checkpoint`` with ``use_reentrant=False``,
the two settings, ``GraphExecGroup``, ``CheckpointError``), so one scenario function runs against
either and a test compares the two results; ``PLAIN`` runs the function without checkpointing.
Names are looked up when called, so this module imports even while the API is being written.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import releases
import torch
import torch.utils.checkpoint as torch_checkpoint_module

import checkpointing
from checkpointing._compat import TorchDispatchMode
from checkpointing._recompute_context import DeclaredContext


@dataclass(frozen=True)
class Variant:
    """One implementation of non-reentrant checkpoint (or none, for ``PLAIN``)."""

    name: str
    module: ModuleType | None

    def checkpoint(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``checkpoint(fn, *args, use_reentrant=False, **kwargs)``, or ``fn(*args)`` for PLAIN."""
        if self.module is None:
            for option in (
                "context_fn",
                "determinism_check",
                "debug",
                "early_stop",
                "preserve_rng_state",
            ):
                kwargs.pop(option, None)
            return fn(*args, **kwargs)
        return self.module.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def set_checkpoint_early_stop(self, enable: bool) -> contextlib.AbstractContextManager[None]:
        """This variant's early-stop switch (a no-op context for PLAIN)."""
        if self.module is None:
            return contextlib.nullcontext()
        return self.module.set_checkpoint_early_stop(enable)

    def set_checkpoint_debug_enabled(
        self, enabled: bool | None
    ) -> contextlib.AbstractContextManager[None]:
        """This variant's debug switch (a no-op context for PLAIN)."""
        if self.module is None:
            return contextlib.nullcontext()
        return self.module.set_checkpoint_debug_enabled(enabled)

    def graph_exec_group(self) -> contextlib.AbstractContextManager[Any]:
        """A fresh ``GraphExecGroup`` of this variant."""
        assert self.module is not None
        return self.module.GraphExecGroup()

    @property
    def checkpoint_error(self) -> type[Exception]:
        """This variant's ``CheckpointError`` class."""
        assert self.module is not None
        return self.module.CheckpointError


TORCH = Variant("torch", torch_checkpoint_module)
OURS = Variant("ours", checkpointing)
PLAIN = Variant("plain", None)
BOTH = (TORCH, OURS)


# torch 2.12 saves a region's inputs as SavedTensors, which dispatch nothing. torch 2.11 saves
# them through a no-op autograd Function (``_NoopSaveInputs``) together with a (0,)-shaped dummy
# tensor, once per checkpoint call (nested ones in recompute included): a dispatch mode sees two
# ``aten.empty.memory_format`` (the dummy and the Function's output), an outer saved-tensors hook
# sees the dummy, and a byte census sees its 0-byte storage. Ours saves inputs without any of
# these on every release.
INPUTS_SAVED_WITHOUT_A_DUMMY = (2, 12)


def is_torch_2_11_input_saver_op(func: Any) -> bool:
    """Whether ``func``, being dispatched now, is one of the two ``aten.empty`` that torch 2.11's
    checkpoint runs to save a region's inputs: the nearest caller in ``torch.utils.checkpoint``
    is its frame generator or ``_NoopSaveInputs.forward``."""
    if releases.has(INPUTS_SAVED_WITHOUT_A_DUMMY) or func is not torch.ops.aten.empty.memory_format:
        return False
    savers = (
        torch_checkpoint_module._checkpoint_without_reentrant_generator.__code__,
        torch_checkpoint_module._NoopSaveInputs.forward.__code__,
    )
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != savers[0].co_filename:
        frame = frame.f_back
    return frame is not None and frame.f_code in savers


class OpCounter(TorchDispatchMode, DeclaredContext):
    """Counts the aten ops run while active, by name.

    ``detach`` is left out: each implementation detaches recomputed tensors its own way, and a
    detach computes nothing. It is counted apart, in ``detaches``. ``passes_detach_through``
    marks the counter as a recompute mode that lets the frame detach below it (NOTE [Nestable
    checkpoint], Rule 9; NOTE [Recompute context protocol]). On torch 2.11 only, the two
    ``aten.empty`` per checkpoint call with which torch's own checkpoint saves inputs
    (``INPUTS_SAVED_WITHOUT_A_DUMMY``) are left out too, counted apart in ``input_savers``;
    newer torch and ours dispatch nothing there.
    """

    def __init__(self, passes_detach_through: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.detaches = 0
        self.input_savers = 0
        self._passes = passes_detach_through

    @property
    def passes_detach_through(self) -> bool:
        return self._passes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten.detach.default:
            self.detaches += 1
        elif is_torch_2_11_input_saver_op(func):
            self.input_savers += 1
        else:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Number of ops counted."""
        return sum(self.counts.values())


@contextlib.contextmanager
def counting_ops() -> Iterator[Counter[str]]:
    """Count the aten ops (detach, and torch 2.11's input savers, left out) run in the body;
    yields the live counter."""
    counter = OpCounter()
    with counter:
        yield counter.counts


def backward_counting(
    out: torch.Tensor, inputs: Sequence[torch.Tensor]
) -> tuple[tuple[torch.Tensor | None, ...], Counter[str]]:
    """Backward of ``out.sum()``: the inputs' gradients (``.grad`` cleared again) and the aten
    ops the backward ran."""
    with counting_ops() as counts:
        out.sum().backward()
    grads = tuple(t.grad for t in inputs)
    for t in inputs:
        t.grad = None
    return grads, counts


def leaf(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    """A fresh leaf that requires grad, drawn from its own generator (the RNG is untouched)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()


def assert_tensors_equal(
    got: Sequence[torch.Tensor | None], expected: Sequence[torch.Tensor | None], what: str = ""
) -> None:
    """Same length, ``None`` in the same places, every tensor bit-identical."""
    assert len(got) == len(expected), f"{what}: {len(got)} vs {len(expected)} tensors"
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert (a is None) == (b is None), f"{what}[{i}]: {a} vs {b}"
        if a is not None and b is not None:
            assert a.shape == b.shape, f"{what}[{i}]: shape {a.shape} vs {b.shape}"
            assert torch.equal(a, b), f"{what}[{i}]: max |diff| {(a - b).abs().max()}"


def raised(call: Callable[[], object]) -> BaseException:
    """Run ``call``, which must raise; return the exception."""
    try:
        call()
    except Exception as exc:  # compared by the caller
        return exc
    raise AssertionError(f"{call} did not raise")


Outcome = tuple[object, list[tuple[type[Warning], str]]]


def outcome(call: Callable[[], object]) -> Outcome:
    """Run ``call``; return its result (or the exception type and message) and its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: object = call()
        except Exception as exc:  # compared with torch's outcome by the caller
            result = (type(exc), str(exc))
    return result, [(w.category, str(w.message)) for w in caught]


def error_of(result: Outcome) -> tuple[type[BaseException], str]:
    """The (type, message) of an outcome that must be an exception."""
    value = result[0]
    assert isinstance(value, tuple), f"expected an exception, got {value!r}"
    return value  # type: ignore[return-value]
