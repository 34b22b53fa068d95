"""Memory of the non-reentrant frame: what is kept between forward and backward, and for how long.

Measured without timing and without an allocator: an outer ``saved_tensors_hooks`` sees what
autograd saves outside checkpointed regions (their inputs, by Rule 2), a census of live tensors
(``gc.get_objects()``, unique storages) sees everything else a region keeps (such as an RNG
state), and storage weak references show when a tensor's memory is gone. ``gc`` is disabled where
a test claims something is freed, so that only reference counting can have freed it; ``gc.collect``
runs at the end to show there was no cyclic garbage either. Rules are NOTE [Nestable checkpoint]'s.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import releases
import torch
import torch.nn.functional as F
from frame_support import BOTH, INPUTS_SAVED_WITHOUT_A_DUMMY, OURS, TORCH, Variant, leaf
from torch.multiprocessing.reductions import StorageWeakRef

_RNG_STATE_BYTES = torch.get_rng_state().nbytes  # 5056 on CPU (mt19937 state)


def _live_storages() -> dict[int, int]:
    """``data_ptr -> nbytes`` of the storage of every tensor a Python object refers to.

    Only plain tensors and parameters: an earlier ``torch.compile`` can leave fake tensors alive,
    which have no data pointer (and no memory).
    """
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            if storage.data_ptr():
                storages[storage.data_ptr()] = storage.nbytes()
    return storages


@contextmanager
def _gc_disabled() -> Iterator[None]:
    """Collect what earlier code left, then keep the cycle collector out of the body."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _Kept:
    """What a forward leaves behind until backward, in bytes of unique storages."""

    def __init__(self) -> None:
        self.saved: dict[int, int] = {}  # what autograd saved outside any region
        self.new: dict[int, int] = {}  # tensors alive after forward that were not before

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    @property
    def new_bytes(self) -> int:
        return sum(self.new.values())


def _measure(
    forward: Callable[[], torch.Tensor], exclude: Callable[[torch.Tensor], list[torch.Tensor]]
) -> tuple[_Kept, torch.Tensor]:
    """Run ``forward`` under an outer saved-tensors hook and a before/after census."""
    kept = _Kept()

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()  # a new Python object on the same storage: the census sees it

    before = _live_storages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    after = _live_storages()
    skip = {t.untyped_storage().data_ptr() for t in exclude(out)}
    kept.new = {p: n for p, n in after.items() if p not in before and p not in skip}
    return kept, out


def _drop_torch_2_11_dummies(v: Variant, kept: _Kept) -> None:
    """Remove from torch 2.11's ``kept.saved`` the (0,)-shaped dummy it saves with each region's
    inputs: their 0-byte storages have no data pointer, so they are one entry, ``0: 0``."""
    if v is TORCH and not releases.has(INPUTS_SAVED_WITHOUT_A_DUMMY):
        assert kept.saved.pop(0, None) == 0, "torch 2.11 saved no dummy"


def _chain(v: Variant, x: torch.Tensor, n: int, fn: Callable[..., Any]) -> torch.Tensor:
    h = x
    for _ in range(n):
        h = v.checkpoint(fn, h)
    return h


def _two_tiny_ops(t: torch.Tensor) -> torch.Tensor:
    return t.sin() * 2


def test_rule_7_kept_bytes_for_500_small_regions() -> None:
    """Rule 7: 500 regions of 2 tiny ops keep their inputs and one shared RNG state; torch adds
    an RNG state each.

    Measured here (torch 2.13, CPU, float32[4] inputs): ours keeps 8,000 bytes of inputs (the
    floor) plus at most one 5,056-byte RNG state shared by all 500 regions; torch keeps
    2,536,000 bytes (the same inputs plus 500 x 5,056 bytes of RNG state).
    """
    results = {}
    with _gc_disabled():
        for v in BOTH:
            x = torch.randn(4, requires_grad=True)
            kept, out = _measure(lambda v=v, x=x: _chain(v, x, 500, _two_tiny_ops), lambda o: [o])
            _drop_torch_2_11_dummies(v, kept)
            floor = 500 * x.nbytes  # every region's input, x included (it is saved too)
            assert len(kept.saved) == 500, v.name
            assert kept.saved_bytes == floor, v.name
            results[v.name] = kept.new_bytes + x.nbytes  # x predates the census
            out.sum().backward()
            assert torch.equal(x.grad, _expected_chain_grad(x, 500))
    # the floor (inputs), plus one RNG state unless an identical one was already captured
    assert results["ours"] in (500 * x.nbytes, 500 * x.nbytes + _RNG_STATE_BYTES)
    assert results["torch"] == 500 * x.nbytes + 500 * _RNG_STATE_BYTES
    assert results["ours"] * 100 < results["torch"]


