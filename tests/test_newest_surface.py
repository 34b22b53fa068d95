"""torch 2.14's and 2.15's ``checkpoint`` surface, offered on every supported release.

Rule numbers: ``test_rule10_*`` are NOTE [Nestable checkpoint], Rule 10 (``_frame``: our hooks
are checkpoint-internal); ``test_rule12_*`` and ``test_rule13_*`` are NOTE [Selective checkpoint
cache], Rules 12 and 13 (``_selective``: ordered effects kept; user hooks respected).

The decorator form, ``respect_saved_tensors_hooks`` (with its ``FutureWarning`` and the
checkpoint-internal hook marks), the ``fn, args, kwargs`` generator and selective checkpointing's
keeping of ops with an ordered side effect. Each test checks ours against the run without
checkpointing and, where the installed torch has the feature, against torch itself side by side;
on older releases the torch half is skipped with a reason naming the release that added it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import releases
import torch
import torch.utils.checkpoint as tc
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import checkpointing
from checkpointing import CheckpointPolicy

IMPLS = {"ours": checkpointing, "torch": tc}


def _impls(release: tuple[int, int], what: str) -> pytest.MarkDecorator:
    """Parametrize over ours and torch's module; torch's needs ``release``."""
    return pytest.mark.parametrize(
        "lib",
        [
            pytest.param(checkpointing, id="ours"),
            pytest.param(tc, id="torch", marks=releases.needs_torch(release, what)),
        ],
    )


def _block(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A small region: two matmuls and pointwise ops."""
    return torch.tanh(t @ w).sin() @ w


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    return x, w


