"""The ``checkpoint()`` front door: validates arguments and picks the variant.

Owns the public signature (identical to ``torch.utils.checkpoint.checkpoint`` in 2.13), the
warning when ``use_reentrant`` is omitted, and the argument errors. The reentrant variant lives in
``_reentrant``; the non-reentrant variant is ``_frame``'s generator, driven here exactly as
``checkpoint_module``'s hooks drive it (one path); the determinism and debug machinery lives in
``_determinism``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Final

from . import _compat
from ._frame import checkpoint_without_reentrant_generator, run_generator
from ._reentrant import CheckpointFunction
from ._state import ContextFn, is_noop_context_fn, noop_context_fn

__all__ = ["CHECKPOINT_OPTIONS", "checkpoint"]

# The keyword arguments of ``checkpoint`` that wrappers and integrations pass through to it.
CHECKPOINT_OPTIONS: Final = frozenset(
    {
        "context_fn",
        "debug",
        "determinism_check",
        "early_stop",
        "preserve_rng_state",
        "use_reentrant",
    }
)

_MSG_USE_REENTRANT_OMITTED = (
    "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly. Starting "
    "in PyTorch 2.9, calling checkpoint without use_reentrant will raise an exception. "
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
    "Passing `context_fn` or `debug` is only supported when use_reentrant=False. "
    "(checkpointing.checkpoint: got use_reentrant=True with {what}. Fix: pass "
    "use_reentrant=False.)"
)
_MSG_NOT_CALLABLE = (
    "checkpointing.checkpoint: expected a callable as the first argument (the function to "
    "checkpoint), got {type_name}. Fix: checkpoint(fn, *inputs, use_reentrant=False)."
)


@_compat.skip_dynamo
def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: ContextFn = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    Drop-in for ``torch.utils.checkpoint.checkpoint`` (same signature and behaviour): the inputs
    are kept and the function is re-run in backward to recompute what backward needs.

    Args:
        function: the region to checkpoint.
        *args: its positional inputs.
        use_reentrant: ``False`` (recommended) for the non-reentrant frame; ``True`` for the
            reentrant ``CheckpointFunction``. Omitted: warns and uses ``True``, as torch 2.13.
        context_fn: returns two context managers, entered around forward and recompute
            (non-reentrant only); see ``create_selective_checkpoint_contexts``.
        determinism_check: ``"default"`` compares shape, dtype and device of recomputed
            tensors with the forward's; ``"none"`` skips that.
        debug: on a mismatch, report the ops run in forward and recompute and the first
            divergence (non-reentrant only).
        early_stop: stop recompute once everything needed exists (non-reentrant only; a
            ``set_checkpoint_early_stop`` context active at forward time overrides it).
        **kwargs: ``preserve_rng_state=True`` (restore RNG state for recompute), then keyword
            arguments for ``function`` (non-reentrant only).

    Example:
        >>> import torch, checkpointing
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = checkpointing.checkpoint(torch.sin, x, use_reentrant=False)
        >>> y.sum().backward()
    """
    if use_reentrant is None:
        # The caller's line (no wrapper frame in between; torch's points into its own wrapper).
        warnings.warn(_MSG_USE_REENTRANT_OMITTED, UserWarning, stacklevel=2)
        use_reentrant = True
    if not callable(function):
        raise TypeError(_MSG_NOT_CALLABLE.format(type_name=type(function).__name__))
    preserve = kwargs.pop("preserve_rng_state", True)
    if use_reentrant:
        if kwargs:
            raise ValueError(_MSG_UNEXPECTED_KWARGS.format(names=",".join(kwargs)))
        if not is_noop_context_fn(context_fn) or debug is not False:
            what = "context_fn" if not is_noop_context_fn(context_fn) else "debug=True"
            raise ValueError(_MSG_REENTRANT_ONLY_DEFAULTS.format(what=what))
        return CheckpointFunction.apply(function, preserve, *args)  # type: ignore[no-untyped-call]  # Function.apply is untyped
    gen = checkpoint_without_reentrant_generator(
        function, preserve, context_fn, determinism_check, debug, early_stop, *args, **kwargs
    )
    return run_generator(gen, function, *args, **kwargs)
