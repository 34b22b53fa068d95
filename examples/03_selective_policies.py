"""Selective checkpointing of transformer blocks: keep the matmuls, recompute the cheap ops.

Three runs of the same 3-layer ``nn.TransformerEncoderLayer`` stack (d_model 64, dropout on):
no checkpointing, full checkpointing, and ``save_matmuls()``. For each we print the bytes kept
for backward and the ops (and FLOPs) re-run in backward, then check that all three give the very
same gradients and that selective checkpointing sits between the other two: it recomputes the
cheap elementwise ops and none of the matmul FLOPs.

Run: python examples/03_selective_policies.py
"""

from typing import Any

import torch
from torch import nn

import checkpointing
from checkpointing import CheckpointPolicy
from checkpointing.policies import as_context_fn, save_matmuls

LAYERS, BATCH, SEQ, D_MODEL, HEADS = 3, 4, 32, 64, 4
SAVING = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)


def make_model() -> nn.ModuleList:
    """The same freshly initialised stack every time (fixed seed), in training mode."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.1, batch_first=True)
        for _ in range(LAYERS)
    ]
    return nn.ModuleList(layers).train()


class KeptBytes:
    """Distinct storages kept for backward: those autograd stores outside the checkpointed
    regions (seen by an outer saved-tensors hook) and those a policy decides to keep."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:  # parameters are in memory anyway
            self.storages[storage.data_ptr()] = storage.nbytes()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    def watching(self, policy: Any) -> Any:
        """``policy``, noting the outputs it keeps (selective checkpointing caches them)."""

        def watched(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            answer = policy(ctx, op, *args, **kwargs)
            if answer in SAVING:
                outputs = ctx.op_output
                for out in outputs if isinstance(outputs, tuple | list) else [outputs]:
                    if isinstance(out, torch.Tensor):
                        self.add(out)
            return answer

        return watched

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def step(mode: str) -> tuple[list[torch.Tensor], int, int, int]:
    """One forward and backward: the gradients, bytes kept, ops and FLOPs recomputed."""
    model = make_model()
    params = list(model.parameters())
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, D_MODEL, requires_grad=True)
    kept = KeptBytes(params)
    context_fn = as_context_fn(kept.watching(save_matmuls()))
    with torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda t: t):
        h = x
        for layer in model:
            if mode == "no checkpointing":
                h = layer(h)
            elif mode == "full checkpointing":
                h = checkpointing.checkpoint(layer, h, use_reentrant=False)
            else:
                h = checkpointing.checkpoint(layer, h, use_reentrant=False, context_fn=context_fn)
    with checkpointing.saved_tensors_report() as report:  # counts ops re-run in backward
        h.square().mean().backward()
    grads = [x.grad, *(p.grad for p in params)]
    recomputed = (report.recompute_ops, report.recompute_flops)
    return [g for g in grads if g is not None], kept.total, *recomputed


results = {mode: step(mode) for mode in ("no checkpointing", "full checkpointing", "save_matmuls")}

# FLOPs as torch.utils.flop_counter counts them: matmuls and attention, not elementwise ops.
print(f"{'':<20} {'kept for backward':>18} {'ops recomputed':>15} {'FLOPs recomputed':>17}")
for mode, (_, kept, ops, flops) in results.items():
    print(f"{mode:<20} {kept / 1024:>14,.0f} KiB {ops:>15} {flops / 1e6:>13,.1f} M")

plain, full, selective = results.values()
n_grads = 1 + len(list(make_model().parameters()))
assert len(plain[0]) == len(full[0]) == len(selective[0]) == n_grads, "gradients are missing"
assert all(map(torch.equal, plain[0], full[0])), "full checkpointing changed the gradients"
assert all(map(torch.equal, plain[0], selective[0])), "selective checkpointing changed gradients"
assert full[1] < selective[1] < plain[1], "selective should keep less than none, more than full"
assert plain[2] == plain[3] == 0
assert 0 < selective[2] < full[2], "selective should recompute fewer ops than full"
assert selective[3] == 0 < full[3], "save_matmuls should recompute no matmul FLOPs"
print("gradients: identical in all three runs (torch.equal, dropout included)")
