"""Properties of ``gradient_checkpoint_scope`` over random op graphs (``strategies.ScopedGraph``).

Each example runs one graph twice from the same RNG seed, once with some of its ops inside one or
two scope blocks (one after the other and both alive, or nested) and once with no scope at all.
The ops are the same in both runs (only what autograd keeps differs), so everything is compared
bit for bit with ``torch.equal``: the loss, first- and second-order gradients, and the CPU RNG
state afterwards. Tensors made in a block are used after it by later steps and by the loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
from hypothesis import given
from strategies import ScopedGraph, scoped_graphs

from checkpointing import _compat
from checkpointing._scope import gradient_checkpoint_scope, gradient_checkpoint_session

Scope = Callable[[], AbstractContextManager[object]]
NO_SCOPE: Scope = contextlib.nullcontext
SCOPE: Scope = gradient_checkpoint_scope


def _forward(
    graph: ScopedGraph, scope: Scope, in_session: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seed, run the graph and its loss, and drop the graph's tensors: returns ``(loss, x, w)``.
    Outside a session, the scope's hook must have left by then (its tensors are dead)."""
    x, w = graph.inputs()
    torch.manual_seed(graph.seed)
    pool = graph.run(x, w, scope)
    loss = graph.loss(pool)
    del pool  # scope tensors die here: backward must recompute them
    if not in_session:
        assert _compat.top_saved_tensors_hooks() is None, "hook left while scope tensors are dead"
    return loss, x, w


Grads = tuple[torch.Tensor | None, ...]


def _assert_same(got: Grads, want: Grads) -> None:
    for i, (g, expected) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (expected is None), f"gradient {i}: {g} vs {expected}"
        if g is not None and expected is not None:
            diff = (g - expected).abs().max()
            assert torch.equal(g, expected), f"gradient {i}: max |diff| {diff}"


class _Run(NamedTuple):
    loss: torch.Tensor
    first: Grads
    second: Grads
    rng_after: torch.Tensor


def _gradients(graph: ScopedGraph, scope: Scope) -> _Run:
    """Loss, gradients of two backwards over one graph (retain_graph), and the RNG state after."""
    loss, x, w = _forward(graph, scope)
    first = torch.autograd.grad(loss, (x, w), retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(loss, (x, w), allow_unused=True)
    return _Run(loss.detach(), first, second, torch.get_rng_state())


@given(scoped_graphs())
def test_gradients_bit_identical_to_no_scope(graph: ScopedGraph) -> None:
    """Loss, input/parameter gradients (two backwards) and the RNG after equal the plain run."""
    got, want = _gradients(graph, SCOPE), _gradients(graph, NO_SCOPE)
    assert torch.equal(got.loss, want.loss)
    _assert_same(got.first, want.first)
    _assert_same(got.second, want.second)
    assert torch.equal(got.rng_after, want.rng_after)


def _partial_gradients(graph: ScopedGraph, scope: Scope) -> tuple[Grads, Grads, torch.Tensor]:
    """Two losses over alternate tensors of the graph; ``torch.autograd.grad`` of each in turn
    (each backward replays only the chains its loss needs), and the RNG state after."""
    x, w = graph.inputs()
    torch.manual_seed(graph.seed)
    pool = graph.run(x, w, scope)
    losses = [graph.loss([x, w, *pool[2::2]]), graph.loss([x, w, *pool[3::2]])]
    del pool  # scope tensors die here: each backward must recompute what it needs
    grads = [
        torch.autograd.grad(loss, (x, w), retain_graph=True, allow_unused=True)
        if loss.requires_grad
        else (None, None)
        for loss in losses
    ]
    return grads[0], grads[1], torch.get_rng_state()


@given(scoped_graphs())
def test_gradients_of_partial_losses_bit_identical_to_no_scope(graph: ScopedGraph) -> None:
    """Rule 7: gradients of one loss, then of another over other tensors of the same graph,
    equal the plain run's bit for bit (draws included), and so does the RNG after."""
    got, want = _partial_gradients(graph, SCOPE), _partial_gradients(graph, NO_SCOPE)
    _assert_same(got[0], want[0])
    _assert_same(got[1], want[1])
    assert torch.equal(got[2], want[2])


def _second_order(graph: ScopedGraph, scope: Scope) -> Grads:
    """Gradients of ``sum(g * g)`` over the first-order gradients ``g`` (create_graph=True)."""
    loss, x, w = _forward(graph, scope)
    grads = torch.autograd.grad(loss, (x, w), create_graph=True, allow_unused=True)
    squares = [(g * g).sum() for g in grads if g is not None and g.requires_grad]
    if not squares:  # every op on the path was linear: nothing to differentiate
        return (None, None)
    total = torch.stack(squares).sum()
    return torch.autograd.grad(total, (x, w), allow_unused=True)


@given(scoped_graphs())
def test_double_backward_bit_identical_to_no_scope(graph: ScopedGraph) -> None:
    """Second-order gradients through recomputed scope tensors equal the plain run's."""
    _assert_same(_second_order(graph, SCOPE), _second_order(graph, NO_SCOPE))


def _kept_bytes(graph: ScopedGraph, scope: Scope) -> int:
    """Bytes of the distinct storages autograd keeps: an outer hook entered before the scope
    counts them, and a session keeps the scope's hook above it (as in examples/04)."""
    storages: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    with (
        torch.autograd.graph.saved_tensors_hooks(count, lambda t: t),
        gradient_checkpoint_session(),
    ):
        loss, _x, _w = _forward(graph, scope, in_session=True)
    del loss
    assert _compat.top_saved_tensors_hooks() is None
    return sum(storages.values())


@given(scoped_graphs())
def test_kept_bytes_never_more_than_without_scope(graph: ScopedGraph) -> None:
    """What autograd keeps for backward with scope blocks is never more than without them."""
    assert _kept_bytes(graph, SCOPE) <= _kept_bytes(graph, NO_SCOPE)


@given(scoped_graphs())
def test_one_block_around_every_step_keeps_only_outside_tensors(graph: ScopedGraph) -> None:
    """With every step in one block, autograd keeps at most x, w and the loss's cotangents:
    no tensor the steps made (masks, views, reductions included)."""
    everything = dataclasses.replace(graph, blocks=((0, len(graph.steps)),))
    outside = (2 + len(graph.steps)) * graph.n * graph.n * 8  # float64 (n, n) tensors
    assert _kept_bytes(everything, SCOPE) <= outside
