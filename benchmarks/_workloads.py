"""The five workloads of issue 6 and the ways each one is checkpointed.

A workload builds its model and inputs once (seeded, shared by both libraries) and hands out
``forward(variant, lib)``: a closure that computes the scalar loss. The harness owns the rest of
the step (zero grads, ``backward``). Variants:

- ``none``: no checkpoint (the baseline; the same code for both libraries);
- ``reentrant`` / ``non-reentrant``: ``checkpoint`` around each block (W1, W2), around the whole
  body (W3), around every call (W4), around each weight's noise (W5);
- ``sac``: non-reentrant with the save-matmuls policy as ``context_fn``;
- ``sequential``: ``checkpoint_sequential`` over the blocks with round(sqrt(n)) segments
  (non-reentrant; torch's segmenting, so the last segment runs without checkpoint);
- ``scope``: ours with ``gradient_checkpoint_scope`` against torch's non-reentrant ``checkpoint``
  of the same code (W3 and W5);
- ``noise+linear`` (W5 only): non-reentrant ``checkpoint`` around the noise *and* the linear
  layer that uses it, the way to keep the noisy weight out of memory without a scope.

``forward`` returns ``None`` where a variant does not apply (the table prints "n/a").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from _libs import Library
from torch import Tensor, nn

Variant = Literal[
    "none", "reentrant", "non-reentrant", "sac", "sequential", "scope", "noise+linear"
]
Forward = Callable[[], Tensor]


def sqrt_segments(n: int) -> int:
    """The segment count the benchmark uses for ``n`` blocks: round(sqrt(n)), at least 1."""
    return max(1, round(math.sqrt(n)))


@dataclass
class Workload:
    """One benchmark problem: its parameters, its variants and a forward per variant."""

    key: str
    title: str
    params: list[Tensor]
    inputs: list[Tensor]
    variants: tuple[Variant, ...]
    build: Callable[[Variant, Library, bool], Forward | None] = field(repr=False)
    # Rounds relative to ``--repeats``: the per-op/per-call workloads are cheap and their
    # samples short, so more rounds buy them a steadier median at little cost.
    rounds_factor: int = 1

    def forward(self, variant: Variant, lib: Library, is_ours: bool) -> Forward | None:
        """The loss closure for ``variant`` under ``lib``, or ``None`` where it does not apply."""
        if variant not in self.variants or not _applies(variant, lib):
            return None
        return self.build(variant, lib, is_ours)

    def zero_grads(self) -> None:
        """Drop the gradients of parameters and inputs (``set_to_none``), as a step begins."""
        for tensor in (*self.params, *self.inputs):
            tensor.grad = None


def _checkpoint_kwargs(variant: Variant, lib: Library) -> dict[str, object]:
    """Keyword arguments of ``checkpoint`` for the per-call variants."""
    if variant == "reentrant":
        return {"use_reentrant": True}
    if variant == "sac":
        return {"use_reentrant": False, "context_fn": lib.save_matmuls}
    return {"use_reentrant": False}


def _applies(variant: Variant, lib: Library) -> bool:
    """Whether ``lib`` has what ``variant`` needs (selective checkpointing may be missing)."""
    return variant != "sac" or lib.save_matmuls is not None


def _chain(blocks: nn.Sequential, x: Tensor, variant: Variant, lib: Library) -> Forward:
    """Run ``blocks`` on ``x`` with one checkpoint per block, or as √n sequential segments."""
    if variant == "none":
        return lambda: blocks(x).sum()
    if variant == "sequential":
        segments = sqrt_segments(len(blocks))
        return lambda: lib.checkpoint_sequential(blocks, segments, x, use_reentrant=False).sum()
    kwargs = _checkpoint_kwargs(variant, lib)

    def forward() -> Tensor:
        h = x
        for block in blocks:
            h = lib.checkpoint(block, h, **kwargs)
        return h.sum()

    return forward


def w1_mlp(depth: int = 32) -> Workload:
    """W1: ``depth`` x (Linear 1024->1024 + GELU), batch 64."""
    torch.manual_seed(1)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(depth)))
    x = torch.randn(64, 1024, requires_grad=True)
    return Workload(
        key="W1",
        title=f"{depth} x (Linear 1024->1024 + GELU), batch 64",
        params=list(blocks.parameters()),
        inputs=[x],
        variants=("none", "reentrant", "non-reentrant", "sac", "sequential"),
        build=lambda variant, lib, _ours: _chain(blocks, x, variant, lib),
    )


def w2_transformer(depth: int = 8, batch: int = 8) -> Workload:
    """W2: ``depth`` x TransformerEncoderLayer(256, 8 heads, dropout 0.1), seq 128, ``batch``."""
    torch.manual_seed(2)
    blocks = nn.Sequential(
        *(nn.TransformerEncoderLayer(256, 8, dropout=0.1, batch_first=True) for _ in range(depth))
    )
    blocks.train()
    x = torch.randn(batch, 128, 256, requires_grad=True)
    return Workload(
        key="W2",
        title=f"{depth} x TransformerEncoderLayer(d_model 256, 8 heads, dropout 0.1), seq 128, "
        f"batch {batch}",
        params=list(blocks.parameters()),
        inputs=[x],
        variants=("none", "reentrant", "non-reentrant", "sac", "sequential"),
        build=lambda variant, lib, _ours: _chain(blocks, x, variant, lib),
    )


def tiny_ops(x: Tensor, w: Tensor, count: int) -> Tensor:
    """``count`` elementwise ops, each saving a tensor for backward (sin, tanh, *w, sigmoid)."""
    h = x
    for i in range(count):
        kind = i % 4
        if kind == 0:
            h = torch.sin(h)
        elif kind == 1:
            h = torch.tanh(h)
        elif kind == 2:
            h = h * w
        else:
            h = torch.sigmoid(h)
    return h


def w3_many_ops(ops: int = 200) -> Workload:
    """W3: one checkpoint around ``ops`` tiny elementwise ops on 64 elements (per-op cost)."""
    torch.manual_seed(3)
    x = torch.randn(64, requires_grad=True)
    w = nn.Parameter(torch.rand(64) + 0.5)

    def body(h: Tensor) -> Tensor:
        return tiny_ops(h, w, ops)

    def build(variant: Variant, lib: Library, is_ours: bool) -> Forward | None:
        if variant == "none":
            return lambda: body(x).sum()
        if variant == "scope":
            fallback = functools.partial(lib.checkpoint, body, x, use_reentrant=False)
            return _scoped(lambda: body(x), lib, is_ours, fallback)
        kwargs = _checkpoint_kwargs(variant, lib)
        return lambda: lib.checkpoint(body, x, **kwargs).sum()

    return Workload(
        key="W3",
        title=f"one checkpoint around {ops} tiny elementwise ops, 64 elements",
        params=[w],
        inputs=[x],
        variants=("none", "reentrant", "non-reentrant", "sac", "scope"),
        build=build,
        rounds_factor=3,
    )


def _scoped(
    body: Callable[[], Tensor], lib: Library, is_ours: bool, fallback: Callable[[], Tensor]
) -> Forward | None:
    """Ours: ``body`` inside ``gradient_checkpoint_scope``; torch: ``fallback`` (a checkpoint)."""
    if not is_ours:
        return lambda: fallback().sum()
    scope = lib.scope
    if scope is None:
        return None

    def forward() -> Tensor:
        with scope():
            out = body()
        return out.sum()

    return forward


def w4_many_calls(calls: int = 500) -> Workload:
    """W4: ``calls`` checkpoints in a chain, each around 2 tiny ops (per-call cost)."""
    torch.manual_seed(4)
    x = torch.randn(64, requires_grad=True)
    w = nn.Parameter(torch.rand(64) + 0.5)

    def two_ops(h: Tensor) -> Tensor:
        return torch.sin(h) * w

    def build(variant: Variant, lib: Library, _ours: bool) -> Forward:
        kwargs = _checkpoint_kwargs(variant, lib)

        def forward() -> Tensor:
            h = x
            for _ in range(calls):
                h = two_ops(h) if variant == "none" else lib.checkpoint(two_ops, h, **kwargs)
            return h.sum()

        return forward

    return Workload(
        key="W4",
        title=f"{calls} checkpoint calls around 2 tiny ops each, 64 elements",
        params=[w],
        inputs=[x],
        variants=("none", "reentrant", "non-reentrant", "sac"),
        build=build,
        rounds_factor=3,
    )


def _noisy(weight: Tensor) -> Tensor:
    """Weight noise: the weight plus Gaussian noise of scale 0.01."""
    return weight + torch.randn_like(weight) * 0.01


def _noise_maker(
    variant: Variant, lib: Library, is_ours: bool
) -> Callable[[Tensor], Tensor] | None:
    """How W5 makes a noisy weight: plainly, through ``checkpoint``, or inside the scope."""
    if variant == "none":
        return _noisy
    if variant == "scope" and is_ours:
        scope = lib.scope
        if scope is None:
            return None

        def scoped(weight: Tensor) -> Tensor:
            with scope():
                return _noisy(weight)

        return scoped
    return lambda weight: lib.checkpoint(_noisy, weight, use_reentrant=False)


def _noisy_linear(h: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """A linear layer with a freshly noised weight."""
    return F.linear(h, _noisy(weight), bias)


def _noise_and_linear(layers: list[nn.Linear], x: Tensor, lib: Library) -> Forward:
    """W5 with one checkpoint around each layer's noise and linear (then GELU outside)."""

    def forward() -> Tensor:
        h = x
        for layer in layers:
            h = lib.checkpoint(_noisy_linear, h, layer.weight, layer.bias, use_reentrant=False)
            h = F.gelu(h)
        return h.sum()

    return forward


