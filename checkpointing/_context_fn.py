"""What a ``context_fn`` may be: torch's function, or (ours) a policy or the name of one.

Owns turning a policy object or a policy name given as ``context_fn`` into the function torch
expects, for every API that takes ``context_fn`` (``checkpoint``, its decorator,
``checkpoint_module``, the wrappers, ``checkpoint_sequential``). The policies and their names
belong to ``checkpointing.policies``; running a ``context_fn`` to ``_frame``.

NOTE [Context functions]
  Rule 1. A ``context_fn`` is called with no arguments and returns the forward and recompute
          contexts (torch's contract; any such callable is used as it is).
  Rule 2. A string is the name of a policy of ``checkpointing.policies``, from the one table
          that ``as_context_fn`` and ``integrations.transformers.enable(policy=...)`` read; an
          unknown name is a ``ValueError`` listing the names (torch: "'str' object is not
          callable").
  Rule 3. A callable that needs two positional arguments cannot be a ``context_fn``; taking
          ``(ctx, op)``, it is a policy given where torch wants the function returning two
          contexts (torch: "missing 2 required positional arguments: 'ctx' and 'op'"), and
          runs under ``create_selective_checkpoint_contexts``. Told from the code of the
          function, or of its class's ``__call__`` (remembered per class); a
          ``functools.partial`` (``as_context_fn``'s form) is taken as torch's without a look.
          One of our policy factories passed uncalled (``context_fn=save_matmuls``) is a
          ``TypeError`` naming the call.
  Rule 4. Each API turns its ``context_fn`` once where it can (the decorator, the wrappers and
          ``checkpoint_module`` when built, ``checkpoint_sequential`` per call); ``checkpoint``
          per call, and only when ``context_fn`` is not the default: plain checkpointing pays
          one identity test.
  Rule 5. Under ``torch.compile`` a name compiles into one graph: its function is made at
          import, and dynamo takes a made object (``fullgraph=True`` works). A policy object
          makes its function while dynamo traces, which dynamo refuses, as it refuses torch's
          ``functools.partial(create_selective_checkpoint_contexts, ...)`` written there: the
          graph breaks and the region runs eagerly, still under the policy. For one graph, pass
          ``as_context_fn(policy)`` made outside the compiled function.
Rejected: asking ``inspect.signature`` per call (tens of microseconds on every selective
checkpoint) and accepting only our own policy classes (a user's policy function would still
fail inside torch).
"""

from __future__ import annotations

import functools
import types
from typing import Final, TypeAlias, TypeGuard

from ._errors import internal_error
from ._selective import Policy, create_selective_checkpoint_contexts, uncalled_factory
from ._state import ContextFn
from .policies import _NAMED, _named

__all__ = ["ContextFnOrPolicy", "context_fn_from"]

# What every API's ``context_fn`` parameter accepts (Rules 1-3).
ContextFnOrPolicy: TypeAlias = ContextFn | Policy | str

_MSG_UNCALLED_FACTORY = (
    "{api}: context_fn got the policy factory checkpointing.policies.{name} itself, which makes "
    "a policy but is not one. Fix: call it, context_fn={call}, or pass its name, "
    "context_fn={name!r}."
)

# Rule 3: per class whose instances are called, whether its ``__call__`` takes ``(ctx, op)``.
_POLICY_CLASSES: Final[dict[type, bool]] = {}


def context_fn_from(value: object, api: str) -> ContextFn:
    """``value`` as torch's ``context_fn`` (NOTE [Context functions]); ``api`` names the caller
    in errors."""
    if isinstance(value, functools.partial):
        return value  # Rule 3: torch's form, as it is
    if isinstance(value, str):
        return _for_name(value, api)
    factory = uncalled_factory(value)
    if factory is not None:
        name, call = factory
        raise TypeError(_MSG_UNCALLED_FACTORY.format(api=api, name=name, call=call))
    if _is_policy(value):
        return functools.partial(create_selective_checkpoint_contexts, value)
    return value  # type: ignore[return-value]  # Rule 1: torch's contract, checked when called


# Rule 2: one ``context_fn`` per name, made at import: regions share its policy's per-op plans,
# and under ``torch.compile`` dynamo finds a made object (one made while it traces is refused).
_BY_NAME: Final[dict[str, ContextFn]] = {
    name: functools.partial(create_selective_checkpoint_contexts, factory())
    for name, factory in _NAMED.items()
}


def _for_name(name: str, api: str) -> ContextFn:
    found = _BY_NAME.get(name)
    if found is None:
        _named(api, name, parameter="context_fn")  # raises, listing the names
        internal_error(f"no context_fn for the policy name {name!r}")
    return found


def _is_policy(value: object) -> TypeGuard[Policy]:
    """Rule 3: whether ``value`` needs the two positional arguments ``(ctx, op)``."""
    if isinstance(value, types.FunctionType):
        return _needs_two(value, bound=0)
    kind = type(value)
    known = _POLICY_CLASSES.get(kind)
    if known is None:
        call = getattr(kind, "__call__", None)  # noqa: B004  # the class's, not the instance's
        known = isinstance(call, types.FunctionType) and _needs_two(call, bound=1)
        _POLICY_CLASSES[kind] = known
    return known


def _needs_two(function: types.FunctionType, bound: int) -> bool:
    """Whether ``function`` needs at least two positional arguments beyond ``bound`` ones."""
    positional = function.__code__.co_argcount - bound
    return positional - len(function.__defaults__ or ()) >= 2