def _grads(run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    x, w = _inputs()
    run(x, w).sum().backward()
    assert x.grad is not None
    assert w.grad is not None
    return [x.grad, w.grad]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


# --- the decorator form (torch 2.14) -----------------------------------------------------------


@_impls(releases.DECORATOR, "the decorator form of checkpoint")
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_decorator_checkpoints_the_function(lib: Any, use_reentrant: bool) -> None:
    """``checkpoint(**options)(fn)`` keeps fn's name and docstring, re-runs fn in backward and
    gives the plain gradients."""
    calls: list[bool] = []

    def block(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The block's own docstring."""
        calls.append(torch.is_grad_enabled())
        return _block(t, w)

    wrapped = lib.checkpoint(use_reentrant=use_reentrant)(block)
    assert wrapped.__name__ == "block"
    assert wrapped.__doc__ == "The block's own docstring."
    assert wrapped.__wrapped__ is block
    assert _equal(_grads(wrapped), _grads(_block))
    assert len(calls) == 2  # forward and recompute


@_impls(releases.DECORATOR, "the decorator form of checkpoint")
def test_decorator_on_a_method_binds_self(lib: Any) -> None:
    """As a method decorator it binds ``self``: the bound method is checkpointed with the same
    options, and the class attribute stays the decorator."""
    seen: list[object] = []

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.lin = nn.Linear(5, 5, dtype=torch.float64)

        @lib.checkpoint(use_reentrant=False)
        def forward(self, t: torch.Tensor, *, scale: float) -> torch.Tensor:
            seen.append(self)
            return torch.tanh(self.lin(t)) * scale

    block = Block()
    x, _ = _inputs()
    block(x, scale=2.0).sum().backward()
    assert seen == [block, block]
    expected = torch.autograd.grad((torch.tanh(block.lin(x)) * 2.0).sum(), x)[0]
    assert x.grad is not None
    assert torch.equal(x.grad, expected)
    assert Block.forward is Block.__dict__["forward"]  # read off the class: the decorator


def test_decorator_matches_torchs_on_dropout() -> None:
    """With RNG preserved, the decorated function replays dropout bit-identically: the same
    gradients as the plain run (and as torch's decorator where it exists)."""

    def noisy(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(_block(t, w), p=0.5)

    def plain(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(7)
        return noisy(t, w)

    def ours(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(7)
        return checkpointing.checkpoint(use_reentrant=False, preserve_rng_state=True)(noisy)(t, w)

    assert _equal(_grads(ours), _grads(plain))
    if releases.has(releases.DECORATOR):

        def theirs(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            torch.manual_seed(7)
            return tc.checkpoint(use_reentrant=False, preserve_rng_state=True)(noisy)(t, w)

        assert _equal(_grads(theirs), _grads(ours))


def test_decorator_rejects_unknown_options_like_torch() -> None:
    """``checkpoint(use_reentrant=False, scale=2)`` with no function: torch 2.14's ValueError
    ("Unexpected keyword arguments: scale"), with the fix."""
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale") as mine:
        checkpointing.checkpoint(use_reentrant=False, scale=2)
    assert "checkpoint(use_reentrant=False)(fn)(x, scale=2)" in str(mine.value)
    if releases.has(releases.DECORATOR):
        with pytest.raises(ValueError, match="Unexpected keyword arguments") as theirs:
            tc.checkpoint(use_reentrant=False, scale=2)
        assert str(mine.value).startswith(str(theirs.value))


def test_decorator_warns_at_call_time_at_the_callers_line() -> None:
    """Without ``use_reentrant`` the decorator does not warn when applied; each call warns
    (torch 2.15's words), pointing at the line that called the decorated function."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = checkpointing.checkpoint()(torch.sin)
        assert caught == []
        x = torch.randn(3, requires_grad=True)
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        wrapped(x).sum().backward()
    assert [(w.category, str(w.message)) for w in caught] == [
        (UserWarning, releases.USE_REENTRANT_WARNING)
    ]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert x.grad is not None
    assert torch.equal(x.grad, torch.cos(x.detach()))


@_impls(releases.DECORATOR, "the decorator form of checkpoint")
def test_decorated_function_gets_keyword_arguments(lib: Any) -> None:
    """Non-reentrant: the decorated function's keyword arguments reach it in forward and
    recompute; reentrant: they are torch's ValueError."""
    calls: list[float] = []

    def scaled(t: torch.Tensor, *, scale: float) -> torch.Tensor:
        calls.append(scale)
        return t.sin() * scale

    x = torch.randn(3, requires_grad=True)
    lib.checkpoint(use_reentrant=False)(scaled)(x, scale=3.0).sum().backward()
    assert calls == [3.0, 3.0]
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        lib.checkpoint(use_reentrant=True)(scaled)(x, scale=3.0)


@_impls(releases.DECORATOR, "the decorator form of checkpoint")
def test_decorated_function_may_take_a_keyword_named_like_an_option(lib: Any) -> None:
    """A decorated function's own keyword named like a checkpoint option (``debug``) reaches
    the function, as torch 2.14's decorator passes the call's keywords apart from its options."""
    seen: list[object] = []

    def block(t: torch.Tensor, *, debug: str) -> torch.Tensor:
        seen.append(debug)
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    lib.checkpoint(use_reentrant=False)(block)(x, debug="mine").sum().backward()
    assert seen == ["mine", "mine"]
    assert x.grad is not None
    assert torch.equal(x.grad, torch.cos(x.detach()))


# --- the fn, args, kwargs generator (torch 2.14) ------------------------------------------------


@_impls(releases.GENERATOR_IMPL, "_checkpoint_without_reentrant_generator_impl")
def test_generator_impl_driven_by_hand(lib: Any) -> None:
    """Driving ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, ...)`` around
    the call checkpoints it: the plain gradients, and fn re-run once in backward."""
    calls: list[int] = []

    def block(t: torch.Tensor, w: torch.Tensor, *, shift: float) -> torch.Tensor:
        calls.append(1)
        return _block(t, w) + shift

    def driven(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gen = lib._checkpoint_without_reentrant_generator_impl(
            block, (t, w), {"shift": 1.0}, preserve_rng_state=False, early_stop=False
        )
        next(gen)
        out = block(t, w, shift=1.0)
        with pytest.raises(StopIteration):
            next(gen)
        return out

    assert _equal(_grads(driven), _grads(lambda t, w: _block(t, w) + 1.0))
    assert len(calls) == 2


# --- respect_saved_tensors_hooks (torch 2.14) ----------------------------------------------------


class _Counting:
    """A user's saved-tensors hook pair that counts its calls (and keeps what it packs)."""

    def __init__(self) -> None:
        self.packed = 0
        self.unpacked = 0

    def pack(self, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.packed += 1
        return ("packed", t)

    def unpack(self, packed: tuple[str, torch.Tensor]) -> torch.Tensor:
        self.unpacked += 1
        return packed[1]

    @contextmanager
    def active(self) -> Iterator[None]:
        with saved_tensors_hooks(self.pack, self.unpack):
            yield


def _save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE
        if op == torch.ops.aten.mm.default
        else (CheckpointPolicy.PREFER_RECOMPUTE)
    )


def _sac_step(
    lib: Any, sac: Any, respect: bool | None, hooks: _Counting | None
) -> list[torch.Tensor]:
    """One step of ``_block`` under ``lib.checkpoint`` with ``sac``'s contexts saving mm,
    inside ``hooks`` if given; backward runs outside them."""
    context_fn = functools.partial(sac.create_selective_checkpoint_contexts, _save_mm)
    x, w = _inputs()
    options: dict[str, Any] = {"use_reentrant": False, "context_fn": context_fn}
    if respect is not None:
        options["respect_saved_tensors_hooks"] = respect
    if hooks is None:
        out = lib.checkpoint(_block, x, w, **options)
    else:
        with hooks.active():
            out = lib.checkpoint(_block, x, w, **options)
    out.sum().backward()
    assert x.grad is not None
    assert w.grad is not None
    return [x.grad, w.grad]


@_impls(releases.RESPECT_HOOKS, "respect_saved_tensors_hooks")
def test_rule13_respect_true_routes_what_sac_saves_through_user_hooks(lib: Any) -> None:
    """True: each mm output SAC keeps goes through the user's pack hook in forward and its
    unpack hook at recompute; gradients stay the plain ones."""
    hooks = _Counting()
    grads = _sac_step(lib, lib, True, hooks)
    assert _equal(grads, _grads(_block))
    # packed: the region's 2 inputs (saved like any op's inputs) and the 2 mm outputs SAC
    # keeps; unpacked: the inputs and the first mm's output (early stop ends recompute before
    # the second mm, whose output backward does not need)
    assert (hooks.packed, hooks.unpacked) == (4, 3)


@_impls(releases.RESPECT_HOOKS, "respect_saved_tensors_hooks")
def test_rule13_respect_false_keeps_user_hooks_out_silently(lib: Any) -> None:
    """False: the user's hooks never see what SAC keeps, and nothing warns."""
    hooks = _Counting()
    assert _equal(_sac_step(lib, lib, False, hooks), _grads(_block))
    assert (hooks.packed, hooks.unpacked) == (2, 2)  # the region's inputs only


@_impls(releases.RESPECT_HOOKS, "respect_saved_tensors_hooks")
def test_rule13_respect_unset_under_user_hooks_warns_future_warning(lib: Any) -> None:
    """None under a user's hooks: the legacy behaviour (hooks bypassed) and torch 2.14's
    FutureWarning telling the user to choose."""
    hooks = _Counting()
    with pytest.warns(FutureWarning, match=r"respect_saved_tensors_hooks=True\|False"):
        grads = _sac_step(lib, lib, None, hooks)
    assert _equal(grads, _grads(_block))
    assert (hooks.packed, hooks.unpacked) == (2, 2)  # the region's inputs only


@pytest.mark.parametrize("respect", [None, True, False])
def test_no_user_hooks_means_no_warning_and_no_routing(respect: bool | None) -> None:
    """Without user hooks our frame's own hooks are never taken for the user's: no warning
    (warnings fail tests here) whatever the option says."""
    assert _equal(_sac_step(checkpointing, checkpointing, respect, None), _grads(_block))


@pytest.mark.parametrize("respect", [None, True])
def test_rule10_torchs_sac_inside_our_checkpoint_sees_through_our_frame(
    respect: bool | None,
) -> None:
    """torch's own SAC contexts inside our checkpoint: without user hooks, our frame does not
    look like one to torch 2.14+ (no FutureWarning); with them and True, torch's mode routes
    its saves through them past our frame, exactly as inside torch's own checkpoint."""
    assert _equal(_sac_step(checkpointing, tc, respect, None), _grads(_block))
    if not releases.has(releases.RESPECT_HOOKS):
        return  # torch's mode before 2.14 knows no user hooks: nothing more to compare
    mine, theirs = _Counting(), _Counting()
    with warnings.catch_warnings(record=True) as in_ours:
        warnings.simplefilter("always")
        _sac_step(checkpointing, tc, respect, mine)
    with warnings.catch_warnings(record=True) as in_torchs:
        warnings.simplefilter("always")
        _sac_step(tc, tc, respect, theirs)
    categories = [w.category for w in in_ours]
    assert categories == [w.category for w in in_torchs]
    assert categories == ([FutureWarning] * 2 if respect is None else [])  # one per kept mm
    assert (mine.packed, mine.unpacked) == (theirs.packed, theirs.unpacked)
    assert (mine.packed, mine.unpacked) == ((4, 3) if respect else (2, 2))


def test_respect_true_reaches_user_hooks_through_nested_frames() -> None:
    """A SAC region inside an outer non-reentrant checkpoint: the user's hooks outside both are
    found through both frames, and gradients stay the plain ones."""
    hooks = _Counting()
    context_fn = functools.partial(checkpointing.create_selective_checkpoint_contexts, _save_mm)

    def outer(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        inner = checkpointing.checkpoint(
            _block,
            t,
            w,
            use_reentrant=False,
            context_fn=context_fn,
            respect_saved_tensors_hooks=True,
        )
        return inner.cos()

    def run(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with hooks.active():
            return checkpointing.checkpoint(outer, t, w, use_reentrant=False)

    assert _equal(_grads(run), _grads(lambda t, w: _block(t, w).cos()))
    # as in one level: the outer inputs and both mm outputs packed, all but the second mm's
    # output (early stop) unpacked; the inner inputs are the outer frame's holders
    assert (hooks.packed, hooks.unpacked) == (4, 3)


def test_rule10_frame_drops_its_user_hooks_mark_after_forward() -> None:
    """The internal mark names the user's hooks only while the frame is on the stack: after
    forward the graph (which holds the frame) keeps no reference to them. The region takes no
    tensor argument, so no input of it is saved through the user's hooks either."""
    hooks = _Counting()
    ref = weakref.ref(hooks)
    x, w = _inputs()
    with hooks.active():
        out = checkpointing.checkpoint(lambda: _block(x, w), use_reentrant=False)
    del hooks
    gc.collect()
    assert ref() is None
    out.sum().backward()


def test_module_and_wrapper_accept_respect_saved_tensors_hooks() -> None:
    """``checkpoint_module`` and ``checkpoint_wrapper`` take the option and pass it on."""
    context_fn = functools.partial(checkpointing.create_selective_checkpoint_contexts, _save_mm)
    for make in (checkpointing.checkpoint_module, checkpointing.checkpoint_wrapper):
        torch.manual_seed(2)
        lin = nn.Linear(5, 5, dtype=torch.float64)
        model = make(lin, context_fn=context_fn, respect_saved_tensors_hooks=True)
        hooks = _Counting()
        x, _ = _inputs()
        with hooks.active():
            out = model(x)
        out.sum().backward()
        assert hooks.packed == hooks.unpacked >= 1, make


# --- ordered side effects (torch 2.15) ---------------------------------------------------------


def _printing(t: torch.Tensor) -> torch.Tensor:
    torch.ops.aten._print.default("side effect")
    return t.sin().cos()


def _printed(capfd: pytest.CaptureFixture[str]) -> int:
    """How often ``_printing`` printed: ``aten::_print`` writes through C stdio, whose buffer
    is flushed first."""
    ctypes.CDLL(None).fflush(None)
    return capfd.readouterr().out.count("side effect")


@_impls(releases.ORDERED_EFFECTS_KEPT, "keeping ops with an ordered side effect in SAC")
@pytest.mark.parametrize(
    ("answer", "prints"),
    [("PREFER_RECOMPUTE", 1), (False, 1), ("MUST_SAVE", 1), ("MUST_RECOMPUTE", 2)],
)
def test_rule12_ordered_effect_runs_once_unless_must_recompute(
    lib: Any, answer: str | bool, prints: int, capfd: pytest.CaptureFixture[str]
) -> None:
    """An op with an ordered side effect (``aten::_print``) is kept by SAC whatever the policy
    answers, so recompute does not repeat it; ``MUST_RECOMPUTE`` replays it. The policy answers
    with the library's own enum (torch tells MUST_RECOMPUTE apart by identity)."""
    member = answer if isinstance(answer, bool) else getattr(lib.CheckpointPolicy, answer)
    policy = lambda ctx, op, *args, **kwargs: member  # noqa: E731
    context_fn = functools.partial(lib.create_selective_checkpoint_contexts, policy)
    x = torch.randn(3, requires_grad=True)
    lib.checkpoint(_printing, x, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert _printed(capfd) == prints
    assert x.grad is not None
    assert torch.equal(x.grad, -torch.sin(x.detach().sin()) * torch.cos(x.detach()))


def test_rule12_ordered_effect_kept_under_an_op_only_policy(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Our op-only policies (planned once per op) keep an effectful op too."""
    context_fn = checkpointing.policies.as_context_fn(checkpointing.policies.save_nothing())
    x = torch.randn(3, requires_grad=True)
    checkpointing.checkpoint(
        _printing, x, use_reentrant=False, context_fn=context_fn
    ).sum().backward()
    assert _printed(capfd) == 1


@pytest.mark.parametrize("lib", [checkpointing, tc], ids=["our_sac", "torch_sac"])
def test_rule10_our_report_and_scope_hooks_are_not_user_hooks(lib: Any) -> None:
    """Our report's and scope session's saved-tensors hooks are checkpoint-internal: a SAC
    region inside them (ours, or torch's from 2.14) does not warn about user hooks."""
    with checkpointing.saved_tensors_report():
        assert _equal(_sac_step(checkpointing, lib, None, None), _grads(_block))
    with checkpointing.gradient_checkpoint_session():
        assert _equal(_sac_step(checkpointing, lib, None, None), _grads(_block))


def test_scope_session_hands_sac_saves_to_user_hooks_below_it() -> None:
    """Under a scope session that sits on a user's hooks, respect_saved_tensors_hooks=True finds
    those hooks through the session's router, as the router itself hands them other tensors."""
    hooks = _Counting()
    context_fn = functools.partial(checkpointing.create_selective_checkpoint_contexts, _save_mm)
    x, w = _inputs()
    with hooks.active(), checkpointing.gradient_checkpoint_session():
        out = checkpointing.checkpoint(
            _block,
            x,
            w,
            use_reentrant=False,
            context_fn=context_fn,
            respect_saved_tensors_hooks=True,
        )
    out.sum().backward()
    assert x.grad is not None
    assert w.grad is not None
    assert _equal([x.grad, w.grad], _grads(_block))
    assert (hooks.packed, hooks.unpacked) == (4, 3)  # as without the session
