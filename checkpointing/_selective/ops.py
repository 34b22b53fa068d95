"""Facts about an op that selective checkpointing works out at its first call and shares.

Owns ``SAC_IGNORED_OPS`` (the ops both modes run as they are), the ``Op`` type, and per op
overload (keyed by its id, the op held): whether a call draws random numbers (``draws_random``),
whether the op leaves its inputs alone, whether it has an ordered side effect or is a
collective (``collectives``), what calling it
calls (its runner), and the cache key of a call (``_region_key``). The state here (``_op_facts``,
``_runners``, ``SAC_IGNORED_OPS``) exists once: the modes import these objects, never copies.
What a policy's answer means is ``policy``'s; what the modes do with these facts is ``forward``'s
and ``recompute``'s.

NOTE [Selective checkpoint cache] (Rules 4, 10 and 12, on op facts; the package docstring says
where the others live)
  Rule 4. ``SAC_IGNORED_OPS`` are neither counted nor cached: they run as they are, both times.
  Rule 10. Random ops (tagged ``nondeterministic_seeded``: dropout, ``rand_like``, ...) are
          recomputed whatever the policy answers (it is still asked, Rule 1), and never take a
          tag's decision (Rule 8). Recompute restores the RNG state of the region's start and
          replays the draws in order, so a kept random op would shift what every later one
          draws: torch caches them and, with two ``rand_like`` and the first kept, gets wrong
          gradients. Recomputing a random op is cheap. An op with a ``dropout_p`` argument
          (the fused attention kernels) draws only when it is not 0, so attention without
          dropout is kept as the policy says.
  Rule 12. An op registered with an ordered side effect (``aten::_print``, a torchbind call, ...;
          the ``c10d`` launches, which return a work handle, excepted) must not run twice:
          recompute would repeat the effect. Its output is kept whatever the policy answers,
          unless the answer is ``MUST_RECOMPUTE``, the one explicit request to replay it (torch
          2.15's rule, on every release; an offload answer keeps it in host memory, as offload
          does). Rule 10 comes first: a random op is recomputed regardless. The effect registry
          is read at an op's first call and remembered (an effect registered later is not
          seen). Functional collectives and their waits are flagged the same way, unlike in
          torch, which recomputes what a policy does not keep of them: NOTE [Collectives under
          selective checkpointing] (``collectives``) says why, and how the ranks agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, TypeAlias

import torch

from .. import _compat
from .._compat import HigherOrderOperator, OpOverload
from .collectives import is_collective

Op: TypeAlias = OpOverload | HigherOrderOperator

_aten = torch.ops.aten
# Ops selective checkpointing runs as they are, never counting or caching them (Rule 4): the
# number of detaches differs between forward and recompute, and the metadata queries (which the
# determinism check adds in forward, and which dispatch for tensor subclasses) would shift every
# later call index. The same set as torch 2.15's; a mutable set like torch's, which also keeps
# the ids of its members: the modes test ``id(func) in SAC_IGNORED_OPS.ids`` per op, where
# ``func in SAC_IGNORED_OPS`` would call ``OpOverload.__hash__``, a Python method (~0.5 us).


class _OpSet(set[OpOverload]):
    """A ``set`` of ops whose ``ids`` follow every change to it."""

    __slots__ = ("ids",)

    def __init__(self, ops: Iterable[OpOverload] = ()) -> None:
        super().__init__(ops)
        self.ids: frozenset[int] = frozenset(map(id, self))

    def _changed(self) -> None:
        self.ids = frozenset(map(id, self))


def _then_refresh(name: str) -> Callable[..., Any]:
    """``set.<name>``, followed by a refresh of ``ids``."""
    method = getattr(set, name)

    def changing(self: _OpSet, *args: Any) -> Any:
        result = method(self, *args)
        self._changed()
        return result

    changing.__name__ = changing.__qualname__ = name
    return changing


for _name in (
    "add",
    "clear",
    "discard",
    "pop",
    "remove",
    "update",
    "difference_update",
    "intersection_update",
    "symmetric_difference_update",
    "__ior__",
    "__iand__",
    "__isub__",
    "__ixor__",
):
    setattr(_OpSet, _name, _then_refresh(_name))
del _name


_IGNORED: Final = _OpSet(
    {
        _aten.detach.default,
        torch.ops.prim.device.default,
        _aten.dim.default,
        _aten.is_contiguous.default,
        _aten.is_contiguous.memory_format,
        _aten.is_non_overlapping_and_dense.default,
        _aten.is_strides_like_format.default,
        _aten.numel.default,
        _aten.size.default,
        _aten.storage_offset.default,
        _aten.stride.default,
        _aten.sym_numel.default,
        _aten.sym_size.default,
        _aten.sym_storage_offset.default,
        _aten.sym_stride.default,
        torch.ops.prim.layout.default,  # torch 2.15 added it; ours has it on every release
    }
)
SAC_IGNORED_OPS: set[OpOverload] = _IGNORED

_INDUCTOR_CODE: Final = _compat.inductor_compiled_code

# Per op kind, worked out once. Rule 10: how to tell whether a call draws random numbers
# (_NEVER, _ALWAYS, or the position of its ``dropout_p`` argument). Rule 8: whether it leaves
# its inputs alone. Keyed by ``id(op)`` (an int hashes in C; an ``OpOverload`` in Python), the
# op itself held in the value, so that the id stays its own; the plans of op-only policies and
# the region caches use the same ids (their ops are all held here).
_NEVER: Final = -1
_ALWAYS: Final = -2
# Rule 12: whether it has an ordered side effect or is a collective (NOTE [Collectives under
# selective checkpointing], Rule 1).
_OpFacts: TypeAlias = tuple[object, int, bool, bool]
_op_facts: dict[int, _OpFacts] = {}
# Per op id, what calling the op calls: for a plain ``OpOverload`` its C++ entry point (one Python
# frame fewer per call, ~0.2 us, in both modes), else the op itself. Filled by ``_runner``
# together with ``_op_facts``, which holds the op.
_runners: dict[int, Callable[..., Any]] = {}


def _region_key(func: object, args: tuple[Any, ...]) -> object:
    """Rule 3: the cache key of an op: its id (see ``_op_facts``), or for an inductor-compiled
    region the op and the region's callable."""
    if func is _INDUCTOR_CODE:
        return _compat.inductor_region_key(func, args)
    return id(func)


