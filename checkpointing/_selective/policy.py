"""The public policy surface of selective checkpointing: what a policy is asked and may answer.

Owns the parity names ``CheckpointPolicy`` and ``SelectiveCheckpointContext``; the ``Policy``,
``OpPolicy`` and ``OpPolicyBase`` kinds of policy; the memory planner's private answer
``SKIP_IN_REPLAY``; what an answer means (``_Action`` per call, and per op for an op-only policy
``_Plan``), checked by ``as_checkpoint_policy`` and its private twins; the list form
(``policy_from``); the registry of ``checkpointing.policies``' factories (``policy_factory``), so
that one passed uncalled is refused; and the ``checkpointing::tag`` op through which policies see
tensor names. Asking the policy and acting on its answers is ``forward``'s job; ready-made
policies live in ``checkpointing.policies``.

NOTE [Selective checkpoint cache] (Rules 1 and 2, on asking and answers; the package docstring
says where the others live)
  Rule 1. The policy is asked once per op of the original forward, after the op ran, with
          ``SelectiveCheckpointContext(is_recompute=False, op_output=out)``; recompute never
          asks (it replays what the forward decided). A policy whose answer depends on the op
          alone and says so (``OpPolicy``: it also has ``answer_for_op(op)``) is asked through
          ``answer_for_op`` once per op overload instead, at that op's first call (and about
          the tag op, once, to know whether recomputed outputs may take a tag's decision), and
          what its answer means for the op (Rules 8 and 10 included) is worked out then and
          remembered: per region, and for good when the policy is ours (``OpPolicyBase``). No
          context built, no call per op. ``tests/test_selective.py`` checks that this decides
          exactly as asking per call does.
  Rule 2. An answer is a ``CheckpointPolicy`` (ours, or torch's member of the same name) or a
          ``bool`` (True is MUST_SAVE, False is PREFER_RECOMPUTE); the memory planner's
          policies may also answer our private ``SKIP_IN_REPLAY`` (Rule 14), which the
          combinators of ``checkpointing.policies`` refuse like any other. Anything else is a
          ``CheckpointError`` naming the policy, the op and the value (torch silently
          recomputes). Not a ``TypeError``: tensor operators (``@``, ``+``, ...) turn a
          ``TypeError`` raised under them into ``NotImplemented``, and the user would read
          "unsupported operand type(s) for @" instead of our message.
"""

from __future__ import annotations

import abc
import enum
import inspect
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeAlias, TypeGuard, TypeVar

import torch
from torch.utils.checkpoint import CheckpointPolicy as _TorchCheckpointPolicy

from .._compat import HigherOrderOperator, OpOverload, OpOverloadPacket
from .._compression import Compress
from .._errors import CheckpointError, internal_error
from .._events import note_tag
from .ops import Op


