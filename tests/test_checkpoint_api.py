"""The ``checkpoint()`` front door, side by side with ``torch.utils.checkpoint.checkpoint``.

Argument handling (the ``use_reentrant`` warning, ``preserve_rng_state``, keyword arguments,
``context_fn``/``debug`` with the reentrant variant) must give torch's warnings, exception types
and key phrases; both variants must give the un-checkpointed gradients on random layer stacks.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import releases
import torch
import torch.utils.checkpoint as tc
from frame_support import error_of, outcome
from hypothesis import given
from strategies import StackSpec, layer_stacks, layer_stacks_with_dropout
from torch import nn

import checkpointing

IMPLEMENTATIONS = pytest.mark.parametrize(
    "impl", [checkpointing.checkpoint, tc.checkpoint], ids=["ours", "torch"]
)
VARIANTS = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "frame"])


def _plain(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return model(x)  # type: ignore[no-any-return]


# --- the signature ---------------------------------------------------------------------------


def _described(parameters: Any, noop: object) -> list[tuple[str, str, Any]]:
    """(name, kind, default) per parameter, in the form of ``releases.CHECKPOINT_PARAMETERS``."""
    out = []
    for name, param in parameters.items():
        default = param.default
        if default is inspect.Parameter.empty:
            default = "<empty>"
        elif default is noop:
            default = "<noop>"
        out.append((name, param.kind.name, default))
    return out


def test_signature_is_torch_2_15s() -> None:
    """Parameter names, kinds and defaults are torch 2.15's on every release (context_fn
    defaults to our no-op, which torch's code also accepts), plus our keyword-only
    ``recompute_state_hooks=None`` and ``tile=None`` before ``**kwargs``."""
    ours = _described(
        inspect.signature(checkpointing.checkpoint).parameters, checkpointing.noop_context_fn
    )
    assert ours.pop(-2) == ("tile", "KEYWORD_ONLY", None)
    assert ours.pop(-2) == ("recompute_state_hooks", "KEYWORD_ONLY", None)
    assert ours == list(releases.CHECKPOINT_PARAMETERS)


@releases.needs_torch(releases.RESPECT_HOOKS, "the decorator form and its parameters")
def test_signature_matches_installed_torch() -> None:
    """Where torch has the newest signature, ours is the very same, plus our keyword-only
    ``recompute_state_hooks=None`` and ``tile=None`` before ``**kwargs``."""
    ours = _described(
        inspect.signature(checkpointing.checkpoint).parameters, checkpointing.noop_context_fn
    )
    theirs = inspect.signature(tc.checkpoint).parameters
    assert ours.pop(-2) == ("tile", "KEYWORD_ONLY", None)
    assert ours.pop(-2) == ("recompute_state_hooks", "KEYWORD_ONLY", None)
    assert ours == _described(theirs, tc.noop_context_fn)


# --- use_reentrant omitted -------------------------------------------------------------------


def test_omitted_use_reentrant_warns_like_torch() -> None:
    """Omitting use_reentrant gives torch's single UserWarning, word for word."""
    x = torch.randn(3, requires_grad=True)
    mine = outcome(lambda: checkpointing.checkpoint(torch.sin, x))
    theirs = outcome(lambda: tc.checkpoint(torch.sin, x))
    assert mine[1] == [(UserWarning, releases.USE_REENTRANT_WARNING)]  # torch 2.15's words
    if releases.has(releases.REWORDED_WARNING):
        assert mine[1] == theirs[1]
    else:  # older releases word it "Starting in PyTorch 2.9, ..."; the category is the same
        assert [c for c, _ in theirs[1]] == [UserWarning]
    assert "use_reentrant parameter should be passed explicitly" in mine[1][0][1]
    assert isinstance(mine[0], torch.Tensor)
    assert isinstance(theirs[0], torch.Tensor)
    assert torch.equal(mine[0], theirs[0])


