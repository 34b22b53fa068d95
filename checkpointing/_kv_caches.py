"""Ground floor: a Hugging Face key/value cache handed to a region that autograd records.

Owns ``is_cache`` (whether a value is a ``transformers`` ``Cache``, told without importing
``transformers``) and ``drop_caches``, the forward pre-hook that runs a region without the
caches it is handed while autograd records, as transformers' own layers run under their
checkpointing. The planner puts it on every planned region (while it profiles and times, and
from ``apply``); the transformers integration's budget plan calls it from its own hook. It
imports nothing of the package, so any floor may use it.

NOTE [Key/value caches]
  Rule 1. A checkpointed region must not receive a cache it writes: the frame keeps its inputs
          until backward, so the cache (and every key and value it holds, bytes no profile can
          see inside an opaque object) stays alive, and the recompute calls ``cache.update`` a
          second time, so the replay sees longer keys than the forward did and diverges. A
          decoder layer writes its cache; a Hugging Face model hands its layers one by default
          (``use_cache=True``), also in training.
  Rule 2. So while autograd records, every planned region, checkpointed or not, runs without
          the caches it is handed (positional or keyword arguments; ``use_cache`` then False).
          The profile, the timed candidates and the installed plan thus run the same ops; a
          region left plain drops its cache too, so the model never returns a cache that holds
          some layers and not others. Under ``no_grad`` (generation, evaluation) nothing is
          recorded, nothing is kept, and caches pass untouched. A planned layer therefore
          computes what it computes under ``use_cache=False`` (as under transformers' own
          checkpointing), not what the plain layer computes when it writes its keys into the
          empty cache and reads them back: that path may round otherwise on some CPUs, so
          bitwise equality holds against the ``use_cache=False`` run, whose layers are handed
          the same inputs.
  Rule 3. Dropping is exact only for an empty cache: a layer that writes its keys into an
          empty cache and reads them back computes what it computes without one. A cache that
          already holds positions (a prefix handed to a training step) would change the layer's
          output if dropped and break the recompute if kept, so the region refuses it with an
          error naming the fix; transformers' checkpointing drops it with a warning instead.
  Rule 4. A layer that declares ``_can_checkpoint_with_cache`` only reads its cache (the
          recompute reads the same states): transformers keeps it there, and so do we.
  Rule 5. A cache is recognised by its class: one of its classes (``__mro__``) is named
          ``Cache`` and defined in a module of the ``transformers`` package. The package is
          never imported for it: a model without transformers pays one attribute walk per
          argument.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["drop_caches", "dropping_caches", "is_cache"]

_MSG_FILLED = (
    "checkpointing: the planned region {region} was handed a transformers {cache} that already "
    "holds {length} positions while autograd records (argument {where}). A checkpointed region "
    "would keep it alive until backward and update it a second time when recomputed; dropping "
    "it would change the layer's output. Fix: train without "
    "a prefix cache (past_key_values=None, use_cache=False), or run the cached calls under "
    "torch.no_grad() (generation)."
)


def is_cache(value: object) -> bool:
    """Rule 5: whether ``value`` is a ``transformers`` key/value ``Cache``."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.split(".", 1)[0] == "transformers"
        for cls in type(value).__mro__
    )


def drop_caches(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Rules 2-4, as a forward pre-hook (``with_kwargs=True``, registered first): while grad is
    enabled, the call's empty caches become None and ``use_cache`` False; a filled one raises."""
    if not torch.is_grad_enabled() or getattr(module, "_can_checkpoint_with_cache", False):
        return None
    dropped = [str(i) for i, value in enumerate(args) if is_cache(value)]
    dropped += [name for name, value in kwargs.items() if is_cache(value)]
    if not dropped:
        return None
    for where in dropped:
        cache = args[int(where)] if where.isdigit() else kwargs[where]
        _check_empty(module, cache, where)
    new_args = tuple(None if is_cache(value) else value for value in args)
    new_kwargs = {name: None if is_cache(value) else value for name, value in kwargs.items()}
    if new_kwargs.get("use_cache"):
        new_kwargs["use_cache"] = False
    return new_args, new_kwargs


@contextlib.contextmanager
def dropping_caches(regions: Iterable[nn.Module]) -> Iterator[None]:
    """Rule 2 for a block that runs the model (the planner's profile): ``drop_caches`` first
    among each region's pre-hooks, taken off after."""
    handles = [
        module.register_forward_pre_hook(drop_caches, with_kwargs=True, prepend=True)
        for module in regions
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_empty(module: nn.Module, cache: Any, where: str) -> None:
    """Rule 3: ``cache`` holds no position (an unreadable length counts as some)."""
    try:
        length = int(cache.get_seq_length())
    except Exception:  # a Cache whose length cannot be read: refuse rather than guess
        length = -1
    if length != 0:
        raise ValueError(
            _MSG_FILLED.format(
                region=type(module).__qualname__,
                cache=type(cache).__qualname__,
                length="an unknown number of" if length < 0 else length,
                where=f"#{where}" if where.isdigit() else repr(where),
            )
        )