def _expected_chain_grad(x: torch.Tensor, n: int) -> torch.Tensor:
    h = x.detach().requires_grad_()
    out = h
    for _ in range(n):
        out = _two_tiny_ops(out)
    out.sum().backward()
    return h.grad


def test_kept_bytes_equal_the_inputs_of_the_regions() -> None:
    """Between forward and backward only the regions' inputs are kept (nested inputs: none)."""

    def model(v: Variant, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = v.checkpoint(lambda t, u: (t @ u).tanh().sin(), x, w)  # keeps x and w
        h = v.checkpoint(
            lambda t: v.checkpoint(lambda s: s.exp().cos(), t.sin()) * 2, h
        )  # keeps h; its inner region's input lives in the outer region (Rule 2)
        return h * 3  # saves nothing

    with _gc_disabled():
        for v in BOTH:
            x, w = leaf(8, 16), leaf(16, 16, seed=1)
            kept, out = _measure(lambda v=v, x=x, w=w: model(v, x, w), lambda o: [o])
            _drop_torch_2_11_dummies(v, kept)
            h_bytes = 8 * 16 * 8
            assert kept.saved_bytes == x.nbytes + w.nbytes + h_bytes, v.name
            assert len(kept.saved) == 3, v.name
            if v is OURS:
                # the first region's output (held as input), and one RNG state shared by all
                # three regions unless an identical one was already captured
                assert kept.new_bytes in (h_bytes, h_bytes + _RNG_STATE_BYTES)
            else:
                assert kept.new_bytes == h_bytes + 3 * _RNG_STATE_BYTES
            out.sum().backward()


def test_rule_7_random_region_keeps_one_rng_state() -> None:
    """Rule 7: a region that draws random numbers keeps exactly one RNG state (for replay)."""
    with _gc_disabled():
        for v in BOTH:
            x = leaf(16)
            kept, out = _measure(
                lambda v=v, x=x: v.checkpoint(lambda t: F.dropout(t.sin(), 0.5), x), lambda o: [o]
            )
            assert kept.new_bytes == _RNG_STATE_BYTES, v.name
            out.sum().backward()


def test_intermediates_are_not_kept_after_forward() -> None:
    """Tensors made inside a region are gone once forward returns (both libraries)."""
    for v in BOTH:
        refs: list[StorageWeakRef] = []

        def fn(x: torch.Tensor, refs: list[StorageWeakRef] = refs) -> torch.Tensor:
            a = x.exp()
            b = a.sin()
            refs.extend(StorageWeakRef(t.untyped_storage()) for t in (a, b))
            return b.cos() * 2

        with _gc_disabled():
            x = leaf(64)
            out = v.checkpoint(fn, x)
            assert [r.expired() for r in refs] == [True, True], v.name
            out.sum().backward()


def _consumed_in_order(v: Variant, retain_graph: bool) -> list[tuple[str, bool, bool]]:
    """Region a = sin(x), b = sin(a), c = sin(b). Backward consumes b, then a.

    At the moment the gradient of b (then of a) is ready, i.e. right after the node that used
    the recomputed b (then a) has run, record whether the recomputed a and b are still alive.
    """
    refs: list[dict[str, StorageWeakRef]] = []
    seen: list[tuple[str, bool, bool]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        call: dict[str, StorageWeakRef] = {}
        refs.append(call)
        a = x.sin()
        call["a"] = StorageWeakRef(a.untyped_storage())
        b = a.sin()
        call["b"] = StorageWeakRef(b.untyped_storage())
        if len(refs) == 1:  # hooks on the forward graph only
            for name, t in (("a", a), ("b", b)):
                t.register_hook(lambda g, name=name: _record(name, refs, seen, g))
        return b.sin()

    x = leaf(32)
    out = v.checkpoint(fn, x)
    out.sum().backward(retain_graph=retain_graph)
    return seen


def _record(
    name: str,
    refs: list[dict[str, StorageWeakRef]],
    seen: list[tuple[str, bool, bool]],
    grad: torch.Tensor,
) -> None:
    recomputed = refs[-1]
    seen.append((name, recomputed["a"].expired(), recomputed["b"].expired()))


def test_rule_4_recomputed_tensors_die_when_consumed() -> None:
    """Rule 4: each recomputed tensor is freed right after the node that unpacked it ran."""
    for retain_graph in (False, True):
        for v in BOTH:
            with _gc_disabled():
                seen = _consumed_in_order(v, retain_graph)
            # after sin(b)'s node: b is gone, a still waits for sin(a)'s node; then a is gone.
            assert seen == [("b", False, True), ("a", True, True)], (v.name, retain_graph)


def test_rule_4_second_backward_recomputes_and_frees_again() -> None:
    """Rule 4: with retain_graph=True a second backward recomputes, and frees as it goes."""
    for v in BOTH:
        calls: list[StorageWeakRef] = []

        def fn(x: torch.Tensor, calls: list[StorageWeakRef] = calls) -> torch.Tensor:
            a = x.exp()
            calls.append(StorageWeakRef(a.untyped_storage()))
            return a.sin()

        with _gc_disabled():
            x = leaf(32)
            out = v.checkpoint(fn, x)
            out.sum().backward(retain_graph=True)
            out.sum().backward(retain_graph=True)
            assert len(calls) == 3, v.name
            assert all(ref.expired() for ref in calls), v.name


class _Region:
    """A checkpointed function as an object, so a weak reference can tell when it is freed."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w).sin().exp() * 2


def _frame_objects() -> list[object]:
    return [o for o in gc.get_objects() if type(o).__module__ == "checkpointing._frame"]


def test_frames_holders_and_function_freed_after_backward() -> None:
    """After backward, frames, holders and the function are freed by refcount alone (ours)."""
    with _gc_disabled():
        x, w = leaf(16), leaf(16, seed=1)
        fn = _Region()
        fn_ref = weakref.ref(fn)
        out = OURS.checkpoint(fn, x, w)
        del fn
        alive_in_forward = len(_frame_objects())
        out.sum().backward()
        del out
        assert alive_in_forward > 0  # frame and holders exist between forward and backward
        assert _frame_objects() == []
        assert fn_ref() is None
        assert gc.collect() == 0  # nothing needed the cycle collector


class _Around:
    """A region that checkpoints ``inner`` around part of its body (nesting without closures)."""

    def __init__(self, inner: Callable[..., torch.Tensor], early_stop: bool) -> None:
        self.inner = inner
        self.early_stop = early_stop

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return OURS.checkpoint(self.inner, x.cos(), w, early_stop=self.early_stop) * 2


def test_nested_frames_freed_after_backward() -> None:
    """Nested regions with early stop on and off: nothing of ours outlives the backward."""
    with _gc_disabled():
        x = leaf(8)
        innermost = _Region()
        middle = _Around(innermost, early_stop=False)
        outer = _Around(middle, early_stop=True)
        refs = [weakref.ref(f) for f in (innermost, middle, outer)]
        out = OURS.checkpoint(outer, x, x * 2)
        del innermost, middle, outer
        out.sum().backward()
        del out
        assert _frame_objects() == []
        assert [r() for r in refs] == [None, None, None]
        assert gc.collect() == 0


def test_partial_backward_frees_everything_once_the_graph_dies() -> None:
    """Backward through one of two outputs, then drop both: frames and holders are freed."""
    with _gc_disabled():
        x = leaf(8)
        a, b = OURS.checkpoint(lambda t: (t.sin().exp(), t.cos().exp()), x)
        a.sum().backward()
        assert _frame_objects() != []  # b's part of the graph still holds the frame
        del a, b
        assert _frame_objects() == []
        assert gc.collect() == 0


def test_no_cyclic_garbage_per_call_unlike_torch() -> None:
    """Side by side, after a warm-up call: torch leaves cyclic garbage per call; ours none."""
    collected = {}
    for v in BOTH:
        v.checkpoint(_Region(), leaf(4), leaf(4)).sum().backward()  # warm-up (lazy imports)
        with _gc_disabled():
            fn = _Region()
            fn_ref = weakref.ref(fn)
            x = leaf(4)
            v.checkpoint(fn, x, x).sum().backward()
            del fn
            collected[v.name] = gc.collect()
        assert fn_ref() is None, v.name
    assert collected["ours"] == 0
    assert collected["torch"] > 0  # torch 2.13: a few objects per call (pytree helpers)
