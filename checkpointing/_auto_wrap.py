"""``apply_activation_checkpointing``: wrappers put in place across a model, by rule or policy.

Owns which submodules of a model get wrapped (torch.distributed's ``check_fn`` and
``auto_wrap_policy``, in torch's order) and the checks of the call's arguments. The wrappers
themselves belong to ``_wrappers``; hook-based checkpointing (``checkpoint_module``, which can
serve as ``checkpoint_wrapper_fn``) to ``_module``.

NOTE [Applied wrappers]
  Rule 1. Without ``auto_wrap_policy``, a submodule is wrapped when ``check_fn(submodule)`` is
          true. With a callable policy, it is called as torch's FSDP wrapping calls it:
          ``policy(module=m, recurse=True, nonwrapped_numel=n)`` says whether to look inside
          ``m``, then, after its children, ``recurse=False`` with the parameter count its
          wrapped children left says whether to wrap ``m`` itself. A policy object that is not
          callable (``CustomPolicy``) picks its modules and their keyword arguments at once.
          Children are visited before their parents, so a match inside a match gives nested
          checkpoints. The root is never wrapped.
  Rule 2. A submodule that already checkpoints (a ``CheckpointWrapper``, ours or torch's, or a
          module hooked by ``checkpoint_module``) is left as it is, inside too, and a callable
          policy counts its parameters as wrapped: applying twice wraps nothing new (counted as
          unwrapped, a size-based policy would wrap the parent around them, and their modules
          would be recomputed twice per backward).
  Rule 3. The call's own options go to every ``checkpoint_wrapper_fn`` call as the caller gave
          them (no defaults filled in), and the options a policy object gives one module win
          over them, as in torch's FSDP policies: ``checkpoint_impl`` or ``use_reentrant`` from
          the policy replaces both of the call's (they name one choice, NOTE [Module wrapper],
          Rule 6). For our wrapper the call's options are checked once, up front, and errors
          name this function; ``recompute_state_hooks`` are read once, so a generator serves
          every wrapper (NOTE [Module wrapper], Rule 8).
  Rule 4. With ``spec=`` the spec picks the modules (NOTE [Spec selection]: its keys, its
          overlap rule, its errors, all before any module is wrapped) and a module's value its
          options: ``"full"`` the call's options as they are, a policy (or ``"offload"``, every
          op's output kept in host memory) ``context_fn=`` that policy, ``"none"`` no wrapper.
          Wrapped deepest first, so a selected module inside a selected one is wrapped before
          its parent (nested checkpoints, as with ``check_fn``). ``check_fn``,
          ``auto_wrap_policy`` or a ``context_fn`` of the call's beside a spec are refused: two
          answers to one question. A budget value is refused too: it is planned at the model's
          first step (``apply_spec``), and this call wraps now. A policy (or ``"offload"``) for
          a ``checkpoint_wrapper_fn`` that takes no ``context_fn`` is refused before any module
          is wrapped: ``offload_wrapper`` recomputes nothing, so a policy, which chooses what a
          checkpoint keeps and what it recomputes, has no choice to make there (keeping
          everything in host memory is what it does with ``"full"``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Final

from torch import nn

from . import _compat
from ._checkpoint import hooks_read_once
from ._module import is_module_checkpointed
from ._spec import select
from ._spec_grammar import OFFLOAD_EVERYTHING, budget_key
from ._wrappers import CheckpointImpl, CheckpointWrapper, checked_options, checkpoint_wrapper

__all__ = ["apply_activation_checkpointing"]

_API: Final = "apply_activation_checkpointing"
_MSG_BAD_CHECK_FN = (
    "checkpointing.apply_activation_checkpointing: check_fn must be a callable taking a module "
    "and returning a bool, got {type_name}. Fix: check_fn=lambda m: isinstance(m, Block)."
)
_MSG_BAD_POLICY = (
    "checkpointing.apply_activation_checkpointing: auto_wrap_policy must be callable as "
    "policy(module, recurse, nonwrapped_numel) or be a torch FSDP wrap policy "
    "(torch.distributed.fsdp.wrap.ModuleWrapPolicy, CustomPolicy), got {got}. Fix: "
    "auto_wrap_policy=ModuleWrapPolicy({{Block}}), or check_fn=lambda m: isinstance(m, Block)."
)

_MSG_SPEC_BUDGET = (
    "checkpointing.apply_activation_checkpointing: the spec key {key!r} has a budget, planned at "
    "the model's first step; this call wraps its modules now. Fix: "
    "checkpointing.apply_spec(model, spec) plans a budget key, or give the key 'full', a policy "
    "or 'none' here."
)
_MSG_SPEC_POLICY_UNTAKEN = (
    "checkpointing.apply_activation_checkpointing: the spec gives {keys} a policy, which the "
    "wrapper runs as context_fn=, but checkpoint_wrapper_fn={wrapper} takes no context_fn. "
    "An offload wrapper recomputes nothing, so a policy (what a checkpoint keeps, what it "
    "recomputes) has no choice to make there. Fix: give those keys 'full' (every selected "
    "module gets {wrapper}: for offload_wrapper, all it saves waits in host memory), or keep "
    "the default checkpoint_wrapper_fn to run each policy (the value 'offload' keeps every "
    "op's output in host memory, under a checkpoint)."
)
_MSG_SPEC_AND = (
    "checkpointing.apply_activation_checkpointing: spec= picks the modules and their policies, "
    "so {other} cannot be given beside it. Fix: drop {other}, or write it into the spec "
    "(e.g. {{'model.layers.*': 'save_matmuls'}})."
)

Wrap = Callable[..., nn.Module]


def _every_module(_: nn.Module) -> bool:
    return True


# torch's default ``check_fn`` is an anonymous ``lambda _: True``; ours is named so that a
# spec can tell it from one the caller gave, and given torch's name for the signature's sake.
_every_module.__name__ = _every_module.__qualname__ = "<lambda>"


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Wrap = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = _every_module,
    auto_wrap_policy: object = None,
    *,
    spec: Mapping[str, Any] | None = None,
    **checkpoint_options: Any,
) -> None:
    """Replace, in place, the submodules of ``model`` that ``check_fn`` (or ``auto_wrap_policy``)
    picks by ``checkpoint_wrapper_fn(submodule, **checkpoint_options)``.

    torch.distributed's function, same arguments, and the policy is asked in torch's order
    with torch's arguments; ours adds ``**checkpoint_options`` for the wrapper
    (``use_reentrant``, ``context_fn``, ``recompute_state_hooks``, ...). The root is never
    wrapped (wrap it with ``checkpoint_wrapper``); modules that already checkpoint are left as
    they are.
    ``checkpoint_wrapper_fn=checkpointing.offload_wrapper`` keeps saved tensors in host memory
    instead; ``checkpoint_wrapper_fn=checkpointing.checkpoint_module`` checkpoints through hooks:
    module names, types and ``state_dict`` keys stay as they were.

    Args:
        model: the model whose submodules to wrap.
        checkpoint_wrapper_fn: called on each picked submodule; returns its replacement.
        check_fn: picks a submodule when it returns True (ignored given ``auto_wrap_policy``).
        auto_wrap_policy: a torch FSDP wrap policy (``ModuleWrapPolicy({Block})``,
            ``CustomPolicy``) or a callable ``(module, recurse, nonwrapped_numel) -> bool``.
        spec: instead of ``check_fn``, a spec as ``checkpointing.apply_spec`` reads it: which
            modules get a wrapper and, per module, the policy its wrapper runs
            (``checkpointing.apply_spec(model, spec, dry_run=True)`` prints the selection).
        **checkpoint_options: passed to every ``checkpoint_wrapper_fn`` call.

    Example:
        >>> import torch, checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> checkpointing.apply_activation_checkpointing(
        ...     model, check_fn=lambda m: isinstance(m, torch.nn.Linear))
        >>> type(model[0]).__name__, sorted(model.state_dict())
        ('CheckpointWrapper', ['0.bias', '0.weight'])
    """
    if not callable(check_fn):
        raise TypeError(_MSG_BAD_CHECK_FN.format(type_name=type(check_fn).__name__))
    options = _checked(checkpoint_wrapper_fn, checkpoint_options)

    def wrap(module: nn.Module, **extra: Any) -> nn.Module:
        return checkpoint_wrapper_fn(module, **_merged(options, extra))

    if spec is not None:
        given = (check_fn, auto_wrap_policy, checkpoint_options)
        _wrap_by_spec(model, spec, wrap, checkpoint_wrapper_fn, *given)
    elif auto_wrap_policy is None:
        _wrap_by_policy(model, _check_fn_policy(check_fn), wrap, is_root=True)
    elif callable(auto_wrap_policy):
        _wrap_by_policy(model, auto_wrap_policy, wrap, is_root=True)
    else:
        targets = _compat.wrap_policy_targets(auto_wrap_policy, model)
        if targets is None:
            got = f"{auto_wrap_policy!r} of type {type(auto_wrap_policy).__name__}"
            raise ValueError(_MSG_BAD_POLICY.format(got=got))
        targets.pop(model, None)  # the root is never wrapped
        _wrap_targets(model, targets, wrap)


def _wrap_by_spec(
    model: nn.Module,
    spec: Mapping[str, Any],
    wrap: Wrap,
    wrapper_fn: Wrap,
    check_fn: object,
    auto_wrap_policy: object,
    options: dict[str, Any],
) -> None:
    """Rule 4: the modules ``spec`` selects wrapped by ``wrap`` (``wrapper_fn`` with the
    call's options), deepest first, each with its policy."""
    for other, given in (
        ("check_fn", check_fn is not _every_module),
        ("auto_wrap_policy", auto_wrap_policy is not None),
        ("context_fn", "context_fn" in options),
    ):
        if given:
            raise ValueError(_MSG_SPEC_AND.format(other=other))
    key = budget_key(spec, _API)
    if key is not None:
        raise ValueError(_MSG_SPEC_BUDGET.format(key=key))
    chosen = [item for item in select(model, spec, _API) if item.action.kind != "none"]
    with_policy = [item.key for item in chosen if item.action.kind in ("policy", "offload")]
    if with_policy and not _takes_context_fn(wrapper_fn):
        keys = ", ".join(repr(key) for key in dict.fromkeys(with_policy))
        wrapper = getattr(wrapper_fn, "__name__", repr(wrapper_fn))
        raise TypeError(_MSG_SPEC_POLICY_UNTAKEN.format(keys=keys, wrapper=wrapper))
    for item in reversed(chosen):  # children before their parents
        parent_name, _, attribute = item.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        policy = OFFLOAD_EVERYTHING if item.action.kind == "offload" else item.action.policy
        extra = {} if policy is None else {"context_fn": policy}
        setattr(parent, attribute, wrap(item.module, **extra))


def _takes_context_fn(wrapper_fn: Wrap) -> bool:
    """Rule 4: whether ``wrapper_fn`` can be called with ``context_fn=`` (by name, or through
    ``**kwargs``); one whose signature cannot be read is given the benefit of the doubt."""
    try:
        parameters = inspect.signature(wrapper_fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == "context_fn" and p.kind is not p.POSITIONAL_ONLY)
        for p in parameters
    )


