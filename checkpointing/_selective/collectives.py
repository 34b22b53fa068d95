"""Collectives under selective checkpointing: which ops they are, and the ranks' agreement.

Owns the collective rule of selective checkpointing: which ops are functional collectives
(``is_collective``) and the one-time check that the ranks of a process group agree on keeping
or recomputing each of them (``agree``). Keeping them is the forward mode's job (through Rule
12's flag, which ``ops._facts`` sets for collectives too); here only what makes them special.

NOTE [Collectives under selective checkpointing]
  Rule 1. A functional collective (the ops of ``torch.ops._c10d_functional`` and
          ``_c10d_functional_autograd`` but ``_wrap_tensor_autograd``, ``wait_tensor``
          included, and ``_dtensor.shard_dim_alltoall``: what
          ``torch.distributed._functional_collectives``, DTensor and tensor parallelism run) is
          kept whatever the policy answers unless the answer is ``MUST_RECOMPUTE``, as an op
          with an ordered effect is (NOTE [Selective checkpoint cache], Rule 12), for two
          reasons of its own. (a) A recompute runs the collective again in backward, where
          every rank of its group must run it too, in the same order: a rank that kept it
          never does, so the ranks that recompute it wait until the group's timeout, and the
          ones that kept it may pair their next collective with the wrong partner (wrong
          gradients, no error). (b) Running it again costs a second round of communication in
          backward, where the gradient collectives already are; keeping it costs its output's
          bytes, which the report shows (``SavedTensorsReport.collective_bytes``). torch
          differs: 2.15 exempts the ``c10d`` namespace from its ordered-effect rule, and every
          release recomputes a collective its policy does not keep. Under a tracing compiler
          the node is tagged MUST_SAVE (Rule 9 there tags it as Rule 12 says), unchecked.
  Rule 2. The first time a process meets a collective op on a process group inside a selective
          region run eagerly, every rank of the group writes to the default group's key-value
          store whether it keeps or recomputes that op, and reads the others' answers; if they
          differ, every rank raises a ``CheckpointError`` naming the op, the group and which
          ranks recompute it. The store is out of band: the check issues no collective, so a
          rank that never joins it cannot pair it with one of its own. It is asked once per
          (group, op) and process, not per call: a few store round trips per kind of
          collective. What it cannot see: a policy whose answer for a later call of the op
          differs on some ranks only (it reads rank-local state besides the op and its
          arguments): answer for collectives by op alone. A rank that never runs the op in a
          selective region leaves the others waiting for its answer (``AGREEMENT_TIMEOUT``),
          then they raise saying so: the ranks of a group must checkpoint alike. A group of one
          rank is never asked; a group destroyed and made again under the same name is not
          asked again (every call looks up only its group's name and op).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final

import torch

from .. import _compat
from .._compat import OpOverload
from .._errors import CheckpointError

_NAMESPACES: Final = frozenset({"_c10d_functional", "_c10d_functional_autograd"})
# In the functional namespace, but no communication: it only wraps a result for autograd.
_NOT_COLLECTIVE: Final = frozenset({"_wrap_tensor_autograd"})
_OTHER_COLLECTIVES: Final = frozenset({("_dtensor", "shard_dim_alltoall")})
# How long a rank waits for the other ranks' answers (Rule 2): past it, some rank of the group
# did not run this collective in a selective region (or died), and waiting longer would hang.
AGREEMENT_TIMEOUT: Final = timedelta(seconds=60)
_KEY: Final = "checkpointing/collective/{group}/{op}/{rank}"

_MSG_DISAGREE = (
    "selective checkpointing: the ranks of process group {group!r} disagree on whether to "
    "recompute the collective {op} in backward: rank(s) {recompute} recompute it (the policy "
    "answered MUST_RECOMPUTE), rank(s) {keep} keep it. A collective recomputed on some ranks only "
    "hangs those ranks in backward and gives the others wrong gradients. Fix: give every rank "
    "the same answer for collectives: MUST_RECOMPUTE on all of them, or any other answer (a "
    "collective is kept unless the policy answers MUST_RECOMPUTE; see the distributed page of "
    "the docs, 'Collectives under a selective policy')."
)
_MSG_ABSENT = (
    "selective checkpointing: rank(s) {absent} of process group {group!r} did not say within "
    "{seconds:.0f} s whether they keep or recompute the collective {op}, which this rank ran "
    "inside a selective checkpoint region (every rank of a group checks once that they agree, "
    "so that no rank recomputes a collective the others kept). Fix: checkpoint the same regions "
    "with a selective policy on every rank of the group (or see whether those ranks failed)."
)


def is_collective(func: object) -> bool:
    """Whether ``func`` is a functional collective or its wait (Rule 1)."""
    namespace = getattr(func, "namespace", None)
    if namespace is None:
        return False
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", None)
    if namespace in _NAMESPACES:
        return name not in _NOT_COLLECTIVE
    return (namespace, name) in _OTHER_COLLECTIVES


# Rule 2: the (group name, op id) pairs this process has checked (the ops are held by
# ``ops._op_facts``, so their ids stay theirs). Looked up on every call of a collective in a
# selective region, so nothing else is worked out before it: a group destroyed and made again
# under the same name is not checked again.
_agreed: set[tuple[str, int]] = set()
# Per op id, the position of its ``group_name`` argument (None: it has none).
_group_index: dict[int, int | None] = {}


def agree(func: object, args: tuple[Any, ...], kwargs: dict[str, Any], recompute: bool) -> None:
    """Rule 2: at the first call of the collective ``func`` on its group in this process, check
    that every rank of the group keeps it, or every rank recomputes it."""
    group_name = _group_name(func, args, kwargs)
    if group_name is None:
        return  # ``wait_tensor`` names no group: it follows its collective
    key = (group_name, id(func))
    if key in _agreed:
        return
    _agreed.add(key)
    ranks = torch.distributed.get_process_group_ranks(_compat.process_group_named(group_name))
    if len(ranks) > 1:
        _check(str(func), group_name, ranks, recompute)


def _check(op: str, group: str, ranks: Sequence[int], recompute: bool) -> None:
    """Rule 2's exchange: this rank's answer to the store, then every rank's."""
    store = _compat.default_store()
    me = torch.distributed.get_rank()
    keys = {rank: _KEY.format(group=group, op=op, rank=rank) for rank in ranks}
    store.set(keys[me], b"1" if recompute else b"0")
    others = [rank for rank in ranks if rank != me]
    try:
        store.wait([keys[rank] for rank in others], AGREEMENT_TIMEOUT)
    except RuntimeError as error:  # the store's timeout (a DistStoreError, a RuntimeError)
        absent = [rank for rank in others if not store.check([keys[rank]])]
        raise CheckpointError(
            _MSG_ABSENT.format(
                absent=_listed(absent),
                group=group,
                seconds=AGREEMENT_TIMEOUT.total_seconds(),
                op=op,
            )
        ) from error
    answers = {rank: store.get(keys[rank]) == b"1" for rank in others}
    answers[me] = recompute
    if len(set(answers.values())) > 1:
        raise CheckpointError(
            _MSG_DISAGREE.format(
                group=group,
                op=op,
                recompute=_listed(sorted(r for r, again in answers.items() if again)),
                keep=_listed(sorted(r for r, again in answers.items() if not again)),
            )
        )


def _group_name(func: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The ``group_name`` argument of a collective's call, or None (``wait_tensor``)."""
    index = _group_index.get(id(func), -1)
    if index == -1:
        found = _compat.argument_index(func, "group_name") if type(func) is OpOverload else None
        index = _group_index[id(func)] = found  # ``func`` is held by ``ops._op_facts``
    if index is None:
        return None
    name = args[index] if len(args) > index else kwargs.get("group_name")
    return name if isinstance(name, str) else None


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