def w5_weight_noise(depth: int = 32) -> Workload:
    """W5: W1's layers with weight noise, kept out of memory by the scope or by ``checkpoint``."""
    torch.manual_seed(5)
    layers = [nn.Linear(1024, 1024) for _ in range(depth)]
    x = torch.randn(64, 1024, requires_grad=True)

    def build(variant: Variant, lib: Library, is_ours: bool) -> Forward | None:
        if variant == "noise+linear":
            return _noise_and_linear(layers, x, lib)
        noisy = _noise_maker(variant, lib, is_ours)
        if noisy is None:
            return None

        def forward() -> Tensor:
            h = x
            for layer in layers:
                h = F.gelu(F.linear(h, noisy(layer.weight), layer.bias))
            return h.sum()

        return forward

    return Workload(
        key="W5",
        title=f"weight noise on {depth} x (Linear 1024->1024 + GELU), batch 64",
        params=[p for layer in layers for p in layer.parameters()],
        inputs=[x],
        variants=("none", "non-reentrant", "scope", "noise+linear"),
        build=build,
    )


def build_workloads(keys: list[str], quick: bool) -> list[Workload]:
    """The selected workloads; ``quick`` shrinks them (W1, W5: 8 layers; W2: 4 layers, batch 1;
    W4: 200 calls) so that a smoke run takes well under a minute."""
    factories: dict[str, Callable[[], Workload]] = {
        "W1": lambda: w1_mlp(8 if quick else 32),
        "W2": lambda: w2_transformer(4 if quick else 8, 1 if quick else 8),
        "W3": w3_many_ops,
        "W4": lambda: w4_many_calls(200 if quick else 500),
        "W5": lambda: w5_weight_noise(8 if quick else 32),
    }
    unknown = [key for key in keys if key not in factories]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {sorted(factories)}")
    return [factories[key]() for key in keys]