def _checked(wrapper_fn: Wrap, options: dict[str, Any]) -> dict[str, Any]:
    """Rule 3: the options every wrapper call gets, as given, checked once where they are ours."""
    hooks = options.get("recompute_state_hooks")
    if hooks is not None:
        hooks = hooks_read_once(hooks, f"checkpointing.{_API}")
        options = {**options, "recompute_state_hooks": hooks}
    if wrapper_fn is checkpoint_wrapper or wrapper_fn is CheckpointWrapper:
        own = {"checkpoint_impl", "hooks_during_recompute"}
        impl = options.get("checkpoint_impl", CheckpointImpl.NO_REENTRANT)
        checked_options(_API, impl, {k: v for k, v in options.items() if k not in own})
    return options


def _merged(options: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Rule 3: the call's options with a policy's per-module ``extra`` over them; a variant
    named in ``extra`` (either spelling) replaces the call's."""
    merged = {**options, **extra}
    for spelling, other in (
        ("checkpoint_impl", "use_reentrant"),
        ("use_reentrant", "checkpoint_impl"),
    ):
        if spelling in extra and other not in extra:
            merged.pop(other, None)
    return merged


def _check_fn_policy(check_fn: Callable[[nn.Module], bool]) -> Callable[..., bool]:
    """``check_fn`` as a policy: look inside every module, wrap those it picks (Rule 1)."""

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or bool(check_fn(module))

    return policy


def _already_checkpointed(module: nn.Module) -> bool:
    """Rule 2 (ours subclass torch's ``CheckpointWrapper``: NOTE [Module wrapper], Rule 5)."""
    torch_wrapper = _compat.checkpoint_wrapper.CheckpointWrapper
    return isinstance(module, torch_wrapper) or is_module_checkpointed(module)


def _wrap_by_policy(
    module: nn.Module, policy: Callable[..., bool], wrap: Wrap, *, is_root: bool
) -> tuple[nn.Module, int]:
    """Rule 1 for a callable policy: ``module`` or its replacement, and the parameter count
    wrapped in it (what torch's FSDP wrapping tells the policy as ``nonwrapped_numel``)."""
    numel = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return module, 0
    wrapped = 0
    for name, child in list(module.named_children()):
        if _already_checkpointed(child):  # Rule 2: its parameters count as wrapped
            wrapped += sum(p.numel() for p in child.parameters())
            continue
        replacement, count = _wrap_by_policy(child, policy, wrap, is_root=False)
        if replacement is not child:
            setattr(module, name, replacement)
        wrapped += count
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
        return wrap(module), numel
    return module, wrapped


def _wrap_targets(module: nn.Module, targets: dict[nn.Module, dict[str, Any]], wrap: Wrap) -> None:
    """Rule 1 for a policy object: children first, each picked module wrapped with the keyword
    arguments the policy gave it."""
    for name, child in list(module.named_children()):
        if _already_checkpointed(child):
            continue
        _wrap_targets(child, targets, wrap)
        if child in targets:
            setattr(module, name, wrap(child, **targets.pop(child)))
