"""Determinism checks, the debug report and the "unpacked twice" error, side by side with torch.

A module-level switch changes what the region computes between its forward and its recompute;
both ``torch.utils.checkpoint`` and ours must raise ``CheckpointError`` with the same key phrases,
counts and positions. Rules are those of NOTE [Determinism checks] in
``checkpointing/_determinism.py``. Beyond torch, the debug report names the first op where the
forward and the recompute diverge.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from frame_support import BOTH, OURS, PLAIN, TORCH, Variant, assert_tensors_equal, leaf, raised

import checkpointing

_changed = {"on": False}  # flipped between forward and backward to make recompute diverge


@pytest.fixture(autouse=True)
def _reset_switch() -> Iterator[None]:
    """Every test starts with the region computing what it computed in forward."""
    _changed["on"] = False
    yield
    _changed["on"] = False


def saves_fewer(x: torch.Tensor) -> torch.Tensor:
    """Forward saves 3 tensors (three sins); with the switch on, recompute saves 2."""
    y = x.sin()
    if not _changed["on"]:
        y = y.sin()
    return y.sin() * 2


def saves_more(x: torch.Tensor) -> torch.Tensor:
    """Forward saves 2 tensors; with the switch on, recompute saves a third."""
    y = x.sin()
    if _changed["on"]:
        y = y.sin()
    return y.cos() * 2


def changes_metadata(x: torch.Tensor) -> torch.Tensor:
    """Same number of saved tensors; with the switch on, positions 1 and 2 change dtype/shape."""
    y = x.sin()
    if _changed["on"]:
        y = y.double()
    z = y.sin()
    if _changed["on"]:
        z = torch.cat([z, z])
    return z.cos().sum() * 2


def changes_dtype(x: torch.Tensor) -> torch.Tensor:
    """Same number of saved tensors; with the switch on, the one at position 1 is float64."""
    y = x.sin()
    if _changed["on"]:
        y = y.double()
    return y.cos().sum() * 2


def _diverging_backward(
    v: Variant, fn: Callable[[torch.Tensor], torch.Tensor], **options: Any
) -> BaseException | None:
    """Forward with the switch off, backward with it on; the exception raised, if any."""
    _changed["on"] = False
    x = leaf(3, dtype=torch.float32)
    out = v.checkpoint(fn, x, **options)
    _changed["on"] = True
    try:
        out.sum().backward()
    except Exception as exc:  # compared by the caller
        return exc
    finally:
        _changed["on"] = False
    return None


def _assert_checkpoint_error(v: Variant, err: BaseException | None, *phrases: str) -> str:
    assert isinstance(err, v.checkpoint_error), f"{v.name}: {type(err)}: {err}"
    assert type(err).__name__ == "CheckpointError"
    assert isinstance(err, RuntimeError)
    message = str(err)
    for phrase in phrases:
        assert phrase in message, f"{v.name}: {phrase!r} not in:\n{message}"
    return message


def test_fewer_tensors_in_recompute() -> None:
    """Rule 1: recompute saves 2 of 3 tensors: CheckpointError with both counts and the tip."""
    for v in BOTH:
        _assert_checkpoint_error(
            v,
            _diverging_backward(v, saves_fewer),
            "A different number of tensors was saved",
            "Number of tensors saved during forward: 3",
            "Number of tensors saved during recomputation: 2",
            "debug=True",
        )


def test_more_tensors_in_recompute_without_early_stop() -> None:
    """Rule 1: recompute saves past the forward's count (early stop off): CheckpointError."""
    for v in BOTH:
        _assert_checkpoint_error(
            v,
            _diverging_backward(v, saves_more, early_stop=False),
            "trying to save more tensors during recomputation",
            "debug=True",
        )


def test_more_tensors_in_recompute_with_early_stop_is_not_detected() -> None:
    """With early stop, recompute ends at the forward's count: no error (as torch)."""
    for v in BOTH:
        assert _diverging_backward(v, saves_more) is None, v.name


def test_different_metadata_in_recompute() -> None:
    """Rule 2: dtype and shape changes: CheckpointError listing each position's metadata."""
    for v in BOTH:
        message = _assert_checkpoint_error(
            v,
            _diverging_backward(v, changes_metadata),
            "have different metadata",
            "tensor at position 1:",
            "tensor at position 2:",
            "'dtype': torch.float32",
            "'dtype': torch.float64",
            "'shape': torch.Size([3])",
            "'shape': torch.Size([6])",
            "debug=True",
        )
        assert "tensor at position 0:" not in message


def test_determinism_check_none_skips_metadata_but_not_counts() -> None:
    """Rule 3: determinism_check="none" ignores metadata; a different count still raises."""
    for v in BOTH:
        assert _diverging_backward(v, changes_dtype, determinism_check="none") is None
        _assert_checkpoint_error(
            v,
            _diverging_backward(v, changes_dtype),
            "have different metadata",
            "tensor at position 1:",
        )
        _assert_checkpoint_error(
            v,
            _diverging_backward(v, saves_fewer, determinism_check="none"),
            "A different number of tensors was saved",
        )


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("value", ["strict", "", "None", "DEFAULT"])
def test_unknown_determinism_check_is_a_value_error(value: str, grad: bool) -> None:
    """Rule 3: any other determinism_check value is a ValueError listing the allowed ones."""
    for v in BOTH:
        with torch.set_grad_enabled(grad):
            err = raised(lambda v=v: v.checkpoint(torch.sin, leaf(3), determinism_check=value))
        assert type(err) is ValueError, v.name
        assert "determinism_check should be one of ['default', 'none']" in str(err)
        assert f"but got {value}" in str(err).replace("'", "")


