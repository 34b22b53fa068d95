"""What a tape records of one op: markers for its tensor arguments, the op, its flattened
arguments, and the facts read once from each op's schema.

Owns ``_Slot`` (a tensor made earlier in the same scope), ``_Outside`` (a tensor from outside
every scope, version-checked at replay), ``_Op``, the hand-made ``_flatten``/``_unflatten`` of op
arguments and the per-op facts cache (``_op_facts``). What a tape does with them (recording,
replaying) is ``tape.py``'s; another scope's tensor is marked by its registry ``_Entry``
(``registry.py``).

The pass-through of Rule 5 is the router's ``_Passed`` (``router.py``); the rest is ``_Outside``.

NOTE [Gradient checkpoint scope] (Rule 5 here; ``__init__`` says where the other rules are)
  Rule 5. Tensors that are not a scope's are passed through detached (never the input object: a
          reference cycle; a leaf, which has no ``grad_fn`` to close one, is kept as it is), with
          autograd's version check. Outside inputs are held detached and version-checked at replay.
          An op that writes an outside tensor is replayed only if a needed tensor comes from it,
          and then on a clone: outside tensors never change twice.

Rejected: holding outside inputs as autograd ``SavedTensor``s (holding an output that way is a C++
reference cycle); replaying (and recording) ops through torch's Python bindings (``torch.sin``)
instead of ``OpOverload._op`` (850 against 1,020 ns per op on W3's tensors, but a binding picks
its overload from the argument types: ``aten.mul.Scalar`` would replay as ``mul.Tensor``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final

import torch

from .._compat import OpOverload, op_runner, returns_alias, tensor_version, written_arguments

_MSG_INPUT_MODIFIED = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [{kind} {shape}] is at version {now}; expected version {then} instead. It is an "
    "input of a gradient_checkpoint_scope, which replays the scope's ops from their inputs in "
    "backward. Fix: do not modify it in place before backward (use an out-of-place op, or pass "
    "a .clone() into the scope)."
)


class _Slot:
    """A tape argument that is a tensor made earlier in the same scope. It does not refer to
    the tape (an ``_Entry`` would: a reference cycle); one shared object per slot number."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


_slots: list[_Slot] = []  # _slots[n] is the marker for slot n, in every tape