def test_omitted_use_reentrant_warning_points_at_the_callers_line() -> None:
    """The warning names the line that called ``checkpoint`` (torch's names its own wrapper)."""
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        checkpointing.checkpoint(torch.sin, x)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_explicit_use_reentrant_does_not_warn(use_reentrant: bool) -> None:
    """Passing use_reentrant explicitly gives no warning (warnings are errors here)."""
    x = torch.randn(3, requires_grad=True)
    checkpointing.checkpoint(torch.sin, x, use_reentrant=use_reentrant).sum().backward()


def test_omitted_use_reentrant_means_reentrant() -> None:
    """Omitted, the reentrant variant runs: forward without grad, and autograd.grad refused."""
    seen: list[bool] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant"):
        loss = checkpointing.checkpoint(fn, x).sum()
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        torch.autograd.grad(loss, x)
    with pytest.warns(UserWarning, match="use_reentrant"):
        checkpointing.checkpoint(fn, x).sum().backward()
    assert seen == [False, False, True]


# --- keyword arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [True, None], ids=["reentrant", "omitted"])
def test_reentrant_rejects_extra_kwargs_like_torch(use_reentrant: bool | None) -> None:
    """Extra keyword arguments with the reentrant variant: torch's ValueError (and warnings)."""
    x = torch.randn(3, requires_grad=True)
    mine = outcome(
        lambda: checkpointing.checkpoint(torch.sin, x, use_reentrant=use_reentrant, a=1, bb=2)
    )
    theirs = outcome(lambda: tc.checkpoint(torch.sin, x, use_reentrant=use_reentrant, a=1, bb=2))
    if releases.has(releases.REWORDED_WARNING):
        assert mine[1] == theirs[1]
    assert [c for c, _ in mine[1]] == [c for c, _ in theirs[1]]
    assert all(message == releases.USE_REENTRANT_WARNING for _, message in mine[1])
    my_type, my_message = error_of(mine)
    their_type, their_message = error_of(theirs)
    assert my_type is their_type is ValueError
    assert their_message == "Unexpected keyword arguments: a,bb"
    assert my_message.startswith(their_message)


@pytest.mark.parametrize(
    "extra",
    [
        {"context_fn": lambda: (contextlib.nullcontext(), contextlib.nullcontext())},
        {"debug": True},
        pytest.param(
            {"respect_saved_tensors_hooks": True},
            marks=releases.needs_torch(releases.RESPECT_HOOKS, "respect_saved_tensors_hooks"),
        ),
        pytest.param(
            {"respect_saved_tensors_hooks": False},
            marks=releases.needs_torch(releases.RESPECT_HOOKS, "respect_saved_tensors_hooks"),
        ),
    ],
    ids=["context_fn", "debug", "respect_true", "respect_false"],
)
def test_reentrant_rejects_context_fn_and_debug_like_torch(extra: dict[str, Any]) -> None:
    """context_fn, debug or respect_saved_tensors_hooks with the reentrant variant: torch's
    ValueError, its key phrase first."""
    x = torch.randn(3, requires_grad=True)
    ours = checkpointing.checkpoint
    mine = outcome(lambda: ours(torch.sin, x, use_reentrant=True, **extra))
    theirs = outcome(lambda: tc.checkpoint(torch.sin, x, use_reentrant=True, **extra))
    my_type, my_message = error_of(mine)
    their_type, their_message = error_of(theirs)
    assert my_type is their_type is ValueError
    assert my_message.startswith(releases.REENTRANT_ONLY_DEFAULTS)
    if releases.has(releases.RESPECT_HOOKS):
        assert my_message.startswith(their_message)
    assert "use_reentrant=False" in my_message


@pytest.mark.parametrize("value", [True, False])
def test_reentrant_rejects_respect_saved_tensors_hooks(value: bool) -> None:
    """respect_saved_tensors_hooks with use_reentrant=True is torch 2.14's ValueError, on
    every release."""
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="respect_saved_tensors_hooks") as info:
        checkpointing.checkpoint(
            torch.sin, x, use_reentrant=True, respect_saved_tensors_hooks=value
        )
    assert str(info.value).startswith(releases.REENTRANT_ONLY_DEFAULTS)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torchs_noop_context_fn_is_accepted_as_the_default(use_reentrant: bool) -> None:
    """Beyond torch: torch's own ``noop_context_fn`` counts as the default (drop-in code)."""
    x = torch.randn(3, requires_grad=True)
    y = checkpointing.checkpoint(
        torch.sin, x, use_reentrant=use_reentrant, context_fn=tc.noop_context_fn
    )
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.cos(x))