def test_determinism_checks_pass_for_a_faithful_region() -> None:
    """Without a divergence, every determinism mode gives the plain gradients."""
    for check in ("default", "none"):
        results = []
        for v in (*BOTH, PLAIN):
            x = leaf(3)
            v.checkpoint(changes_metadata, x, determinism_check=check).backward()
            results.append((x.grad,))
        assert_tensors_equal(results[1], results[2])
        assert_tensors_equal(results[0], results[2])


# ---------------------------------------------------------------------------------------------
# "Unpacked twice"
# ---------------------------------------------------------------------------------------------


class _ReadsSavedTwice(torch.autograd.Function):
    """A custom Function whose backward reads ctx.saved_tensors twice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        ctx.saved_tensors
        ctx.saved_tensors
        return grad * 2


def test_unpacking_a_saved_tensor_twice_is_an_error() -> None:
    """Reading ctx.saved_tensors twice in one backward: CheckpointError, as torch."""
    for v in BOTH:
        x = leaf(3)
        out = v.checkpoint(lambda t: _ReadsSavedTwice.apply(t.sin()), x)
        message = _assert_checkpoint_error(
            v,
            raised(lambda out=out: out.sum().backward()),
            "already unpacked once",
            "ctx.saved_tensors",
        )
        assert "GraphExecGroup" not in message


def test_unpacking_twice_with_retain_graph_still_raises() -> None:
    """Rule 4: even with retain_graph=True a recomputed tensor is handed out once per backward."""
    for v in BOTH:
        x = leaf(3)
        out = v.checkpoint(lambda t: _ReadsSavedTwice.apply(t.sin()), x)
        _assert_checkpoint_error(
            v,
            raised(lambda out=out: out.sum().backward(retain_graph=True)),
            "already unpacked once",
        )


# ---------------------------------------------------------------------------------------------
# Debug report
# ---------------------------------------------------------------------------------------------


def _line_of(fn: Callable[..., Any], code: str) -> str:
    """``file:line`` of the first line of ``fn`` whose text contains ``code``."""
    lines, start = inspect.getsourcelines(fn)
    for offset, text in enumerate(lines):
        if code in text:
            return f"{inspect.getsourcefile(fn)}:{start + offset}"
    raise AssertionError(f"{code!r} not in {fn.__name__}")


def _debug_ways(v: Variant) -> dict[str, Callable[[Callable[..., Any]], BaseException | None]]:
    def via_argument(fn: Callable[..., Any]) -> BaseException | None:
        return _diverging_backward(v, fn, debug=True)

    def via_setting(fn: Callable[..., Any]) -> BaseException | None:
        with v.set_checkpoint_debug_enabled(True):
            return _diverging_backward(v, fn, debug=False)

    return {"argument": via_argument, "setting": via_setting}


@pytest.mark.parametrize("way", ["argument", "setting"])
def test_debug_report_lists_forward_and_recompute_ops_with_source_lines(way: str) -> None:
    """debug=True / set_checkpoint_debug_enabled(True): both op logs, in order, with file:line."""
    first, second, third = (
        _line_of(saves_fewer, "y = x.sin()"),
        _line_of(saves_fewer, "y = y.sin()"),
        _line_of(saves_fewer, "return y.sin() * 2"),
    )
    for v in BOTH:
        message = _assert_checkpoint_error(
            v,
            _debug_ways(v)[way](saves_fewer),
            "Operations executed during the original forward",
            "Operations executed during recomputation",
            "Detected non-determinism while running activation checkpointing",
            "aten.sin.default",
            first,
            second,
            third,
        )
        forward_part, recompute_part = message.split("Operations executed during recomputation")
        forward_part = forward_part.split("Operations executed during the original forward")[1]
        assert forward_part.count("aten.sin.default") == 3, v.name
        assert recompute_part.count("aten.sin.default") >= 2, v.name
        if v is OURS:
            # Our log keeps the forward's ops in execution order, each with its source line.
            assert (
                forward_part.index(first) < forward_part.index(second) < forward_part.index(third)
            )
            recompute_log = recompute_part.split("First divergence")[0]
            assert second not in recompute_log


def test_debug_report_points_at_the_first_divergence() -> None:
    """Beyond torch: the report names the first op where forward and recompute differ."""
    cases = {
        saves_fewer: ("First divergence at op", _line_of(saves_fewer, "return y.sin() * 2")),
        saves_more: ("First divergence at op 2", _line_of(saves_more, "y = y.sin()")),
        changes_metadata: (
            "First divergence at op 2",
            _line_of(changes_metadata, "y = y.double()"),
        ),
    }
    for fn, (phrase, where) in cases.items():
        err = _diverging_backward(OURS, fn, debug=True, early_stop=fn is not saves_more)
        message = _assert_checkpoint_error(OURS, err, phrase)
        divergence = message.split(phrase)[1].split("ERROR:")[0]
        assert where in divergence, f"{fn.__name__}: {where} not in\n{divergence}"
        assert "first divergence" in message.lower()


def test_debug_report_after_an_earlier_backward_shows_the_failing_recompute_only() -> None:
    """A second backward diverges: the report logs that recompute, not the earlier one too.

    Ours only: torch 2.13 cannot re-enter its debug context and fails on the second backward.
    """
    x = leaf(3, dtype=torch.float32)
    out = OURS.checkpoint(saves_fewer, x, debug=True)
    out.sum().backward(retain_graph=True)
    _changed["on"] = True
    message = _assert_checkpoint_error(
        OURS, raised(lambda: out.sum().backward()), "First divergence at op"
    )
    recompute_part = message.split("Operations executed during recomputation")[1]
    recompute_part = recompute_part.split("First divergence")[0]
    assert recompute_part.count("aten.sin.default") == 2  # the failing recompute ran two sins
    divergence = message.split("First divergence")[1].split("ERROR:")[0]
    assert _line_of(saves_fewer, "return y.sin() * 2") in divergence


def test_debug_report_keeps_the_original_error() -> None:
    """The debug report still carries the counts of the error it explains."""
    for v in BOTH:
        err = _diverging_backward(v, saves_fewer, debug=True)
        assert isinstance(err, v.checkpoint_error)
    message = str(_diverging_backward(OURS, saves_fewer, debug=True))
    assert "Number of tensors saved during forward: 3" in message
    assert "Number of tensors saved during recomputation: 2" in message


@pytest.mark.parametrize("way", ["argument", "setting"])
def test_debug_report_keeps_torchs_guidance_word_for_word(way: str) -> None:
    """Rule 4: torch's guidance paragraph, cut from torch's own report, is in ours verbatim."""
    torch_message = str(_debug_ways(TORCH)[way](saves_fewer))
    start = torch_message.index("You are seeing this error because you passed `debug=True`")
    end = torch_message.index("Note that the logs can be quite long")
    guidance = torch_message[start:end].rstrip()
    assert "1) Compare the operators" in guidance
    assert "2) Review the stack trace" in guidance
    for v in BOTH:
        message = _assert_checkpoint_error(v, _debug_ways(v)[way](saves_fewer), guidance)
        assert message.index(guidance) > message.index("Operations executed during recomputation")


def test_debug_setting_off_overrides_the_argument() -> None:
    """set_checkpoint_debug_enabled(False) beats debug=True; None defers to the argument."""
    for v in BOTH:
        with v.set_checkpoint_debug_enabled(False):
            plain_error = _diverging_backward(v, saves_fewer, debug=True)
        with v.set_checkpoint_debug_enabled(None):
            report = _diverging_backward(v, saves_fewer, debug=True)
        assert "Operations executed" not in str(plain_error), v.name
        assert "A different number of tensors was saved" in str(plain_error)
        assert "Operations executed during the original forward" in str(report), v.name


def test_debug_without_divergence_is_silent() -> None:
    """debug=True on a faithful region: no error, plain gradients."""
    grads = []
    for v in (*BOTH, PLAIN):
        x = leaf(3)
        v.checkpoint(saves_fewer, x, debug=True).sum().backward()
        grads.append((x.grad,))
    assert_tensors_equal(grads[0], grads[2])
    assert_tensors_equal(grads[1], grads[2])


@pytest.mark.parametrize("way", ["argument", "setting"])
def test_debug_with_a_custom_context_fn_is_a_value_error(way: str) -> None:
    """debug (argument or setting) with a non-default context_fn: ValueError, as torch."""

    def context_fn() -> tuple[Any, Any]:
        return contextlib.nullcontext(), contextlib.nullcontext()

    for v in BOTH:
        setting = v.set_checkpoint_debug_enabled(True) if way == "setting" else None
        with setting or contextlib.nullcontext():
            err = raised(
                lambda v=v: v.checkpoint(
                    torch.sin, leaf(3), debug=way == "argument", context_fn=context_fn
                )
            )
        assert type(err) is ValueError, v.name
        assert "debug=True is incompatible with non-default context_fn" in str(err)


def test_debug_report_for_unpacked_twice() -> None:
    """With debug on, the "unpacked twice" error also comes with the op logs (as torch)."""
    for v in BOTH:
        x = leaf(3)
        out = v.checkpoint(lambda t: _ReadsSavedTwice.apply(t.sin()), x, debug=True)
        _assert_checkpoint_error(
            v,
            raised(lambda out=out: out.sum().backward()),
            "Operations executed during the original forward",
        )


def test_checkpoint_error_is_exported_and_a_runtime_error() -> None:
    """checkpointing.CheckpointError is a RuntimeError, named like torch's."""
    assert issubclass(checkpointing.CheckpointError, RuntimeError)
    assert checkpointing.CheckpointError.__name__ == TORCH.checkpoint_error.__name__
