"""The reentrant variant: ``CheckpointFunction``.

Owns the autograd ``Function`` that runs the region under ``no_grad`` in forward and re-runs it
with grad enabled inside its own backward, calling ``torch.autograd.backward`` reentrantly on the
re-run's outputs. Global state capture and restore belong to ``_state.ForwardState``.

NOTE [Reentrant checkpoint]
  Rule 1. Forward runs under ``torch.no_grad``: nothing inside the region is saved; only the tensor
          inputs are (through ``save_for_backward``, so in-place changes before backward raise).
  Rule 2. Backward re-runs the region on detached copies of the inputs under the forward's RNG,
          autocast and device context, then back-propagates through the outputs that require
          grad, with the incoming gradients, and returns the inputs' ``.grad``.
  Rule 3. Only ``.backward()`` without ``inputs=`` can drive a reentrant backward; under
          ``torch.autograd.grad`` or ``backward(inputs=...)`` it raises and names
          ``use_reentrant=False`` as the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._compat import is_checkpoint_valid, run_backward
from ._state import ForwardState, check_backward_validity, detach_variable

__all__ = ["CheckpointFunction"]

_MSG_GRAD_API = (
    "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing "
    "an `inputs` parameter to .backward(). To resolve this error, you can either set "
    "use_reentrant=False, or call .backward() without passing the `inputs` argument."
)
_MSG_NO_OUTPUT_REQUIRES_GRAD = (
    "none of output has requires_grad=True, this checkpoint() is not necessary"
)


class CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint (``use_reentrant=True``), as ``torch.utils.checkpoint``'s.

    Forward runs the function under ``torch.no_grad()`` and keeps only its inputs; backward
    re-runs it with gradients on detached copies of the inputs (under the forward's RNG state)
    and back-propagates through that re-run. Only ``.backward()`` can drive it:
    ``torch.autograd.grad`` raises, as with torch's.
    """

    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any
    ) -> Any:
        """Run ``run_function(*args)`` without recording a graph; keep only the inputs."""
        check_backward_validity(args)
        ctx.run_function = run_function
        ctx.state = ForwardState(args, preserve_rng_state)
        ctx.inputs = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.tensor_indices = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_indices))
        with torch.no_grad():  # See NOTE [Reentrant checkpoint], Rule 1
            outputs = run_function(*args)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        """Re-run the region with grad on detached copies of its inputs (under the forward's
        RNG state) and back-propagate through that re-run; only ``.backward()`` can drive it."""
        if not is_checkpoint_valid():  # See NOTE [Reentrant checkpoint], Rules 2 and 3
            raise RuntimeError(_MSG_GRAD_API)
        inputs = list(ctx.inputs)
        for index, tensor in zip(ctx.tensor_indices, ctx.saved_tensors, strict=True):
            inputs[index] = tensor
        state: ForwardState = ctx.state
        with state.restored():
            detached = detach_variable(tuple(inputs))
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs, strict=False)
            if isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if not pairs:
            raise RuntimeError(_MSG_NO_OUTPUT_REQUIRES_GRAD)
        run_backward([p[0] for p in pairs], [p[1] for p in pairs])
        grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in detached)
        return (None, None, *grads)
