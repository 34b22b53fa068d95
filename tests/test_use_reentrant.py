"""``use_reentrant`` must be a bool (or omitted) wherever ours takes it.

Torch reads any other value for its truth: ``use_reentrant="false"`` runs the reentrant variant in
silence, and with ``context_fn`` its error then says "got use_reentrant=True". Ours refuses such a
value before anything runs, with a TypeError naming the fix (``use_reentrant=False``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import checkpointing

NOT_BOOLS = ["false", "False", 0, 1, torch.tensor(False)]


def _x() -> torch.Tensor:
    return torch.randn(3, 3, requires_grad=True)


class Counted(nn.Module):
    """A linear that counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def _checkpoint(flag: object, layer: Counted) -> None:
    checkpointing.checkpoint(layer, _x(), use_reentrant=flag)


def _decorator(flag: object, layer: Counted) -> None:
    checkpointing.checkpoint(use_reentrant=flag)(layer)(_x())


def _sequential_torch_path(flag: object, layer: Counted) -> None:
    checkpointing.checkpoint_sequential([layer, nn.Tanh()], 2, _x(), flag)


def _sequential_by_keyword(flag: object, layer: Counted) -> None:
    checkpointing.checkpoint_sequential([layer], 1, _x(), use_reentrant=flag, strategy="sqrt")


def _wrapper(flag: object, layer: Counted) -> None:
    checkpointing.checkpoint_wrapper(layer, use_reentrant=flag)(_x())


def _wrapper_class(flag: object, layer: Counted) -> None:
    checkpointing.CheckpointWrapper(layer, use_reentrant=flag)(_x())


def _applied(flag: object, layer: Counted) -> None:
    model = nn.Sequential(layer, nn.Tanh())
    checkpointing.apply_activation_checkpointing(model, use_reentrant=flag)
    model(_x())


def _module(flag: object, layer: Counted) -> None:
    checkpointing.checkpoint_module(layer, use_reentrant=flag)
    layer(_x())


CALLS: dict[str, tuple[Callable[[object, Counted], None], str]] = {
    "checkpoint": (_checkpoint, "checkpointing.checkpoint:"),
    "decorator": (_decorator, "checkpointing.checkpoint:"),
    "checkpoint_sequential (torch's path)": (_sequential_torch_path, "checkpoint_sequential:"),
    "checkpoint_sequential (strategy)": (_sequential_by_keyword, "checkpoint_sequential:"),
    "checkpoint_wrapper": (_wrapper, "checkpointing.checkpoint_wrapper:"),
    "CheckpointWrapper": (_wrapper_class, "checkpointing.CheckpointWrapper:"),
    "apply_activation_checkpointing": (_applied, "apply_activation_checkpointing:"),
    "checkpoint_module": (_module, "checkpointing.checkpoint_module:"),
}


@pytest.mark.parametrize("flag", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("call", CALLS)
def test_a_non_bool_use_reentrant_is_refused_before_anything_runs(call: str, flag: object) -> None:
    """Every API taking ``use_reentrant`` refuses a non-bool: a TypeError naming the API, the
    value and the fix; the module never ran."""
    run, api = CALLS[call]
    layer = Counted()
    with pytest.raises(TypeError) as info:
        run(flag, layer)
    message = str(info.value)
    assert api in message
    assert "use_reentrant must be True or False" in message
    assert "Fix: pass the bool, use_reentrant=False" in message
    assert layer.calls == 0


def test_the_string_false_would_run_torchs_reentrant_variant() -> None:
    """Why: torch reads ``"false"`` as true, runs the reentrant variant, and with a
    ``context_fn`` says "got use_reentrant=True"; ours names the value instead."""
    context_fn = torch_checkpoint.noop_context_fn
    x = _x()
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        torch_checkpoint.checkpoint(
            torch.sin, x, use_reentrant="false", context_fn=lambda: context_fn()
        )
    with pytest.raises(TypeError, match=r"got 'false' of type str"):
        checkpointing.checkpoint(
            torch.sin, x, use_reentrant="false", context_fn=lambda: context_fn()
        )


def test_a_tensor_given_by_position_to_checkpoint_sequential_names_the_second_input() -> None:
    """The fourth positional argument of ``checkpoint_sequential`` is ``use_reentrant``: a
    tensor there is a second input, and the message says how to pass it."""
    with pytest.raises(TypeError, match=r"input=\(a, b\)"):
        checkpointing.checkpoint_sequential([nn.Tanh()], 1, _x(), torch.ones(3))


@pytest.mark.parametrize("flag", [True, False, None])
def test_bools_and_none_still_run(flag: Any) -> None:
    """The check refuses only non-bools: ``True``, ``False`` and an omitted value run."""
    layer = Counted()
    warned = pytest.warns(UserWarning, match="use_reentrant")
    with warned if flag is None else contextlib.nullcontext():
        checkpointing.checkpoint(layer, _x(), use_reentrant=flag).sum().backward()
    assert layer.calls == 2
