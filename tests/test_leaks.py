"""No leaks, no cycles: 1,000 training steps of each mechanism with ``gc`` disabled.

Three checks per mechanism (a leak or a cycle per step grows memory over a long training run):
- live Python objects and live tensors do not grow over 1,000 steps after a warm-up;
- frames, holders, the checkpointed function and the module are dead after backward (weakrefs);
- a step creates no reference cycles of ours: with ``gc`` disabled, ``gc.collect()`` finds no
  garbage that is a tensor or belongs to ``checkpointing``.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from garbage_support import described, gc_disabled, ours  # noqa: F401  (gc_disabled: a fixture)
from mechanism_support import MECHANISMS, forward, make_params

import checkpointing
from checkpointing._frame import Frame, Holder
from checkpointing._wrappers import checkpoint_wrapper

STEPS = 1_000
WARMUP = 20
# Allowed drift in gc-tracked objects after warm-up: caches of torch and of Python that fill once
# (dispatcher and pytree caches, interned strings); a per-step leak would show 1,000 or more.
SLACK = 50
CHECKPOINTED = [m for m in MECHANISMS if m != "plain"]


def _step(mechanism: str, params: list[torch.Tensor], x: torch.Tensor) -> None:
    loss = forward(mechanism, params, x).sum()
    loss.backward()
    for p in params:
        p.grad = None


def _counts() -> tuple[int, int]:
    objects = gc.get_objects()
    # type(), not isinstance: some objects warn when their __class__ is read.
    tensors = sum(1 for o in objects if issubclass(type(o), torch.Tensor))
    return len(objects), tensors


# torch's ``tree_flatten``/``tree_map`` leave 7 cyclic objects per call (a self-referencing
# closure); ``tree_leaves``/``tree_iter`` leave none, so the package calls only those on hot paths.


@pytest.mark.parametrize("mechanism", CHECKPOINTED)
@pytest.mark.usefixtures("gc_disabled")
def test_objects_and_tensors_do_not_grow_over_1000_steps(mechanism: str) -> None:
    """After warm-up, 1,000 steps leave the numbers of live objects and tensors as they were."""
    params = make_params()
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(WARMUP):
        _step(mechanism, params, x)
    objects_before, tensors_before = _counts()
    for _ in range(STEPS):
        _step(mechanism, params, x)
    objects_after, tensors_after = _counts()
    assert tensors_after == tensors_before, (mechanism, tensors_before, tensors_after)
    assert objects_after - objects_before <= SLACK, (mechanism, objects_before, objects_after)


@pytest.mark.parametrize("mechanism", CHECKPOINTED)
@pytest.mark.usefixtures("gc_disabled")
def test_steps_create_no_reference_cycles_of_ours(mechanism: str) -> None:
    """With gc disabled, ``gc.collect()`` after 50 steps finds no garbage of ours."""
    params = make_params()
    x = torch.randn(4, 8, dtype=torch.float64)
    _step(mechanism, params, x)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    for _ in range(50):
        _step(mechanism, params, x)
    gc.collect()
    found = [o for o in gc.garbage if ours(o)]
    assert not found, f"{mechanism}: reference cycles of ours: {described(found)}"


def _weak_checkpointing_objects() -> list[weakref.ref[Any]]:
    return [weakref.ref(o) for o in gc.get_objects() if type(o) in (Frame, Holder)]


@pytest.mark.parametrize("mechanism", ["non_reentrant", "nested", "sac", "offload", "sequential"])
@pytest.mark.usefixtures("gc_disabled")
def test_frames_and_holders_die_after_backward(mechanism: str) -> None:
    """Every ``Frame`` and ``Holder`` of a step is dead once backward ran and the loss is gone."""
    params = make_params()
    x = torch.randn(4, 8, dtype=torch.float64)
    loss = forward(mechanism, params, x).sum()
    refs = _weak_checkpointing_objects()
    assert refs, "the step made no frame or holder: the test would prove nothing"
    loss.backward()
    del loss
    assert [r() for r in refs if r() is not None] == []


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.usefixtures("gc_disabled")
def test_function_module_and_inputs_die_after_backward(use_reentrant: bool) -> None:
    """The checkpointed module (and its function) and the inputs do not outlive the step."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    wrapped = checkpoint_wrapper(module, use_reentrant=use_reentrant)
    x = torch.randn(3, 4, requires_grad=True)
    refs = [weakref.ref(module), weakref.ref(wrapped), weakref.ref(x), weakref.ref(module[0])]
    wrapped(x).sum().backward()
    del module, wrapped, x
    assert [r() for r in refs if r() is not None] == []


@pytest.mark.usefixtures("gc_disabled")
def test_closure_dies_with_the_graph_when_backward_is_skipped() -> None:
    """A forward whose backward never runs releases the function with the output."""
    weight = torch.randn(4, 4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t @ weight)

    fn_ref = weakref.ref(fn)
    out = forward_once(fn)
    frame_refs = _weak_checkpointing_objects()
    del fn, out
    assert fn_ref() is None
    assert [r() for r in frame_refs if r() is not None] == []


def forward_once(fn: Any) -> torch.Tensor:
    """One non-reentrant checkpoint of ``fn`` on a fresh input."""
    return checkpointing.checkpoint(fn, torch.randn(2, 4), use_reentrant=False)  # type: ignore[no-any-return]


def _pair_fn(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return pair[0].sin() * pair[1]


@pytest.mark.usefixtures("gc_disabled")
def test_container_inputs_leave_no_garbage() -> None:
    """Checkpointing a function of a tuple of tensors leaves no cyclic garbage per step."""
    a = torch.randn(3, requires_grad=True)
    for _ in range(3):
        checkpointing.checkpoint(_pair_fn, (a, a), use_reentrant=False).sum().backward()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(100):
        checkpointing.checkpoint(_pair_fn, (a, a), use_reentrant=False).sum().backward()
    assert len(gc.get_objects()) - before <= SLACK