class CheckpointPolicy(enum.Enum):
    """What selective checkpointing does with one op's output (parity with torch).

    - ``MUST_SAVE`` / ``PREFER_SAVE``: keep the output from the forward; recompute reuses it.
    - ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``: drop it; recompute runs the op again.
    - ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``: keep it in host memory and bring it back
      to its device for recompute (torch recomputes these in eager mode; we really offload).

    ``MUST_*`` asks a compiler (``torch.compile``'s partitioner) not to override the choice; in
    eager mode MUST and PREFER act the same. A member equals torch's member of the same name
    (and hashes alike), so a policy written against either enum works with either library.
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_CPU_OFFLOAD = 4
    PREFER_CPU_OFFLOAD = 5

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _TorchCheckpointPolicy):
            return self._name_ == other._name_
        return self is other

    def __hash__(self) -> int:
        return hash(self._name_)


class SelectiveCheckpointContext:
    """What a policy is told about the op it decides on (parity with torch).

    Attributes:
        is_recompute: always False: policies are asked only in the original forward, and
            recompute replays what they decided there; kept for compatibility.
        op_output: the op's output: a tensor, a tuple or list of them, or None (``tag``).
    """

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, *, is_recompute: bool, op_output: Any = None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output


class Policy(Protocol):
    """A selective-checkpoint policy: called once per op of the forward, after the op, with the
    op's arguments; returns what to do with its output (a ``CheckpointPolicy`` or a bool).

    A policy whose answer depends on the op alone (not on the context, the arguments or its
    earlier calls) can say so by also defining ``answer_for_op(op)`` with that same answer
    (``OpPolicy``); it is then asked once per op overload instead of once per op call.
    """

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | Compress | bool: ...


class OpPolicy(Policy, Protocol):
    """A ``Policy`` whose answer depends on the op alone: ``answer_for_op(op)`` gives, without
    arguments, what calling the policy for any call of ``op`` returns (NOTE [Selective
    checkpoint cache], Rule 1). Every policy of ``checkpointing.policies`` is one, except the
    name-based ones and combinations including them."""

    def answer_for_op(self, op: Op, /) -> CheckpointPolicy | Compress | bool: ...


class OpPolicyBase(abc.ABC):
    """Base of our op-only policies: calling one asks ``answer_for_op``; each instance holds
    what the forward mode worked out per op from its answers, for every region using it."""

    __slots__ = ("_op_plans",)

    def __init__(self) -> None:
        self._op_plans: dict[object, _OpPlan] = {}

    @abc.abstractmethod
    def answer_for_op(self, op: Op, /) -> CheckpointPolicy | Compress: ...

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Op, /, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | Compress:
        return self.answer_for_op(op)


def answers_by_op(policy: object) -> TypeGuard[OpPolicy]:
    """Whether ``policy`` says its answer depends on the op alone (has ``answer_for_op``)."""
    return callable(getattr(policy, "answer_for_op", None))


# --- Our factories, recognised when passed uncalled -------------------------------------------
# A factory of ``checkpointing.policies`` is callable, so "any callable" accepts ``save_matmuls``
# where ``save_matmuls()`` was meant, and the first forward then fails inside torch ("unsupported
# operand type(s) for @"). Each factory is registered here by identity, so that every API taking
# a policy can refuse exactly these functions and no user callable (torch accepts any callable;
# we stay a drop-in). Rejected: guessing from the signature (a user's ``*args`` policy matches).

_F = TypeVar("_F", bound=Callable[..., Any])
# id -> (the factory, its name and how to call it, for messages); holding the factory keeps its
# id its own.
_FACTORIES: Final[dict[int, tuple[Callable[..., Any], str, str]]] = {}


def policy_factory(factory: _F) -> _F:
    """Register ``factory`` as a policy factory of ours (see the comment above)."""
    name = factory.__name__
    call = f"{name}(...)" if inspect.signature(factory).parameters else f"{name}()"
    _FACTORIES[id(factory)] = (factory, name, call)
    return factory


def uncalled_factory(policy: object) -> tuple[str, str] | None:
    """The name of ``policy`` and how to call it (``"save_matmuls()"``) if it is one of our
    factories, else None."""
    found = _FACTORIES.get(id(policy))
    if found is None or found[0] is not policy:
        return None
    return found[1], found[2]


# --- The tag op: names that policies can see --------------------------------------------------

# torch.library's registration API is public but untyped in 2.13.
_LIBRARY = torch.library.Library("checkpointing", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIBRARY.define("tag(Tensor x, str name) -> ()")  # type: ignore[no-untyped-call]


def _tag_kernel(x: torch.Tensor, name: str) -> None:
    """Nothing to compute: the op exists so that dispatch modes (and policies) see the name."""


_LIBRARY.impl("tag", _tag_kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
TAG_OP: Final[OpOverload] = torch.ops.checkpointing.tag.default

_MSG_TAG_TENSOR = (
    "checkpointing.policies.tag: expected a torch.Tensor as the first argument, got {got!r} of "
    "type {type}. Fix: tag the tensor itself, e.g. `h = tag(h, 'attn_out')`."
)
_MSG_TAG_NAME = (
    "checkpointing.policies.tag: expected the name to be a str, got {got!r} of type {type}. "
    "Fix: pass the name policies will look for, e.g. `tag(h, 'attn_out')`."
)


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Name ``tensor`` for policies; returns ``tensor`` itself (no copy, no autograd node).

    The name is visible to policies as the op ``torch.ops.checkpointing.tag.default`` with
    arguments ``(tensor, name)``. ``save_only_these_names`` and ``offload_these_names`` keep
    tagged tensors; the decision is handed to the op that produced the tensor, so that op is not
    recomputed either (else the tensor would cost its memory and its recompute both). A maker
    that returned several tensors, wrote the tensor in place (itself or through a view) or drew
    random numbers cannot take it: the tag then keeps nothing, the tensor is recomputed with its
    maker, and a policy that keeps no tensor of that name in the region warns once. A tensor
    made outside the region (an input, a parameter) is there for backward anyway. Outside a
    selective checkpoint it costs one no-op dispatch.

    Example:
        >>> import functools, torch, checkpointing
        >>> from checkpointing.policies import as_context_fn, save_only_these_names, tag
        >>> def block(x, w):
        ...     return torch.relu(tag(x @ w, "proj")).sum()
        >>> x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
        >>> ctx = as_context_fn(save_only_these_names("proj"))
        >>> checkpointing.checkpoint(block, x, w, use_reentrant=False, context_fn=ctx).backward()
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(_MSG_TAG_TENSOR.format(got=tensor, type=type(tensor).__name__))
    if not isinstance(name, str):
        raise TypeError(_MSG_TAG_NAME.format(got=name, type=type(name).__name__))
    TAG_OP(tensor, name)
    if not _dynamo_compiling():  # a report built from the loss names the tensor's memory
        note_tag(tensor, name)
    return tensor


_dynamo_compiling: Final = torch.compiler.is_dynamo_compiling


# --- Actions and plans: what an answer means --------------------------------------------------


class ReplayAnswer(enum.Enum):
    """Answers of ours beyond torch's ``CheckpointPolicy``, for the memory planner only (not in
    the public namespace; policy combinators refuse them, Rule 2)."""

    SKIP_IN_REPLAY = enum.auto()
    """Run the op in forward and keep only its outputs' metadata; the replay hands out fresh
    uninitialized tensors of that metadata instead of running it (NOTE [Selective checkpoint
    cache], Rule 14, in ``skip``): for an op whose outputs backward never needs."""


SKIP_IN_REPLAY: Final = ReplayAnswer.SKIP_IN_REPLAY


class _Action(enum.Enum):
    """What the forward mode does with an output, once the policy's answer is understood."""

    RECOMPUTE = enum.auto()
    SAVE = enum.auto()
    OFFLOAD = enum.auto()
    PLACEHOLDER = enum.auto()  # Rule 14: keep the metadata, hand out blanks in the replay


