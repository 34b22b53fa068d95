"""The objects behind the readable policies of ``checkpointing.policies``.

``checkpointing.policies`` holds the public sentences (``save_matmuls()``, ``either(...)``, ...)
with their documentation and argument checks; each returns one of the small classes here: a
constant answer, an answer by op set, an answer by tensor name, and the combination of several
policies in the keep order. They give a readable repr, say what they name for keeping
(``unkept``), and those whose answer depends on the op alone say so with ``answer_for_op``, so
that they are asked once per op overload (NOTE [Selective checkpoint cache], Rule 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from .._compression import Compress
from .ops import Op
from .policy import (
    TAG_OP,
    CheckpointPolicy,
    OpPolicy,
    OpPolicyBase,
    Policy,
    SelectiveCheckpointContext,
    answers_by_op,
    as_checkpoint_policy,
)
from .unkept import NOTHING_ASKED, Asked, asked_of

# The keep order of ``checkpointing.policies``' docstring: a higher rank keeps more. The ranks
# are spaced so that compressed answers fit between them: a ``Compress`` keeps less than the
# exact keep at its place and more than the level below it, a finer format ranks higher (fp8
# per tensor < fp8 per row < int8 < bf16 < fp16)::
#
#     PREFER_RECOMPUTE < MUST_RECOMPUTE < Compress(offload=True) < PREFER_CPU_OFFLOAD
#                      < MUST_CPU_OFFLOAD < Compress() < PREFER_SAVE < MUST_SAVE
#
# A chain (a total order on answers), so ``either`` (its maximum) and ``both`` (its minimum) keep
# their lattice laws with compressed answers (``tests/test_compression.py``).
_RANK: Final[dict[CheckpointPolicy, int]] = {
    CheckpointPolicy.PREFER_RECOMPUTE: 0,
    CheckpointPolicy.MUST_RECOMPUTE: 10,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: 20,
    CheckpointPolicy.MUST_CPU_OFFLOAD: 30,
    CheckpointPolicy.PREFER_SAVE: 40,
    CheckpointPolicy.MUST_SAVE: 50,
}
_COMPRESSED_BELOW: Final = {True: 20, False: 40}  # by ``offload``: the exact keep above it
_Answer = CheckpointPolicy | Compress
_Pick = Callable[..., _Answer]  # max or min, by ``keep_rank``


def keep_rank(answer: _Answer) -> int:
    """Where ``answer`` sits in the keep order (a higher rank keeps more)."""
    if isinstance(answer, Compress):
        return _COMPRESSED_BELOW[answer.offload] - 9 + answer.rank
    return _RANK[answer]


# --- The policy objects (small classes: a readable repr; those whose answer depends on the op
# alone say so with ``answer_for_op``, and are asked once per op overload) ---------------------


class _Constant(OpPolicyBase):
    """The same answer for every op."""

    __slots__ = ("_answer", "_name")

    def __init__(self, answer: CheckpointPolicy, name: str) -> None:
        super().__init__()
        self._answer = answer
        self._name = name

    def answer_for_op(self, op: Op, /) -> CheckpointPolicy:
        return self._answer

    def __repr__(self) -> str:
        return f"{self._name}()"


class _ByOp(OpPolicyBase):
    """``hit`` for the ops in a set, ``miss`` for every other op."""

    __slots__ = ("_asked_to_keep", "_hit", "_keeps_routing", "_miss", "_ops", "_repr")

    def __init__(
        self,
        ops: frozenset[Op],
        hit: CheckpointPolicy,
        miss: CheckpointPolicy,
        description: str,
        asked: Asked = NOTHING_ASKED,
        routing: bool = False,
    ) -> None:
        super().__init__()
        self._ops = ops
        self._hit = hit
        self._miss = miss
        self._repr = description
        self._asked_to_keep = asked  # what it names for keeping (``_selective.unkept``)
        # Whether its saves of routing ops keep the routing (``save_routing``: NOTE [Routing
        # ops], read by the forward mode).
        self._keeps_routing = routing

    def answer_for_op(self, op: Op, /) -> CheckpointPolicy:
        return self._hit if op in self._ops else self._miss

    def __repr__(self) -> str:
        return self._repr


class _ByName:
    """``hit`` for ``tag`` ops whose name is in a set, PREFER_RECOMPUTE for every other op
    (the answer depends on the tag's name argument: asked for every op)."""

    __slots__ = ("_asked_to_keep", "_hit", "_names", "_repr")

    def __init__(self, names: frozenset[str], hit: CheckpointPolicy, description: str) -> None:
        self._names = names
        self._hit = hit
        self._repr = description
        self._asked_to_keep = Asked(frozenset(), names)

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy:
        if op is TAG_OP and len(args) > 1 and args[1] in self._names:
            return self._hit
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return self._repr


class _Combined:
    """The answer of highest (``either``) or lowest (``both``) rank among several policies."""

    __slots__ = ("_asked_to_keep", "_keeps_routing", "_pick", "_policies", "_repr")

    def __init__(self, policies: tuple[Policy, ...], pick: _Pick, name: str) -> None:
        self._policies = policies
        self._pick = pick
        self._repr = f"{name}({', '.join(map(repr, policies))})"
        self._asked_to_keep = _asked_by_all(policies, pick)
        self._keeps_routing = _keeps_routing(policies)

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> _Answer:
        answers = [
            as_checkpoint_policy(policy(ctx, op, *args, **kwargs), policy, op)
            for policy in self._policies
        ]
        return self._pick(answers, key=keep_rank)

    def __repr__(self) -> str:
        return self._repr


class _CombinedByOp(OpPolicyBase):
    """``_Combined`` of policies that all answer by op alone: itself answers by op alone."""

    __slots__ = ("_asked_to_keep", "_keeps_routing", "_pick", "_policies", "_repr")

    def __init__(self, policies: tuple[OpPolicy, ...], pick: _Pick, name: str) -> None:
        super().__init__()
        self._policies = policies
        self._pick = pick
        self._repr = f"{name}({', '.join(map(repr, policies))})"
        self._asked_to_keep = _asked_by_all(policies, pick)
        self._keeps_routing = _keeps_routing(policies)

    def answer_for_op(self, op: Op, /) -> _Answer:
        answers = [
            as_checkpoint_policy(policy.answer_for_op(op), policy, op) for policy in self._policies
        ]
        return self._pick(answers, key=keep_rank)

    def __repr__(self) -> str:
        return self._repr


def _keeps_routing(policies: Iterable[object]) -> bool:
    """Whether any of ``policies`` keeps routing as ``save_routing`` does (NOTE [Routing ops])."""
    return any(getattr(policy, "_keeps_routing", False) for policy in policies)


def _asked_by_all(policies: Iterable[object], pick: _Pick) -> Asked:
    """What a combination names for keeping: ``either`` (``max``) what any of its policies
    names, ``both`` what all of them name (``_selective.unkept``)."""
    asked = [asked_of(policy) for policy in policies]
    if pick is max:
        return Asked(
            frozenset().union(*(a.ops for a in asked)),
            frozenset().union(*(a.names for a in asked)),
        )
    return Asked(
        frozenset.intersection(*(a.ops for a in asked)),
        frozenset.intersection(*(a.names for a in asked)),
    )


def _combined(policies: tuple[Policy, ...], pick: _Pick, name: str) -> Policy:
    """``either``/``both`` of ``policies``: op-only when every one of them is."""
    by_op = tuple(policy for policy in policies if answers_by_op(policy))
    if len(by_op) == len(policies):
        return _CombinedByOp(by_op, pick, name)
    return _Combined(policies, pick, name)
