"""The LM head and its cross-entropy loss as one tiled region: ``tiled_lm_head_loss``.

Owns the recipe for the largest transient of a long-context step, the logits over the vocabulary
and their loss: chunk by chunk over the tokens, logits are made, reduced to each token's loss and
dropped, and backward remakes each chunk's logits once and turns them into their gradient in
place. The logits are never whole. The generic tiled region (``_tiling``) cannot do this: its
per-chunk autograd would hold the logits' gradient beside the logits and make one weight
gradient per chunk; here the weight's gradient is accumulated into one buffer.

NOTE [Tiled LM head]
  Rule 1. The loss is torch's ``cross_entropy`` of ``linear(hidden, weight, bias).float()``
          with ``ignore_index``: ``"mean"`` divides the sum over the tokens by the number of
          tokens not ignored in the whole call (the global count, not a per-chunk one), so
          every chunk's tokens weigh alike; ``"sum"`` does not divide. No token counted: the
          mean is ``nan``, as torch's.
  Rule 2. The inputs are saved before any chunk runs (NOTE [Tiled regions], Rule 2): an outer
          checkpoint's recompute that needs nothing after them stops there. Besides them, the
          node keeps each token's log-sum-exp (one float per token, by plain reference), so
          backward needs no second pass over the vocabulary.
  Rule 3. Backward per chunk: the logits are remade, and ``softmax - one_hot`` times the
          token's weight is written over them (in float32); the hidden states' gradient is that
          times the weight, the weight's is accumulated into one buffer (``addmm_``, in the
          weight's dtype), the bias's summed. This is autograd's arithmetic in another order:
          the gradients agree with the untiled ``cross_entropy`` to rounding (tolerance in
          ``tests/test_tiled_recipes.py``), not bitwise.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import _compat
from ._errors import describe_value, internal_error
from ._options import Tiling

__all__ = ["tiled_lm_head_loss"]

_API: Final = "checkpointing.tiled_lm_head_loss"
_MSG_SHAPES = (
    "checkpointing.tiled_lm_head_loss: {what}. Expected hidden of shape (..., hidden_size), "
    "labels of shape (...) (the same leading dimensions, already shifted for next-token "
    "prediction) and a head of shape (vocab_size, hidden_size); got hidden {hidden}, labels "
    "{labels}, head {head}. Fix: pass the decoder's last hidden states, the shifted labels and "
    "the model's lm_head."
)
_MSG_REDUCTION = (
    "checkpointing.tiled_lm_head_loss: reduction must be 'mean' or 'sum', got {got!r}. (A "
    "per-token loss would be as large as the labels; for it, tile a function that returns "
    "per-token losses with checkpointing.tiled.)"
)


def tiled_lm_head_loss(
    hidden: torch.Tensor,
    head: nn.Linear | torch.Tensor,
    labels: torch.Tensor,
    *,
    chunks: int | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """``cross_entropy(head(hidden).float(), labels)`` without ever making all the logits.

    Runs chunk by chunk over the tokens, in forward and in backward (NOTE [Tiled LM head]): at
    most one chunk's logits (``chunk x vocab``) live at a time. ``labels`` are the targets of
    each position (already shifted), ``ignore_index`` marks those without one; ``"mean"``
    divides by the tokens counted in the whole call.

    Args:
        hidden: the last hidden states, ``(..., hidden_size)``.
        head: the LM head (an ``nn.Linear``, bias allowed) or its weight ``(vocab, hidden)``.
        labels: integer targets with ``hidden``'s leading shape.
        chunks: how many chunks of tokens, or ``chunk_size`` tokens per chunk (default: 8
            chunks).
        ignore_index: the label of positions without a target.
        reduction: ``"mean"`` (over the counted tokens) or ``"sum"``.

    Example:
        >>> import torch, checkpointing
        >>> head = torch.nn.Linear(16, 100, bias=False)
        >>> hidden = torch.randn(2, 32, 16, requires_grad=True)
        >>> labels = torch.randint(0, 100, (2, 32))
        >>> loss = checkpointing.tiled_lm_head_loss(hidden, head, labels, chunks=4)
        >>> loss.backward()
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(_MSG_REDUCTION.format(got=reduction))
    weight = head.weight if isinstance(head, nn.Linear) else head
    bias = head.bias if isinstance(head, nn.Linear) else None
    _check_shapes(hidden, weight, labels)
    if chunks is None and chunk_size is None:
        chunks = 8
    tiling = Tiling(dim=0, chunks=chunks, chunk_size=chunk_size)
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    run = _HeadRun(tiling.bounds(flat.shape[0]), ignore_index, reduction == "mean")
    if not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in (flat, weight, bias)
    ):
        with torch.no_grad():
            return run.forward(flat, weight, bias, targets)
    run.saved = _compat.save_inputs([flat, weight, bias, targets])  # Rule 2
    run.targets = targets
    if bias is None:
        out: torch.Tensor = _HeadNode.apply(run, flat, weight)  # type: ignore[no-untyped-call]  # untyped
    else:
        out = _HeadNode.apply(run, flat, weight, bias)  # type: ignore[no-untyped-call]  # untyped
    return out


