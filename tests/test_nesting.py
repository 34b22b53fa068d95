"""Nested non-reentrant checkpoints: NOTE [Nestable checkpoint], Rules 1-3, any depth.

Each test runs the same nested program with ``torch.utils.checkpoint`` and with ours and compares
the order in which regions are re-run (a log the regions append to), the ops recomputed in
backward, and the gradients, which must also equal the run without checkpointing. The Hypothesis
test draws random op programs with regions nested at random places.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import releases
import torch
from frame_support import (
    BOTH,
    INPUTS_SAVED_WITHOUT_A_DUMMY,
    PLAIN,
    Variant,
    assert_tensors_equal,
    counting_ops,
    leaf,
)
from hypothesis import given
from strategies import OpProgram, op_programs
from torch.multiprocessing.reductions import StorageWeakRef

Grads = tuple[torch.Tensor | None, ...]


def _two_levels(
    v: Variant, log: list[str], *, outer_early_stop: bool = True, inner_early_stop: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[StorageWeakRef]]:
    """outer(x) = 3 * checkpoint(inner, exp(x)); inner(a) = 2 * sin(sin(a)).

    The outer region saves exp's output and inner's input; the inner one saves a and sin(a).
    ``refs`` gets a weak reference to the storage of inner's input each time outer runs.
    """
    refs: list[StorageWeakRef] = []

    def inner(a: torch.Tensor) -> torch.Tensor:
        log.append("i1")
        c = a.sin()
        log.append("i2")
        d = c.sin()
        log.append("i3")
        return d * 2

    def outer(x: torch.Tensor) -> torch.Tensor:
        log.append("o1")
        a = x.exp()
        refs.append(StorageWeakRef(a.untyped_storage()))
        log.append("o2")
        b = v.checkpoint(inner, a, early_stop=inner_early_stop)
        log.append("o3")
        return b * 3

    x = leaf(4)
    return x, v.checkpoint(outer, x, early_stop=outer_early_stop), refs


_FORWARD = ["o1", "o2", "i1", "i2", "i3", "o3"]


def test_rule_1_saved_tensors_belong_to_the_innermost_checkpoint() -> None:
    """Rule 1: the outer recompute stops at inner's input; it never re-runs inner's body."""

    def scenario(v: Variant) -> tuple[list[str], Any, Grads]:
        log: list[str] = []
        x, out, _ = _two_levels(v, log)
        assert log == _FORWARD
        log.clear()
        with counting_ops() as ops:
            out.sum().backward()
        return log, ops, (x.grad,)

    (their_log, their_ops, theirs), (our_log, our_ops, ours) = (scenario(v) for v in BOTH)
    _, _, plain = scenario(PLAIN)
    # outer re-runs up to inner's input (its 2nd and last saved tensor), then inner re-runs up
    # to sin(a). Were inner's tensors outer's too, outer's recompute would run inner's body.
    assert our_log == their_log == ["o1", "o2", "i1", "i2"]
    assert our_ops == their_ops
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_rule_1_outer_hook_sees_only_the_outermost_inputs() -> None:
    """Rule 1: a user's saved-tensors hook around nested checkpoints sees only x (never inner's)."""

    def scenario(v: Variant) -> list[tuple[int, ...]]:
        seen: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, out, _ = _two_levels(v, [])
        out.sum().backward()
        return seen

    theirs, ours = (scenario(v) for v in BOTH)
    if not releases.has(INPUTS_SAVED_WITHOUT_A_DUMMY):
        # torch 2.11 also saves a (0,)-shaped dummy, before the outer region's inputs
        assert theirs[:1] == [(0,)]
        theirs = theirs[1:]
    assert ours == theirs == [(4,)]


def test_rule_2_inner_inputs_are_saved_by_the_parent() -> None:
    """Rule 2: inner's input (made inside outer) is not kept; unpacking re-runs outer first."""

    def scenario(v: Variant) -> tuple[list[str], list[bool], Grads]:
        log: list[str] = []
        x, out, refs = _two_levels(v, log)
        after_forward = [ref.expired() for ref in refs]
        log.clear()
        out.sum().backward()
        return log, after_forward, (x.grad,)

    (their_log, their_dead, theirs), (our_log, our_dead, ours) = (scenario(v) for v in BOTH)
    _, _, plain = scenario(PLAIN)
    assert our_dead == their_dead == [True]
    assert our_log[:2] == their_log[:2] == ["o1", "o2"]  # the parent is re-run before inner
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def _nested_levels(
    v: Variant, depth: int, early_stops: tuple[bool, ...], log: list[str], x: torch.Tensor
) -> torch.Tensor:
    """depth levels, each: h = sin(h) * w_i; h = checkpoint(next level)(h); return cos(h)."""
    weights = [leaf(*x.shape, seed=10 + i).detach() for i in range(depth)]

    def level(i: int, h: torch.Tensor) -> torch.Tensor:
        log.append(f"L{i}>")
        h = h.sin() * weights[i]
        if i + 1 < depth:
            h = v.checkpoint(functools.partial(level, i + 1), h, early_stop=early_stops[i + 1])
        log.append(f"L{i}<")
        return h.cos()

    return v.checkpoint(functools.partial(level, 0), x, early_stop=early_stops[0])


