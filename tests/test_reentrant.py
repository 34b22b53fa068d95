"""Reentrant checkpoint (``CheckpointFunction``, ``use_reentrant=True``).

Correctness against the run without checkpointing (Hypothesis over random layer stacks), and
parity with ``torch.utils.checkpoint`` side by side: same results, warnings, errors and recompute
counts. See NOTE [Reentrant checkpoint] in ``checkpointing/_reentrant.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from hypothesis import given
from strategies import StackSpec, layer_stacks, layer_stacks_with_dropout
from torch import nn

import checkpointing

Runner = Callable[..., Any]


def _ours_function(fn: Callable[..., Any], *args: Any, preserve: bool = True) -> Any:
    return checkpointing.CheckpointFunction.apply(fn, preserve, *args)


def _ours_front_door(fn: Callable[..., Any], *args: Any, preserve: bool = True) -> Any:
    return checkpointing.checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=preserve)


def _torch(fn: Callable[..., Any], *args: Any, preserve: bool = True) -> Any:
    return tc.checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=preserve)


# Example tests run our reentrant checkpoint both through the autograd Function and through the
# front door; the Hypothesis tests use the Function (test_checkpoint_api covers the front door).
BOTH_ENTRIES = pytest.mark.parametrize(
    "ours", [_ours_function, _ours_front_door], ids=["CheckpointFunction", "checkpoint"]
)


def _recorded(call: Callable[[], object]) -> tuple[object, list[tuple[type[Warning], str]]]:
    """Run ``call``; return its result and the (category, message) of each warning raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [(w.category, str(w.message)) for w in caught]


def _raised(call: Callable[[], object]) -> tuple[type[BaseException], str]:
    """Run ``call``, which must raise, and return the exception type and message."""
    with pytest.raises(Exception) as info:  # noqa: PT011 - compared with torch by the caller
        call()
    return info.type, str(info.value)


