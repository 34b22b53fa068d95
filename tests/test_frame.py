"""Non-reentrant checkpoint: the frame, its holders, recompute, early stop, backward inside.

Every parity test runs one scenario with ``torch.utils.checkpoint`` (``use_reentrant=False``) and
with ours in the same test and compares gradients, the ops recomputed in backward (counted with a
dispatch mode), call logs and errors; correctness is proven against the run without checkpointing.
Rules are those of NOTE [Nestable checkpoint] in ``checkpointing/_frame.py``; the nesting rules
(1-3) are in ``test_nesting.py``, memory (Rules 4 and 7) in ``test_frame_memory.py``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import releases
import torch
import torch.nn.functional as F
from frame_support import (
    BOTH,
    INPUTS_SAVED_WITHOUT_A_DUMMY,
    OURS,
    PLAIN,
    TORCH,
    OpCounter,
    Variant,
    assert_tensors_equal,
    counting_ops,
    leaf,
    raised,
)

import checkpointing
from checkpointing import _compat

Grads = tuple[torch.Tensor | None, ...]


def _region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.sin() @ w).tanh() * x[:, :1].exp()


def _step(v: Variant, fn: Callable[..., Any] = _region, **options: Any) -> tuple[Grads, Any]:
    """Forward one region, backward its sum; gradients of (x, w) and the backward op counts."""
    x, w = leaf(4, 3), leaf(3, 3, seed=1)
    out = v.checkpoint(fn, x, w, **options)
    with counting_ops() as ops:
        out.sum().backward()
    return (out.detach(), x.grad, w.grad), ops


def test_gradients_equal_plain_run_and_torch() -> None:
    """One region: outputs and gradients equal the plain run; backward runs torch's ops."""
    plain, _ = _step(PLAIN)
    (theirs, their_ops), (ours, our_ops) = (_step(v) for v in BOTH)
    assert_tensors_equal(ours, plain, "ours vs plain")
    assert_tensors_equal(theirs, plain, "torch vs plain")
    assert our_ops == their_ops
    assert our_ops["aten.sin.default"] == 1  # the region was recomputed once


def test_forward_dispatches_only_the_functions_ops() -> None:
    """A user's dispatch mode around the forward sees the function's ops and nothing more."""

    def scenario(v: Variant) -> tuple[Any, int]:
        x = leaf(3)
        with OpCounter() as counter:
            v.checkpoint(lambda t: t.sin() * 2, x)
        return counter.counts, counter.input_savers

    (theirs, their_savers), (ours, our_savers) = (scenario(v) for v in BOTH)
    assert ours == theirs == {"aten.sin.default": 1, "aten.mul.Tensor": 1}
    # torch 2.11 alone also dispatches two aten.empty to save the region's inputs (counted apart)
    assert our_savers == 0
    assert their_savers == (0 if releases.has(INPUTS_SAVED_WITHOUT_A_DUMMY) else 2)


# ---------------------------------------------------------------------------------------------
# Rule 4: recomputed tensors serve one backward
# ---------------------------------------------------------------------------------------------


def _calls_per_backward(v: Variant, retain_twice: bool) -> tuple[list[int], Grads]:
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x.sin().sin().exp().sin() * 2

    x = leaf(5)
    out = v.checkpoint(fn, x)
    seen = [len(calls)]
    out.sum().backward(retain_graph=retain_twice)
    seen.append(len(calls))
    if retain_twice:
        out.sum().backward()
        seen.append(len(calls))
    return seen, (x.grad,)


@pytest.mark.parametrize("retain_twice", [False, True], ids=["one-backward", "retain-graph-twice"])
def test_rule_4_one_recompute_per_backward(retain_twice: bool) -> None:
    """Rule 4: one recompute per backward however many unpacks; a second backward recomputes."""
    (their_calls, their_grads), (our_calls, our_grads) = (
        _calls_per_backward(v, retain_twice) for v in BOTH
    )
    _, plain_grads = _calls_per_backward(PLAIN, retain_twice)
    assert our_calls == their_calls == ([1, 2, 3] if retain_twice else [1, 2])
    assert_tensors_equal(our_grads, plain_grads)
    assert_tensors_equal(their_grads, plain_grads)


