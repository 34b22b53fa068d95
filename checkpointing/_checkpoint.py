"""The ``checkpoint()`` front door: validates arguments and picks the variant.

Owns the public signature (torch 2.14's, the newest: ``function`` may be omitted to get a
decorator), the decorator's wrapper, the warning when ``use_reentrant`` is omitted, and the
argument errors. The reentrant variant lives in ``_reentrant``; the non-reentrant variant is
``_frame``'s generator, driven here exactly as ``checkpoint_module``'s hooks drive it (one path);
the determinism and debug machinery lives in ``_determinism``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, TypeVar, overload

import torch

from . import _compat, _compiled
from ._context_fn import ContextFnOrPolicy, context_fn_from
from ._errors import describe_value
from ._frame import frame_generator, run_generator
from ._options import CheckpointOptions, Tiling, options_of
from ._reentrant import CheckpointFunction
from ._state import (
    RecomputeStateHook,
    is_noop_context_fn,
    noop_context_fn,
    state_hooks_from,
)
from ._tiling import check_tile_options, run_tiled

__all__ = [
    "CHECKPOINT_OPTIONS",
    "CheckpointedFunction",
    "check_use_reentrant",
    "checkpoint",
    "checkpoint_call",
    "hooks_read_once",
]

# The keyword arguments of ``checkpoint`` that wrappers and integrations pass through to it.
CHECKPOINT_OPTIONS: Final = frozenset(
    {
        "context_fn",
        "debug",
        "determinism_check",
        "early_stop",
        "preserve_rng_state",
        "recompute_state_hooks",
        "respect_saved_tensors_hooks",
        "use_reentrant",
    }
)

_API: Final = "checkpointing.checkpoint"
_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

# Torch 2.15's wording (2.11-2.14 said "Starting in PyTorch 2.9, ...").
_MSG_USE_REENTRANT_OMITTED = (
    "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly. In a "
    "future release, calling checkpoint without use_reentrant will raise an exception. "
    "use_reentrant=False is recommended, but if you need to preserve the current default "
    "behavior, you can pass use_reentrant=True. Refer to docs for more details on the "
    "differences between the two variants."
)
_MSG_UNEXPECTED_KWARGS = (
    "Unexpected keyword arguments: {names}. (checkpointing.checkpoint with use_reentrant=True "
    "cannot pass keyword arguments to the function. Fix: pass use_reentrant=False, or bind "
    "them with functools.partial.)"
)
_MSG_REENTRANT_ONLY_DEFAULTS = (
    "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported when "
    "use_reentrant=False. (checkpointing.checkpoint: got use_reentrant=True with {what}. Fix: "
    "pass use_reentrant=False.)"
)
_MSG_DECORATOR_KWARGS = (
    "Unexpected keyword arguments: {names}. (checkpointing.checkpoint called without a function "
    "returns a decorator, which takes checkpoint options only. Fix: pass the function's own "
    "arguments when calling the decorated function, e.g. "
    "`checkpoint(use_reentrant=False)(fn)(x, scale=2)`.)"
)
_MSG_HOOKS_USED_UP = (
    "{api}: recompute_state_hooks is an iterator with no hooks left (a generator already "
    "used, e.g. given to another wrapper first), so no state would be restored. Fix: pass a "
    "list, e.g. recompute_state_hooks=[counter], which every call can read."
)
_MSG_USE_REENTRANT_NOT_BOOL = (
    "{api}: use_reentrant must be True or False (or omitted), got {observed}. Torch reads any "
    "other value for its truth, so use_reentrant='false' would run the reentrant variant.{hint} "
    "Fix: pass the bool, use_reentrant=False (recommended) or use_reentrant=True."
)
_HINT_TENSOR = (
    " A tensor there is usually a second input given by position: pass it before the options, "
    "and use_reentrant by keyword."
)
_MSG_NOT_CALLABLE = (
    "checkpointing.checkpoint: expected a callable as the first argument (the function to "
    "checkpoint), got {type_name}. Fix: checkpoint(fn, *inputs, use_reentrant=False)."
)


@overload
def checkpoint(
    function: Callable[..., _T],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: ContextFnOrPolicy = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    recompute_state_hooks: RecomputeStateHook | Iterable[RecomputeStateHook] | None = None,
    tile: Tiling | None = None,
    **kwargs: Any,
) -> _T: ...


@overload
def checkpoint(
    function: None = None,
    *,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: ContextFnOrPolicy = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    recompute_state_hooks: RecomputeStateHook | Iterable[RecomputeStateHook] | None = None,
    tile: Tiling | None = None,
) -> Callable[[_F], _F]: ...


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: ContextFnOrPolicy = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    recompute_state_hooks: RecomputeStateHook | Iterable[RecomputeStateHook] | None = None,
    tile: Tiling | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    Drop-in for ``torch.utils.checkpoint.checkpoint`` (torch 2.15's signature and behaviour, on
    every supported release): the inputs are kept and the function is re-run in backward to
    recompute what backward needs. Called with options only, it returns a decorator.

    Args:
        function: the region to checkpoint; omitted, ``checkpoint(**options)`` returns a
            decorator for functions and methods (``@checkpoint(use_reentrant=False)``).
        *args: its positional inputs.
        use_reentrant: ``False`` (recommended) for the non-reentrant frame; ``True`` for the
            reentrant ``CheckpointFunction``. Omitted: warns and uses ``True``, as torch.
        preserve_rng_state: restore the RNG state of the forward for recompute.
        context_fn: returns two context managers, entered around forward and recompute
            (non-reentrant only); see ``create_selective_checkpoint_contexts``. Ours also
            takes a policy (``save_matmuls()``) or a policy's name (``"save_matmuls"``).
        determinism_check: ``"default"`` compares shape, dtype and device of recomputed
            tensors with the forward's; ``"none"`` skips that.
        debug: on a mismatch, report the ops run in forward and recompute and the first
            divergence (non-reentrant only).
        early_stop: stop recompute once everything needed exists (non-reentrant only; a
            ``set_checkpoint_early_stop`` context active at forward time overrides it).
        respect_saved_tensors_hooks: route what a selective policy keeps through the user's
            saved-tensors hooks (``True``), or not (``False``); ``None`` does not, and warns
            (``FutureWarning``) when such hooks are active (non-reentrant only).
        recompute_state_hooks: ours: objects with ``snapshot()`` and ``restore(state)`` (one,
            or a list) for user state the recompute must see as the forward did (e.g. a
            counter seeding a custom random kernel): restored when recompute starts and after
            each kept span it skips (``checkpointing.keep``); the caller's state is put back
            afterwards.
        tile: ours: a ``checkpointing.Tiling`` declaring the region position-wise along a
            dimension (tokens): its forward and its recompute then run chunk by chunk, so what
            lives inside the region at once is about ``1/chunks`` of it (non-reentrant only;
            without ``context_fn`` and ``recompute_state_hooks``). See ``checkpointing.tiled``.
        **kwargs: keyword arguments for ``function`` (non-reentrant only).

    Example:
        >>> import torch, checkpointing
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = checkpointing.checkpoint(torch.sin, x, use_reentrant=False)
        >>> y.sum().backward()
        >>> @checkpointing.checkpoint(use_reentrant=False)
        ... def block(t):
        ...     return t.sin().cos()
        >>> block(x).sum().backward()
    """
    check_use_reentrant(use_reentrant, _API)
    if context_fn is not noop_context_fn:  # See NOTE [Context functions], Rule 4
        context_fn = context_fn_from(context_fn, _API)
    if function is None and not args:
        if kwargs:
            raise ValueError(_MSG_DECORATOR_KWARGS.format(names=",".join(kwargs)))
        if recompute_state_hooks is not None:
            recompute_state_hooks = hooks_read_once(recompute_state_hooks, _API)
        options = options_of(
            use_reentrant,
            preserve_rng_state,
            context_fn,
            determinism_check,
            debug,
            early_stop,
            respect_saved_tensors_hooks,
            recompute_state_hooks,
            tile,
            api=_API,
        )
        return functools.partial(CheckpointedFunction, options=options)
    run: Callable[[Any, tuple[Any, ...], dict[str, Any], CheckpointOptions], Any] = checkpoint_call
    if _compiled.compiling():  # dynamo is tracing: torch's region ([Compiled regions])
        run = _compiled.torch_region  # a tiled region too, untiled (NOTE [Tiled regions], 9)
    elif tile is not None:  # NOTE [Tiled regions]
        use_reentrant = bool(use_reentrant)  # no warning: a tiled region is not reentrant
    elif use_reentrant is None:
        # The caller's line (no wrapper frame in between; torch's points into its own wrapper).
        warnings.warn(_MSG_USE_REENTRANT_OMITTED, UserWarning, stacklevel=2)
        use_reentrant = True
    options = options_of(  # NOTE [Checkpoint options], Rule 2: the defaults build nothing
        use_reentrant,
        preserve_rng_state,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        respect_saved_tensors_hooks,
        recompute_state_hooks,
        tile,
        api=_API,
    )
    return run(function, args, kwargs, options)


