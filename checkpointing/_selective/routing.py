"""Routing ops: the calls that decide where a mixture-of-experts layer sends each token.

Owns ``ROUTING_OPS`` (what ``policies.save_routing()`` keeps), ``RANKING_OPS`` (the routing ops
whose first input holds the scores they rank), ``copy_outputs`` (the private copy a kept
routing output is made of) and ``keeps_routing`` (whether a policy asks for the rules below).
The forward mode (``forward``) applies them when such a policy saves one of these ops; the
recompute mode hands the copies out like any saved entry.

A mixture-of-experts router ranks scores (``topk``, ``sort``, ``argmax``, ``kthvalue``), counts
the tokens each expert receives (``bincount``, ``histc``) and finds each expert's tokens
(``nonzero``, which ``torch.where(mask)`` runs). When the recompute of a checkpointed layer
computes the scores differently (another reduction order, a counter that moved, jitter noise
outside the RNG), it routes differently: tensor shapes change (a ``CheckpointError`` at best) or
the same shapes hold other tokens (a wrong gradient). Keeping these ops' outputs replays the
forward's routing whatever the second run computes.

NOTE [Routing ops] (selective checkpointing; the numbers are cited as "NOTE [Routing ops]")
  Rule 1. ``ROUTING_OPS`` are the functional overloads of the ops above that reach a dispatch
          mode (``argsort`` and ``one_hot`` decompose into ``sort`` and a scatter first);
          ``save_routing()`` answers MUST_SAVE for them and PREFER_RECOMPUTE for the rest.
          ``cumsum`` is left out: recomputed from kept counts it gives the same offsets, and
          elsewhere (state-space models) it runs over whole activations.
  Rule 2. Under a policy that keeps routing (``save_routing()``, alone or in ``either`` /
          ``both``: it says so with ``_keeps_routing``, read by ``keeps_routing``), a routing
          op that the policy's answer saves is kept as a private copy of its outputs, not as
          an alias: routers normalise the top-k values in place (``router_top_value /=
          router_top_value.sum(...)`` in Hugging Face's Mixtral and Qwen2-MoE), and an alias
          would fail the cache's mutation check (NOTE [Selective checkpoint cache], Rule 5)
          or, allowed, be divided twice. The copy is what the op returned; the recompute runs
          the in-place step on it again, as the forward did.
  Rule 3. There, a saved ranking op keeps the scores it ranked too: the tensor passed as its
          first input, when the region made it by a recomputed op (Rule 8's hand-over, as for
          a kept tag; the forward mode notes the makers of every output for it). Backward
          through the routing weights (``softmax``'s backward reads its output) then reads
          the forward's scores, so gradients equal the run without checkpointing even when
          the router computes other scores the second time. Scores made outside the region,
          or by an op that cannot take the hand-over (it returned several tensors, drew random
          numbers, or they were changed in place since), are not kept by this rule; the
          routing itself still is (Rule 2). Other policies that save these ops (``save_ops``,
          the planner's) keep them as any op, an alias and nothing more: what they keep is
          what they priced.
  Rule 4. Offload answers for routing ops keep them as offload keeps any output (a host copy
          on an accelerator); only save answers follow Rules 2 and 3.
  Rule 5. Under a tracing compiler the partitioner decides (Rule 9 of the cache NOTE); these
          rules are eager-mode ones.

Rejected: keeping only the top-k indices and gathering the values from the recomputed scores
at replay (exact only when the scores are kept anyway, Rule 3, and it needs the op's arguments
at replay); detecting the router by shape (``num_experts`` columns), torchtitan's way for its
router matmul: a tiny model's hidden size may equal its expert count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import torch

from .._compat import OpOverload
from .unkept import is_composite

__all__ = [
    "RANKING_IDS",
    "RANKING_OPS",
    "ROUTING_IDS",
    "ROUTING_OPS",
    "copy_outputs",
    "keeps_routing",
]


def _functional(names: Iterable[str]) -> frozenset[OpOverload]:
    """The overloads of aten ops ``names`` that return fresh tensors and reach a dispatch mode
    (no ``out=`` form, nothing composite)."""
    aten = torch.ops.aten
    found: set[OpOverload] = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if not op._schema.is_mutable and not is_composite(op):
                found.add(op)
    return frozenset(found)


# Rule 1: ops that rank scores, and ops that count or find each expert's tokens. ``max.dim``
# ranks too but is left out: hand-written softmaxes subtract ``x.max(dim)`` from whole
# attention scores, which Rule 3 would keep.
_RANKING_NAMES: Final = ("topk", "sort", "argmax", "kthvalue")
_DISPATCH_NAMES: Final = ("bincount", "histc", "nonzero", "nonzero_static")

RANKING_OPS: Final[frozenset[OpOverload]] = _functional(_RANKING_NAMES)
ROUTING_OPS: Final[frozenset[OpOverload]] = RANKING_OPS | _functional(_DISPATCH_NAMES)
# By id, for the forward mode's per-call test (``OpOverload.__hash__`` is a Python method).
RANKING_IDS: Final[frozenset[int]] = frozenset(map(id, RANKING_OPS))
ROUTING_IDS: Final[frozenset[int]] = frozenset(map(id, ROUTING_OPS))


def copy_outputs(out: Any) -> Any:
    """Rule 2: ``out`` with each tensor replaced by a private copy (tuples and lists rebuilt)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple | list):
        return type(out)(copy_outputs(item) for item in out)
    return out


def keeps_routing(policy: object) -> bool:
    """Rule 2: whether ``policy`` keeps routing as ``save_routing()`` does (it, or a
    combination including it, says so with ``_keeps_routing``)."""
    return bool(getattr(policy, "_keeps_routing", False))
