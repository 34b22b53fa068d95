"""Compressed saves: bytes kept per format, and what compression does to a small training run.

Two measurements, each decision side by side with the exact one in the same process:

1. Bytes: one step of a small GPT (2 layers, width 128, sequence 64, batch 16), every block
   checkpointed under ``save_matmuls()`` (exact) or ``compress_ops(*MATMUL_OPS, to=...)``; a
   ``saved_tensors_report`` gives the bytes kept (activations, each storage once) and the bytes
   kept compressed; ``OffloadStats`` gives the bytes an offloading policy moves to host memory,
   exact (``offload_ops``) and compressed (``compress_ops(..., offload=True)``).
2. Accuracy: 300 Adam steps (learning rate 3e-3, gradients clipped to norm 1) of a smaller
   GPT (2 layers, width 64) on a synthetic task (``--task copy``, the default, or ``reverse``
   a sequence of 16 digits, a fifth of the target digits noisy), the same seed, data and
   initial weights for every decision; the final loss (on 32 held-out batches, and the mean
   training loss of the last 20 steps) against the exact run's, and the loss curves drawn to
   ``docs/compression_loss.png`` (``--plot``).

Run: ``PYTHONPATH=. python benchmarks/compression.py --plot`` (about 10 minutes on 2 busy CPU cores;
nothing is timed, so no lock is needed).
"""

from __future__ import annotations

import argparse
import math
import platform
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import checkpointing
from checkpointing.policies import (
    MATMUL_OPS,
    as_context_fn,
    compress_ops,
    offload_ops,
    save_matmuls,
)

DECISIONS: dict[str, Any] = {
    "exact (save_matmuls)": None,
    "bf16": {"to": "bf16"},
    "fp16": {"to": "fp16"},
    "fp8, per tensor": {"to": "fp8"},
    "fp8, per row": {"to": "fp8", "scale": "row"},
    "int8, per row": {"to": "int8"},
}


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(attention.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, blocks, each block checkpointed under ``context_fn``."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)
        self.context_fn: Any = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            if self.context_fn is None:
                x = checkpointing.checkpoint(block, x, use_reentrant=False)
            else:
                x = checkpointing.checkpoint(
                    block, x, use_reentrant=False, context_fn=self.context_fn
                )
        return self.head(self.norm(x))


def policy_for(kwargs: dict[str, Any] | None, **extra: Any) -> Any:
    return save_matmuls() if kwargs is None else compress_ops(*MATMUL_OPS, **kwargs, **extra)


# --- 1. Bytes -----------------------------------------------------------------------------------


@dataclass
class Bytes:
    activations: int
    compressed: int
    to_host: int


def measure_bytes(kwargs: dict[str, Any] | None) -> Bytes:
    torch.manual_seed(0)
    model = GPT(vocab=32, width=128, layers=2, heads=4, length=64)
    tokens = torch.randint(0, 32, (16, 64))
    model.context_fn = as_context_fn(policy_for(kwargs))
    with checkpointing.saved_tensors_report() as report:
        model(tokens).square().mean().backward()
    stats = checkpointing.OffloadStats()
    offloading = offload_ops(*MATMUL_OPS) if kwargs is None else policy_for(kwargs, offload=True)
    model.context_fn = as_context_fn(offloading, offload_stats=stats)
    model(tokens).square().mean().backward()
    return Bytes(
        report.activation_bytes, report.bytes_by_decision()["compressed"], stats.offloaded_bytes
    )


# --- 2. Accuracy --------------------------------------------------------------------------------

STEPS, BATCH, DIGITS, VOCAB = 300, 32, 16, 12  # tokens 0-9, 10 = separator
NOISE = 0.2
TASK = "copy"


def digits_task(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``digits SEP digits`` (copy) or ``digits SEP reversed(digits)`` (reverse); the loss is
    on the second half, where a fifth of the
    target digits are replaced by random ones (``NOISE``): the loss has a floor (the targets'
    entropy), so a run that has learned the task sits on it instead of sliding towards zero,
    where any two runs differ by large ratios of tiny numbers."""
    digits = torch.randint(0, 10, (BATCH, DIGITS), generator=generator)
    separator = torch.full((BATCH, 1), 10)
    answer = digits.flip(1) if TASK == "reverse" else digits
    sequence = torch.cat([digits, separator, answer], dim=1)
    targets = sequence[:, 1:].clone()
    noisy = torch.rand(targets[:, DIGITS:].shape, generator=generator) < NOISE
    random = torch.randint(0, 10, noisy.shape, generator=generator)
    targets[:, DIGITS:] = torch.where(noisy, random, targets[:, DIGITS:])
    return sequence[:, :-1], targets


def train(kwargs: dict[str, Any] | None) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, width=64, layers=2, heads=4, length=2 * DIGITS + 1)
    model.context_fn = as_context_fn(policy_for(kwargs))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        inputs, targets = digits_task(generator)
        logits = model(inputs)[:, DIGITS:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[:, DIGITS:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, held_out_loss(model)


def held_out_loss(model: GPT) -> float:
    """The loss on 32 batches the training never saw (the same for every decision), without
    gradients (checkpointing then runs the blocks plainly): the final loss, free of one batch's
    sampling noise."""
    generator = torch.Generator().manual_seed(2)
    total = 0.0
    with torch.no_grad():
        for _ in range(32):
            inputs, targets = digits_task(generator)
            logits = model(inputs)[:, DIGITS:]
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[:, DIGITS:].reshape(-1))
            total += loss.item() / 32
    return total


def final(losses: list[float]) -> float:
    return sum(losses[-20:]) / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", action="store_true", help="draw docs/compression_loss.png")
    parser.add_argument("--only", nargs="*", help="train only these decisions (and the exact)")
    parser.add_argument("--task", choices=("reverse", "copy"), default="copy")
    args = parser.parse_args()
    global TASK
    TASK = args.task
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print("\n1. Bytes kept, one step (2 layers, width 128, sequence 64, batch 16)")
    print(f"{'decision':<22} {'activations':>12} {'compressed':>11} {'to host':>10}")
    for name, kwargs in DECISIONS.items():
        if args.only is None:
            b = measure_bytes(kwargs)
            print(f"{name:<22} {b.activations:>12,} {b.compressed:>11,} {b.to_host:>10,}")
    print(
        f"\n2. {TASK} task, {STEPS} steps: held-out loss after training (32 unseen batches), "
        "and the mean training loss of the last 20 steps"
    )
    curves: dict[str, list[float]] = {}
    finals: dict[str, float] = {}
    for name, kwargs in DECISIONS.items():
        if args.only is not None and kwargs is not None and name not in args.only:
            continue
        curves[name], finals[name] = train(kwargs)
        exact = next(iter(DECISIONS))
        print(
            f"{name:<22} held-out {finals[name]:.4f} ({finals[name] / finals[exact] - 1:+.2%})  "
            f"last 20 steps {final(curves[name]):.4f} "
            f"({final(curves[name]) / final(curves[exact]) - 1:+.2%})"
        )
    if args.plot:
        draw(curves)


def draw(curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        axes.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (log scale)")
    axes.set_title(f"{TASK} task, small GPT: matmul outputs kept exactly or compressed")
    axes.legend()
    figure.tight_layout()
    figure.savefig("docs/compression_loss.png", dpi=120)
    print("drew docs/compression_loss.png")


if __name__ == "__main__":
    main()