def test_rule_2_innermost_unpack_recomputes_every_parent_in_order() -> None:
    """Rule 2: at depth 4, the first unpack re-runs levels 0, 1, 2 before the innermost."""

    def scenario(v: Variant) -> list[str]:
        log: list[str] = []
        out = _nested_levels(v, 4, (True,) * 4, log, leaf(3))
        log.clear()
        out.sum().backward()
        return log

    theirs, ours = (scenario(v) for v in BOTH)
    assert ours == theirs
    assert [entry for entry in ours if entry.endswith(">")][:4] == ["L0>", "L1>", "L2>", "L3>"]


@pytest.mark.parametrize(
    "early_stops",
    [(True, True), (False, True), (True, False), (False, False)],
    ids=["stop-stop", "full-stop", "stop-full", "full-full"],
)
def test_rule_3_checkpoints_met_during_recompute_still_apply(
    early_stops: tuple[bool, bool],
) -> None:
    """Rule 3: during outer's full recompute the inner checkpoint keeps its own tensors."""

    def scenario(v: Variant) -> tuple[list[str], Any, Grads]:
        log: list[str] = []
        x, out, _ = _two_levels(
            v, log, outer_early_stop=early_stops[0], inner_early_stop=early_stops[1]
        )
        log.clear()
        with counting_ops() as ops:
            out.sum().backward()  # outer with early_stop=False would raise on extra tensors
        return log, ops, (x.grad,)

    (their_log, their_ops, theirs), (our_log, our_ops, ours) = (scenario(v) for v in BOTH)
    _, _, plain = scenario(PLAIN)
    assert our_log == their_log
    assert our_ops == their_ops
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "no-early-stop"])
def test_rule_3_recompute_inside_another_checkpoints_forward(early_stop: bool) -> None:
    """Rule 3: a region recomputed while another checkpoint runs forward is not captured by it."""

    def scenario(v: Variant) -> tuple[list[int], Any, Grads]:
        calls: list[int] = []

        def first(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x.sin().sin()

        def second(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)  # recomputes `first`
            return x.cos() * g + y.exp()

        x = leaf(4)
        y = v.checkpoint(first, x)
        out = v.checkpoint(second, x, y, early_stop=early_stop)
        with counting_ops() as ops:
            out.sum().backward()
        return calls, ops, (x.grad,)

    (their_calls, their_ops, theirs), (our_calls, our_ops, ours) = (scenario(v) for v in BOTH)
    _, _, plain = scenario(PLAIN)
    assert our_calls == their_calls
    assert our_ops == their_ops
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


_DEPTH_CASES = {
    "depth3-stop": (True, True, True),
    "depth3-full": (False, False, False),
    "depth4-mixed": (True, False, True, False),
    "depth5-mixed": (False, True, True, False, True),
    "depth6-stop": (True,) * 6,
}


@pytest.mark.parametrize("early_stops", list(_DEPTH_CASES.values()), ids=list(_DEPTH_CASES))
def test_arbitrary_depth_with_early_stop_on_and_off(early_stops: tuple[bool, ...]) -> None:
    """3+ levels, early stop per level on or off: torch's re-run order and ops, plain gradients."""

    def scenario(v: Variant) -> tuple[list[str], Any, Grads]:
        log: list[str] = []
        x = leaf(3)
        out = _nested_levels(v, len(early_stops), early_stops, log, x)
        log.clear()
        with counting_ops() as ops:
            out.sum().backward()
        return log, ops, (out.detach(), x.grad)

    (their_log, their_ops, theirs), (our_log, our_ops, ours) = (scenario(v) for v in BOTH)
    _, _, plain = scenario(PLAIN)
    assert our_log == their_log
    assert our_ops == their_ops
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


@pytest.mark.parametrize("setting", [True, False], ids=["setting-on", "setting-off"])
def test_nested_early_stop_setting_at_forward(setting: bool) -> None:
    """set_checkpoint_early_stop around a nested forward governs every level, as with torch."""

    def scenario(v: Variant) -> tuple[list[str], Grads]:
        log: list[str] = []
        x = leaf(3)
        with v.set_checkpoint_early_stop(setting):
            out = _nested_levels(v, 3, (not setting,) * 3, log, x)
        log.clear()
        out.sum().backward()
        return log, (x.grad,)

    (their_log, theirs), (our_log, ours) = (scenario(v) for v in BOTH)
    _, plain = scenario(PLAIN)
    assert our_log == their_log
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_nested_double_backward() -> None:
    """Double backward through three nested regions equals the plain run (torch's ops)."""

    def scenario(v: Variant) -> tuple[Grads, Any]:
        x = leaf(3)
        out = _nested_levels(v, 3, (True, False, True), [], x)
        with counting_ops() as ops:
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (gx * gx.exp()).sum().backward()
        return (gx.detach(), x.grad), ops

    (theirs, their_ops), (ours, our_ops), (plain, _) = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)
    assert our_ops == their_ops


