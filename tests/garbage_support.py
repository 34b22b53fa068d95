"""Collection switched off, and the garbage of ours told apart: for the tests that show a step
leaves no reference cycle (``gc.collect()`` with automatic collection disabled finds nothing of
``checkpointing``'s, nor any tensor)."""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture
def gc_disabled() -> Iterator[None]:
    """Disable automatic collection for the test; restore it afterwards."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


def ours(obj: Any) -> bool:
    """Whether a garbage object is a tensor or belongs to checkpointing's code."""
    if issubclass(type(obj), torch.Tensor):
        return True
    if isinstance(obj, types.FrameType):
        return "checkpointing" in obj.f_code.co_filename.split("/")[-2:-1]
    if isinstance(obj, types.FunctionType | types.MethodType):
        return (getattr(obj, "__module__", None) or "").startswith("checkpointing")
    return type(obj).__module__.startswith("checkpointing")


def described(garbage: list[Any]) -> list[str]:
    """The garbage objects' types, each once, as ``module.qualname``."""
    return sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in garbage})