def test_rule_4_unpack_outside_backward_recomputes_each_time() -> None:
    """Rule 4: a saved tensor unpacked outside backward recomputes for that unpack alone."""

    def scenario(v: Variant) -> tuple[int, torch.Tensor]:
        calls: list[int] = []

        def fn(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x.exp()

        x = leaf(3)
        out = v.checkpoint(fn, x)
        first = out.grad_fn._saved_result
        second = out.grad_fn._saved_result
        assert torch.equal(first, second)
        return len(calls), first

    (their_calls, theirs), (our_calls, ours) = (scenario(v) for v in BOTH)
    assert our_calls == their_calls == 3
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------
# Rule 5: early stop
# ---------------------------------------------------------------------------------------------

_FORWARD_LOG = ["sin1", "sin2", "scale", "done"]
_STOPPED_LOG = ["sin1", "sin2"]  # the second sin saves the last tensor the forward saved


def _logged_region(log: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        log.append("sin1")
        a = x.sin()
        log.append("sin2")
        b = a.sin()
        log.append("scale")
        c = b * 2  # saves nothing
        log.append("done")
        return c

    return fn


def _early_stop_run(
    v: Variant, early_stop: bool, at_forward: bool | None, at_backward: bool | None
) -> tuple[list[str], Any, Grads]:
    log: list[str] = []
    x = leaf(6)
    fwd = v.set_checkpoint_early_stop(at_forward) if at_forward is not None else None
    with fwd or contextlib.nullcontext():
        out = v.checkpoint(_logged_region(log), x, early_stop=early_stop)
    assert log == _FORWARD_LOG
    log.clear()
    bwd = v.set_checkpoint_early_stop(at_backward) if at_backward is not None else None
    with bwd or contextlib.nullcontext(), counting_ops() as ops:
        out.sum().backward()
    return log, ops, (x.grad,)


@pytest.mark.parametrize(
    ("early_stop", "at_forward", "at_backward", "expected"),
    [
        (True, None, None, _STOPPED_LOG),
        (False, None, None, _FORWARD_LOG),
        (True, False, None, _FORWARD_LOG),
        (False, True, None, _STOPPED_LOG),
        (True, None, False, _STOPPED_LOG),
        (False, None, True, _FORWARD_LOG),
    ],
    ids=[
        "default-stops",
        "argument-off",
        "setting-off-overrides-argument",
        "setting-on-overrides-argument",
        "setting-at-backward-ignored-on",
        "setting-at-backward-ignored-off",
    ],
)
def test_rule_5_early_stop(
    early_stop: bool, at_forward: bool | None, at_backward: bool | None, expected: list[str]
) -> None:
    """Rule 5: recompute stops after the last saved tensor; the forward-time setting wins."""
    (their_log, their_ops, their_grads), (our_log, our_ops, our_grads) = (
        _early_stop_run(v, early_stop, at_forward, at_backward) for v in BOTH
    )
    _, _, plain_grads = _early_stop_run(PLAIN, early_stop, None, None)
    assert our_log == their_log == expected
    assert our_ops == their_ops
    assert_tensors_equal(our_grads, plain_grads)
    assert_tensors_equal(their_grads, plain_grads)


def test_rule_5_early_stop_saves_ops() -> None:
    """Rule 5: with early stop the ops after the last saving op are not re-run (torch's count)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos() + x.exp() * 3  # exp saves its output: the tail is add and mul

    def recomputed(v: Variant, early_stop: bool) -> Any:
        x = leaf(4)
        out = v.checkpoint(fn, x, early_stop=early_stop)
        with counting_ops() as ops:
            out.sum().backward()
        return ops

    stopped = [recomputed(v, True) for v in BOTH]
    full = [recomputed(v, False) for v in BOTH]
    assert stopped[1] == stopped[0]
    assert full[1] == full[0]
    assert sum(full[1].values()) > sum(stopped[1].values())


# ---------------------------------------------------------------------------------------------
# Rule 6: backward inside the checkpointed function
# ---------------------------------------------------------------------------------------------


def _grad_inside_retained(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    z = y.cos()
    (gx,) = torch.autograd.grad(z.sum(), x, retain_graph=True)
    return z * gx


def _grad_inside_freed(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    z = y.cos()
    (gx,) = torch.autograd.grad(z.sum(), x)  # frees the holders of x and y: recompute skips them
    return x.cos() * gx


def _grad_inside_create_graph(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    z = (y * x).cos()
    (gx,) = torch.autograd.grad(z.sum(), x, create_graph=True)
    return gx * z


_INSIDE = {
    "retain-graph": _grad_inside_retained,
    "holders-freed": _grad_inside_freed,
    "create-graph": _grad_inside_create_graph,
}


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "no-early-stop"])
@pytest.mark.parametrize("kind", list(_INSIDE))
def test_rule_6_backward_inside_the_region(kind: str, early_stop: bool) -> None:
    """Rule 6: autograd.grad inside the checkpointed function; same gradients and work as torch."""
    inner = _INSIDE[kind]

    def scenario(v: Variant) -> tuple[int, Any, Grads]:
        calls: list[int] = []

        def fn(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return inner(x)

        x = leaf(5)
        out = v.checkpoint(fn, x, early_stop=early_stop)
        with counting_ops() as ops:
            out.sum().backward()
        return len(calls), ops, (x.grad,)

    (their_calls, their_ops, theirs), (our_calls, our_ops, ours) = (scenario(v) for v in BOTH)
    _, _, plain = scenario(PLAIN)
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)
    assert our_calls == their_calls
    assert our_ops == their_ops


# ---------------------------------------------------------------------------------------------
# Rule 7: randomness is replayed bit for bit
# ---------------------------------------------------------------------------------------------


def _dropout_region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.dropout(x @ w, p=0.5, training=True).sin() * torch.rand_like(x[:, :1])


def _dropout_step(v: Variant, **options: Any) -> tuple[Grads, torch.Tensor]:
    torch.manual_seed(1234)
    x, w = leaf(6, 4), leaf(4, 4, seed=1)
    out = v.checkpoint(_dropout_region, x, w, **options)
    out.sum().backward()
    return (out.detach(), x.grad, w.grad), torch.rand(8)


def test_rule_7_random_region_is_replayed_bit_identically() -> None:
    """Rule 7: dropout and rand_like give the plain run's gradients; the caller's stream goes on."""
    plain, plain_next = _dropout_step(PLAIN)
    for v in BOTH:
        grads, after = _dropout_step(v)
        assert_tensors_equal(grads, plain, v.name)
        assert torch.equal(after, plain_next), f"{v.name}: recompute disturbed the caller's RNG"


def _draws_inside_fork_rng(x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        noise = torch.rand_like(x)  # the region draws, then puts the CPU stream back
    return (x * noise).sin()


def test_rule_7_region_that_puts_the_rng_back_is_still_replayed() -> None:
    """Rule 7: random draws inside fork_rng leave the stream unchanged, yet replay is exact."""

    def scenario(v: Variant) -> Grads:
        torch.manual_seed(5)
        x = leaf(8)
        out = v.checkpoint(_draws_inside_fork_rng, x)
        torch.rand(3)  # the caller draws between forward and backward
        out.sum().backward()
        return (out.detach(), x.grad)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(theirs, plain, "torch")
    assert_tensors_equal(ours, plain, "ours")


def test_rule_7_each_backward_replays_the_same_numbers() -> None:
    """Rule 7: with retain_graph=True, both recomputes replay the forward's random numbers."""

    def scenario(v: Variant) -> Grads:
        torch.manual_seed(3)
        x, w = leaf(6, 4), leaf(4, 4, seed=1)
        out = v.checkpoint(_dropout_region, x, w)
        out.sum().backward(retain_graph=True)
        torch.rand(5)  # the stream moves on between the two backward calls
        out.sum().backward()
        return (x.grad, w.grad)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_rule_7_preserve_rng_state_false_draws_fresh_numbers_like_torch() -> None:
    """preserve_rng_state=False: recompute draws from the current stream, exactly as torch."""

    def scenario(v: Variant) -> Grads:
        torch.manual_seed(0)
        x, w = leaf(6, 4), leaf(4, 4, seed=1)
        out = v.checkpoint(_dropout_region, x, w, preserve_rng_state=False)
        torch.manual_seed(99)
        out.sum().backward()
        return (out.detach(), x.grad, w.grad)

    theirs, ours = (scenario(v) for v in BOTH)
    assert_tensors_equal(ours, theirs)
    plain, _ = _dropout_step(PLAIN)
    assert not torch.equal(ours[1], plain[1])  # different masks: the flag really took effect


@pytest.mark.parametrize("passes", [True, False])
def test_rule_9_recompute_detaches_below_a_mode_that_passes_detach_through(passes: bool) -> None:
    """Only a recompute mode marked ``passes_detach_through`` is spared the detaches."""
    recompute_mode = OpCounter(passes)
    x, w = leaf(4, 3), leaf(3, 3, seed=1)
    out = checkpointing.checkpoint(
        _region,
        x,
        w,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), recompute_mode),
    )
    out.sum().backward()
    plain, _ = _step(PLAIN)
    assert_tensors_equal((out.detach(), x.grad, w.grad), plain)
    assert recompute_mode.detaches == (0 if passes else 7)  # the region saves 7 grad tensors