def test_kwargs_checked_before_context_fn_like_torch() -> None:
    """With both extra kwargs and debug=True, the kwargs error wins, as in torch."""
    x = torch.randn(3, requires_grad=True)
    ours = checkpointing.checkpoint
    mine = outcome(lambda: ours(torch.sin, x, use_reentrant=True, debug=True, z=1))
    theirs = outcome(lambda: tc.checkpoint(torch.sin, x, use_reentrant=True, debug=True, z=1))
    assert error_of(mine)[1].startswith(error_of(theirs)[1])
    assert "Unexpected keyword arguments: z" in error_of(mine)[1]


def test_reentrant_accepts_default_context_fn_and_debug_false() -> None:
    """Our own noop_context_fn and debug=False are accepted with the reentrant variant."""
    x = torch.randn(3, requires_grad=True)
    out = checkpointing.checkpoint(
        torch.sin, x, use_reentrant=True, context_fn=checkpointing.noop_context_fn, debug=False
    )
    out.sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))


@IMPLEMENTATIONS
def test_frame_passes_kwargs_to_fn(impl: Callable[..., Any]) -> None:
    """use_reentrant=False passes **kwargs to fn in forward and recompute (same for torch)."""
    calls: list[dict[str, Any]] = []

    def fn(t: torch.Tensor, *, scale: float, shift: torch.Tensor) -> torch.Tensor:
        calls.append({"scale": scale, "shift": shift})
        return (t * scale + shift).sin()

    torch.manual_seed(5)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    shift = torch.randn(4, dtype=torch.float64, requires_grad=True)
    impl(fn, x, use_reentrant=False, scale=3.0, shift=shift).sum().backward()
    assert len(calls) == 2
    assert all(c["scale"] == 3.0 and c["shift"] is shift for c in calls)
    assert torch.equal(x.grad, 3.0 * torch.cos(x.detach() * 3.0 + shift.detach()))
    assert torch.equal(shift.grad, torch.cos(x.detach() * 3.0 + shift.detach()))


