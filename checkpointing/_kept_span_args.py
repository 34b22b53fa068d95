"""A kept span's arguments: which of its tensors are theirs, and whether it wrote them.

Owns what ``_keep`` needs to know about the tensor arguments of ``keep(fn, *args)``: the tensors
among them (``tensor_leaves``), whether a tensor the span saves or returns is one of them or a
view of one (``recipe_for``), how the replay rebuilds such a tensor from its own arguments
(``rebuild``), and the check that the span did not write them in place (``ArgumentVersions``).
The spans themselves, their hooks and the replay belong to ``_keep``; the rules are its NOTE
[Kept spans] (Rules 2, 3 and 9).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch

from . import _compat
from ._errors import CheckpointError

__all__ = [
    "ArgumentVersions",
    "Recipe",
    "rebuild",
    "recipe_for",
    "storage_ranges",
    "tensor_leaves",
]

_PLAIN: Final = (torch.Tensor, torch.nn.Parameter)

# How the replay rebuilds a tensor from the span's arguments: (argument index, None) for the
# argument itself, (index, size, stride, storage offset relative to the argument's) for a view.
Recipe = tuple[int, tuple[int, ...] | None, tuple[int, ...], int]

_MSG_ARGUMENT_WRITTEN = (
    "checkpointing.keep: the span {name} in {region} wrote its tensor argument #{index} "
    "({what}) in place (version {then} -> {now}). The replay in backward skips the span and "
    "cannot write the argument again, so the region's recompute would read it as it was "
    "before the span and give wrong gradients; checkpointing refuses. Fix: make the write out "
    "of place (nn.ReLU() instead of nn.ReLU(inplace=True), `t = t.relu()` instead of "
    "`t.relu_()`), clone the argument inside the span (keep(lambda t: fn(t.clone()), x)), or "
    "move the in-place operation out of the span."
)


def tensor_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among a span's arguments, positional then keyword, containers opened."""
    leaves: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            leaves.append(value)
        elif isinstance(value, tuple | list | dict):
            leaves.extend(t for t in _compat.tree_leaves(value) if isinstance(t, torch.Tensor))
    return leaves


def storage_ranges(leaves: list[torch.Tensor]) -> list[tuple[int, int] | None]:
    """Where each argument's storage lies in memory, to tell its views (NOTE [Kept spans],
    Rule 2)."""
    ranges: list[tuple[int, int] | None] = []
    for leaf in leaves:
        try:
            storage = leaf.untyped_storage()
            start = storage.data_ptr()
            ranges.append((start, start + storage.nbytes()) if start else None)
        except (RuntimeError, NotImplementedError, TypeError):  # a subclass without storage
            ranges.append(None)
    return ranges


def recipe_for(
    x: torch.Tensor, leaves: list[torch.Tensor], ranges: list[tuple[int, int] | None]
) -> Recipe | None:
    """How to rebuild ``x`` from the span's arguments, or None if it is not one of theirs."""
    for index, leaf in enumerate(leaves):
        if x is leaf:
            return (index, None, (), 0)
    if not ranges or type(x) not in _PLAIN or x.numel() == 0:
        return None
    pointer = x.data_ptr()
    for index, bounds in enumerate(ranges):
        if bounds is not None and bounds[0] <= pointer < bounds[1]:
            leaf = leaves[index]
            if leaf.dtype is not x.dtype or leaf.device != x.device:
                return None
            offset = int(x.storage_offset()) - int(leaf.storage_offset())
            return (index, tuple(x.shape), tuple(x.stride()), offset)
    return None


def rebuild(recipe: Recipe, leaves: list[torch.Tensor]) -> torch.Tensor:
    """The replay's tensor for ``recipe``: the argument itself, or the same view of it. The
    caller runs it inside the span's marker (NOTE [Kept spans], Rule 6)."""
    index, size, stride, offset = recipe
    leaf = leaves[index]
    if size is None:
        return leaf
    return leaf.detach().as_strided(size, stride, leaf.storage_offset() + offset)


class ArgumentVersions:
    """The version counters of a span's tensor arguments when it starts (NOTE [Kept spans],
    Rule 9): every in-place write through a tensor that shares an argument's storage by a
    view or a ``detach`` (metadata writes such as ``t_()`` and ``resize_()`` included) moves
    the counter, as autograd's own in-place checks rely on. An inference tensor has no
    counter, and cannot be written outside inference mode (where no span runs)."""

    __slots__ = ("versions",)

    def __init__(self, leaves: list[torch.Tensor]) -> None:
        self.versions = [_version(leaf) for leaf in leaves]

    def refuse_writes(
        self, leaves: list[torch.Tensor], name: str, region: Callable[[], str]
    ) -> None:
        """Raise if the span wrote one of ``leaves`` (the same list as at the start); ``region``
        names the region, asked only when raising (a span call must not pay for the label)."""
        for index, (leaf, then) in enumerate(zip(leaves, self.versions, strict=True)):
            now = _version(leaf)
            if now != then:
                what = f"shape {tuple(leaf.shape)}, dtype {leaf.dtype}"
                raise CheckpointError(
                    _MSG_ARGUMENT_WRITTEN.format(
                        name=name, region=region(), index=index, what=what, then=then, now=now
                    )
                )


def _version(tensor: torch.Tensor) -> int:
    """A tensor's version counter; -1 for an inference tensor, which has none."""
    if tensor.is_inference():
        return -1
    return int(tensor._version)