def test_rule_9_a_users_mode_still_sees_every_recompute_detach_like_torch() -> None:
    """With a user's mode active in backward, selective checkpoint's recompute detaches
    through every mode, as torch's does: the user's mode counts torch's number of them."""
    policy = [torch.ops.aten.mm.default]
    counts = []
    for module in (torch.utils.checkpoint, checkpointing):
        x, w = leaf(4, 3), leaf(3, 3, seed=1)
        context_fn = functools.partial(module.create_selective_checkpoint_contexts, policy)
        out = module.checkpoint(_region, x, w, use_reentrant=False, context_fn=context_fn)
        with OpCounter() as user_mode:
            out.sum().backward()
        counts.append(user_mode.detaches)
    assert counts[0] == counts[1] > 0


# ---------------------------------------------------------------------------------------------
# Ways to run backward, and what may flow in and out of a region
# ---------------------------------------------------------------------------------------------


def test_autograd_grad() -> None:
    """torch.autograd.grad over a region: plain gradients, torch's recompute ops."""

    def scenario(v: Variant) -> tuple[Grads, Any]:
        x, w = leaf(4, 3), leaf(3, 3, seed=1)
        out = v.checkpoint(_region, x, w)
        with counting_ops() as ops:
            grads = torch.autograd.grad(out.sum(), (x, w))
        assert x.grad is None
        assert w.grad is None
        return grads, ops

    (theirs, their_ops), (ours, our_ops), (plain, _) = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)
    assert our_ops == their_ops


