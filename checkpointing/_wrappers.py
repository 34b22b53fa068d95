"""Module wrappers: torch.distributed's wrapper API (``checkpoint_wrapper``, ``offload_wrapper``,
``CheckpointWrapper``, ``OffloadWrapper``, ``ActivationWrapper``, ``CheckpointImpl``).

Owns the ``nn.Module`` that runs another module under ``checkpoint`` or with its saved tensors in
host memory (the names, signatures and defaults of
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``), how its ``state_dict`` keys stay
those of the unwrapped model, and what the wrapped module's own hooks do during recompute.
Checkpointing itself belongs to ``_checkpoint``; where saved tensors go, to ``_host_saves``;
applying wrappers across a model, to ``_auto_wrap``; ``is_recomputing`` to ``_state``.

NOTE [Module wrapper]
  Rule 1. The inner module is a registered submodule named ``_checkpoint_wrapped_module`` (torch's
          name, so ``torch.distributed.checkpoint`` and FSDP, which strip that name from
          parameter names, understand our wrapper too). ``state_dict()`` removes the name from
          keys (a state-dict post hook) and ``load_state_dict`` adds it back (a load pre hook),
          so a checkpoint saved with or without wrapping, or with torch's wrapper, loads into
          either.
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
  Rule 5. Our classes subclass torch's (``ActivationWrapper``, ``CheckpointWrapper``,
          ``OffloadWrapper``), so ``isinstance`` checks written against torch's classes accept
          ours: FSDP1's ``FullyShardedDataParallel.module`` looks through a wrapper it wraps,
          and user code counting wrappers counts ours. Torch's ``__init__`` is not run (it
          binds torch's checkpoint and registers torch's state-dict hooks, whose load hook
          would prefix keys already prefixed); only ``nn.Module``'s.
  Rule 6. torch's spelling ``checkpoint_impl`` (its ``CheckpointImpl`` enum, which is ours) and
          ours, ``use_reentrant``, mean one thing: ``REENTRANT`` is ``use_reentrant=True``.
          Given both, ``use_reentrant`` decides; ``REENTRANT`` with ``use_reentrant=False`` is
          refused. Any other ``checkpoint_impl`` is a ``TypeError``.
  Rule 7. With ``checkpoint_fn`` given, that function runs, as in torch:
          ``checkpoint_fn(module, *args, **checkpoint_fn_kwargs, **kwargs)``, with the call's
          keyword arguments packed into positional ones when ``checkpoint_impl`` is
          ``REENTRANT``. The options are that function's; Rule 4 is not ours to keep there (the
          module is called with its hooks).
  Rule 8. ``recompute_state_hooks`` given to a wrapper are read once, when it is built: a
          generator would serve only the first call, and later recomputes would restore
          nothing.

Rejected: sharing the inner module's ``_parameters``/``_modules`` dicts with the wrapper (names
unchanged everywhere, but ``train()``, ``_apply`` overrides such as RNNs' and custom
``_load_from_state_dict`` of the inner module would be bypassed), and swapping the inner module's
``forward`` attribute (mutates the user's module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from . import _compat
from ._checkpoint import CHECKPOINT_OPTIONS, check_use_reentrant, checkpoint, hooks_read_once
from ._context_fn import context_fn_from
from ._host_saves import SavingOnHost
from ._state import is_recomputing

__all__ = [
    "ActivationWrapper",
    "CheckpointImpl",
    "CheckpointWrapper",
    "OffloadWrapper",
    "checked_options",
    "checkpoint_wrapper",
    "offload_wrapper",
]

# torch's enum itself (Rule 6): ``REENTRANT`` or ``NO_REENTRANT``.
CheckpointImpl = _compat.checkpoint_wrapper.CheckpointImpl

_INNER = "_checkpoint_wrapped_module"
_INNER_PREFIX = _INNER + "."

_MSG_NOT_A_MODULE = (
    "checkpointing.{api}: expected an nn.Module to wrap, got {type_name}. Fix: "
    "wrap a module ({api}(layer)), or call checkpointing.checkpoint(fn, ...) for a "
    "plain function."
)
_MSG_UNKNOWN_OPTION = (
    "checkpointing.{api}: unknown checkpoint option(s) {names}; expected some of "
    "{allowed}. Fix: pass only checkpoint() options here; the module's own keyword arguments "
    "go to the call, wrapped(x, key=value).{hint}"
)
_HINT_CUSTOM_FN = (
    " To pass options to your own checkpoint function, give it as checkpoint_fn=...; its "
    "options are then not checked here."
)
_MSG_BAD_IMPL = (
    "checkpointing.{api}: 'checkpoint_impl' must be a CheckpointImpl (REENTRANT or "
    "NO_REENTRANT), got {got}. Fix: checkpoint_impl=checkpointing.CheckpointImpl.REENTRANT "
    "(torch's enum, the same object), or use_reentrant=True for the reentrant variant "
    "(use_reentrant=False, the default, for the other)."
)
_MSG_IMPL_CONFLICT = (
    "checkpointing.{api}: checkpoint_impl=CheckpointImpl.REENTRANT and use_reentrant=False "
    "ask for different variants. Fix: pass one of them (use_reentrant=False alone, or "
    "checkpoint_impl=CheckpointImpl.NO_REENTRANT)."
)
_MSG_BAD_CHECKPOINT_FN = (
    "checkpointing.{api}: checkpoint_fn must be a checkpoint function called as "
    "checkpoint_fn(module, *args, **kwargs), got {got}. Fix: leave it out to use "
    "checkpointing.checkpoint, or pass e.g. checkpoint_fn=torch.utils.checkpoint.checkpoint."
)


def checked_options(api: str, checkpoint_impl: object, options: dict[str, Any]) -> dict[str, Any]:
    """The options a wrapper passes to ``checkpoint`` (Rules 3, 6 and 8), or a clear error
    naming ``api``: unknown names, a ``checkpoint_impl`` that is not a ``CheckpointImpl``, a
    ``use_reentrant`` that is not a bool, a conflict between the two."""
    if not isinstance(checkpoint_impl, CheckpointImpl):
        got = f"{checkpoint_impl!r} of type {type(checkpoint_impl).__name__}"
        raise TypeError(_MSG_BAD_IMPL.format(api=api, got=got))
    unknown = sorted(options.keys() - CHECKPOINT_OPTIONS)
    if unknown:
        allowed = sorted(CHECKPOINT_OPTIONS)
        message = _MSG_UNKNOWN_OPTION.format(
            api=api, names=unknown, allowed=allowed, hint=_HINT_CUSTOM_FN
        )
        raise TypeError(message)
    reentrant = checkpoint_impl is CheckpointImpl.REENTRANT
    use_reentrant = options.get("use_reentrant")
    check_use_reentrant(use_reentrant, f"checkpointing.{api}")
    if use_reentrant is None:
        use_reentrant = reentrant
    elif reentrant and not use_reentrant:
        raise ValueError(_MSG_IMPL_CONFLICT.format(api=api))
    checked = {**options, "use_reentrant": bool(use_reentrant)}
    if "context_fn" in options:  # NOTE [Context functions], Rule 4: turned once
        checked["context_fn"] = context_fn_from(options["context_fn"], f"checkpointing.{api}")
    if options.get("recompute_state_hooks") is not None:  # Rule 8
        checked["recompute_state_hooks"] = hooks_read_once(
            options["recompute_state_hooks"], f"checkpointing.{api}"
        )
    return checked


class ActivationWrapper(_compat.checkpoint_wrapper.ActivationWrapper):
    """What ``CheckpointWrapper`` and ``OffloadWrapper`` share, as in torch: the wrapped module
    under ``_checkpoint_wrapped_module``, unwrapped ``state_dict`` keys and parameter names,
    attribute lookups and indexing passed on. A checkpoint saved with or without the wrapper
    (ours or torch's) loads into either.

    A subclass of torch's class of that name, so ``isinstance`` checks written against torch's
    classes accept ours. Not built directly: subclasses define ``forward``."""

    def __init__(self, mod: nn.Module) -> None:
        nn.Module.__init__(self)  # not torch's __init__ (Rule 5)
        self._checkpoint_wrapped_module = mod
        # Both registration methods are public but untyped in torch 2.13. See Rule 1.
        self.register_state_dict_post_hook(_strip_inner_prefix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_inner_prefix)  # type: ignore[no-untyped-call]

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            inner = nn.Module.__getattr__(self, _INNER)
            return getattr(inner, name)

    def __getitem__(self, key: Any) -> Any:
        """Index the wrapped module (for a wrapped ``nn.Sequential``/``nn.ModuleList``)."""
        inner: Any = self._checkpoint_wrapped_module  # indexable only for containers
        return inner[key]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under their unwrapped names; called on a parent,
        names include ``_checkpoint_wrapped_module.`` as with torch's wrapper."""
        for name, param in nn.Module.named_parameters(self, prefix, recurse, remove_duplicate):
            yield name.replace(_INNER_PREFIX, ""), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers under their unwrapped names, as ``named_parameters``."""
        for name, buf in nn.Module.named_buffers(self, prefix, recurse, remove_duplicate):
            yield name.replace(_INNER_PREFIX, ""), buf


class CheckpointWrapper(ActivationWrapper, _compat.checkpoint_wrapper.CheckpointWrapper):
    """Runs the wrapped module under ``checkpointing.checkpoint``.

    Built as torch's: ``CheckpointWrapper(module)``, ``checkpoint_impl``, ``checkpoint_fn`` and
    checkpoint options as keyword arguments (``checkpoint_wrapper`` does the same). Attribute
    lookups and indexing the wrapper does not answer itself go to the wrapped module, so
    ``wrapped.weight`` or ``wrapped[0]`` still work.
    """

    def __init__(
        self,
        mod: nn.Module,
        checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
        checkpoint_fn: Callable[..., Any] | None = None,
        *,
        hooks_during_recompute: bool = False,
        **checkpoint_fn_kwargs: Any,
    ) -> None:
        api = "CheckpointWrapper"
        if not isinstance(mod, nn.Module):
            raise TypeError(_MSG_NOT_A_MODULE.format(api=api, type_name=type(mod).__name__))
        if checkpoint_fn is None:
            options = checked_options(api, checkpoint_impl, checkpoint_fn_kwargs)
            run: functools.partial[Any] = functools.partial(checkpoint, **options)
        else:  # Rule 7
            checked_options(api, checkpoint_impl, {})
            options = dict(checkpoint_fn_kwargs)
            run = functools.partial(_checked_fn(api, checkpoint_fn), **options)
        super().__init__(mod)
        self.checkpoint_impl = checkpoint_impl
        self.checkpoint_fn = run  # torch's attribute: what a call runs
        self.custom_checkpoint_fn = checkpoint_fn is not None
        self.hooks_during_recompute = hooks_during_recompute
        self.checkpoint_options = options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module on ``args``/``kwargs`` under ``checkpoint``."""
        if self.custom_checkpoint_fn:  # Rule 7: torch's call, exactly
            run: Callable[..., Any] = self.checkpoint_fn
            inner = self._checkpoint_wrapped_module
            if self.checkpoint_impl is CheckpointImpl.REENTRANT and kwargs:
                packed = functools.partial(_call_packed, inner, len(args), tuple(kwargs))
                return run(packed, *args, *kwargs.values())
            return run(inner, *args, **kwargs)
        options = self.checkpoint_options
        if options["use_reentrant"] and kwargs:
            keys = tuple(kwargs)
            return checkpoint(
                _call_with_packed_kwargs, self, len(args), keys, *args, *kwargs.values(), **options
            )
        return checkpoint(_call_inner, self, *args, **options, **kwargs)

    def extra_repr(self) -> str:
        """Show the options the wrapper passes to its checkpoint function."""
        options = ", ".join(f"{k}={v!r}" for k, v in self.checkpoint_options.items())
        if self.custom_checkpoint_fn:
            name = getattr(self.checkpoint_fn.func, "__qualname__", repr(self.checkpoint_fn.func))
            return f"checkpoint_fn={name}, {options}".rstrip(", ")
        return f"{options}, hooks_during_recompute={self.hooks_during_recompute}"


class OffloadWrapper(ActivationWrapper, _compat.checkpoint_wrapper.OffloadWrapper):
    """Runs the wrapped module once, with what autograd saves for its backward kept in host
    memory (``_host_saves``: on CUDA through the offload engine, copies off the compute stream
    and prefetched in backward); nothing is recomputed. Built as torch's: ``OffloadWrapper(m)``
    or ``offload_wrapper(m)``."""

    def __init__(self, mod: nn.Module) -> None:
        if not isinstance(mod, nn.Module):
            raise TypeError(
                _MSG_NOT_A_MODULE.format(api="OffloadWrapper", type_name=type(mod).__name__)
            )
        super().__init__(mod)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module with its saved tensors offloaded."""
        with SavingOnHost():
            return self._checkpoint_wrapped_module(*args, **kwargs)


def _checked_fn(api: str, checkpoint_fn: object) -> Callable[..., Any]:
    """``checkpoint_fn`` if it can be called, else a clear error (Rule 7)."""
    if not callable(checkpoint_fn):
        got = f"{checkpoint_fn!r} of type {type(checkpoint_fn).__name__}"
        raise TypeError(_MSG_BAD_CHECKPOINT_FN.format(api=api, got=got))
    return checkpoint_fn


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


def _call_packed(module: nn.Module, n_args: int, keys: tuple[str, ...], *flat: Any) -> Any:
    """The module's call rebuilt from positional inputs, for a custom ``checkpoint_fn`` (Rule 7)."""
    kwargs = dict(zip(keys, flat[n_args:], strict=True))
    return module(*flat[:n_args], **kwargs)


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
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    *,
    hooks_during_recompute: bool = False,
    **checkpoint_fn_kwargs: Any,
) -> nn.Module:
    """Wrap ``module`` so that every call runs under ``checkpointing.checkpoint``.

    torch.distributed's ``checkpoint_wrapper``: same signature, defaults and behaviour
    (non-reentrant by default, without the warning plain ``checkpoint`` gives). ``state_dict``
    keys are those of the unwrapped module and checkpoints load either way; the module's own
    forward hooks do not run again in recompute (hooks of modules inside it do, and can ask
    ``checkpointing.is_recomputing()``), unless ``hooks_during_recompute=True``.

    Args:
        module: the module to checkpoint.
        checkpoint_impl: ``CheckpointImpl.NO_REENTRANT`` (default) or ``REENTRANT``; the same as
            ``use_reentrant=False``/``True`` (torch's enum itself).
        checkpoint_fn: a checkpoint function to run instead of ``checkpointing.checkpoint``,
            called as ``checkpoint_fn(module, *args, **checkpoint_fn_kwargs, **kwargs)``.
        hooks_during_recompute: also run ``module``'s forward pre-hooks and hooks in recompute.
        **checkpoint_fn_kwargs: passed on every call: to ``checkpoint_fn`` if given, else to
            ``checkpoint`` (``use_reentrant``, ``context_fn``, ``determinism_check``, ``debug``,
            ``early_stop``, ``preserve_rng_state``, ``recompute_state_hooks``, ...).

    Example:
        >>> import torch, checkpointing
        >>> block = checkpointing.checkpoint_wrapper(torch.nn.Linear(4, 4))
        >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> sorted(block.state_dict())
        ['bias', 'weight']
    """
    api = "checkpoint_wrapper"
    if not isinstance(module, nn.Module):
        raise TypeError(_MSG_NOT_A_MODULE.format(api=api, type_name=type(module).__name__))
    if checkpoint_fn is None:  # checked here, so that errors name this function
        checkpoint_fn_kwargs = checked_options(api, checkpoint_impl, checkpoint_fn_kwargs)
    return CheckpointWrapper(
        module,
        checkpoint_impl,
        checkpoint_fn,
        hooks_during_recompute=hooks_during_recompute,
        **checkpoint_fn_kwargs,
    )


def offload_wrapper(module: nn.Module) -> nn.Module:
    """Wrap ``module`` so that what autograd saves during its calls waits in host memory.

    torch.distributed's ``offload_wrapper``: nothing is recomputed; on CUDA the copies run on
    side streams into pooled pinned buffers and come back prefetched in backward, off the
    compute stream; tensors already in host memory stay where they are. It
    composes with ``checkpoint_wrapper``: offload what a checkpoint keeps.

    Example:
        >>> import torch, checkpointing
        >>> block = checkpointing.offload_wrapper(torch.nn.Linear(4, 4))
        >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            _MSG_NOT_A_MODULE.format(api="offload_wrapper", type_name=type(module).__name__)
        )
    return OffloadWrapper(module)
