"""The forward mode of selective checkpointing: runs each op, asks the policy, fills the cache.

Owns ``_CachingMode`` (the first context of ``create_selective_checkpoint_contexts``): per op it
works out, or recalls, what the policy's answer means (``_plan_for``), keeps what the answer says
(``cache._keep``; for a skip, the metadata, where ``skip.may_skip`` allows it), hands a kept
tag's decision to the tensor's producer, and under a tracing compiler tags the traced nodes
instead of deciding. What answers mean is ``policy``'s, the facts it reads per op ``ops``', the
entries it makes ``cache``'s; replaying them is ``recompute``'s.

NOTE [Selective checkpoint cache] (Rules 8, 9 and 11, on the forward mode; the package docstring
says where the others live)
  Rule 8. A kept ``tag(x, name)`` hands its decision to the op that produced ``x``: that op's
          slot gets ``x`` (saved or offloaded, as the tag's answer says) and the tag itself is
          recomputed, which is free. This needs the producer to have run out of place in this
          region, returned ``x`` alone, been marked for recompute, not be random (Rule 10),
          and ``x`` to be unchanged since; otherwise the tag keeps nothing and ``x`` follows
          its producer's decision (Rule 15 says so when the policy names the tag). Without
          the hand-over, eager recompute would re-run the producer anyway, so a named tensor
          would cost its memory and its recompute both.
  Rule 9. Under a tracing compiler (a proxy mode is active, as in AOTAutograd), every output is
          cached and the traced nodes are tagged with the policy (as torch's enum) and
          ``ac_graph_id``, as torch does, so that the partitioner decides. A kept tag tags its
          tensor's producer too (Rule 8's hand-over, for the partitioner). An offload answer is
          tagged as torch's SAC tags it (the partitioner keeps the output on the device) and
          said once (NOTE [Compiled regions], Rule 3).
  Rule 11. Dynamo never traces the modes' ``__torch_dispatch__`` nor what it calls (a policy,
          the op's own Python kernels). This matters when a ``torch.compile``d function runs
          inside a region and breaks its graph: the eager ops between its graphs reach our
          modes with dynamo's frame hook set, and dynamo would compile our dispatch code.
          Torch keeps it out with a wrapper around every mode's ``__torch_dispatch__`` (a
          Python call and two eval-frame switches per op); ours opt out of the wrapper and mark
          the code objects once instead (``_compat.skip_dynamo_in_code``), same protection,
          no cost per op. Under AOTAutograd tracing (Rule 9) dynamo's hook is already off.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import torch
from torch.utils.checkpoint import CheckpointPolicy as _TorchCheckpointPolicy

from .. import _compat
from .._compiled import say_once
from .._compression import COMPARING_OPS, Compress, refuse_exact_op
from .._errors import CheckpointError, internal_error
from .._state import span_depth as _span_depth
from .._trees import StorageKey, storage_key
from .cache import _Blank, _Cache, _CacheMode, _Entry, _keep, _OpRecord, _save_traced
from .collectives import agree, is_collective
from .ops import (
    _ALWAYS,
    _IGNORED,
    _INDUCTOR_CODE,
    SAC_IGNORED_OPS,
    Op,
    _draws_at,
    _facts,
    _region_key,
    _runner,
    _runners,
)
from .policy import (
    _ACTION_OF_ID,
    _ANSWER_TYPES,
    SKIP_IN_REPLAY,
    TAG_OP,
    CheckpointPolicy,
    OpPolicy,
    Policy,
    SelectiveCheckpointContext,
    _Action,
    _action_of,
    _as_torch_policy,
    _bad_answer,
    _Keep,
    _OpPlan,
    _Plan,
    answers_by_op,
)
from .routing import RANKING_IDS, ROUTING_IDS, copy_outputs, keeps_routing
from .skip import may_skip
from .unkept import Makers, Unkept, asked_of, cause_of, note_makers, say_random

_proxy_mode: Final = _compat.proxy_mode

_ASK: Final[_OpPlan] = (_Plan.ASK, _Action.RECOMPUTE)
# Plan members as module constants for the per-op path: reading an ``Enum`` member through its
# class costs ~50 ns, a global ~10 ns.
_PLAN_COUNT: Final = _Plan.COUNT
_PLAN_KEEP: Final = _Plan.KEEP
_PLAN_ASK: Final = _Plan.ASK
_PLACEHOLDER: Final = _Action.PLACEHOLDER
_OFFLOAD: Final = _Action.OFFLOAD
_dispatch_mode_depth: Final = _compat.dispatch_mode_depth
_ROUTING_IDS: Final = ROUTING_IDS
_RANKING_IDS: Final = RANKING_IDS

# Rule 12: the answers that keep an op with an ordered effect all the same (every "recompute"
# answer except MUST_RECOMPUTE, and Rule 14's skip), by identity; and, under a tracing compiler,
# torch's tags that stay as they are.
_PREFERS_RECOMPUTE: Final = frozenset(
    {
        id(CheckpointPolicy.PREFER_RECOMPUTE),
        id(_TorchCheckpointPolicy.PREFER_RECOMPUTE),
        id(False),
        id(SKIP_IN_REPLAY),
    }
)
_SAVE_OR_REPLAY: Final = frozenset(
    {
        _TorchCheckpointPolicy.MUST_SAVE,
        _TorchCheckpointPolicy.PREFER_SAVE,
        _TorchCheckpointPolicy.MUST_RECOMPUTE,
    }
)
_MSG_COMPARED_WITH_COMPRESSED = (
    "selective checkpoint: the policy keeps the output of {op} exactly, and its input is kept "
    "compressed; {op}'s backward finds its winners by comparing that input with the kept "
    "result, and the restored input equals none of them (the gradient would be lost). Fix: let "
    "{op} be recomputed (do not keep it), so that it runs on the restored input, or keep its "
    "input exactly."
)
_MSG_HOOKS_BYPASSED = (
    "A saved_tensors_hooks context (e.g. save_on_cpu) is active around a selective activation "
    "checkpoint region. Tensors that SAC saves currently bypass these hooks, but a future "
    "release will route them through the hooks like any other saved tensor. Silence this "
    "warning and choose the behavior explicitly by passing respect_saved_tensors_hooks=True|False "
    "to checkpointing.checkpoint (or checkpointing.checkpoint_module / checkpoint_wrapper)."
)


# Where the output of a recompute-marked op sits in the cache, for a later tag (Rule 8): a weak
# reference to the output, its record and call index, and its version then. A tuple, not a
# class: one is made per recomputed op of every forward that may keep a tag.
_Producer: TypeAlias = tuple[weakref.ref[torch.Tensor], _OpRecord, int, int]


class _CachingMode(_CacheMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Forward: runs each op, asks the policy, caches what it keeps (Rules 1-5, 7-9, 14)."""

    def __init__(self, policy: Policy, cache: _Cache) -> None:
        # No super().__init__(), like torch's own SAC modes: the base's __enter__ creates what
        # it needs, and a pair of modes is built for every checkpoint call.
        self.policy = policy
        self.cache = cache
        # Set by torch.compile's activation-checkpoint lowering (Rule 9).
        self.ac_graph_id: int | None = None
        # Set by the checkpoint that enters this mode (Rule 13).
        self.respect_saved_tensors_hooks: bool | None = None
        self._producers: dict[int, _Producer] = {}
        # Rule 9: the nodes each traced output came from, for a later tag (made when tracing).
        self._traced: dict[int, tuple[weakref.ref[torch.Tensor], list[Any]]] | None = None
        # Rule 1: an op-only policy's plans by op id (kept on the policy when it is ours).
        self._plans: dict[int, _OpPlan] | None = None
        self._by_op: OpPolicy | None = None
        # Rule 15: what the policy names for keeping, and what this region could not keep of
        # it; the makers that cannot take a tag are noted only when it names tensors.
        asked = asked_of(policy)
        self._asked_ops = asked.ops
        self._asked_names = asked.names
        self._makers: Makers | None = {} if asked.names else None
        self._unkept: Unkept | None = None
        self._routing = keeps_routing(policy)  # NOTE [Routing ops]
        # NOTE [Compressed saves], Rule 4: the outputs kept compressed so far, by storage (a
        # view of one is one too; made at the first one: regions that compress nothing never
        # look).
        self._compressed: dict[StorageKey, weakref.ref[torch.Tensor]] | None = None
        if answers_by_op(policy):
            self._by_op = policy
            plans: dict[int, _OpPlan] | None = getattr(policy, "_op_plans", None)
            self._plans = {} if plans is None else plans

    @_compat.skip_dynamo_in_code  # Rule 11
    def __torch_dispatch__(
        self,
        func: Op,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # The hot path: one call per op of every selectively checkpointed forward.
        if kwargs is None:
            kwargs = {}
        # A tracer's mode would be below this one (active modes are counted without it).
        if _dispatch_mode_depth() and _proxy_mode() is not None and _compat.proxy_tracing_active():
            return self._dispatch_traced(func, args, kwargs)
        op_id = id(func)
        if op_id in _IGNORED.ids or _span_depth():  # a kept span's op: NOTE [Kept spans], Rule 6
            return func(*args, **kwargs)
        out = (_runners.get(op_id) or _runner(func))(*args, **kwargs)
        key = op_id if func is not _INDUCTOR_CODE else _region_key(func, args)
        plans = self._plans
        if plans is not None:
            op_plan = plans.get(op_id)
            if op_plan is None:
                op_plan = self._learn_plan(func, plans)
            if op_plan[0] is _PLAN_COUNT:  # Rule 3: a count is all that recompute needs
                counts = self.cache.counts
                counts[key] = counts.get(key, 0) + 1
                return out
        else:
            op_plan = _ASK
        records = self.cache.records
        record = records.get(key)
        if record is None:
            record = records[key] = _OpRecord(op_plan, _facts(func))
        index = record.calls
        record.calls = index + 1
        if op_plan[0] is _PLAN_KEEP:
            record.keep(index, self._entry(out, op_plan[1], func, args))
            return out
        return self._decide(func, args, kwargs, out, record, index)

    def _decide(
        self,
        func: Op,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        record: _OpRecord,
        index: int,
    ) -> Any:
        """Rules 1, 2, 8, 10 and 14 for one call: ask the policy (unless its answer for the op
        is known), keep or hand over what it says, note producers for later tags."""
        action = record.action
        if record.plan is _PLAN_ASK:
            ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
            answer = self.policy(ctx, func, *args, **kwargs)
            # Rule 2, inline: answers are singletons (enum members, bools): identity finds them.
            asked = _ACTION_OF_ID.get(id(answer)) if type(answer) in _ANSWER_TYPES else None
            if asked is not None:
                action = asked
            elif isinstance(answer, Compress):
                refuse_exact_op("Compress", func)  # NOTE [Compressed saves], Rule 4
                action = answer
            else:
                raise _bad_answer(answer, self.policy, func)
            if record.effect and id(answer) in _PREFERS_RECOMPUTE:
                action = _Action.SAVE  # Rule 12
        if record.effect and is_collective(func):  # NOTE [Collectives under selective ...]
            agree(func, args, kwargs, action is _Action.RECOMPUTE)
        draw_rule = record.draw_rule
        random = draw_rule == _ALWAYS or (draw_rule >= 0 and _draws_at(draw_rule, args, kwargs))
        if action is _PLACEHOLDER and (
            func is TAG_OP or not record.pure or not may_skip(func, args, kwargs, out)
        ):
            action = _Action.RECOMPUTE  # Rule 14: a blank could be wrong here (random: below)
        if action is not _Action.RECOMPUTE and func is not TAG_OP and not random:
            if action is _Action.SAVE and self._routing and id(func) in _ROUTING_IDS:
                self._keep_routing(func, args, out, record, index)
            else:
                entry = (
                    _Blank(out) if action is _PLACEHOLDER else self._entry(out, action, func, args)
                )
                record.keep(index, entry)
            if self._makers is not None and type(out) is torch.Tensor:
                self._makers.pop(id(out), None)  # Rule 15: kept, so a tag of it keeps it
        elif func is TAG_OP:
            if action is not _Action.RECOMPUTE:
                self._tag(args, kwargs, action)
        else:
            if random and self._asked_ops and action not in (_Action.RECOMPUTE, _PLACEHOLDER):
                self._note_random(func, record)  # Rule 15 (b)
            if record.pure and not random and type(out) is torch.Tensor:
                self._producers[id(out)] = (weakref.ref(out), record, index, out._version)
            elif self._makers is not None:  # Rule 15 (c)
                note_makers(self._makers, func, out, record.pure, random)
        return out

    def _keep_routing(
        self, func: Op, args: tuple[Any, ...], out: Any, record: _OpRecord, index: int
    ) -> None:
        """NOTE [Routing ops], Rules 2 and 3: keep a copy of a routing op's outputs and, for a
        ranking op, hand the save over to the maker of the scores it ranked."""
        record.keep(index, self._entry(copy_outputs(out), _Action.SAVE, func))
        if id(func) in _RANKING_IDS and args and isinstance(args[0], torch.Tensor):
            self._hand_over(args[0], _Action.SAVE)

    def _tag(self, args: tuple[Any, ...], kwargs: dict[str, Any], action: _Keep) -> None:
        """A kept tag: Rule 8's hand-over, and Rule 15 (c)'s note when its name was named."""
        tensor = args[0] if args else kwargs["x"]
        name = args[1] if len(args) > 1 else kwargs["name"]
        kept = self._hand_over(tensor, action, name)
        makers = self._makers
        if makers is None:
            return
        if name not in self._asked_names:
            return
        unkept = self._unkept
        if unkept is None:
            unkept = self._unkept = Unkept()
        if kept:
            unkept.kept_names.add(name)
            return
        cause = cause_of(makers, tensor)
        if cause is not None:
            unkept.refused_names.setdefault(name, cause)

    def _note_random(self, func: Op, record: _OpRecord) -> None:
        """Rule 15 (b): a random call of an op the policy names was answered with a keep."""
        if func in self._asked_ops:
            unkept = self._unkept
            if unkept is None:
                unkept = self._unkept = Unkept()
            unkept.random_ops[func] = record

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's base is untyped
        unkept = self._unkept
        if unkept is not None and exc[0] is None:  # Rule 15: the region's verdict
            self._unkept = None
            unkept.say(self.policy)

    def _learn_plan(self, func: Op, plans: dict[int, _OpPlan]) -> _OpPlan:
        """Rule 1: ask the op-only policy about ``func`` once, and remember its plan."""
        policy = self._by_op
        if policy is None:
            internal_error("an op plan was asked for a policy that answers per call")
        op_plan = plans[id(func)] = _plan_for(policy, func, plans)
        return op_plan

    def _hand_over(self, tensor: torch.Tensor, action: _Keep, name: object = None) -> bool:
        """Rule 8: give a kept tag's decision to the op that produced ``tensor``, if allowed;
        whether it was."""
        producer = self._producers.pop(id(tensor), None)
        if producer is None:
            return False
        ref, record, index, version = producer
        if ref() is not tensor or tensor._version != version:
            return False
        record.keep(index, self._entry(tensor, action, f"the tensor tagged {name!r}"))
        return True

    def _entry(self, out: Any, action: _Keep, op: object, args: tuple[Any, ...] = ()) -> _Entry:
        """The cache entry for ``out`` (made by ``op`` from ``args``) under a keep ``action``
        (Rule 13 for saves; NOTE [Compressed saves], Rule 4, where anything is compressed)."""
        if self._compressed is not None and op in COMPARING_OPS:
            self._refuse_compressed_input(op, args)
        hooks = self._hooks_for_saves() if action is _Action.SAVE else None
        entry = _keep(out, action, self.offload_stats, hooks, self.cache, op)
        if type(action) is Compress:
            compressed = self._compressed
            if compressed is None:
                compressed = self._compressed = {}
            for tensor in out if isinstance(out, tuple | list) else (out,):
                key = storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
                if key is not None:
                    compressed[key] = weakref.ref(tensor)
        return entry

    def _refuse_compressed_input(self, op: object, args: tuple[Any, ...]) -> None:
        """NOTE [Compressed saves], Rule 4: ``op`` compares its input with its result in
        backward; kept exactly while its input is kept compressed, the restored input would
        equal no kept result."""
        compressed = self._compressed or {}
        for arg in args:
            key = storage_key(arg) if isinstance(arg, torch.Tensor) else None
            ref = compressed.get(key) if key is not None else None
            kept = ref() if ref is not None else None
            if kept is not None and storage_key(kept) == key:  # alive: not a reused address
                raise CheckpointError(_MSG_COMPARED_WITH_COMPRESSED.format(op=op))

    def _hooks_for_saves(self) -> _compat.HookPair | None:
        """Rule 13: the user's saved-tensors hooks a save goes through, or None; warns when
        they are active and the checkpoint did not say whether to respect them."""
        hooks = _compat.user_saved_tensors_hooks()
        if hooks is None:
            return None
        respect = self.respect_saved_tensors_hooks
        if respect is None:
            # stacklevel 4: past this method, _entry and __torch_dispatch__, to the op's caller
            warnings.warn(_MSG_HOOKS_BYPASSED, FutureWarning, stacklevel=4)
        return hooks if respect else None

    def _dispatch_traced(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Rule 9: what torch does under AOTAutograd tracing, so the partitioner decides."""
        if self.ac_graph_id is not None:  # torch 2.11 sets the id itself and gives us none
            _compat.set_traced_node_meta("ac_graph_id", self.ac_graph_id)
        _compat.set_traced_node_meta("recompute", _TorchCheckpointPolicy.PREFER_RECOMPUTE)
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        count_before = _compat.traced_node_count()
        out = func(*args, **kwargs)
        key = _region_key(func, args)
        record = self.cache.records.get(key)
        if record is None:
            record = self.cache.records[key] = _OpRecord(_ASK, _facts(func))
        index = record.calls
        record.calls = index + 1
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        answer = self.policy(ctx, func, *args, **kwargs)
        action = _action_of(answer, self.policy, func)
        if action is _PLACEHOLDER:  # Rule 14: the partitioner decides what to recompute
            answer, action = CheckpointPolicy.PREFER_RECOMPUTE, _Action.RECOMPUTE
        tag = _as_torch_policy(answer)
        if action is _Action.OFFLOAD:
            say_once("offload")  # the partitioner keeps it on the device (NOTE [Compiled regions])
        elif type(action) is Compress:
            say_once("compress")
        if record.effect and tag not in _SAVE_OR_REPLAY:  # Rule 12, as torch 2.15 tags it
            tag = _TorchCheckpointPolicy.MUST_SAVE
        nodes = _compat.traced_nodes_since(count_before)
        for node in nodes:
            node.meta["recompute"] = tag
        traced = self._traced
        if traced is None:
            traced = self._traced = {}
        if func is TAG_OP:
            found = traced.get(id(args[0]))
            if action is not _Action.RECOMPUTE and found is not None and found[0]() is args[0]:
                for node in found[1]:  # Rule 8 for the partitioner: the producer is kept
                    node.meta["recompute"] = tag
        elif isinstance(out, torch.Tensor):
            traced[id(out)] = (weakref.ref(out), nodes)
        record.keep(index, _save_traced(out))
        return out


def _plan_for(policy: OpPolicy, func: Op, plans: dict[int, _OpPlan]) -> _OpPlan:
    """Rule 1: what an op-only policy's answer for ``func`` means for every call of it."""
    answer = policy.answer_for_op(func)
    action = _action_of(answer, policy, func)
    _, draw_rule, pure, effect = _facts(func)
    if effect and id(answer) in _PREFERS_RECOMPUTE:
        action = _Action.SAVE  # Rule 12
    if type(action) is Compress:
        refuse_exact_op("Compress", func)  # NOTE [Compressed saves], Rule 4
    if draw_rule == _ALWAYS:
        keeps = action is not _Action.RECOMPUTE and action is not _PLACEHOLDER
        if keeps and func in asked_of(policy).ops:
            say_random(policy, func)  # Rule 15 (b): no call of it will ever be kept
        return _Plan.COUNT, _Action.RECOMPUTE  # Rule 10: a random op is never kept
    if func is TAG_OP or draw_rule >= 0 or action is _PLACEHOLDER or effect:
        return _Plan.CHECK, action  # Rules 8, 10, 14; collectives: agree (in _decide)
    if action is _Action.SAVE and id(func) in _ROUTING_IDS and keeps_routing(policy):
        return _Plan.CHECK, action  # NOTE [Routing ops], Rules 2 and 3
    if action is not _Action.RECOMPUTE:
        return _Plan.KEEP, action
    if pure and (_tags_may_keep(policy, plans) or keeps_routing(policy)):
        return _Plan.NOTE, action  # Rule 8: its output may take a later decision
    return _Plan.COUNT, action


def _tags_may_keep(policy: OpPolicy, plans: dict[int, _OpPlan]) -> bool:
    """Whether an op-only policy keeps tags (else no output needs a producer note, Rule 8).
    An invalid answer for the tag op is left for a tag's first call to report (Rule 2)."""
    op_plan = plans.get(id(TAG_OP))
    if op_plan is None:
        try:
            op_plan = plans[id(TAG_OP)] = _plan_for(policy, TAG_OP, plans)
        except CheckpointError:
            return True
    return op_plan[1] is not _Action.RECOMPUTE and op_plan[1] is not _PLACEHOLDER
