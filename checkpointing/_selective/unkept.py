"""What a policy asked by name to keep and selective checkpointing could not keep: said once.

Owns ``Asked`` (the ops and tensor names a policy names for keeping, which our policies carry
as ``_asked_to_keep`` and ``asked_of`` reads), ``Unkept`` (what a forward mode notes while its
region runs: the refused tags and the named random ops, decided when the mode exits), the
causes a tag can be refused for (``cause_of``), the check and warning for a composite op named
to a factory of ``checkpointing.policies`` (``never_dispatched``, ``say_composite``), and
``say_once``, the once-per-process warning. Noting is ``forward``'s job, calling
``say_composite`` the factories'.

NOTE [Selective checkpoint cache] (Rule 15, on asks that keep nothing; the package docstring
says where the others live)
  Rule 15. A policy that names something to keep and keeps none of it says so (a
          ``UserWarning``, once per process per op or name and cause) with the fix, instead of
          recomputing in silence. Only what is *named* counts: the ops of ``save_ops``,
          ``offload_ops`` and ``save_attention``, the names of ``save_only_these_names`` and
          ``offload_these_names``; ``either`` names what any of its policies names, ``both``
          what all of them name. ``save_matmuls()``, ``save_everything()`` and plain callables
          name nothing: a region without matmuls asked for nothing, and a false alarm teaches
          users to ignore the warning. The causes:
          (a) a composite op (``scaled_dot_product_attention``, ``linear``, ``layer_norm``,
              ``matmul``: a ``CompositeImplicitAutograd`` kernel) is decomposed before dispatch
              reaches a policy, so naming it can never match: said when ``save_ops``,
              ``offload_ops`` or ``recompute_ops`` is called, naming the kernels instead. A
              packet counts when all its overloads but the ``out=`` ones are composite.
              torch's list form of ``create_selective_checkpoint_contexts`` stays silent, as
              torch's does (parity).
          (b) a named op that drew random numbers is recomputed (Rule 10): said at the end of
              the region's forward if no call of it in the region was kept (an op that always
              draws, under a policy asked per op, at its first call: no call can be kept).
          (c) a named tag whose hand-over is refused (Rule 8) because the tensor's last maker
              in the region was recomputed and cannot take it (it returned several tensors,
              wrote it in place, itself or through a view, or drew random numbers): said at
              the end of the region's forward if no tag of that name in the region was kept. A
              tag of a tensor made outside the region (an input, a parameter) or kept by its
              maker's own answer is no refusal: the tensor is there for backward either way.
          Not seen: an ask that nothing in the region runs into. Attention that runs the math
          fallback (on CPU whenever ``dropout_p`` is not 0) shows a policy ``bmm``s and a
          softmax, no attention op, so ``save_attention()`` keeps nothing there and cannot
          tell that attention ran.
          The per-op path stays as it was for every other call: the makers that cannot take a
          tag are noted only under a policy that names tensors, a random call only when it was
          answered with a keep, and the verdict is taken once, when the forward mode exits.
          Rejected: deciding per training step (no object sees a step) and per call (a name
          kept in one call of a region and refused in another is not "kept nothing").
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Final, NamedTuple

import torch

from .. import _compat
from .._compat import HigherOrderOperator, OpOverload, OpOverloadPacket
from .cache import _OpRecord
from .ops import Op


class Asked(NamedTuple):
    """What a policy names for keeping (Rule 15): ops, and tensor names given to ``tag``."""

    ops: frozenset[Op]
    names: frozenset[str]


NOTHING_ASKED: Final = Asked(frozenset(), frozenset())


def asked_of(policy: object) -> Asked:
    """What ``policy`` names for keeping: our policies carry it, any other names nothing."""
    asked = getattr(policy, "_asked_to_keep", None)
    return asked if type(asked) is Asked else NOTHING_ASKED


# Why a recomputed call cannot take a tag's decision (Rule 15 (c)), with the op that made it.
SEVERAL: Final = "several"
WRITTEN: Final = "written"
RANDOM: Final = "random"
Cause = tuple[str, Op]
# id(tensor) -> (the tensor, weakly; why its maker cannot take a tag)
Makers = dict[int, tuple[weakref.ref[torch.Tensor], Cause]]


def note_makers(makers: Makers, func: Op, out: object, pure: bool, random: bool) -> None:
    """Note the tensors of ``out``, made by a recomputed call of ``func`` that cannot take a
    later tag's decision, with why (Rule 15 (c))."""
    cause: Cause = (RANDOM if random else WRITTEN if not pure else SEVERAL, func)
    if type(out) is torch.Tensor:
        makers[id(out)] = (weakref.ref(out), cause)
        base = _compat.view_base(out) if not pure else None
        if base is not None:  # written through a view (``h[0].zero_()``): ``h`` was written
            makers[id(base)] = (weakref.ref(base), cause)
    elif type(out) is tuple or type(out) is list:
        for item in out:
            if type(item) is torch.Tensor:
                makers[id(item)] = (weakref.ref(item), cause)