def test_backward_with_inputs() -> None:
    """backward(inputs=[w]) fills only w.grad, with the plain value."""

    def scenario(v: Variant) -> tuple[Grads, Any]:
        x, w = leaf(4, 3), leaf(3, 3, seed=1)
        out = v.checkpoint(_region, x, w)
        with counting_ops() as ops:
            out.sum().backward(inputs=[w])
        assert x.grad is None
        return (w.grad,), ops

    (theirs, their_ops), (ours, our_ops), (plain, _) = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)
    assert our_ops == their_ops


def test_partial_backward_one_output_at_a_time() -> None:
    """Two outputs, backward through each separately: plain gradients, torch's recompute count."""

    def scenario(v: Variant) -> tuple[list[int], Grads]:
        calls: list[int] = []

        def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(1)
            return (x.sin() * w).exp(), (x * w).cos()

        x, w = leaf(3), leaf(3, seed=1)
        a, b = v.checkpoint(fn, x, w)
        a.sum().backward()
        first = (x.grad.clone(), w.grad.clone())
        b.sum().backward()
        return [len(calls)], (*first, x.grad, w.grad)

    (their_calls, theirs), (our_calls, ours), (_, plain) = (scenario(v) for v in (*BOTH, PLAIN))
    assert our_calls == their_calls == [3]
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_unused_output_never_backpropagated() -> None:
    """A backward that reaches only part of the region still recomputes what it needs."""

    def scenario(v: Variant) -> Grads:
        def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.exp() * w, (x * w).sin()

        x, w = leaf(3), leaf(3, seed=1)
        a, _unused = v.checkpoint(fn, x, w)
        a.sum().backward()
        return (x.grad, w.grad)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_keyword_arguments_reach_the_function_in_forward_and_recompute() -> None:
    """**kwargs (tensors and plain values) go to fn in forward and in recompute."""

    def scenario(v: Variant) -> tuple[list[tuple[float, str]], Grads]:
        seen: list[tuple[float, str]] = []

        def fn(x: torch.Tensor, *, bias: torch.Tensor, scale: float, tag: str) -> torch.Tensor:
            seen.append((scale, tag))
            return (x * scale + bias).sin() * bias

        x, bias = leaf(4), leaf(4, seed=1)
        out = v.checkpoint(fn, x, bias=bias, scale=3.0, tag="t")
        out.sum().backward()
        return seen, (out.detach(), x.grad, bias.grad)

    (their_seen, theirs), (our_seen, ours), (_, plain) = (scenario(v) for v in (*BOTH, PLAIN))
    assert our_seen == their_seen == [(3.0, "t"), (3.0, "t")]
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_nested_containers_in_inputs_and_outputs() -> None:
    """Tensors inside dicts, lists and tuples flow in and out, with plain gradients."""

    def fn(tree: dict[str, Any], n: int) -> dict[str, Any]:
        a, (b, c) = tree["a"], tree["rest"]
        return {"out": [(a * b).sin(), ((b + c[0]).exp(),)], "n": n, "none": None}

    def scenario(v: Variant) -> Grads:
        a, b, c = leaf(3), leaf(3, seed=1), leaf(3, seed=2)
        result = v.checkpoint(fn, {"a": a, "rest": [b, (c,)]}, 7)
        assert result["n"] == 7
        assert result["none"] is None
        first, (second,) = result["out"]
        (first.sum() + second.sum()).backward()
        return (first.detach(), second.detach(), a.grad, b.grad, c.grad)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_outputs_that_do_not_require_grad() -> None:
    """Detached, integer and non-tensor outputs come back as in the plain run."""

    def fn(x: torch.Tensor) -> tuple[Any, ...]:
        y = x.sin()
        return y, y.detach(), x.argmax(), 3, None

    def scenario(v: Variant) -> tuple[list[bool], Grads]:
        x = leaf(5)
        y, detached, idx, three, none = v.checkpoint(fn, x)
        flags = [t.requires_grad for t in (y, detached, idx)]
        assert (three, none) == (3, None)
        y.sum().backward()
        return flags, (detached, idx, x.grad)

    (their_flags, theirs), (our_flags, ours), (plain_flags, plain) = (
        scenario(v) for v in (*BOTH, PLAIN)
    )
    assert our_flags == their_flags == plain_flags == [True, False, False]
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_detached_tensors_inside_the_region() -> None:
    """detach() and no_grad inside the region cut gradients exactly as in the plain run."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x.sin()
        with torch.no_grad():
            scale = (w * 2).exp()
        return a.detach() * w + a * scale + x.detach().cos() * x

    def scenario(v: Variant) -> tuple[Grads, Any]:
        x, w = leaf(4), leaf(4, seed=1)
        out = v.checkpoint(fn, x, w)
        with counting_ops() as ops:
            out.sum().backward()
        return (x.grad, w.grad), ops

    (theirs, their_ops), (ours, our_ops), (plain, _) = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)
    assert our_ops == their_ops


def test_inputs_that_do_not_require_grad_and_non_tensors() -> None:
    """Non-tensor arguments and inputs without grad pass through; only w gets a gradient."""

    def fn(x: torch.Tensor, w: torch.Tensor, k: int, name: str, nothing: None) -> torch.Tensor:
        assert (k, name, nothing) == (2, "n", None)
        return (x**k * w).sin()

    def scenario(v: Variant) -> Grads:
        x = leaf(4).detach()
        w = leaf(4, seed=1)
        out = v.checkpoint(fn, x, w, 2, "n", None)
        out.sum().backward()
        return (x.grad, w.grad)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


@pytest.mark.parametrize("shape", ["identity", "view", "inplace"])
def test_unusual_region_bodies(shape: str) -> None:
    """Regions that return their input, a view of it, or use in-place ops on intermediates."""
    bodies: dict[str, Callable[[torch.Tensor], Any]] = {
        "identity": lambda x: x,
        "view": lambda x: x.view(2, 3).t(),
        "inplace": lambda x: (x * 1).sin_().mul_(x).exp(),
    }

    def scenario(v: Variant) -> Grads:
        x = leaf(6)
        out = v.checkpoint(bodies[shape], x)
        (out * leaf(*out.shape, seed=3)).sum().backward()
        return (out.detach(), x.grad)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_higher_order_gradients() -> None:
    """create_graph=True through a region, then a double backward: plain results, torch's ops."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w).sin().exp() * x.cos()

    def scenario(v: Variant) -> tuple[Grads, Any]:
        x, w = leaf(5), leaf(5, seed=1)
        out = v.checkpoint(fn, x, w)
        with counting_ops() as ops:
            gx, gw = torch.autograd.grad(out.sum(), (x, w), create_graph=True)
            (gx.pow(2).sum() + (gw * x).sum()).backward()
        return (gx.detach(), gw.detach(), x.grad, w.grad), ops

    (theirs, their_ops), (ours, our_ops), (plain, _) = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)
    assert our_ops == their_ops


