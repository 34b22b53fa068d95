"""Checkpoint a deep nn.Sequential in sqrt(n) segments with one call.

Run: python examples/02_checkpoint_sequential.py
"""

import math

import torch
from torch import nn

import checkpointing

DEPTH, WIDTH, BATCH = 16, 128, 32

torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)])
x = torch.randn(BATCH, WIDTH, requires_grad=True)
segments = round(math.sqrt(DEPTH))


def step(use_checkpoint: bool) -> tuple[list[torch.Tensor], int]:
    """One forward and backward; the parameter gradients and the activation bytes kept."""
    model.zero_grad()
    with checkpointing.saved_tensors_report() as report:
        if use_checkpoint:
            out = checkpointing.checkpoint_sequential(model, segments, x, use_reentrant=False)
        else:
            out = model(x)
    kept = report.activation_bytes
    out.square().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], kept


plain_grads, plain_kept = step(use_checkpoint=False)
ckpt_grads, ckpt_kept = step(use_checkpoint=True)
print(f"{DEPTH} layers, {segments} segments")
print(f"activations kept without checkpointing: {plain_kept / 1024:8.1f} KiB")
print(f"activations kept with {segments} segments:     {ckpt_kept / 1024:8.1f} KiB")
assert all(map(torch.equal, plain_grads, ckpt_grads)), "gradients differ"
assert ckpt_kept * 2 < plain_kept, "checkpoint_sequential should keep far fewer activations"
print("gradients identical")

# Beyond torch: strategies. "log" nests checkpoints (about log2(n) activations kept); "optimal"
# fits a byte budget with the least recompute time. sequential_schedule() shows the plan.
schedule = checkpointing.sequential_schedule(model, None, x, strategy="log")
print(schedule)
budget = (schedule.peak_bytes or 0) * 2
optimal = checkpointing.sequential_schedule(model, None, x, strategy="optimal", budget=budget)
print(optimal)
for strategy in (schedule, optimal):
    model.zero_grad()
    out = checkpointing.checkpoint_sequential(
        model, None, x, use_reentrant=False, strategy=strategy
    )
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(map(torch.equal, plain_grads, grads)), f"{strategy.strategy}: gradients differ"
print("log and optimal schedules: gradients identical")