def cause_of(makers: Makers, tensor: torch.Tensor) -> Cause | None:
    """Why ``tensor``'s last maker in the region could not take its tag, or None when it
    was not made there by a recomputed call (made outside, or kept)."""
    found = makers.get(id(tensor))
    if found is None or found[0]() is not tensor:
        return None
    return found[1]


class Unkept:
    """What a forward mode noted of its region's named asks (Rule 15 (b), (c)): the tags
    refused and kept by name, and the named random ops with their records."""

    __slots__ = ("kept_names", "random_ops", "refused_names")

    def __init__(self) -> None:
        self.refused_names: dict[str, Cause] = {}
        self.kept_names: set[str] = set()
        self.random_ops: dict[Op, _OpRecord] = {}

    def say(self, policy: object) -> None:
        """The verdict at the end of the region's forward: warn (once) for each named thing
        none of which the region kept."""
        for op, record in self.random_ops.items():
            if not record.kept:
                say_random(policy, op)
        for name, (kind, op) in self.refused_names.items():
            if name not in self.kept_names:
                because = _BECAUSE[kind].format(op=op)
                fix = _FIX_RANDOM if kind == RANDOM else _FIX_BY_OP.format(keep=_keep_op(op))
                text = _MSG_TAG.format(policy=policy, name=name, because=because, fix=fix)
                say_once(("tag", name, kind, str(op)), text)


def say_random(policy: object, op: Op) -> None:
    """Rule 15 (b): ``policy`` names the random ``op``, and none of its outputs was kept."""
    say_once(("random", str(op)), _MSG_RANDOM_OP.format(policy=policy, op=op))


_MSG_RANDOM_OP = (
    "checkpointing: the policy {policy!r} names {op} to keep, but a checkpointed region kept "
    "none of its outputs: the calls drew random numbers (dropout), and an op that draws is "
    "always recomputed, so that the recompute draws the same numbers. Fix: "
)
_FIX_RANDOM = (
    "run it without dropout (dropout_p=0; e.g. attention_dropout=0.0 in a transformers "
    "config), or keep the call with checkpointing.keep(fn, *args), which runs it once and keeps "
    "what it saves, random draws included."
)
_MSG_RANDOM_OP += _FIX_RANDOM
_MSG_TAG = (
    "checkpointing: the policy {policy!r} names {name!r} to keep, but a checkpointed region "
    "kept no tensor tagged {name!r}: tag(x, {name!r}) hands the decision to the op that made "
    "x, and {because}, so x is recomputed. Fix: {fix}"
)
_BECAUSE: Final = {
    SEVERAL: "{op} returns several tensors (only an op returning x alone can keep it for a tag)",
    WRITTEN: "x was last written in place by {op}, which is recomputed",
    RANDOM: "{op} drew random numbers, and an op that draws is always recomputed",
}
_FIX_BY_OP = (
    "keep what makes x with checkpointing.keep(fn, *args) (e.g. `x = checkpointing.keep("
    "self.norm, h)`), or keep that op by name: either(<this policy>, {keep})."
)


def _keep_op(op: Op) -> str:
    """The policy that keeps ``op``'s outputs, as the fix spells it."""
    if "_scaled_dot_product" in str(op):
        return "save_attention()"  # the kernel of every device, not this one's only
    return f"save_ops(torch.ops.{op})"


_said: set[tuple[str, ...]] = set()
_said_lock = threading.Lock()


# --- Rule 15 (a): composite ops, said by the factory that names one --------------------------


