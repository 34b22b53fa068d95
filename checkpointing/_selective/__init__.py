"""Selective activation checkpointing (SAC): which op outputs a checkpointed region keeps.

Owns the parity names ``CheckpointPolicy``, ``SelectiveCheckpointContext``, ``SAC_IGNORED_OPS``
and ``create_selective_checkpoint_contexts``; our ``OffloadStats`` and the ``Policy`` protocol;
the ``checkpointing::tag`` op through which policies see tensor names; and below them the two
dispatch modes (the forward one asks the policy and fills the cache, the recompute one replays
from it), the cache entries (a saved alias, a host copy) and, for the memory planner only, the
private answer ``SKIP_IN_REPLAY`` with the taint that makes a wrong skip an error. Entering the
modes around forward and recompute is the frame's job (``_frame``, through ``context_fn``);
ready-made policies live in ``policies`` (the objects they return in ``readable``). This front
door only re-exports: what the rest of ``checkpointing`` and the tests import from
``checkpointing._selective``.

One concept per module; each imports only from the ones listed before it:

- ``collectives``: the collective rule: which ops are functional collectives, and the ranks'
  one-time agreement on keeping or recomputing each (NOTE [Collectives under selective
  checkpointing]).
- ``ops``: facts about an op, worked out at its first call and shared by both modes: the ``Op``
  type, ``SAC_IGNORED_OPS``, ``draws_random``, ordered effects (collectives too), runners,
  region keys.
- ``policy``: the public policy surface: ``CheckpointPolicy``, ``SelectiveCheckpointContext``,
  ``Policy`` / ``OpPolicy`` / ``OpPolicyBase``, what an answer means (the planner's private
  ``SKIP_IN_REPLAY`` included), the list form, the tag op.
- ``cache``: what a region keeps: ``OffloadStats``, the entries and host copies, the records.
- ``compressing``: ``compress_ops`` and ``compress_these_names``, and ``keep_rank``, the keep
  order with ``Compress`` answers (the codec is ``checkpointing._compression``'s).
- ``unkept``: what a policy names to keep and could not keep: ``Asked``, the once-only warning.
- ``readable``: the objects behind ``checkpointing.policies``' sentences: a constant answer,
  an answer by op set or by tensor name, and combinations in the keep order.
- ``skip``: skipping ops in the replay: when a call may be skipped, and the replay's taint.
- ``alternating``: ``TorchtitanOp``, torchtitan's "op" policy (every second matmul), and NOTE
  [Per-region policies]: a policy that counts is copied fresh for each region call.
- ``forward``: the forward (caching) mode.
- ``recompute``: the recompute (cached) mode.
- ``contexts``: ``create_selective_checkpoint_contexts``, which builds the pair.

Where this departs from the obvious split, and why: ``_Action`` (what an answer does with one
output) and ``_Plan`` (what an op-only policy's answer does with every call of an op) live in
``policy``, not with the cache or the modes: they are the meaning of an answer, the cache's
records and both modes read them, and ``OpPolicyBase`` holds plans, so the module below the
cache is the one place they fit without an import cycle. ``Op`` lives in ``ops``, the bottom
module, for the same reason. The constructor has a module of its own because it is the only code
that knows both modes, and keeping it out of this file keeps the front door a list of names.

NOTE [Selective checkpoint cache] is one NOTE whose numbered rules sit with the module that owns
them (the numbers are unchanged, so "See NOTE [Selective checkpoint cache], Rule k" holds):
  Rule 1 (``policy``): the policy is asked once per op of the forward, never in recompute; an
          op-only policy once per op overload.
  Rule 2 (``policy``): an answer is a ``CheckpointPolicy`` or a bool, else a ``CheckpointError``.
  Rule 3 (``cache``): entries are keyed by op and call index; only kept calls have one.
  Rule 4 (``ops``): ``SAC_IGNORED_OPS`` are neither counted nor cached.
  Rule 5 (``cache``): a saved entry is version-checked when handed out.
  Rule 6 (``recompute``): an entry is handed out once; a second backward raises, except for
  regions whose forward ran under ``split_backward()`` (every pass over the graph is served).
  Rule 7 (``cache``): offload keeps a host copy (a host tensor as an alias).
  Rule 8 (``forward``): a kept tag hands its decision to the op that produced the tensor.
  Rule 9 (``forward``): under a tracing compiler every output is cached and the nodes tagged.
  Rule 10 (``ops``): random ops are recomputed whatever the policy answers.
  Rule 11 (``forward``): dynamo never traces the modes' ``__torch_dispatch__``.
  Rule 12 (``ops``): an op with an ordered side effect is kept unless told MUST_RECOMPUTE;
          so is a functional collective (``collectives``: NOTE [Collectives under selective
          checkpointing], a NOTE of its own).
  Rule 13 (``cache``): saves bypass the user's saved-tensors hooks unless the checkpoint asks.
  Rule 14 (``skip``): a call answered SKIP_IN_REPLAY is replayed by blanks; a needed one raises.
  Rule 15 (``unkept``): a policy that names something to keep and keeps none of it says so once.
"""

from __future__ import annotations

from .._offload import OffloadStats
from .cache import _CONSUMED as _CONSUMED
from .collectives import is_collective
from .contexts import create_selective_checkpoint_contexts
from .ops import SAC_IGNORED_OPS, Op, draws_random
from .policy import (
    SKIP_IN_REPLAY,
    TAG_OP,
    CheckpointPolicy,
    OpPolicy,
    OpPolicyBase,
    Policy,
    ReplayAnswer,
    SelectiveCheckpointContext,
    answers_by_op,
    as_checkpoint_policy,
    policy_factory,
    policy_from,
    tag,
    uncalled_factory,
)
from .recompute import split_backward
from .skip import may_skip, reads_values, replay_taint
from .unkept import NOTHING_ASKED, Asked, asked_of, is_composite, never_dispatched, say_composite

__all__ = [
    "NOTHING_ASKED",
    "SAC_IGNORED_OPS",
    "SKIP_IN_REPLAY",
    "TAG_OP",
    "Asked",
    "CheckpointPolicy",
    "OffloadStats",
    "Op",
    "OpPolicy",
    "OpPolicyBase",
    "Policy",
    "ReplayAnswer",
    "SelectiveCheckpointContext",
    "answers_by_op",
    "as_checkpoint_policy",
    "asked_of",
    "create_selective_checkpoint_contexts",
    "draws_random",
    "is_collective",
    "is_composite",
    "may_skip",
    "never_dispatched",
    "policy_factory",
    "policy_from",
    "reads_values",
    "replay_taint",
    "say_composite",
    "split_backward",
    "tag",
    "uncalled_factory",
]