def test_third_order_gradient() -> None:
    """Three nested grads through one region equal the plain run's."""

    def scenario(v: Variant) -> Grads:
        x = leaf(4)
        out = v.checkpoint(lambda t: t.sin() * t.exp(), x)
        (g1,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad(g2.sum(), x)
        return (g1.detach(), g2.detach(), g3)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


# ---------------------------------------------------------------------------------------------
# context_fn, grad mode
# ---------------------------------------------------------------------------------------------


def _phase_contexts(events: list[str]) -> Callable[[], tuple[Any, Any]]:
    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        events.append(f"enter {name}")
        try:
            yield
        finally:
            events.append(f"exit {name}")

    return lambda: (phase("forward"), phase("recompute"))


def test_context_fn_contexts_wrap_their_phase() -> None:
    """context_fn: the first context wraps the forward call, the second the recompute."""

    def scenario(v: Variant) -> list[str]:
        events: list[str] = []

        def fn(x: torch.Tensor) -> torch.Tensor:
            events.append("fn")
            return x.sin().cos() * 2

        x = leaf(3)
        out = v.checkpoint(fn, x, context_fn=_phase_contexts(events))
        events.append("backward")
        out.sum().backward()
        return events

    theirs, ours = (scenario(v) for v in BOTH)
    assert ours == theirs
    assert ours == [
        "enter forward",
        "fn",
        "exit forward",
        "backward",
        "enter recompute",
        "fn",
        "exit recompute",
    ]


def test_context_fn_dispatch_modes_see_their_phase() -> None:
    """context_fn with dispatch modes: each mode sees the ops of its phase, as with torch."""

    def scenario(v: Variant) -> tuple[Any, Any]:
        forward_mode, recompute_mode = OpCounter(), OpCounter()
        x = leaf(3)
        out = v.checkpoint(
            lambda t: t.sin().cos() * 2, x, context_fn=lambda: (forward_mode, recompute_mode)
        )
        out.sum().backward()
        return forward_mode.counts, recompute_mode.counts

    (their_fwd, their_rec), (our_fwd, our_rec) = (scenario(v) for v in BOTH)
    assert our_fwd == their_fwd
    assert our_rec == their_rec
    assert our_fwd["aten.cos.default"] == 1
    assert our_rec["aten.sin.default"] == 1


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_without_grad_the_function_runs_plainly(mode: str) -> None:
    """Under no_grad/inference_mode: fn runs once, nothing requires grad, contexts not entered."""
    grad_off = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def scenario(v: Variant) -> tuple[list[str], torch.Tensor]:
        events: list[str] = []

        def fn(x: torch.Tensor) -> torch.Tensor:
            events.append("fn")
            return x.sin()

        x = leaf(3)
        with grad_off():
            out = v.checkpoint(fn, x, context_fn=_phase_contexts(events))
        assert not out.requires_grad
        return events, out

    (their_events, theirs), (our_events, ours) = (scenario(v) for v in BOTH)
    assert our_events == their_events == ["fn"]
    assert torch.equal(ours, theirs)


def test_autocast_of_forward_is_restored_in_recompute() -> None:
    """A region run under CPU autocast, backward outside it: plain gradients, no mismatch."""

    def scenario(v: Variant) -> Grads:
        x, w = leaf(4, 4, dtype=torch.float32), leaf(4, 4, seed=1, dtype=torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = v.checkpoint(lambda a, b: (a @ b).float().sin(), x, w)
        out.sum().backward()
        return (out.detach(), x.grad, w.grad)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_user_hooks_active_during_backward_do_not_see_recompute() -> None:
    """Rule 3: recompute's saves go to the frame even under a user's hooks at backward time."""

    def scenario(v: Variant) -> tuple[int, Grads]:
        packed: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(1)
            return t

        x = leaf(4)
        out = v.checkpoint(lambda t: t.sin().exp(), x)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out.sum().backward()
        return len(packed), (x.grad,)

    (their_packed, theirs), (our_packed, ours), (_, plain) = (scenario(v) for v in (*BOTH, PLAIN))
    assert our_packed == their_packed == 0
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


def test_context_fn_is_called_once_per_checkpoint_even_without_grad() -> None:
    """context_fn() is called once per checkpoint call, also under no_grad (as torch)."""

    def scenario(v: Variant) -> list[int]:
        calls: list[int] = []

        def context_fn() -> tuple[Any, Any]:
            calls.append(1)
            return contextlib.nullcontext(), contextlib.nullcontext()

        x = leaf(3)
        v.checkpoint(torch.sin, x, context_fn=context_fn).sum().backward()
        with torch.no_grad():
            v.checkpoint(torch.sin, x, context_fn=context_fn)
        return calls

    theirs, ours = (scenario(v) for v in BOTH)
    assert ours == theirs == [1, 1]


def test_grad_mode_of_forward_is_restored_in_recompute() -> None:
    """A region whose forward ran under enable_grad inside no_grad code recomputes correctly."""

    def scenario(v: Variant) -> Grads:
        x = leaf(4)
        with torch.no_grad(), torch.enable_grad():
            out = v.checkpoint(lambda t: t.exp().sin(), x)
        out.sum().backward()
        return (x.grad,)

    theirs, ours, plain = (scenario(v) for v in (*BOTH, PLAIN))
    assert_tensors_equal(ours, plain)
    assert_tensors_equal(theirs, plain)


# ---------------------------------------------------------------------------------------------
# Errors a user can cause (same types and phrases as torch)
# ---------------------------------------------------------------------------------------------


# releases.THROWS_INTO_GENERATOR (torch 2.13): checkpoint throws fn's exception into its frame
# generator, so the frame's saved-tensors hook is popped at once and a forward context that
# swallows the exception is detected. torch 2.11 and 2.12 let the exception pass the generator by:
# its hook stays on the stack until the generator is garbage-collected (here, once the exception's
# traceback is gone), and a swallowing context never sees the exception.


def _both_since(release: tuple[int, int], what: str) -> pytest.MarkDecorator:
    """Parametrize ``v`` over torch and ours; torch's half needs ``release``."""
    return pytest.mark.parametrize(
        "v",
        [
            pytest.param(TORCH, id="torch", marks=releases.needs_torch(release, what)),
            pytest.param(OURS, id="ours"),
        ],
    )


@_both_since(releases.THROWS_INTO_GENERATOR, "throwing fn's exception into its frame generator")
def test_exception_in_the_function_propagates_and_leaves_no_hook(v: Variant) -> None:
    """An exception from fn reaches the caller unchanged, its hook already gone; the next
    checkpoint works."""

    def boom(x: torch.Tensor) -> torch.Tensor:
        x.sin()
        raise KeyError("boom")

    before = _compat.top_saved_tensors_hooks()
    err = raised(lambda: v.checkpoint(boom, leaf(3)))
    assert type(err) is KeyError
    assert _compat.top_saved_tensors_hooks() == before  # while err's traceback is alive
    x = leaf(3)
    v.checkpoint(torch.sin, x).sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_exception_during_recompute_propagates_from_backward() -> None:
    """fn raising only in recompute: backward raises that exception; no hook is left behind."""

    for v in BOTH:
        state = {"recomputing": False}

        def fn(x: torch.Tensor, state: dict[str, bool] = state) -> torch.Tensor:
            if state["recomputing"]:
                raise KeyError("recompute")
            return x.sin()

        out = v.checkpoint(fn, leaf(3))
        state["recomputing"] = True
        err = raised(lambda out=out: out.sum().backward())
        assert type(err) is KeyError, v.name


def test_saved_tensors_hooks_disabled_is_reported_as_torch() -> None:
    """Under disable_saved_tensors_hooks a checkpoint raises torch's RuntimeError and message."""
    for v in BOTH:
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this block"):
            err = raised(lambda v=v: v.checkpoint(torch.sin, leaf(3)))
        assert type(err) is RuntimeError, v.name
        assert "no hooks in this block" in str(err)


@_both_since(
    releases.THROWS_INTO_GENERATOR, "the error for a context_fn that swallows fn's exception"
)
def test_forward_context_that_swallows_the_exception_is_an_error(v: Variant) -> None:
    """A context_fn forward context that suppresses fn's exception: RuntimeError, as torch."""

    @contextlib.contextmanager
    def swallow() -> Iterator[None]:
        with contextlib.suppress(ValueError):
            yield

    def bad(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    err = raised(lambda: v.checkpoint(bad, leaf(3), context_fn=lambda: (swallow(), swallow())))
    assert type(err) is RuntimeError
    assert "suppressed an exception" in str(err)


def test_input_modified_in_place_before_backward() -> None:
    """An input changed in place after forward: autograd's version error, as torch."""

    def scenario(v: Variant) -> BaseException:
        x = leaf(3)
        h = x * 1
        out = v.checkpoint(lambda t: t.sin(), h)
        with torch.no_grad():
            h.add_(1)
        return raised(lambda: out.sum().backward())

    for err in (scenario(v) for v in BOTH):
        assert type(err) is RuntimeError
        assert "modified by an inplace operation" in str(err)


# ---------------------------------------------------------------------------------------------
# GraphExecGroup
# ---------------------------------------------------------------------------------------------


def _two_branch_region(calls: list[int]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return x.sin() * 2, y.cos() * 2  # each branch saves only its own input

    return fn


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "ungrouped"])
def test_graph_exec_group_recomputes_once_for_two_backwards(grouped: bool) -> None:
    """GraphExecGroup: two backward calls over disjoint parts recompute once (twice without)."""

    def scenario(v: Variant) -> tuple[int, Grads]:
        calls: list[int] = []
        x, y = leaf(3), leaf(3, seed=1)
        a, b = v.checkpoint(_two_branch_region(calls), x, y)
        group = v.graph_exec_group() if grouped else contextlib.nullcontext()
        with group:
            (gx,) = torch.autograd.grad(a.sum(), x)
            (gy,) = torch.autograd.grad(b.sum(), y)
        return len(calls), (gx, gy)

    (their_calls, theirs), (our_calls, ours) = (scenario(v) for v in BOTH)
    assert our_calls == their_calls == (2 if grouped else 3)
    expected = (2 * leaf(3).detach().cos(), -2 * leaf(3, seed=1).detach().sin())
    assert_tensors_equal(ours, expected)
    assert_tensors_equal(theirs, expected)


def test_graph_exec_group_overlapping_backwards_raise() -> None:
    """GraphExecGroup: two backwards needing the same saved tensor raise CheckpointError."""

    def scenario(v: Variant) -> BaseException:
        x = leaf(3)
        a, b = v.checkpoint(lambda t: (t.sin() + 1, t.sin() * 2), x)
        out = a + b
        with v.graph_exec_group():
            torch.autograd.grad(out.sum(), x, retain_graph=True)
            return raised(lambda: torch.autograd.grad(out.sum(), x))

    for v, err in zip(BOTH, (scenario(v) for v in BOTH), strict=True):
        assert isinstance(err, v.checkpoint_error)
        assert "unpacked once" in str(err)
        assert "GraphExecGroup" in str(err)


def test_graph_exec_group_cannot_be_nested() -> None:
    """Entering a GraphExecGroup inside another raises RuntimeError, as torch."""
    for outer in BOTH:
        for inner in BOTH:
            with outer.graph_exec_group():
                err = raised(lambda inner=inner: inner.graph_exec_group().__enter__())
            assert type(err) is RuntimeError, (outer.name, inner.name)
            assert "cannot be nested" in str(err)


def test_graph_exec_group_is_left_on_exit() -> None:
    """After a group exits, each backward recomputes again (the group no longer applies)."""

    def scenario(v: Variant) -> int:
        calls: list[int] = []
        x, y = leaf(3), leaf(3, seed=1)
        a, _ = v.checkpoint(_two_branch_region(calls), x, y)
        with v.graph_exec_group():
            torch.autograd.grad(a.sum(), x, retain_graph=True)
        torch.autograd.grad(a.sum(), x)
        return len(calls)

    assert [scenario(v) for v in BOTH] == [3, 3]


# ---------------------------------------------------------------------------------------------
# Ours only: is_recomputing()
# ---------------------------------------------------------------------------------------------


def test_is_recomputing_is_true_only_inside_recompute() -> None:
    """is_recomputing() is False in forward and after backward, True while fn is re-run."""
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(checkpointing.is_recomputing())
        return x.sin()

    assert not checkpointing.is_recomputing()
    x = leaf(3)
    out = OURS.checkpoint(fn, x)
    out.sum().backward()
    assert seen == [False, True]
    assert not checkpointing.is_recomputing()