def is_composite(op: object) -> bool:
    """Whether ``op`` decomposes into other ops before dispatch reaches selective checkpointing
    (it has a ``CompositeImplicitAutograd`` kernel): no policy ever sees it."""
    if not isinstance(op, OpOverload):
        return False
    try:
        return op.has_kernel_for_dispatch_key(torch.DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:  # a TorchScript-only overload (``aten.to.prim_Device``) has no kernels
        return False


def never_dispatched(op: object) -> bool:
    """Whether naming ``op`` (an overload, or a packet: all its overloads but the ``out=``
    ones) can never match a call a policy sees."""
    if not isinstance(op, OpOverloadPacket):
        return is_composite(op)
    overloads = op.overloads()  # type: ignore[no-untyped-call]  # untyped in 2.13
    calls = [getattr(op, name) for name in overloads if name != "out" and not name.endswith("_out")]
    return bool(calls) and all(map(is_composite, calls))


_MSG_COMPOSITE = (
    "checkpointing.policies.{api}: {op} never reaches a policy, so this policy never "
    "{does} it: it is a composite op, which torch decomposes into other ops before selective "
    "checkpointing sees any. Fix: {fix}"
)
_DOES: Final = {
    "save_ops": "keeps",
    "offload_ops": "offloads",
    "recompute_ops": "recomputes",
    "compress_ops": "keeps compressed",
}
_FIX_ATTENTION = (
    "name the attention kernels it runs, one per device: {api}(*checkpointing.policies."
    "ATTENTION_OPS){shorthand} ({kernels})."
)
_FIX_COMPOSITE = (
    "name the ops it runs instead; checkpointing.saved_tensors_report() lists them by op for a "
    "checkpointed step (e.g. aten.linear runs aten.addmm or aten.mm, aten.layer_norm runs "
    "aten.native_layer_norm, aten.matmul runs aten.mm or aten.bmm)."
)


def say_composite(api: str, op: object, attention_ops: Iterable[Op]) -> None:
    """Rule 15 (a): ``api`` (a factory of ``checkpointing.policies``) was given ``op``, which
    can never match; ``attention_ops`` are the kernels to name for attention."""
    if "scaled_dot_product_attention" in str(op):
        shorthand = ", which save_attention() is" if api == "save_ops" else ""
        kernels = ", ".join(sorted(map(str, attention_ops)))
        fix = _FIX_ATTENTION.format(api=api, shorthand=shorthand, kernels=kernels)
    else:
        fix = _FIX_COMPOSITE
    text = _MSG_COMPOSITE.format(api=api, op=op, does=_DOES[api], fix=fix)
    say_once(("composite", api, str(op)), text, stacklevel=4)  # the factory's caller


# --- Once per process --------------------------------------------------------------------------


def overloads_of(
    api: str, ops: Iterable[object], attention_ops: Iterable[Op] = ()
) -> frozenset[Op]:
    """The overloads ``ops`` stand for, as the op-taking policy sentences read them (a packet
    stands for all of its overloads); a composite op, which no policy ever sees, is said once
    (cause (a)); anything else is a ``TypeError`` naming ``api``."""
    found: set[Op] = set()
    for op in ops:
        if isinstance(op, OpOverload | HigherOrderOperator):
            found.add(op)
        elif isinstance(op, OpOverloadPacket):
            overloads = op.overloads()  # type: ignore[no-untyped-call]  # untyped in 2.13
            found.update(getattr(op, name) for name in overloads)
        else:
            raise TypeError(_MSG_NOT_AN_OP.format(api=api, got=op, type=type(op).__name__))
        if never_dispatched(op):
            say_composite(api, op, attention_ops)
    return frozenset(found)


def say_once(key: tuple[str, ...], text: str, stacklevel: int = 2) -> None:
    """Warn with ``text`` unless a warning with ``key`` was given before in this process
    (``stacklevel`` counts from the caller of this function)."""
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    warnings.warn(text, UserWarning, stacklevel=stacklevel + 1)


_MSG_NOT_AN_OP = (
    "checkpointing.policies.{api}: expected torch operators (e.g. torch.ops.aten.mm.default, "
    "or torch.ops.aten.mm for all its overloads), got {got!r} of type {type}. Fix: pass the "
    "op from torch.ops, not a Python function such as torch.mm."
)
