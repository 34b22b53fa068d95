"""Weight noise on a Linear layer: the noisy weight is recomputed instead of kept for backward.

Run: python examples/04_gradient_checkpoint_scope.py
"""

import contextlib

import torch
import torch.nn.functional as F

from checkpointing import gradient_checkpoint_scope, gradient_checkpoint_session

torch.manual_seed(0)
layer = torch.nn.Linear(1024, 1024)
x = torch.randn(8, 1024, requires_grad=True)


def step(use_scope: bool) -> tuple[int, list[torch.Tensor]]:
    """One forward/backward; returns the bytes kept for backward and the gradients."""
    kept: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:  # an outer hook: sees what stays for backward
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    torch.manual_seed(1)  # same noise in both runs
    # The session keeps the scope's hook above the counting hook for the whole step.
    counting = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)
    with counting, gradient_checkpoint_session():
        with gradient_checkpoint_scope() if use_scope else contextlib.nullcontext():
            noisy = layer.weight + 0.01 * torch.randn_like(layer.weight)
        y = F.linear(x, noisy, layer.bias).relu().sum()
        del noisy
    y.backward()
    grads = [p.grad.clone() for p in (layer.weight, layer.bias, x)]  # type: ignore[union-attr]
    layer.zero_grad()
    x.grad = None
    return sum(kept.values()), grads


plain_bytes, plain_grads = step(use_scope=False)
scope_bytes, scope_grads = step(use_scope=True)
print(f"kept for backward without scope: {plain_bytes / 2**20:.2f} MiB")
print(f"kept for backward with scope:    {scope_bytes / 2**20:.2f} MiB")
assert all(torch.equal(a, b) for a, b in zip(plain_grads, scope_grads, strict=True))
assert scope_bytes < plain_bytes
print("gradients identical")
