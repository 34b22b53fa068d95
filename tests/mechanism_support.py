"""Every checkpointing mechanism behind one call, for the reliability tests (threads, leaks, DDP).

``forward(mechanism, params, x)`` runs the same tiny two-layer block under the named mechanism,
so a test can compare any mechanism with ``"plain"`` (no checkpointing). Mechanisms whose module
is still missing (SAC, offload, the scope) make the calling test skip, via ``require``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import checkpointing
from checkpointing._wrappers import checkpoint_wrapper

MECHANISMS = (
    "plain",
    "reentrant",
    "non_reentrant",
    "nested",
    "sac",
    "offload",
    "scope",
    "sequential",
    "wrapper",
    "module",
)
WIDTH = 8


def require(name: str) -> Any:
    """``checkpointing.<name>``, or from the private module that will hold it; skip if absent."""
    value = getattr(checkpointing, name, None)
    if value is not None:
        return value
    for module in ("checkpointing._selective", "checkpointing._scope", "checkpointing.policies"):
        try:
            value = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if value is not None:
            return value
    pytest.skip(f"checkpointing.{name} is not available yet")


def make_params(seed: int = 0, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Leaf weights of the block: ``w1, b1, w2``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(WIDTH, 2 * WIDTH), (2 * WIDTH,), (2 * WIDTH, WIDTH)]
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _layer1(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w1 + b1)


def _block(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.sin(_layer1(x, w1, b1) @ w2)


def _nested(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = checkpointing.checkpoint(_layer1, x, w1, b1, use_reentrant=False)
    return torch.sin(h @ w2)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = require("CheckpointPolicy")
    if op is torch.ops.aten.mm.default:
        return policy.MUST_SAVE
    return policy.PREFER_RECOMPUTE


def _offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = require("CheckpointPolicy")
    if op is torch.ops.aten.mm.default:
        return policy.MUST_CPU_OFFLOAD
    return policy.PREFER_RECOMPUTE


def _sac(policy: Callable[..., Any]) -> Callable[[], Any]:
    return functools.partial(require("create_selective_checkpoint_contexts"), policy)


class _Layer(torch.nn.Module):
    """``fn(x, *weights)`` as a module, for ``checkpoint_sequential`` and the wrapper."""

    def __init__(self, fn: Callable[..., torch.Tensor], *weights: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.weights = weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, *self.weights)


def _second(h: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.sin(h @ w2)


def forward(mechanism: str, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The block's output for ``x``, computed under ``mechanism``."""
    w1, b1, w2 = params
    if mechanism == "plain":
        return _block(x, w1, b1, w2)
    if mechanism in ("reentrant", "non_reentrant"):
        reentrant = mechanism == "reentrant"
        return checkpointing.checkpoint(_block, x, w1, b1, w2, use_reentrant=reentrant)
    if mechanism == "nested":
        return checkpointing.checkpoint(_nested, x, w1, b1, w2, use_reentrant=False)
    if mechanism in ("sac", "offload"):
        policy = _save_matmuls if mechanism == "sac" else _offload_matmuls
        return checkpointing.checkpoint(
            _block, x, w1, b1, w2, use_reentrant=False, context_fn=_sac(policy)
        )
    if mechanism == "scope":
        with require("gradient_checkpoint_scope")():
            h = _layer1(x, w1, b1)
        return _second(h, w2)
    if mechanism == "sequential":
        layers = torch.nn.Sequential(_Layer(_layer1, w1, b1), _Layer(_second, w2))
        return checkpointing.checkpoint_sequential(layers, 2, x, use_reentrant=False)
    if mechanism == "wrapper":
        return checkpoint_wrapper(_Layer(_block, w1, b1, w2))(x)
    if mechanism == "module":
        return checkpointing.checkpoint_module(_Layer(_block, w1, b1, w2))(x)
    raise ValueError(f"unknown mechanism {mechanism!r}")


class StateCounter:
    """User state a recompute must see as the forward did (a ``RecomputeStateHook``): a counter
    the region reads and bumps."""

    def __init__(self) -> None:
        self.n = 0

    def snapshot(self) -> int:
        return self.n

    def restore(self, state: int) -> None:
        self.n = state