def draws_random(func: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this op call draws random numbers (NOTE [Selective checkpoint cache], Rule 10)."""
    rule = _facts(func)[1]
    if rule < 0:
        return rule == _ALWAYS
    return _draws_at(rule, args, kwargs)


def _draws_at(rule: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Rule 10 for an op with a ``dropout_p`` argument at position ``rule``: draws unless 0."""
    dropout_p = args[rule] if len(args) > rule else kwargs.get("dropout_p", 0.0)
    return bool(dropout_p != 0)


def _facts(func: object) -> _OpFacts:
    """``func`` (held), its draw rule (Rule 10), whether it is pure (Rule 8) and whether it has
    an ordered side effect or is a collective (Rule 12), worked out on its first call and
    remembered."""
    facts = _op_facts.get(id(func))
    if facts is None:
        facts = _op_facts[id(func)] = (
            func,
            _draw_rule(func),
            _is_pure(func),
            _compat.has_ordered_effect(func) or is_collective(func),
        )
    return facts


def _runner(func: Op) -> Callable[..., Any]:
    """What calling ``func`` calls (see ``_runners``), worked out on its first call."""
    _facts(func)  # holds ``func``, so that its id keys ``_runners`` for good
    run = _runners[id(func)] = _compat.op_runner(func) if type(func) is OpOverload else func
    return run


def _draw_rule(func: object) -> int:
    if not isinstance(func, OpOverload) or torch.Tag.nondeterministic_seeded not in func.tags:
        return _NEVER
    index = _compat.argument_index(func, "dropout_p")
    return _ALWAYS if index is None else index


def _is_pure(func: object) -> bool:
    """Rule 8: whether ``func`` leaves its inputs alone (then it may take a tag's decision)."""
    return isinstance(func, OpOverload) and not _compat.op_mutates_inputs(func)
