"""The recompute-context protocol (NOTE [Recompute context protocol]): one definition, one probe,
misspelt declarations refused; spans under a declared and an undeclared context, against the
plain run."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Final

import pytest
import torch

import checkpointing
from checkpointing import _keep, create_selective_checkpoint_contexts, keep
from checkpointing._determinism import OpLogger
from checkpointing._frame import NULL_CONTEXT
from checkpointing._planning.apply.draws import draw_contexts
from checkpointing._recompute_context import DeclaredContext, declared, hand_respect
from checkpointing.policies import save_matmuls

DEFAULTS = (False, False, True)  # passes_detach_through, honours_kept_spans, honours_kept_blocks


def answers(context: object) -> tuple[bool, bool, bool]:
    said = declared(context)
    return said.passes_detach_through, said.honours_kept_spans, said.honours_kept_blocks


def test_rule1_contexts_that_say_nothing_are_read_at_the_safe_defaults() -> None:
    """A context not derived from the base (the frame's null one, torch's, a user's) is read at
    the defaults, even if it carries an attribute of the same name."""

    class Lookalike(contextlib.nullcontext[None]):
        honours_kept_spans = True  # not derived from the base: not a declaration

    torch_pair = torch.utils.checkpoint.create_selective_checkpoint_contexts(save_matmuls())
    for context in (NULL_CONTEXT, contextlib.nullcontext(), Lookalike(), torch_pair[1], None):
        assert answers(context) == DEFAULTS


def test_rule1_our_contexts_say_their_answers() -> None:
    """Selective checkpoint's recompute mode passes detach through and honours spans; the debug
    logger honours spans; the planner's draws modes honour spans but not blocks."""
    forward, recompute = create_selective_checkpoint_contexts(save_matmuls())
    assert answers(recompute) == (True, True, True)
    assert answers(forward) == (False, True, True)
    assert answers(OpLogger().mode()) == (False, True, True)
    assert answers(draw_contexts(None)[1]) == (False, True, False)
    stacked = draw_contexts(create_selective_checkpoint_contexts(save_matmuls()))[1]
    assert answers(stacked) == (False, True, False)


@pytest.mark.parametrize("name", ["honors_kept_spans", "honours_kept_span", "passes_detach_thru"])
def test_rule2_a_misspelt_answer_is_refused_when_the_class_is_made(name: str) -> None:
    """A subclass attribute that starts like an answer and is none is a TypeError naming it."""
    with pytest.raises(TypeError, match=f"sets '{name}'.*Fix: spell it"):
        type("Misspelt", (DeclaredContext,), {name: True})


def test_rule2_a_subclass_says_its_answers_as_class_attributes() -> None:
    """A subclass's class attributes override the base's defaults; the rest stay."""

    class Says(DeclaredContext):
        honours_kept_spans: Final = True

    assert answers(Says()) == (False, True, True)


class _DeclaredNull(contextlib.nullcontext[None], DeclaredContext):
    """A user's recompute context that runs nothing and says spans keep it in step."""

    honours_kept_spans: Final = True


def _run(context_fn: Any) -> tuple[int, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    calls = 0

    def span(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return (a @ b).sin()

    def block(t: torch.Tensor) -> torch.Tensor:
        return (keep(span, t.cos(), w) @ w).tanh()

    if context_fn is None:
        out = block(x)
    else:
        out = checkpointing.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()
    assert x.grad is not None
    assert w.grad is not None
    return calls, x.grad, w.grad


def test_spans_under_a_declared_and_an_undeclared_user_context_match_the_plain_run() -> None:
    """A declared context lets the replay skip the span (one call); an undeclared one makes it a
    plain call (two calls, said once); gradients equal the plain run's either way."""
    _, gx, gw = _run(None)

    def declared_fn() -> tuple[Any, Any]:
        return contextlib.nullcontext(), _DeclaredNull()

    def undeclared_fn() -> tuple[Any, Any]:
        return contextlib.nullcontext(), contextlib.nullcontext()

    calls, dx, dw = _run(declared_fn)
    assert calls == 1
    torch.testing.assert_close((dx, dw), (gx, gw), rtol=0, atol=0)
    _keep._warned_foreign.clear()
    with pytest.warns(UserWarning, match="context_fn that is not checkpointing's"):
        calls, ux, uw = _run(undeclared_fn)
    assert calls == 2
    torch.testing.assert_close((ux, uw), (gx, gw), rtol=0, atol=0)


def test_hand_respect_reaches_selective_forward_contexts_only() -> None:
    """``respect_saved_tensors_hooks`` is set on a context that has it, and nowhere else."""
    forward, _ = create_selective_checkpoint_contexts(save_matmuls())
    for value in (True, False, None):
        hand_respect(forward, value)
        assert forward.respect_saved_tensors_hooks is value  # type: ignore[attr-defined]
    plain = contextlib.nullcontext()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hand_respect(plain, True)
    assert not hasattr(plain, "respect_saved_tensors_hooks")