@_compat.skip_dynamo_in_code
def checkpoint_call(
    function: object, args: tuple[Any, ...], kwargs: dict[str, Any], options: CheckpointOptions
) -> Any:
    """One checkpointed call of ``function(*args, **kwargs)`` with the options resolved (no
    ``None`` for ``use_reentrant``): what ``checkpoint`` and its decorator both run. ``kwargs``
    stay ``function``'s own, so a function may take a keyword named like an option."""
    if not callable(function):
        raise TypeError(_MSG_NOT_CALLABLE.format(type_name=type(function).__name__))
    if options.tile is not None:  # NOTE [Tiled regions]
        check_tile_options(_API, options)
        return run_tiled(function, args, kwargs, options)
    if options.use_reentrant:
        if kwargs:
            raise ValueError(_MSG_UNEXPECTED_KWARGS.format(names=",".join(kwargs)))
        _refuse_non_reentrant_options(options)
        hooks = state_hooks_from(options.recompute_state_hooks, _API)
        if hooks:
            function = _RestoringState(function, hooks)
        return CheckpointFunction.apply(function, options.preserve_rng_state, *args)  # type: ignore[no-untyped-call]  # Function.apply is untyped
    gen = frame_generator(function, args, kwargs, options)
    return run_generator(gen, function, *args, **kwargs)


