"""The runs of joined regions a plan installs as one chain each (NOTE [Planner apply], Rule A4).

Owns the checks ``apply`` makes, before it installs anything, on the regions that
``RegionDecision.joined`` puts in one checkpoint frame: each joined region continues a
checkpointed one, every region of a run is checkpointed whole with the same draws, and no region
joins one whose frame ends at a trail. Installing a run belongs to ``installed``, the chain itself
to ``_chain``; the decisions to ``plan``, which this module reads by their fields only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn

from ..._errors import internal_error

__all__ = ["Run", "check_joined", "check_trails", "check_whole"]


class _Decision(Protocol):
    """What the checks read of a ``RegionDecision``."""

    @property
    def name(self) -> str: ...
    @property
    def checkpoint(self) -> bool: ...
    @property
    def save(self) -> tuple[tuple[str, int], ...]: ...
    @property
    def offload(self) -> tuple[tuple[str, int], ...]: ...
    @property
    def skip(self) -> tuple[tuple[str, int], ...]: ...
    @property
    def keep_draws(self) -> bool: ...


class _Span(Protocol):
    """What the checks read of a ``SpanDecision``."""

    @property
    def kind(self) -> str: ...
    @property
    def first(self) -> str: ...
    @property
    def last(self) -> str: ...


Run = list[tuple[nn.Module, Any, Any]]
"""One region alone, or a region and those joined to it: (module, ``context_fn``, decision)."""

_MSG_JOINED_ALONE = (
    "checkpointing.ActivationPlan.apply: region {name!r} is joined to the region before it in "
    "plan.regions (one checkpoint frame across both), but {before}. A joined region continues "
    "the frame of a region checkpointed whole or joined itself. Nothing was installed. Fix: set "
    '"joined": false for {name!r} in the plan\'s JSON (or checkpoint it), or re-plan.'
)
_MSG_JOINED_PART = (
    "checkpointing.ActivationPlan.apply: regions {names} are joined into one checkpoint frame, "
    "but {name!r} {what}. A joined run is checkpointed whole: its one frame recomputes every op "
    "of every region in it, with one policy for all. Nothing was installed. Fix: set "
    '"joined": false where the run should split, or re-plan.'
)
_MSG_JOINED_TRAIL = (
    "checkpointing.ActivationPlan.apply: region {name!r} ends its frame at the start of its "
    "child {child!r} (a 'trail' span), but region {next!r} is joined to it: the frame would end "
    'before the joined region runs. Nothing was installed. Fix: set "joined": false for '
    "{next!r} in the plan's JSON, or re-plan."
)


def check_joined(regions: Sequence[_Decision], index: int, runs: list[Run]) -> None:
    """A joined region is checkpointed and continues the run of the region before it."""
    region = regions[index]
    before = None if index == 0 else regions[index - 1]
    problem = (
        "it is the first region"
        if before is None
        else f"the region before it, {before.name!r}, is not checkpointed"
        if not before.checkpoint
        else "it is not checkpointed itself"
        if not region.checkpoint
        else None
    )
    if problem is not None:
        raise ValueError(_MSG_JOINED_ALONE.format(name=region.name, before=problem))
    if not runs or runs[-1][-1][2] is not before:
        internal_error("a joined region's run is not the last one")


def check_whole(run: Sequence[_Decision]) -> None:
    """Every region of a joined run is checkpointed whole, keeping draws alike."""
    names = ", ".join(repr(d.name) for d in run)
    for decision in run:
        what = (
            "keeps, offloads or skips ops of its own (save, offload, skip)"
            if decision.save or decision.offload or decision.skip
            else "keeps its draws where the others do not (keep_draws)"
            if decision.keep_draws != run[0].keep_draws
            else None
        )
        if what is not None:
            raise ValueError(_MSG_JOINED_PART.format(names=names, name=decision.name, what=what))


def check_trails(runs: list[Run], spans: Sequence[_Span]) -> None:
    """A region whose frame ends at a trail's start (Rule M13) has no region joined after it."""
    children = {span.first: span.last for span in spans if span.kind == "trail"}
    for run in runs:
        for (_, _, decision), (_, _, after) in itertools.pairwise(run):
            child = children.get(decision.name)
            if child is not None:
                raise ValueError(
                    _MSG_JOINED_TRAIL.format(name=decision.name, child=child, next=after.name)
                )