_ACTIONS: Final[dict[object, _Action]] = {
    CheckpointPolicy.MUST_SAVE: _Action.SAVE,
    CheckpointPolicy.PREFER_SAVE: _Action.SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: _Action.RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: _Action.RECOMPUTE,
    CheckpointPolicy.MUST_CPU_OFFLOAD: _Action.OFFLOAD,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: _Action.OFFLOAD,
    True: _Action.SAVE,
    False: _Action.RECOMPUTE,
    SKIP_IN_REPLAY: _Action.PLACEHOLDER,
}
# Torch's members find ours in ``_ACTIONS`` (equal and same hash); an int must not find a bool.
_ANSWER_TYPES: Final = frozenset(
    {CheckpointPolicy, _TorchCheckpointPolicy, bool, ReplayAnswer, Compress}
)
# The same map keyed by identity, for the per-op path: every answer of an accepted type is one of
# these singletons, and ``id`` skips the Python-level ``__hash__`` of our members.
_ACTION_OF_ID: Final[dict[int, _Action]] = {
    **{id(member): _ACTIONS[member] for member in CheckpointPolicy},
    **{id(member): _ACTIONS[member] for member in _TorchCheckpointPolicy},
    id(True): _Action.SAVE,
    id(False): _Action.RECOMPUTE,
    id(SKIP_IN_REPLAY): _Action.PLACEHOLDER,
}


class _Plan(enum.Enum):
    """What the forward mode does with each call of an op (Rule 1: fixed per op for an
    op-only policy; ASK for any other policy)."""

    COUNT = enum.auto()  # keep nothing and note nothing: the call count is all (Rule 3)
    NOTE = enum.auto()  # keep nothing, note the output for a later tag (Rule 8)
    KEEP = enum.auto()  # keep every output as the op-only answer says (save or offload)
    CHECK = enum.auto()  # the op-only answer keeps, but the call decides: a tag hands its
    # decision over (Rule 8), an op with ``dropout_p`` may draw (Rule 10)
    ASK = enum.auto()  # ask the policy, then decide (Rules 2, 8, 10)


# What the forward mode does with a kept output: an action, or a ``Compress`` answer itself
# (NOTE [Compressed saves]), which keeps it compressed (and in host memory with ``offload``).
_Keep: TypeAlias = _Action | Compress
# An op-only policy's plan for one op, and the action of its answer.
_OpPlan: TypeAlias = tuple[_Plan, _Keep]


# --- Policies: answers, and the list form -----------------------------------------------------

_MSG_BAD_ANSWER = (
    "selective checkpoint (create_selective_checkpoint_contexts): the policy {policy!r} "
    "returned {answer!r} (type {type}) for op {op}; expected a CheckpointPolicy member or a "
    "bool. torch.utils.checkpoint would silently recompute this op; checkpointing refuses to "
    "guess. Fix: return a CheckpointPolicy for every op, e.g. end the policy with "
    "`return CheckpointPolicy.PREFER_RECOMPUTE`."
)


def _bad_answer(answer: object, policy: object, op: object) -> CheckpointError:
    """Rule 2: the error for an answer that is neither a ``CheckpointPolicy`` nor a bool."""
    return CheckpointError(
        _MSG_BAD_ANSWER.format(policy=policy, answer=answer, type=type(answer).__name__, op=op)
    )


