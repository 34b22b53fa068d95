"""A kept span's record: what the forward of one span leaves for the replay.

Owns ``Span`` (held by the frame that the span ran in, one per span, in forward order) and the
span's outputs as the replay will be served them (``hold_outputs``, ``held_outputs``). Below both
the frame (``_frame``, which holds spans and releases those its replay cannot reach) and the
spans themselves (``_keep``, which makes them in forward and skips them in the replay), so that
each imports this module and neither the other's. The rules are NOTE [Kept spans] in ``_keep``
(Rules 2-5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._kept_span_args import Recipe, recipe_for

__all__ = ["Held", "Span", "held_outputs", "hold_outputs", "map_tensors"]


class Span:
    """What the forward of one span left for the replay (NOTE [Kept spans], Rules 2-5)."""

    __slots__ = (
        "label",
        "name",
        "outputs",
        "released",
        "rng_after",
        "routed",
        "start",
        "state_after",
    )

    def __init__(self, name: str, start: int) -> None:
        self.name = name
        self.label: str | None = None  # how a watching report names it (None: none watches)
        self.start = start  # holders the frame had when the span began (Rule 3)
        self.routed: list[Recipe] = []  # saved arguments, in the order they were saved
        self.outputs: Any = None  # the span's return value, tensors as ``Held``
        self.released = False
        self.rng_after: tuple[torch.Tensor | None, list[torch.Tensor]] | None = None
        self.state_after: tuple[Any, ...] | None = None

    def release(self) -> None:
        """The replay will not reach this span (Rule 3): drop what only it would use."""
        self.outputs = None
        self.rng_after = None
        self.state_after = None
        self.released = True


class Held:
    """One tensor output of a span, as the replay will be served it (Rule 3): a detached alias
    and the version it had when the span returned, or a recipe to rebuild it from the replay's
    arguments (``alias`` None)."""

    __slots__ = ("alias", "recipe", "requires_grad", "version")

    def __init__(
        self,
        alias: torch.Tensor | None,
        recipe: Recipe | None,
        requires_grad: bool,
        version: int,
    ) -> None:
        self.alias = alias
        self.recipe = recipe
        self.requires_grad = requires_grad
        self.version = version


def hold_outputs(
    span: Span,
    outputs: Any,
    leaves: list[torch.Tensor],
    ranges: list[tuple[int, int] | None],
) -> None:
    """Rule 3: aliases of the outputs (or recipes for those that are the arguments' views)."""

    def hold(value: torch.Tensor) -> Held:
        recipe = recipe_for(value, leaves, ranges) if leaves else None
        if recipe is not None:
            return Held(None, recipe, value.requires_grad, -1)
        return Held(value.detach(), None, value.requires_grad, value._version)

    span.outputs = map_tensors(outputs, hold)


def held_outputs(span: Span) -> list[torch.Tensor]:
    """The outputs ``span`` holds for the replay (not those rebuilt from its arguments)."""
    found: list[torch.Tensor] = []

    def collect(held: Held) -> Held:
        if held.alias is not None:
            found.append(held.alias)
        return held

    map_tensors(span.outputs, collect, Held)
    return found


def map_tensors(value: Any, fn: Callable[[Any], Any], leaf: type = torch.Tensor) -> Any:
    """``value`` with every ``leaf`` inside tuples, named tuples, lists and dicts mapped by
    ``fn`` (other objects are left as they are)."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, tuple):
        mapped = [map_tensors(item, fn, leaf) for item in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, list):
        return [map_tensors(item, fn, leaf) for item in value]
    if isinstance(value, dict):
        return type(value)((key, map_tensors(item, fn, leaf)) for key, item in value.items())
    return value
