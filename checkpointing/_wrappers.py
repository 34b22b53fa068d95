"""Module wrappers: ``checkpoint_wrapper`` and ``apply_activation_checkpointing``.

Owns the ``nn.Module`` that runs another module under ``checkpoint`` (the names users know from
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``), how its ``state_dict`` keys stay
those of the unwrapped model, and what the wrapped module's own hooks do during recompute.
Checkpointing itself belongs to ``_checkpoint``; ``is_recomputing`` to ``_state``.

NOTE [Module wrapper]
  Rule 1. The inner module is a registered submodule named ``_checkpoint_wrapped_module`` (torch's
          name, so ``torch.distributed.checkpoint`` and FSDP, which strip that name from
          parameter names, understand our wrapper too). ``state_dict()`` removes the name from
          keys (a state-dict post hook) and ``load_state_dict`` adds it back (a load pre hook),
          so a checkpoint saved with or without wrapping loads into either.
  Rule 2. ``named_parameters``/``named_buffers`` called on the wrapper itself give the
          unwrapped names; called on a parent, they include ``_checkpoint_wrapped_module.``
          as torch's wrapper does (nn.Module builds those names without asking the child).
  Rule 3. ``use_reentrant`` defaults to ``False`` (torch's wrapper does the same; plain
          ``checkpoint`` warns instead). With ``use_reentrant=True``, keyword arguments of the
          module are passed positionally and rebuilt inside, so their tensors get gradients.
  Rule 4. Hooks registered on the wrapper run once per call, outside the checkpoint. The inner
          module's own forward pre-hooks and forward hooks run in forward only: recompute calls
          its ``forward`` directly, unless ``hooks_during_recompute=True``. Hooks of modules
          further inside do run again; they can ask ``checkpointing.is_recomputing()``.
          A pre-hook that changes the inputs or the weights (legacy ``weight_norm``) must run in
          recompute as well: register it on the wrapper or pass ``hooks_during_recompute=True``.

Rejected: sharing the inner module's ``_parameters``/``_modules`` dicts with the wrapper (names
unchanged everywhere, but ``train()``, ``_apply`` overrides such as RNNs' and custom
``_load_from_state_dict`` of the inner module would be bypassed), and swapping the inner module's
``forward`` attribute (mutates the user's module).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ._checkpoint import CHECKPOINT_OPTIONS, checkpoint
from ._module import is_module_checkpointed
from ._state import is_recomputing

__all__ = ["CheckpointWrapper", "apply_activation_checkpointing", "checkpoint_wrapper"]

_INNER = "_checkpoint_wrapped_module"
_INNER_PREFIX = _INNER + "."

_MSG_NOT_A_MODULE = (
    "checkpointing.checkpoint_wrapper: expected an nn.Module to wrap, got {type_name}. Fix: "
    "wrap a module (checkpoint_wrapper(layer)), or call checkpointing.checkpoint(fn, ...) for a "
    "plain function."
)
_MSG_UNKNOWN_OPTION = (
    "checkpointing.checkpoint_wrapper: unknown checkpoint option(s) {names}; expected some of "
    "{allowed}. Fix: pass only checkpoint() options here; the module's own keyword arguments "
    "go to the call, wrapped(x, key=value).{hint}"
)
_HINT_CHECKPOINT_IMPL = (
    " torch's checkpoint_impl=CheckpointImpl.REENTRANT is spelled use_reentrant=True here."
)
_MSG_BAD_CHECK_FN = (
    "checkpointing.apply_activation_checkpointing: check_fn must be a callable taking a module "
    "and returning a bool, got {type_name}. Fix: check_fn=lambda m: isinstance(m, Block)."
)


class CheckpointWrapper(nn.Module):
    """Runs the wrapped module under ``checkpointing.checkpoint``; see NOTE [Module wrapper].

    Build it with ``checkpoint_wrapper``. Attribute lookups and indexing the wrapper does not
    answer itself go to the wrapped module, so ``wrapped.weight`` or ``wrapped[0]`` still work.
    """

    def __init__(
        self,
        module: nn.Module,
        hooks_during_recompute: bool,
        checkpoint_options: dict[str, Any],
    ) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module
        self.hooks_during_recompute = hooks_during_recompute
        self.checkpoint_options = {"use_reentrant": False, **checkpoint_options}  # Rule 3
        # Both registration methods are public but untyped in torch 2.13. See Rule 1.
        self.register_state_dict_post_hook(_strip_inner_prefix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_inner_prefix)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module on ``args``/``kwargs`` under ``checkpoint``."""
        options = self.checkpoint_options
        if options["use_reentrant"] and kwargs:
            keys = tuple(kwargs)
            return checkpoint(
                _call_with_packed_kwargs, self, len(args), keys, *args, *kwargs.values(), **options
            )
        return checkpoint(_call_inner, self, *args, **options, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = super().__getattr__(_INNER)
            return getattr(inner, name)

    def __getitem__(self, key: Any) -> Any:
        """Index the wrapped module (for a wrapped ``nn.Sequential``/``nn.ModuleList``)."""
        inner: Any = self._checkpoint_wrapped_module  # indexable only for containers
        return inner[key]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under their unwrapped names (Rule 2)."""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace(_INNER_PREFIX, ""), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers under their unwrapped names (Rule 2)."""
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield name.replace(_INNER_PREFIX, ""), buf

    def extra_repr(self) -> str:
        """Show the options the wrapper passes to ``checkpoint``."""
        options = ", ".join(f"{k}={v!r}" for k, v in self.checkpoint_options.items())
        return f"{options}, hooks_during_recompute={self.hooks_during_recompute}"


def _call_inner(wrapper: CheckpointWrapper, *args: Any, **kwargs: Any) -> Any:
    """The checkpointed function: the inner module with its hooks in forward; in recompute,
    only its ``forward`` unless the user asked for hooks (NOTE [Module wrapper], Rule 4)."""
    inner = wrapper._checkpoint_wrapped_module
    if is_recomputing() and not wrapper.hooks_during_recompute:
        return inner.forward(*args, **kwargs)
    return inner(*args, **kwargs)


def _call_with_packed_kwargs(
    wrapper: CheckpointWrapper, n_args: int, keys: tuple[str, ...], *flat: Any
) -> Any:
    """Reentrant checkpoint takes positional inputs only: rebuild the call (Rule 3)."""
    kwargs = dict(zip(keys, flat[n_args:], strict=True))
    return _call_inner(wrapper, *flat[:n_args], **kwargs)


def _strip_inner_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """State-dict post hook: ``p._checkpoint_wrapped_module.k`` becomes ``p.k`` (Rule 1)."""
    _rename_keys(state_dict, prefix + _INNER_PREFIX, prefix)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # The wrapped module's version metadata takes the wrapper's place, as if unwrapped.
        inner_meta = metadata.pop(prefix + _INNER, None)
        if inner_meta is not None:
            metadata[prefix[:-1]] = inner_meta
        _rename_keys(metadata, prefix + _INNER_PREFIX, prefix)


def _add_inner_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load-state-dict pre hook: ``p.k`` becomes ``p._checkpoint_wrapped_module.k``, so both
    wrapped and unwrapped checkpoints load (Rule 1)."""
    _rename_keys(state_dict, prefix, prefix + _INNER_PREFIX, skip=prefix + _INNER_PREFIX)


def _rename_keys(
    mapping: dict[str, Any], old_prefix: str, new_prefix: str, skip: str | None = None
) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the keys that start with it, in place;
    keys starting with ``skip`` (already renamed) are left alone."""
    for key in [k for k in mapping if k.startswith(old_prefix)]:
        if skip is not None and key.startswith(skip):
            continue
        mapping[new_prefix + key[len(old_prefix) :]] = mapping.pop(key)


def checkpoint_wrapper(
    module: nn.Module, *, hooks_during_recompute: bool = False, **checkpoint_options: Any
) -> CheckpointWrapper:
    """Wrap ``module`` so that every call runs under ``checkpointing.checkpoint``.

    Same name and use as torch.distributed's ``checkpoint_wrapper``, with ``use_reentrant=False``
    by default. ``state_dict`` keys are those of the unwrapped module and checkpoints load either
    way; the module's own forward hooks do not run again in recompute (see NOTE [Module wrapper]).

    Args:
        module: the module to checkpoint.
        hooks_during_recompute: also run ``module``'s forward pre-hooks and hooks in recompute.
        **checkpoint_options: passed to ``checkpoint`` on every call (``use_reentrant``,
            ``context_fn``, ``determinism_check``, ``debug``, ``early_stop``,
            ``preserve_rng_state``).

    Example:
        >>> import torch, checkpointing
        >>> block = checkpointing.checkpoint_wrapper(torch.nn.Linear(4, 4))
        >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> sorted(block.state_dict())
        ['bias', 'weight']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(_MSG_NOT_A_MODULE.format(type_name=type(module).__name__))
    unknown = sorted(checkpoint_options.keys() - CHECKPOINT_OPTIONS)
    if unknown:
        hint = _HINT_CHECKPOINT_IMPL if "checkpoint_impl" in unknown else ""
        raise TypeError(
            _MSG_UNKNOWN_OPTION.format(names=unknown, allowed=sorted(CHECKPOINT_OPTIONS), hint=hint)
        )
    return CheckpointWrapper(module, hooks_during_recompute, checkpoint_options)


def _always(module: nn.Module) -> bool:
    return True


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = _always,
    **checkpoint_options: Any,
) -> None:
    """Replace, in place, each submodule of ``model`` for which ``check_fn`` is true by
    ``checkpoint_wrapper_fn(submodule, **checkpoint_options)``.

    Same name and use as torch.distributed's function. The root is never wrapped (wrap it with
    ``checkpoint_wrapper``). Children are visited before their parents, so a match inside a
    match gives nested checkpoints; existing ``CheckpointWrapper`` modules, and modules already
    hooked by ``checkpoint_module``, are left as they are, so applying twice wraps nothing new.
    ``checkpoint_wrapper_fn=checkpointing.checkpoint_module`` checkpoints through hooks instead
    of wrappers: module names, types and ``state_dict`` keys stay as they were.

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
    _wrap_children(model, checkpoint_wrapper_fn, check_fn, checkpoint_options)


def _wrap_children(
    parent: nn.Module,
    wrapper_fn: Callable[..., nn.Module],
    check_fn: Callable[[nn.Module], bool],
    options: dict[str, Any],
) -> None:
    for name, child in list(parent.named_children()):
        if isinstance(child, CheckpointWrapper) or is_module_checkpointed(child):
            continue
        _wrap_children(child, wrapper_fn, check_fn, options)
        if check_fn(child):
            setattr(parent, name, wrapper_fn(child, **options))