def _action_of(answer: object, policy: object, op: object) -> _Keep:
    """Rule 2: map a policy's answer to an action, or explain why it is not one."""
    if type(answer) is Compress:
        return answer
    action = _ACTIONS.get(answer) if type(answer) in _ANSWER_TYPES else None
    if action is None:
        raise _bad_answer(answer, policy, op)
    return action


_POLICY_OF: Final[dict[object, CheckpointPolicy]] = {
    **{member: member for member in CheckpointPolicy},
    True: CheckpointPolicy.MUST_SAVE,
    False: CheckpointPolicy.PREFER_RECOMPUTE,
}


def as_checkpoint_policy(answer: object, policy: object, op: object) -> CheckpointPolicy | Compress:
    """Rule 2 for code that combines policies: the ``CheckpointPolicy`` an answer stands for
    (torch's members and bools included), a ``Compress`` answer as it is, or the
    ``CheckpointError`` saying why it is neither."""
    if type(answer) is Compress:
        return answer
    result = _POLICY_OF.get(answer) if type(answer) in _ANSWER_TYPES else None
    if result is None:
        raise _bad_answer(answer, policy, op)
    return result


def _as_torch_policy(answer: object) -> _TorchCheckpointPolicy:
    """Torch's member for an answer (the partitioner reads node metadata with torch's enum)."""
    if isinstance(answer, bool):
        return (
            _TorchCheckpointPolicy.MUST_SAVE if answer else _TorchCheckpointPolicy.PREFER_RECOMPUTE
        )
    if isinstance(answer, Compress):  # the partitioner keeps it, uncompressed
        return _TorchCheckpointPolicy.MUST_SAVE
    if not isinstance(answer, CheckpointPolicy | _TorchCheckpointPolicy):
        internal_error(f"{answer!r} reached _as_torch_policy without passing _action_of")
    return _TorchCheckpointPolicy[answer.name]


class _SaveListed(OpPolicyBase):
    """The list form of ``create_selective_checkpoint_contexts``: MUST_SAVE for the listed
    ops, PREFER_RECOMPUTE for every other op (parity with torch)."""

    __slots__ = ("ops",)

    def __init__(self, ops: frozenset[Op]) -> None:
        super().__init__()
        self.ops = ops

    def answer_for_op(self, op: Op, /) -> CheckpointPolicy:
        if op in self.ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"save_listed_ops({sorted(map(str, self.ops))})"


_MSG_NOT_AN_OP = (
    "Expected op in `op_list` to be an OpOverload but got: {op} of type {type}. "
    "(create_selective_checkpoint_contexts: a list means 'save these ops'; each element must be "
    "a torch.ops OpOverload such as torch.ops.aten.mm.default, or a HigherOrderOperator.) {hint}"
)
_HINT_PACKET = (
    "Please update the OpOverloadPacket to a specific OpOverload: for `{op}`, pass "
    "`{op}.default` (or the overload you mean)."
)
_MSG_NOT_A_POLICY = (
    "policy_fn_or_list must be either a function or a list of ops "
    "(create_selective_checkpoint_contexts got {got!r} of type {type}). Fix: pass a callable "
    "`policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`, or a list such as "
    "[torch.ops.aten.mm.default]."
)
_MSG_UNCALLED_FACTORY = (
    "create_selective_checkpoint_contexts: expected a policy (a callable "
    "`policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`) or a list of ops, got the policy "
    "factory checkpointing.policies.{name} itself, which makes a policy but is not one (the "
    "first forward would fail inside torch). Fix: call the factory, e.g. {call} rather than "
    "{name}."
)


def policy_from(policy_fn_or_list: object) -> Policy:
    """Validate the first argument of ``create_selective_checkpoint_contexts`` (torch's rules:
    a list of ops, or any callable, but not one of our factories uncalled)."""
    if isinstance(policy_fn_or_list, list):
        for op in policy_fn_or_list:
            if not isinstance(op, OpOverload | HigherOrderOperator):
                is_packet = isinstance(op, OpOverloadPacket)
                hint = _HINT_PACKET.format(op=op) if is_packet else ""
                raise ValueError(_MSG_NOT_AN_OP.format(op=op, type=type(op), hint=hint))
        return _SaveListed(frozenset(policy_fn_or_list))
    if callable(policy_fn_or_list):
        factory = uncalled_factory(policy_fn_or_list)
        if factory is not None:
            name, call = factory
            raise TypeError(_MSG_UNCALLED_FACTORY.format(name=name, call=call))
        policy: Policy = policy_fn_or_list
        return policy
    raise TypeError(
        _MSG_NOT_A_POLICY.format(got=policy_fn_or_list, type=type(policy_fn_or_list).__name__)
    )