def _plain(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return model(x)  # type: ignore[no-any-return]


# --- correctness over random layer stacks ----------------------------------------------------


@given(spec=layer_stacks())
def test_gradients_equal_unchecked_run(spec: StackSpec) -> None:
    """Input and parameter gradients are bit-identical to the run without checkpointing."""
    expected = spec.run(_plain)
    got = spec.run(lambda model, x: _ours_function(model, x))
    got.assert_equal(expected)


@given(spec=layer_stacks_with_dropout())
def test_dropout_bit_identical_with_preserved_rng(spec: StackSpec) -> None:
    """preserve_rng_state=True: dropout replays exactly, the caller's stream ends as unchecked."""
    torch.manual_seed(0)
    expected = spec.run(_plain)
    torch.manual_seed(0)
    got = spec.run(lambda model, x: _ours_function(model, x, preserve=True))
    got.assert_equal(expected)
    assert torch.equal(got.rng_after, expected.rng_after)


@given(spec=layer_stacks_with_dropout())
def test_unpreserved_rng_redraws_like_torch(spec: StackSpec) -> None:
    """preserve_rng_state=False: recompute draws fresh masks from the caller's stream, as torch.

    The gradients then generally differ from the un-checkpointed run (not asserted); they equal
    torch's bit for bit, and the caller's stream has advanced past the un-checkpointed one.
    """
    torch.manual_seed(2)
    plain = spec.run(_plain)
    torch.manual_seed(2)
    theirs = spec.run(lambda model, x: _torch(model, x, preserve=False))
    torch.manual_seed(2)
    got = spec.run(lambda model, x: _ours_function(model, x, preserve=False))
    got.assert_equal(theirs)
    assert torch.equal(got.rng_after, theirs.rng_after)
    assert not torch.equal(got.rng_after, plain.rng_after)


@given(spec=layer_stacks(dtypes=(torch.float64,)))
def test_gradients_equal_torch_checkpoint(spec: StackSpec) -> None:
    """Gradients are bit-identical to torch.utils.checkpoint's reentrant variant."""
    ours_result = spec.run(lambda model, x: _ours_function(model, x))
    theirs = spec.run(lambda model, x: _torch(model, x))
    ours_result.assert_equal(theirs)


# --- NOTE [Reentrant checkpoint], Rule 1: forward under no_grad ------------------------------


@BOTH_ENTRIES
def test_rule1_forward_runs_without_grad_recompute_with_grad(ours: Runner) -> None:
    """Rule 1: fn sees grad disabled in forward and enabled in the re-run, as in torch."""
    seen: dict[str, list[bool]] = {"ours": [], "torch": []}

    def region(key: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            seen[key].append(torch.is_grad_enabled())
            return t.sin()

        return fn

    x = torch.randn(4, requires_grad=True)
    ours(region("ours"), x).sum().backward()
    _torch(region("torch"), x).sum().backward()
    assert seen["ours"] == seen["torch"] == [False, True]


@BOTH_ENTRIES
def test_rule1_in_place_change_of_input_before_backward_raises(ours: Runner) -> None:
    """Rule 1: inputs are saved with version checks; changing one in place makes backward raise."""
    for run in (ours, _torch):
        x = torch.randn(3, requires_grad=True)
        y = x * 1
        out = run(lambda t: t.exp(), y)
        with torch.no_grad():
            y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@BOTH_ENTRIES
def test_output_requires_grad_like_torch(ours: Runner) -> None:
    """The outputs require grad exactly when torch's do (every tensor output, given one input)."""
    x = torch.randn(3, requires_grad=True)

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        return t * 2, t.detach() + 1, 5

    mine, theirs = ours(fn, x), _torch(fn, x)
    assert [getattr(o, "requires_grad", None) for o in mine] == [
        getattr(o, "requires_grad", None) for o in theirs
    ]
    assert mine[2] == theirs[2] == 5


# --- Rule 2: the re-run ---------------------------------------------------------------------


@BOTH_ENTRIES
def test_rule2_non_tensor_inputs_kept(ours: Runner) -> None:
    """Rule 2: non-tensor arguments reach the re-run as the very same objects."""
    scale, extra, missing = 3.0, [1, 2], None
    calls: list[tuple[object, ...]] = []

    def fn(t: torch.Tensor, s: float, name: str, nothing: None, lst: list[int]) -> torch.Tensor:
        calls.append((s, name, nothing, lst))
        return t * s * len(lst) if name == "mul" else t

    x = torch.randn(5, requires_grad=True)
    ours(fn, x, scale, "mul", missing, extra).sum().backward()
    assert len(calls) == 2
    assert all(c[0] is scale and c[2] is missing and c[3] is extra for c in calls)
    assert torch.equal(x.grad, torch.full((5,), 6.0))


@BOTH_ENTRIES
def test_rule2_tensors_in_containers_reach_the_rerun_undetached(ours: Runner) -> None:
    """Rule 2: a tensor inside a container is passed as is, so its gradients are torch's."""
    grads = []
    for run in (ours, _torch):
        torch.manual_seed(10)  # the same inputs for both implementations
        x = torch.randn(3, requires_grad=True)
        y = torch.randn(3, requires_grad=True)
        run(lambda t, box: t * box[0], x, [y]).sum().backward()
        grads.append((x.grad, y.grad))
    (mx, my), (tx, ty) = grads
    assert torch.equal(mx, tx)
    assert torch.equal(my, ty)


@BOTH_ENTRIES
def test_rule2_rng_restored_for_rerun(ours: Runner) -> None:
    """Rule 2: dropout in the re-run reuses the forward's mask (matches the unchecked gradient)."""
    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(3)
    plain = torch.nn.functional.dropout(x, 0.5).mul(x)
    (expected,) = torch.autograd.grad(plain.sum(), x)
    torch.manual_seed(3)
    ours(lambda t: torch.nn.functional.dropout(t, 0.5).mul(t), x).sum().backward()
    assert torch.equal(x.grad, expected)


@BOTH_ENTRIES
def test_rule2_rng_restore_when_only_rerun_draws_matches_torch(ours: Runner) -> None:
    """Rule 2: a region that draws only in its re-run leaves the caller's RNG stream as torch does.

    torch always forks the CPU RNG around the re-run when preserve_rng_state=True, so the
    caller's stream is never advanced by recompute, even when the forward drew nothing.
    """

    def fn(t: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            torch.rand(3)
        return t * 2

    after = []
    for run in (ours, _torch):
        torch.manual_seed(4)
        x = torch.randn(3, requires_grad=True)
        run(fn, x).sum().backward()
        after.append(torch.get_rng_state())
    assert torch.equal(after[0], after[1])


@BOTH_ENTRIES
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_rule2_autocast_state_restored(ours: Runner, where: str) -> None:
    """Rule 2: the re-run sees the forward's CPU autocast state; gradients equal torch's."""
    seen: dict[str, list[tuple[bool, torch.dtype]]] = {"ours": [], "torch": []}
    w = torch.randn(8, 8, dtype=torch.float32)

    def region(key: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            out = (t @ w).relu() @ w
            seen[key].append((torch.is_autocast_enabled("cpu"), out.dtype))
            return out.float().tanh()

        return fn

    grads = []
    for key, run in (("ours", ours), ("torch", _torch)):
        torch.manual_seed(10)  # the same inputs for both implementations
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "forward"):
            out = run(region(key), x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "backward"):
            out.sum().backward()
        grads.append(x.grad)
    autocast_in_forward = where == "forward"
    dtype = torch.bfloat16 if autocast_in_forward else torch.float32
    assert seen["ours"] == seen["torch"] == [(autocast_in_forward, dtype)] * 2
    assert torch.equal(grads[0], grads[1])


@BOTH_ENTRIES
def test_rule2_backward_only_through_outputs_requiring_grad(ours: Runner) -> None:
    """Rule 2: outputs that do not require grad in the re-run are skipped, as in torch."""

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        return t * 2, t.detach() + 1, 5

    grads = []
    for run in (ours, _torch):
        x = torch.randn(3, requires_grad=True)
        a, b, _ = run(fn, x)
        (a.sum() + b.sum()).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0], torch.full((3,), 2.0))


@BOTH_ENTRIES
def test_rule2_multiple_outputs_and_unused_output(ours: Runner) -> None:
    """Rule 2: several outputs, one unused by the loss, give torch's gradients."""

    def fn(t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (t * u).sin(), t.exp()

    grads = []
    for run in (ours, _torch):
        torch.manual_seed(10)  # the same inputs for both implementations
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        y = torch.randn(4, dtype=torch.float64, requires_grad=True)
        first, _ = run(fn, x, y)
        first.sum().backward()
        grads.append((x.grad, y.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])


@BOTH_ENTRIES
def test_rule2_no_output_requires_grad_raises_like_torch(ours: Runner) -> None:
    """Rule 2: when no re-run output requires grad, backward raises torch's RuntimeError."""
    results = []
    for run in (ours, _torch):
        x = torch.randn(3, requires_grad=True)
        out = run(lambda t: t.detach() * 2, x)
        results.append(_raised(lambda out=out: out.sum().backward()))
    assert results[0][0] is results[1][0] is RuntimeError
    assert "none of output has requires_grad=True" in results[0][1]
    assert "none of output has requires_grad=True" in results[1][1]


@BOTH_ENTRIES
def test_rule2_rerun_output_of_another_shape_raises_like_torch(ours: Runner) -> None:
    """Rule 2: a re-run whose output shape differs from the forward's raises torch's error."""
    results = []
    for run in (ours, _torch):
        calls = []

        def grows(t: torch.Tensor, calls: list[int] = calls) -> torch.Tensor:
            calls.append(1)
            return t.repeat(len(calls)) * 2

        x = torch.randn(3, requires_grad=True)
        out = run(grows, x)
        results.append(_raised(lambda out=out: out.sum().backward()))
    assert results[0] == results[1]
    assert results[0][0] is RuntimeError
    assert "Mismatch in shape" in results[0][1]


# --- Rule 3: only .backward() without inputs= ------------------------------------------------


@BOTH_ENTRIES
@pytest.mark.parametrize("api", ["autograd.grad", "backward(inputs=...)"])
def test_rule3_grad_apis_raise_naming_the_fix(ours: Runner, api: str) -> None:
    """Rule 3: torch.autograd.grad and backward(inputs=) raise RuntimeError naming the fix."""
    results = []
    for run in (ours, _torch):
        x = torch.randn(3, requires_grad=True)
        loss = run(lambda t: t.sin(), x).sum()
        if api == "autograd.grad":
            results.append(_raised(lambda loss=loss, x=x: torch.autograd.grad(loss, x)))
        else:
            results.append(_raised(lambda loss=loss, x=x: loss.backward(inputs=[x])))
    assert results[0][0] is results[1][0] is RuntimeError
    for phrase in ("use_reentrant=True", "use_reentrant=False", ".grad()", "`inputs`"):
        assert phrase in results[0][1]
        assert phrase in results[1][1]


# --- warnings and recompute counts -----------------------------------------------------------


@BOTH_ENTRIES
def test_no_input_requires_grad_warns_like_torch(ours: Runner) -> None:
    """No tensor input requiring grad warns as torch does, and the output needs no grad."""
    x = torch.randn(3)
    mine, my_warnings = _recorded(lambda: ours(lambda t: t * 2, x))
    theirs, their_warnings = _recorded(lambda: _torch(lambda t: t * 2, x))
    assert my_warnings == their_warnings
    assert [c for c, _ in my_warnings] == [UserWarning]
    assert "None of the inputs have requires_grad=True" in my_warnings[0][1]
    assert isinstance(mine, torch.Tensor)
    assert isinstance(theirs, torch.Tensor)
    assert mine.requires_grad is theirs.requires_grad is False
    assert torch.equal(mine, theirs)


@BOTH_ENTRIES
def test_no_warning_when_an_input_requires_grad(ours: Runner) -> None:
    """No warning when at least one tensor input requires grad (pytest turns warnings to errors)."""
    ours(lambda t, u: t + u, torch.randn(2), torch.randn(2, requires_grad=True)).sum().backward()


def _counting_runs(run: Runner, retain: bool) -> int:
    calls = 0

    def fn(t: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return t.exp()

    x = torch.randn(3, requires_grad=True)
    out = run(fn, x).sum()
    out.backward(retain_graph=retain)
    if retain:
        out.backward()
    return calls


@BOTH_ENTRIES
@pytest.mark.parametrize("retain", [False, True])
def test_recompute_count_equals_torch(ours: Runner, retain: bool) -> None:
    """fn runs as many times as under torch: once in forward, once per backward."""
    assert _counting_runs(ours, retain) == _counting_runs(_torch, retain) == (3 if retain else 2)


def _nested_counts(run: Runner) -> tuple[int, int, torch.Tensor, list[tuple[type, str]]]:
    counts = {"outer": 0, "inner": 0}

    def inner(t: torch.Tensor) -> torch.Tensor:
        counts["inner"] += 1
        return t.sin()

    def outer(t: torch.Tensor) -> torch.Tensor:
        counts["outer"] += 1
        return run(inner, t * 2).cos()

    torch.manual_seed(10)  # the same inputs for both implementations
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    # The inner call sees an input computed under no_grad, so it warns (as torch's does).
    _, caught = _recorded(lambda: run(outer, x).sum().backward())
    assert x.grad is not None
    return counts["outer"], counts["inner"], x.grad, caught


@BOTH_ENTRIES
def test_nested_recompute_counts_and_gradients_equal_torch(ours: Runner) -> None:
    """Nested reentrant checkpoints: torch's run counts, gradient and warnings."""
    mine, theirs = _nested_counts(ours), _nested_counts(_torch)
    assert mine[:2] == theirs[:2]
    assert torch.equal(mine[2], theirs[2])
    assert mine[3] == theirs[3]
