"""``checkpoint_sequential``: checkpoint a chain of modules or functions in segments.

Owns how a chain is cut into segments (``segment_bounds``, a pure function) and the loop that
checkpoints each segment. By default it cuts exactly as torch 2.13 does: ``segments - 1``
checkpointed segments of ``len // segments`` functions each, then the rest runs un-checkpointed.
Checkpointing itself belongs to ``_checkpoint``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._checkpoint import checkpoint

__all__ = ["checkpoint_sequential", "segment_bounds"]

_MSG_USE_REENTRANT_OMITTED = (
    "torch.utils.checkpoint.checkpoint_sequential: the use_reentrant parameter should be "
    "passed explicitly. In version 2.9 we will raise an exception if use_reentrant is not "
    "passed. use_reentrant=False is recommended, but if you need to preserve the current "
    "default behavior, you can pass use_reentrant=True. Refer to docs for more details on the "
    "differences between the two variants."
)
_MSG_UNEXPECTED_KWARGS = (
    "Unexpected keyword arguments: {names}. (checkpointing.checkpoint_sequential accepts only "
    "preserve_rng_state as an extra keyword. Fix: remove the others.)"
)
_MSG_BAD_SEGMENTS = (
    "checkpointing.checkpoint_sequential: segments must be an integer between 1 and the number "
    "of functions ({n}), got {segments!r}. Fix: pass segments=min(segments, {n}) (e.g. "
    "round(sqrt({n})) for the usual memory/compute balance)."
)


def segment_bounds(n_functions: int, segments: int) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` ranges of the chain, torch's way: every range but the last is
    checkpointed and has ``n_functions // segments`` functions; the last gets the remainder.

    >>> segment_bounds(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    """
    size = n_functions // segments
    bounds = [(start, start + size) for start in range(0, size * (segments - 1), size)]
    last_start = bounds[-1][1] if bounds else 0
    bounds.append((last_start, n_functions))
    return bounds


def _run_range(functions: Sequence[Callable[..., Any]], start: int, end: int) -> Any:
    def forward(value: Any) -> Any:
        for j in range(start, end):
            value = functions[j](value)
        return value

    return forward


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``functions`` in order on ``input``, checkpointing all segments but the last.

    Drop-in for ``torch.utils.checkpoint.checkpoint_sequential``: the same segmenting, the same
    warning when ``use_reentrant`` is omitted; only ``preserve_rng_state`` is accepted in
    ``kwargs``. Beyond torch, a bad ``segments`` is a clear ``ValueError``.

    Example:
        >>> import torch, checkpointing
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> out = checkpointing.checkpoint_sequential(model, 2, x, use_reentrant=False)
    """
    if use_reentrant is None:
        warnings.warn(_MSG_USE_REENTRANT_OMITTED, UserWarning, stacklevel=2)
        use_reentrant = True
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError(_MSG_UNEXPECTED_KWARGS.format(names=",".join(kwargs)))
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    n = len(functions)
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n:
        raise ValueError(_MSG_BAD_SEGMENTS.format(n=n, segments=segments))
    *checkpointed, (last_start, last_end) = segment_bounds(n, segments)
    for start, end in checkpointed:
        input = checkpoint(
            _run_range(functions, start, end),
            input,
            use_reentrant=use_reentrant,
            preserve_rng_state=preserve,
        )
    return _run_range(functions, last_start, last_end)(input)