def test_sibling_regions_inside_a_region() -> None:
    """Two sibling checkpoints inside one outer checkpoint, partial backward through each."""

    def scenario(v: Variant) -> tuple[list[int], Grads]:
        calls: list[int] = []

        def leaf_region(h: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return h.sin().exp()

        def outer(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return v.checkpoint(leaf_region, x * 2), v.checkpoint(leaf_region, y.cos())

        x, y = leaf(3), leaf(3, seed=1)
        a, b = v.checkpoint(outer, x, y)
        a.sum().backward()
        b.sum().backward()
        return calls, (x.grad, y.grad)

    (their_calls, theirs), (our_calls, ours), (_, plain) = (scenario(v) for v in (*BOTH, PLAIN))
    assert len(our_calls) == len(their_calls)
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


# ---------------------------------------------------------------------------------------------
# Hypothesis: random op programs, regions nested at random places
# ---------------------------------------------------------------------------------------------


def _program_step(program: OpProgram, checkpoint: Callable[..., torch.Tensor]) -> tuple[Grads, Any]:
    """Run the program, take first-order gradients with create_graph, then a double backward."""
    n = program.n
    x, w = leaf(n, n, seed=program.seed), leaf(n, n, seed=program.seed + 1)
    cotangent = leaf(n, n, seed=program.seed + 2).detach()
    torch.manual_seed(program.seed)
    out = program.run(x, w, checkpoint)
    with counting_ops() as ops:
        gx, gw = torch.autograd.grad(
            (out * cotangent).sum(), (x, w), create_graph=True, allow_unused=True
        )
        second = (gx * gx).sum() + (0 if gw is None else (gw * w).sum())
        if second.requires_grad:
            second.backward()
    first = tuple(None if g is None else g.detach() for g in (gx, gw))
    return (out.detach(), *first, x.grad, w.grad), ops


@given(program=op_programs())
def test_random_nested_programs_match_plain_and_torch(program: OpProgram) -> None:
    """Random nested programs: gradients and double backward equal plain; torch's op counts."""
    (theirs, their_ops), (ours, our_ops), (plain, _) = (
        _program_step(program, v.checkpoint) for v in (*BOTH, PLAIN)
    )
    for got, what in ((ours, "ours"), (theirs, "torch")):
        for a, b in zip(got, plain, strict=True):
            assert (a is None) == (b is None), what
            if a is not None and b is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)
    assert our_ops == their_ops
