"""The selective policy a planned region runs: its answer per (op, occurrence) (Rules M3, A1 and
S8).

Owns ``_RegionContexts`` (a region's ``context_fn``: the selective modes around a fresh keyed
policy per call, over the draws modes where it keeps its random draws, Rule S7), its pickling by
op names, and ``resolve_op``. Which answers a region gets is ``plan``'s business.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _compat
from ..._selective import (
    CheckpointPolicy,
    Op,
    ReplayAnswer,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)
from .draws import draw_contexts

__all__ = ["Answer", "resolve_op"]

_MSG_UNKNOWN_OP = (
    "checkpointing.ActivationPlan.from_json: unknown op {name!r} (expected a name like "
    "'aten.mm.default' that torch.ops resolves). Fix: load the plan with the torch version "
    "and custom-op libraries it was made with, or re-plan."
)

# What a planned region answers for one op call: torch's answers, or ours (Rule S8).
Answer = CheckpointPolicy | ReplayAnswer


class _KeyedPolicy:
    """One region call's selective policy: the decision for each (op, occurrence) (Rule M3).
    A fresh one per call of the region, so occurrences count from 0 in every forward."""

    __slots__ = ("counts", "decisions")

    def __init__(self, decisions: dict[tuple[Op, int], Answer]) -> None:
        self.decisions = decisions
        self.counts: dict[Op, int] = {}

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> Answer:
        index = self.counts.get(op, 0)
        self.counts[op] = index + 1
        return self.decisions.get((op, index), CheckpointPolicy.PREFER_RECOMPUTE)


class _RegionContexts:
    """The ``context_fn`` of one planned region: SAC modes around a fresh ``_KeyedPolicy``
    (where it keeps, offloads or skips, Rule S8), over the draws modes where it keeps its
    random draws (Rule S7). Pickled with the model (``torch.save``) by op names: torch's op
    objects do not pickle."""

    __slots__ = ("decisions", "keep_draws")

    def __init__(
        self, decisions: dict[tuple[Op, int], Answer], *, keep_draws: bool = False
    ) -> None:
        self.decisions = decisions
        self.keep_draws = keep_draws

    def __call__(self) -> tuple[Any, Any]:
        if not self.keep_draws:
            return self._selective()
        return draw_contexts(self._selective() if self.decisions else None)

    def _selective(self) -> tuple[Any, Any]:
        policy = _KeyedPolicy(self.decisions)
        # The public ``Policy`` protocol names torch's answers only; the modes take ours too
        # (SKIP_IN_REPLAY, NOTE [Selective checkpoint cache], Rule 2).
        return create_selective_checkpoint_contexts(policy)  # type: ignore[arg-type]  # see above

    def __reduce__(self) -> tuple[Any, ...]:
        named = [(str(op), index, policy) for (op, index), policy in self.decisions.items()]
        return _region_contexts_by_name, (named, self.keep_draws)


def _region_contexts_by_name(
    named: list[tuple[str, int, Answer]], keep_draws: bool = False
) -> _RegionContexts:
    """A pickled ``_RegionContexts`` back, its ops resolved by name."""
    return _RegionContexts(
        {(resolve_op(op), index): policy for op, index, policy in named}, keep_draws=keep_draws
    )


def resolve_op(name: str) -> Op:
    """The op named like ``aten.mm.default`` (what ``str(op)`` gives)."""
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.rpartition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        raise ValueError(_MSG_UNKNOWN_OP.format(name=name)) from None
    if not isinstance(op, _compat.OpOverload):
        raise ValueError(_MSG_UNKNOWN_OP.format(name=name))
    return op
