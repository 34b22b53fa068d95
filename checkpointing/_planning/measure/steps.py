"""A training step at plan time: its loss, what it differentiates, one plain run of it.

Shared by the recorder (``recorder``), the profile (``profile``), the peak (``live_bytes``'s
caller) and the timed candidates (``trials``): the default loss, the gradients a step asks for
(through ``torch.autograd.grad``, so ``.grad`` stays untouched, Rule M7), and the input shapes a
plan compares (Rule A2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..._trees import tensors

__all__ = ["default_loss", "differentiate", "input_shapes", "plain_step", "step_setting"]


def default_loss(output: Any) -> torch.Tensor:
    """The sum of every floating-point tensor in the output that requires grad."""
    terms = [t.float().sum() for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms:
        raise ValueError(_MSG_NO_GRAD)
    return torch.stack(terms).sum()


_MSG_NO_GRAD = (
    "checkpointing.plan_checkpointing: the model's output has no floating-point tensor that "
    "requires grad, so there is nothing to backward and no activation is kept. Fix: pass "
    "inputs or parameters that require grad, or a loss_fn(output) -> scalar tensor."
)


def input_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[int]]:
    """Rule A2: the shapes a plan compares, positional inputs first, then keyword ones by name
    (not in call order), 0-d tensors (a scalar such as a loss's token count) left out."""
    named = tuple(kwargs[name] for name in sorted(kwargs))
    return [list(t.shape) for t in tensors((args, named)) if t.dim() > 0]


def step_setting(
    model: nn.Module, inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.device, Callable[[], None] | None]:
    """What a measured step of ``model`` on ``inputs`` differentiates (the parameters and the
    inputs that require grad), its device, and how to wait for that device (None on CPU)."""
    wrt = [p for p in model.parameters() if p.requires_grad] + [
        t for t in inputs if t.requires_grad
    ]
    device = next((t.device for t in (*model.parameters(), *inputs)), torch.device("cpu"))
    return wrt, device, torch.cuda.synchronize if device.type == "cuda" else None


def plain_step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    wrt: list[torch.Tensor],
) -> None:
    """One forward, loss and backward; the gradients go nowhere (``autograd.grad``) and are
    dropped at the step's end."""
    output = model(*args, **kwargs)
    loss = default_loss(output) if loss_fn is None else loss_fn(output)
    del output
    differentiate(loss, wrt)


def differentiate(loss: torch.Tensor, wrt: list[torch.Tensor]) -> None:
    """A measured step's backward; its gradients go nowhere (Rules M7 and M15): ``autograd.grad``
    with respect to ``wrt`` and every other leaf the loss's graph reaches (FSDP2's gathered
    parameters, which exist only during the step), so that the whole backward runs, hooks
    included, and no ``.grad`` is written: nothing for a sharding's hooks to reduce or
    accumulate."""
    torch.autograd.grad(loss, _leaves(loss, wrt), allow_unused=True)


def _leaves(loss: torch.Tensor, wrt: list[torch.Tensor]) -> list[torch.Tensor]:
    """``wrt`` and, after it, the leaves that ``loss``'s graph accumulates into, each once."""
    found = {id(t): t for t in wrt}
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)  # an ``AccumulateGrad`` node's tensor
        if isinstance(leaf, torch.Tensor):
            found.setdefault(id(leaf), leaf)
        stack.extend(following for following, _index in node.next_functions)
    return list(found.values())