@VARIANTS
@IMPLEMENTATIONS
def test_preserve_rng_state_is_not_passed_to_fn(
    impl: Callable[..., Any], use_reentrant: bool
) -> None:
    """preserve_rng_state is taken out of **kwargs: fn never sees it, and reentrant accepts it."""
    seen: list[dict[str, Any]] = []

    def fn(t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return t.exp()

    x = torch.randn(3, requires_grad=True)
    impl(fn, x, use_reentrant=use_reentrant, preserve_rng_state=False).sum().backward()
    assert seen == [{}, {}]


# --- results and warnings side by side -------------------------------------------------------


@VARIANTS
def test_no_input_requires_grad_warnings_like_torch(use_reentrant: bool) -> None:
    """No input requiring grad: same warnings as torch (reentrant warns, the frame does not)."""
    x = torch.randn(3)
    mine = outcome(lambda: checkpointing.checkpoint(torch.sin, x, use_reentrant=use_reentrant))
    theirs = outcome(lambda: tc.checkpoint(torch.sin, x, use_reentrant=use_reentrant))
    assert mine[1] == theirs[1]
    assert len(mine[1]) == int(use_reentrant)
    assert isinstance(mine[0], torch.Tensor)
    assert isinstance(theirs[0], torch.Tensor)
    assert torch.equal(mine[0], theirs[0])
    assert mine[0].requires_grad is theirs[0].requires_grad is False


@VARIANTS
def test_not_callable_raises_type_error_like_torch(use_reentrant: bool) -> None:
    """A non-callable function is a TypeError in both (ours names the API)."""
    x = torch.randn(3, requires_grad=True)
    mine = outcome(lambda: checkpointing.checkpoint(3, x, use_reentrant=use_reentrant))
    theirs = outcome(lambda: tc.checkpoint(3, x, use_reentrant=use_reentrant))
    assert error_of(mine)[0] is error_of(theirs)[0] is TypeError
    assert "checkpointing.checkpoint" in error_of(mine)[1]


@pytest.mark.parametrize("bad", ["strict", "", None])
def test_bad_determinism_check_raises_like_torch(bad: object) -> None:
    """An unknown determinism_check is a ValueError listing the allowed values, as in torch."""
    x = torch.randn(3, requires_grad=True)
    mine = outcome(
        lambda: checkpointing.checkpoint(torch.sin, x, use_reentrant=False, determinism_check=bad)
    )
    theirs = outcome(
        lambda: tc.checkpoint(torch.sin, x, use_reentrant=False, determinism_check=bad)
    )
    assert error_of(mine)[0] is error_of(theirs)[0] is ValueError
    for phrase in ("determinism_check", "default", "none"):
        assert phrase in error_of(mine)[1]


@VARIANTS
def test_structured_outputs_like_torch(use_reentrant: bool) -> None:
    """Tuple outputs with non-tensors come back as torch's, with torch's gradients."""

    def fn(t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        return t * u, 7, (t - u).tanh()

    results = []
    for impl in (checkpointing.checkpoint, tc.checkpoint):
        torch.manual_seed(6)
        x = torch.randn(5, dtype=torch.float64, requires_grad=True)
        y = torch.randn(5, dtype=torch.float64, requires_grad=True)
        a, seven, b = impl(fn, x, y, use_reentrant=use_reentrant)
        (a.sum() * b.sum()).backward()
        results.append((a.detach(), seven, b.detach(), x.grad, y.grad))
    for mine, theirs in zip(*results, strict=True):
        assert mine == theirs if isinstance(mine, int) else torch.equal(mine, theirs)


def _counting(impl: Callable[..., Any], use_reentrant: bool, backwards: int) -> int:
    calls = 0

    def fn(t: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return t.sin().exp()

    x = torch.randn(3, requires_grad=True)
    loss = impl(fn, x, use_reentrant=use_reentrant).sum()
    for i in range(backwards):
        loss.backward(retain_graph=i < backwards - 1)
    return calls


@VARIANTS
@pytest.mark.parametrize("backwards", [0, 1, 2])
def test_recompute_count_equals_torch(use_reentrant: bool, backwards: int) -> None:
    """fn runs as many times as under torch: forward plus one re-run per backward."""
    mine = _counting(checkpointing.checkpoint, use_reentrant, backwards)
    assert mine == _counting(tc.checkpoint, use_reentrant, backwards) == 1 + backwards


@VARIANTS
def test_under_no_grad_like_torch(use_reentrant: bool) -> None:
    """Under torch.no_grad the result equals torch's and fn runs once."""
    calls: list[int] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.cos()

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        mine = outcome(lambda: checkpointing.checkpoint(fn, x, use_reentrant=use_reentrant))
        theirs = outcome(lambda: tc.checkpoint(fn, x, use_reentrant=use_reentrant))
    assert mine[1] == theirs[1]
    assert isinstance(mine[0], torch.Tensor)
    assert isinstance(theirs[0], torch.Tensor)
    assert torch.equal(mine[0], theirs[0])
    assert mine[0].requires_grad is theirs[0].requires_grad
    assert len(calls) == 2


# --- correctness over random layer stacks ----------------------------------------------------


@contextlib.contextmanager
def _seed(seed: int) -> Iterator[None]:
    torch.manual_seed(seed)
    yield


@VARIANTS
@given(spec=layer_stacks())
def test_gradients_equal_unchecked_run(use_reentrant: bool, spec: StackSpec) -> None:
    """Both variants: input and parameter gradients bit-identical to the unchecked run."""
    expected = spec.run(_plain)
    got = spec.run(lambda m, x: checkpointing.checkpoint(m, x, use_reentrant=use_reentrant))
    got.assert_equal(expected)


@given(spec=layer_stacks())
def test_frame_works_with_autograd_grad(spec: StackSpec) -> None:
    """The frame supports torch.autograd.grad: gradients bit-identical to the unchecked run."""
    model = spec.build()
    x = spec.make_input()
    params = [x, *model.parameters()]
    cotangent = torch.ones(x.shape[0], spec.layers[-1].width, dtype=spec.dtype)
    expected = torch.autograd.grad(model(x), params, cotangent)
    out = checkpointing.checkpoint(model, x, use_reentrant=False)
    got = torch.autograd.grad(out, params, cotangent)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@VARIANTS
@given(spec=layer_stacks_with_dropout())
def test_dropout_bit_identical_and_rng_stream_kept(use_reentrant: bool, spec: StackSpec) -> None:
    """preserve_rng_state=True: dropout replays exactly and the caller's stream is as unchecked."""
    with _seed(7):
        expected = spec.run(_plain)
    with _seed(7):
        got = spec.run(lambda m, x: checkpointing.checkpoint(m, x, use_reentrant=use_reentrant))
    got.assert_equal(expected)
    assert torch.equal(got.rng_after, expected.rng_after)


@VARIANTS
@given(spec=layer_stacks_with_dropout())
def test_unpreserved_rng_matches_torch(use_reentrant: bool, spec: StackSpec) -> None:
    """preserve_rng_state=False: results and the RNG stream afterwards equal torch's, bit for bit.

    Gradients then generally differ from the unchecked run (recompute draws new masks); that is
    documented behaviour and not asserted.
    """
    results = []
    for impl in (checkpointing.checkpoint, tc.checkpoint):
        with _seed(8):
            results.append(
                spec.run(
                    lambda m, x, impl=impl: impl(
                        m, x, use_reentrant=use_reentrant, preserve_rng_state=False
                    )
                )
            )
    mine, theirs = results
    mine.assert_equal(theirs)
    assert torch.equal(mine.rng_after, theirs.rng_after)


@VARIANTS
def test_callers_rng_stream_untouched_when_only_recompute_draws(use_reentrant: bool) -> None:
    """A region that draws only when re-run leaves the caller's RNG stream as torch leaves it.

    torch forks the CPU RNG around every recompute when preserve_rng_state=True, so recompute
    never advances the caller's stream, even when the forward drew nothing.
    """
    draw = {"now": False}

    def fn(t: torch.Tensor) -> torch.Tensor:
        if draw["now"]:
            torch.rand(3)
        return t.exp()

    after = []
    for impl in (checkpointing.checkpoint, tc.checkpoint):
        torch.manual_seed(15)
        x = torch.randn(3, requires_grad=True)
        draw["now"] = False
        loss = impl(fn, x, use_reentrant=use_reentrant).sum()
        draw["now"] = True
        loss.backward()
        after.append(torch.get_rng_state())
    assert torch.equal(after[0], after[1])


# --- exception classes -------------------------------------------------------------------------


def _recompute_changes_shape(impl: Callable[..., torch.Tensor]) -> None:
    """A region whose recompute saves a tensor of another shape: the determinism check fires."""
    calls = []

    def region(x: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        return x[: 4 - len(calls)].sin().sum()  # one row fewer each call

    impl(region, torch.randn(4, 3, requires_grad=True), use_reentrant=False).backward()


@IMPLEMENTATIONS
def test_except_torchs_checkpoint_error_catches_ours(impl: Callable[..., torch.Tensor]) -> None:
    """Issue 39, item 2: ``checkpointing.CheckpointError`` is a subclass of torch's, so an
    ``except torch.utils.checkpoint.CheckpointError`` written for torch catches ours."""
    assert issubclass(checkpointing.CheckpointError, tc.CheckpointError)
    with pytest.raises(tc.CheckpointError, match="Recomputed values for the following tensors"):
        _recompute_changes_shape(impl)
