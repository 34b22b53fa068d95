"""Ready-made tiled regions for the position-wise blocks of a transformer: ``tiled_mlp`` and
``tiled_experts``.

Owns which dimension and which inputs each block is tiled along, and the check that the module
is one the recipe fits. The mechanism is ``_tiling``'s (through ``checkpoint_module(module,
tile=...)``, so ``remove_checkpoint_module`` undoes a recipe); the LM head and its loss have a
recipe of their own (``_tiled_head``).

NOTE [Tiled recipes]
  Rule 1. An MLP (``Linear``-activation-``Linear``, SwiGLU's gate and up projections) maps each
          token alone: tiled along the tokens (``dim=1`` for ``(batch, tokens, hidden)``). A
          gated MLP written as Llama's is differentiated by hand (``_tiled_gated``, NOTE [Tiled
          gated MLP]); any other through the tiled region's per-chunk autograd.
  Rule 2. Experts take the routed tokens flattened, ``(tokens, hidden)``, with each token's
          routing (``top_k_index``, ``top_k_weights``, ``(tokens, k)``): tiled along dim 0,
          every positional input split (a token's expert choice travels with it). Routing
          computed per token, as top-k is, is position-wise; routing with a capacity (tokens
          dropped when an expert is full) is not, and must stay outside the experts.
"""

from __future__ import annotations

from torch import nn

from ._module import checkpoint_module
from ._options import Tiling

__all__ = ["tiled_experts", "tiled_mlp"]

_MSG_NOT_MODULE = (
    "checkpointing.{api}: expected an nn.Module ({what}), got {got}. Fix: pass the module "
    "itself, e.g. {example}."
)


def tiled_mlp(
    mlp: nn.Module,
    chunks: int | None = 8,
    *,
    chunk_size: int | None = None,
    dim: int = 1,
    preserve_rng_state: bool = True,
    debug: bool = False,
) -> nn.Module:
    """Checkpoint ``mlp`` as a sequence-tiled region: its forward and recompute run over
    ``chunks`` chunks of tokens (NOTE [Tiled recipes], Rule 1), so its wide intermediate lives
    one chunk at a time. A gated MLP written as Llama's (``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))``, ``nn.Linear`` projections, no module hooks) has its backward written by hand:
    no recompute of its output, each chunk's intermediates freed as soon as they are read.
    Returns ``mlp``; ``remove_checkpoint_module(mlp)`` undoes it.

    Example:
        >>> import torch, checkpointing
        >>> mlp = torch.nn.Sequential(
        ...     torch.nn.Linear(8, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8)
        ... )
        >>> _ = checkpointing.tiled_mlp(mlp, chunks=4)
        >>> mlp(torch.randn(2, 16, 8)).sum().backward()
    """
    if not isinstance(mlp, nn.Module):
        raise TypeError(
            _MSG_NOT_MODULE.format(
                api="tiled_mlp", what="the MLP", got=type(mlp).__name__, example="layer.mlp"
            )
        )
    tile = Tiling(dim=dim, chunks=None if chunk_size else chunks, chunk_size=chunk_size)
    return checkpoint_module(mlp, tile=tile, preserve_rng_state=preserve_rng_state, debug=debug)


def tiled_experts(
    experts: nn.Module,
    chunks: int | None = 8,
    *,
    chunk_size: int | None = None,
    split: tuple[int, ...] = (0, 1, 2),
    preserve_rng_state: bool = True,
    debug: bool = False,
) -> nn.Module:
    """Checkpoint an MoE layer's experts as a region tiled over the routed tokens: called as
    ``experts(hidden, top_k_index, top_k_weights)`` (transformers' layout: one row per token),
    each chunk of tokens goes through its experts in turn, so the routed buffers live one chunk
    at a time (NOTE [Tiled recipes], Rule 2). ``split``: the positional inputs with one row
    per token. Returns ``experts``; ``remove_checkpoint_module(experts)`` undoes it.
    """
    if not isinstance(experts, nn.Module):
        raise TypeError(
            _MSG_NOT_MODULE.format(
                api="tiled_experts",
                what="the experts",
                got=type(experts).__name__,
                example="layer.mlp.experts",
            )
        )
    tile = Tiling(dim=0, chunks=None if chunk_size else chunks, chunk_size=chunk_size, split=split)
    return checkpoint_module(experts, tile=tile, preserve_rng_state=preserve_rng_state, debug=debug)