def _refuse_non_reentrant_options(options: CheckpointOptions) -> None:
    """The options that only the non-reentrant variant has, refused for the reentrant one."""
    if not is_noop_context_fn(options.context_fn):
        what = "context_fn"
    elif options.debug is not False:
        what = "debug=True"
    elif options.respect_saved_tensors_hooks is not None:
        what = f"respect_saved_tensors_hooks={options.respect_saved_tensors_hooks!r}"
    else:
        return
    raise ValueError(_MSG_REENTRANT_ONLY_DEFAULTS.format(what=what))


def check_use_reentrant(value: object, api: str, tensor_hint: str = "") -> None:
    """Refuse a ``use_reentrant`` that is neither a bool nor ``None`` (torch would read its truth:
    ``"false"`` is true); ``tensor_hint`` says what a tensor there usually is, where ``api``
    takes it by position."""
    if value is not None and not isinstance(value, bool):  # bool has no subclasses
        hint = (tensor_hint or _HINT_TENSOR) if isinstance(value, torch.Tensor) else ""
        message = _MSG_USE_REENTRANT_NOT_BOOL.format(
            api=api, observed=describe_value(value), hint=hint
        )
        raise TypeError(message)


def hooks_read_once(value: object, api: str) -> tuple[RecomputeStateHook, ...]:
    """``recompute_state_hooks`` given to something that checkpoints many calls (the decorator,
    the wrappers) as a tuple, read now: a generator must serve every call, not only the first
    (issue 40, item 5). An iterator with nothing left is refused: it was used up elsewhere."""
    hooks = state_hooks_from(value, api)
    if not hooks and isinstance(value, Iterator):
        raise ValueError(_MSG_HOOKS_USED_UP.format(api=api))
    return hooks


class _RestoringState:
    """A reentrant checkpoint's function with user state hooks (NOTE [Nestable checkpoint],
    Rule 12, for ``CheckpointFunction``): the first call (forward) snapshots; every later call
    (a re-run in backward) restores the forward's state and then puts the caller's back."""

    __slots__ = ("entry", "function", "hooks")

    def __init__(self, function: Callable[..., Any], hooks: tuple[RecomputeStateHook, ...]):
        self.function = function
        self.hooks = hooks
        self.entry: tuple[Any, ...] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.entry is None:
            self.entry = tuple(hook.snapshot() for hook in self.hooks)
            return self.function(*args)
        outer = tuple(hook.snapshot() for hook in self.hooks)
        for hook, snapshot in zip(self.hooks, self.entry, strict=True):
            hook.restore(snapshot)
        try:
            return self.function(*args)
        finally:
            for hook, snapshot in zip(self.hooks, outer, strict=True):
                hook.restore(snapshot)


class CheckpointedFunction:
    """``function`` with checkpoint options bound: what ``@checkpoint(**options)`` returns.

    Calling it checkpoints one call of ``function``; it keeps ``function``'s name, docstring
    and module, and as a method decorator binds ``self`` (the bound method is checkpointed
    with the same options)."""

    def __init__(
        self,
        function: Callable[..., Any],
        options: CheckpointOptions,
        eager: CheckpointOptions | None = None,
    ) -> None:
        self.function = function
        self.options = options  # as the decorator was given them (NOTE [Checkpoint options], 4)
        if eager is None:  # what an eager call runs: an omitted use_reentrant resolved
            eager = options
            if options.use_reentrant is None:  # tiled: no reentrant form; else torch's default
                eager = dataclasses.replace(options, use_reentrant=options.tile is None)
        self.eager = eager
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = self.options
        if _compiled.compiling():  # dynamo is tracing: torch's region ([Compiled regions])
            return _compiled.torch_region(self.function, args, kwargs, options)  # untiled (9)
        if options.use_reentrant is None and options.tile is None:
            # Warned here, so that the warning points at the caller's line, not at this one.
            warnings.warn(_MSG_USE_REENTRANT_OMITTED, UserWarning, stacklevel=2)
        # The call's keywords stay the function's, even one named like an option (as torch).
        return checkpoint_call(self.function, args, kwargs, self.eager)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        if _compiled.compiling() and isinstance(self.function, types.FunctionType):
            # What the bound copy below does, in a form every release's dynamo traces.
            return functools.partial(self, instance)
        bind = getattr(self.function, "__get__", None)
        if bind is None:
            return self
        return type(self)(bind(instance, owner), self.options, self.eager)