def _check_shapes(hidden: Any, weight: Any, labels: Any) -> None:
    def fail(what: str) -> None:
        raise ValueError(
            _MSG_SHAPES.format(
                what=what,
                hidden=describe_value(hidden),
                labels=describe_value(labels),
                head=describe_value(weight),
            )
        )

    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels)):
        fail("hidden, labels and the head's weight must be tensors")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        fail("the head's weight must be (vocab, hidden) with hidden's last size")
    if labels.shape != hidden.shape[:-1]:
        fail("labels must have hidden's leading shape")
    if labels.is_floating_point() or labels.is_complex():
        fail("labels must be integers")


class _HeadNode(torch.autograd.Function):
    """The autograd node of one call: forward and backward chunk by chunk (Rules 2 and 3)."""

    @staticmethod
    def forward(ctx: Any, run: _HeadRun, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        flat, weight = tensors[0], tensors[1]
        bias = tensors[2] if len(tensors) > 2 else None
        targets, run.targets = run.targets, None  # the saved copy is for backward
        if targets is None:
            internal_error("the LM head's labels did not reach its forward")
        return run.forward(flat, weight, bias, targets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        run: _HeadRun = ctx.run
        flat, weight, bias, targets = _compat.unpack_inputs(run.saved)
        needs = ctx.needs_input_grad
        grads = run.backward(
            grad, flat, weight, bias, targets, needs[1], needs[2], len(needs) > 3 and needs[3]
        )
        return (None, *grads[: len(needs) - 1])


class _HeadRun:
    """One call: its chunks, the per-token log-sum-exp and the count of tokens (Rule 1)."""

    def __init__(self, bounds: list[tuple[int, int]], ignore_index: int, mean: bool) -> None:
        self.bounds = bounds
        self.ignore_index = ignore_index
        self.mean = mean
        self.saved: list[Any] = []
        self.targets: torch.Tensor | None = None  # the labels, from the call to the forward
        self.lse: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def logits(
        self,
        flat: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        start: int,
        size: int,
    ) -> torch.Tensor:
        return F.linear(flat.narrow(0, start, size), weight, bias).float()

    def forward(
        self,
        flat: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """The loss, chunk by chunk; keeps each token's log-sum-exp (Rule 2)."""
        valid = targets != self.ignore_index
        safe = targets.masked_fill(~valid, 0)
        lse = torch.empty(targets.shape, dtype=torch.float32, device=flat.device)
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for start, size in self.bounds:
            logits = self.logits(flat, weight, bias, start, size)
            rows = lse.narrow(0, start, size)
            torch.logsumexp(logits, dim=-1, out=rows)
            picked = logits.gather(1, safe.narrow(0, start, size).unsqueeze(1)).squeeze(1)
            del logits
            total += ((rows - picked) * valid.narrow(0, start, size)).sum()
        self.lse = lse
        self.count = valid.sum()
        return total / self.count if self.mean else total

    def backward(
        self,
        grad: torch.Tensor,
        flat: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        want_hidden: bool,
        want_weight: bool,
        want_bias: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Remake each chunk's logits once and turn them into their gradient (Rule 3)."""
        lse, count = self.lse, self.count
        if lse is None or count is None:
            internal_error("the LM head's backward ran before its forward")
        scale = grad.float() / count if self.mean else grad.float()
        valid = targets != self.ignore_index
        safe = targets.masked_fill(~valid, 0)
        weights = valid * scale  # each token's share of the loss's gradient
        d_hidden = torch.empty_like(flat) if want_hidden else None
        d_weight: torch.Tensor | None = None
        d_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if want_bias and bias is not None else None
        )
        for start, size in self.bounds:
            probs = self.logits(flat, weight, bias, start, size)
            probs.sub_(lse.narrow(0, start, size).unsqueeze(1)).exp_()
            rows = torch.arange(size, device=probs.device)
            probs[rows, safe.narrow(0, start, size)] -= 1.0
            probs.mul_(weights.narrow(0, start, size).unsqueeze(1))
            if d_bias is not None:
                d_bias += probs.sum(0)
            g = probs.to(weight.dtype)
            del probs
            if d_hidden is not None:
                torch.mm(g, weight, out=d_hidden.narrow(0, start, size))
            if want_weight:
                h = flat.narrow(0, start, size)
                if d_weight is None:
                    d_weight = g.t().mm(h)
                else:
                    d_weight.addmm_(g.t(), h)
            del g
        if want_weight and d_weight is None:
            d_weight = torch.zeros_like(weight)
        out_bias = d_bias.to(bias.dtype) if d_bias is not None and bias is not None else None
        return d_hidden, d_weight, out_bias