class _Outside:
    """A tape argument from outside any scope: a detached alias and the version it was read at.
    One per tensor and version in a tape: every op that reads it shares it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version

    def value(self, written: bool) -> torch.Tensor:
        """The replay value (See NOTE [Gradient checkpoint scope], Rule 5)."""
        if written:
            return self.tensor.clone()  # written by this op: the real tensor changes only once
        now = tensor_version(self.tensor)
        if now != self.version:
            kind, shape = self.tensor.type(), list(self.tensor.shape)
            raise RuntimeError(
                _MSG_INPUT_MODIFIED.format(kind=kind, shape=shape, now=now, then=self.version)
            )
        return self.tensor


_Draw = tuple[torch.Generator, torch.Tensor]  # a generator and its state just before one draw
_Flat = list[Any] | tuple[Any, ...]  # an op's arguments, flattened


class _Op:
    """One taped op: what runs it (``_compat.op_runner``), its flattened arguments (tensors
    replaced by markers: ``_Slot`` for this scope's tensors, ``_Entry`` for another scope's,
    ``_Outside`` otherwise), the argument positions it writes, the slot of each new tensor
    output, the groups of this tape it reads and those it creates or writes, and for a random
    op the state it drew from (Rule 7). Built in one call, after the op ran."""

    __slots__ = ("draw", "leaves", "outs", "reads", "run", "spec", "touches", "writes")

    def __init__(
        self,
        run: Callable[..., Any],
        leaves: list[Any],
        spec: _Spec,
        writes: tuple[int, ...],
        outs: tuple[int | None, ...],
        reads: tuple[int, ...],
        touches: tuple[int, ...],
        draw: _Draw | None,
    ) -> None:
        self.run = run
        self.leaves = leaves
        self.spec = spec
        self.writes = writes
        self.outs = outs
        self.reads = reads
        self.touches = touches
        self.draw = draw


# Op arguments are flattened by hand: torch's ``tree_flatten``/``tree_unflatten`` leave a few
# cyclic objects per call, and the tape records every op of a scope: garbage made per op would
# wake the cyclic collector in the middle of a step.
_Spec = Any  # None for a leaf; (container type, [child specs]) or (dict, [(key, spec)])
_FLAT: Final = "flat"  # the spec of ``(args, {})`` where no argument is a container
_NESTED: Final = object()  # ``record_plain``'s answer for an argument that is a container
_CONTAINERS: Final = (tuple, list, dict)


def _flatten(obj: Any, leaves: list[Any]) -> _Spec:
    """Append ``obj``'s leaves to ``leaves`` and return how to rebuild it (aten arguments nest
    only tuples, lists and the kwargs dict)."""
    if isinstance(obj, (tuple, list)):
        return (type(obj), [_flatten(item, leaves) for item in obj])
    if isinstance(obj, dict):
        return (dict, [(key, _flatten(value, leaves)) for key, value in obj.items()])
    leaves.append(obj)
    return None


def _unflatten(spec: _Spec, leaves: Iterator[Any]) -> Any:
    """Rebuild what ``_flatten`` took apart, taking leaves in order."""
    if spec is None:
        return next(leaves)
    kind, children = spec
    if kind is dict:
        return {key: _unflatten(child, leaves) for key, child in children}
    return kind([_unflatten(child, leaves) for child in children])


# Ops that write arguments their schema does not mark as written: batch norm in training mode
# updates running_mean and running_var (positions 3 and 4; ``training`` is position 5).
_HIDDEN_WRITES: Final = (
    torch.ops.aten.native_batch_norm,
    torch.ops.aten.cudnn_batch_norm,
    torch.ops.aten.miopen_batch_norm,
)


# Per op, worked out once from its schema: what runs it, the (position, name) of each argument it
# writes, whether it draws random numbers, whether it returns a view, whether it has hidden
# writes, and whether it is plain: none of these, and no output aliases an input (so an output
# is never an argument itself). Keyed by the op's id; ``_known_ops`` keeps each op alive so that
# its id stays its own.
_OpFacts = tuple[Callable[..., Any], tuple[tuple[int, str], ...], bool, bool, bool, bool]
_op_facts: dict[int, _OpFacts] = {}
_known_ops: list[OpOverload] = []


def _learn_facts(func: OpOverload) -> _OpFacts:
    _known_ops.append(func)
    written = written_arguments(func)
    random = torch.Tag.nondeterministic_seeded in func.tags
    is_view = bool(func.is_view)
    hidden_writes = func.overloadpacket in _HIDDEN_WRITES
    plain = not (written or random or is_view or hidden_writes or returns_alias(func))
    facts = _op_facts[id(func)] = (op_runner(func), written, random, is_view, hidden_writes, plain)
    return facts


def _written_ids(
    written: tuple[tuple[int, str], ...],
    hidden_writes: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> set[int]:
    """Ids of the tensors an op writes: schema-marked arguments plus hidden writes."""
    return {id(t) for t in _written_tensors(written, hidden_writes, args, kwargs)}


def _written_tensors(
    written: tuple[tuple[int, str], ...],
    hidden_writes: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Iterator[torch.Tensor]:
    for position, name in written:
        value = args[position] if position < len(args) else kwargs.get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                yield tensor
    if hidden_writes and len(args) > 5 and args[5] is True:
        yield from (t for t in args[3:5] if isinstance(t, torch.Tensor))


def written_tensors(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors ``func`` writes in this call: the arguments its schema marks as written, and
    batch norm's running statistics in training mode (which it does not mark)."""
    facts = _op_facts.get(id(func)) or _learn_facts(func)
    return list(_written_tensors(facts[1], facts[4], args, kwargs))
