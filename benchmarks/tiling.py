"""Sequence-tiled regions: the in-layer peak and the step time against the untiled checkpoint.

Usage (from the repository root)::

    python benchmarks/tiling.py                 # scale 4 (below), 3 sequence lengths
    python benchmarks/tiling.py --scale 1       # the issue's sizes (slow on CPU)
    python benchmarks/tiling.py --quick         # smoke run on tiny sizes (numbers are noise)

Two blocks, each the whole of one checkpointed layer, in float32:

* MLP: a pre-norm layer ``h + mlp(norm(h))`` with a Llama-shaped SwiGLU MLP (hidden 2048,
  intermediate 8192), checkpointed with ``checkpoint(..., use_reentrant=False)``. Variants: the
  MLP untiled (the baseline); the MLP tiled (``checkpointing.tiled``, the mechanism of
  ``tiled_mlp``) at 1, 2, 4, 8, 16 chunks, differentiated by hand (NOTE [Tiled gated MLP]); the
  same MLP written with ``F.silu`` inline, which the tiled region does not recognise, through its
  generic per-chunk autograd at 8 chunks; and the patch-the-model way at 8 chunks: a tiled MLP
  module as the libraries that patch models write it (an ``autograd.Function`` that runs the
  chunks under ``no_grad``, saves its input with ``save_for_backward`` and recomputes chunk by
  chunk in backward), inside the same checkpointed layer, where the layer's recompute runs it a
  third time. Block ``mlp-frozen``: the same with the MLP's weights frozen (no weight gradient
  made), the in-layer transient without the weights' gradients.
* LM head + loss: ``cross_entropy(linear(norm(h), W).float(), labels)`` with a 128k vocabulary
  (128256, Llama 3's), checkpointed. Variants: untiled; ``checkpointing.tiled_lm_head_loss`` at
  1, 2, 4, 8, 16 chunks; and the generic tiled region (``checkpoint(..., tile=Tiling(...))`` of
  a per-token loss, reduced after it) at 8 chunks, which shows why the head has its own recipe.

Sizes. ``--scale s`` divides every size (tokens, hidden, intermediate, vocabulary) by ``s``:
every tensor of these blocks is the product of two of them, so every byte count is exactly
``1/s**2`` of the full-size one and every ratio of peaks is the full-size ratio, while the
arithmetic shrinks by ``s**3``. The default, scale 4 on tokens 1k, 2k and 4k, is the issue's 4k,
8k and 16k tokens; the full sizes' arithmetic (a 16k MLP step is 6.6 TFLOP) does not fit a
shared 2-core CPU's session. Times at the small scale are the conservative ones (smaller
chunks use the matmul kernels less well).

Measures. Peak: the most bytes of tensors live at once during one step (forward, backward of
the loss), above what was live before it: the planner's live-bytes high-water mark
(``checkpointing._planning.measure.live_bytes.cpu_peak``; a dispatch mode, no allocator
profiler). The parameters and the input exist before the step and are not in it; the gradients it
makes are. "In-layer" ratio = untiled peak / variant peak. Time: process CPU seconds per step, one
torch thread, median over rounds run in A B C C B A order after a warm-up step, at the middle length
only (``--time-tokens``; the head at its shortest). Run the timing alone on the machine (e.g.
under ``flock``); ``--no-timing`` measures the peaks only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import checkpointing
from checkpointing import Tiling
from checkpointing._planning.measure.live_bytes import cpu_peak

FULL = {"hidden": 2048, "intermediate": 8192, "vocab": 128256}
CHUNKS = (1, 2, 4, 8, 16)


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``, no biases, written as transformers writes
    it (so a tiled region differentiates it by hand, NOTE [Tiled gated MLP])."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GenericSwiGLU(SwiGLU):
    """The same MLP written another way (``F.silu`` inline): not recognised, so a tiled region
    runs it through its generic per-chunk autograd."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PatchedTiledMLP(torch.autograd.Function):
    """The patch-the-model way: forward by chunks under no_grad, input saved after it
    (``save_for_backward``), backward recomputing chunk by chunk into ``.grad``."""

    @staticmethod
    def forward(ctx: Any, mlp: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
        ctx.mlp, ctx.chunks = mlp, chunks
        ctx.save_for_backward(x)
        out = torch.empty_like(x)
        start = 0
        for part in x.chunk(chunks, dim=1):
            out.narrow(1, start, part.shape[1]).copy_(mlp(part))
            start += part.shape[1]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            pairs = zip(x.chunk(ctx.chunks, dim=1), grad.chunk(ctx.chunks, dim=1), strict=True)
            for part, g in pairs:
                torch.autograd.backward(ctx.mlp(part), g)
        return None, x.grad, None


Step = Callable[[], None]


def mlp_steps(tokens: int, scale: int, frozen: bool = False) -> dict[str, Step]:
    """Each MLP variant's training step (fresh gradients each time); ``frozen``: the MLP's
    weights do not require grad, so the step makes no weight gradient (the in-layer transient
    without them)."""
    hidden, inner = FULL["hidden"] // scale, FULL["intermediate"] // scale
    torch.manual_seed(0)
    mlp, norm = SwiGLU(hidden, inner), nn.RMSNorm(hidden)
    generic = GenericSwiGLU(hidden, inner)
    generic.load_state_dict(mlp.state_dict())
    mlp.requires_grad_(not frozen)
    generic.requires_grad_(not frozen)
    x = torch.randn(1, tokens, hidden, requires_grad=True)

    def step(layer: Callable[[torch.Tensor], torch.Tensor]) -> None:
        x.grad = None
        for p in (*mlp.parameters(), *generic.parameters(), *norm.parameters()):
            p.grad = None
        checkpointing.checkpoint(layer, x, use_reentrant=False).sum().backward()

    def tiled(chunks: int, module: nn.Module = mlp) -> Step:
        run = checkpointing.tiled(module, dim=1, chunks=chunks)
        return functools.partial(step, lambda h: h + run(norm(h)))

    steps = {"checkpoint, untiled": functools.partial(step, lambda h: h + mlp(norm(h)))}
    steps |= {f"tiled_mlp, {c} chunks": tiled(c) for c in CHUNKS}
    steps["tiled, generic autograd path, 8 chunks"] = tiled(8, generic)
    steps["patched tiled MLP, 8 chunks"] = functools.partial(
        step, lambda h: h + PatchedTiledMLP.apply(mlp, norm(h), 8)
    )
    return steps


def head_steps(tokens: int, scale: int) -> dict[str, Step]:
    """Each LM-head-and-loss variant's training step."""
    hidden, vocab = FULL["hidden"] // scale, FULL["vocab"] // scale
    torch.manual_seed(0)
    head, norm = nn.Linear(hidden, vocab, bias=False), nn.RMSNorm(hidden)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    labels[0, : tokens // 10] = -100  # a prompt without targets

    def step(block: Callable[[torch.Tensor], torch.Tensor]) -> None:
        x.grad = None
        for p in (*head.parameters(), *norm.parameters()):
            p.grad = None
        checkpointing.checkpoint(block, x, use_reentrant=False).backward()

    def untiled(h: torch.Tensor) -> torch.Tensor:
        logits = head(norm(h)).float()
        return F.cross_entropy(logits.view(-1, vocab), labels.view(-1))

    def recipe(chunks: int) -> Step:
        return functools.partial(
            step, lambda h: checkpointing.tiled_lm_head_loss(norm(h), head, labels, chunks=chunks)
        )

    def per_token(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, weight).float()
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none")

    def generic(h: torch.Tensor) -> torch.Tensor:
        losses = checkpointing.checkpoint(
            per_token, norm(h), labels, head.weight, tile=Tiling(dim=1, chunks=8, split=(0, 1))
        )
        return losses.sum() / (labels != -100).sum()

    steps = {"checkpoint, untiled": functools.partial(step, untiled)}
    steps |= {f"tiled_lm_head_loss, {c} chunks": recipe(c) for c in CHUNKS}
    steps["generic tiled region, 8 chunks"] = functools.partial(step, generic)
    return steps


def peaks(steps: dict[str, Step], label: str = "") -> dict[str, int]:
    """Each step's live-bytes peak above what was live before it (each printed as it is
    measured: a long run's partial results are kept)."""
    out = {}
    for name, step in steps.items():
        gc.collect()
        out[name] = cpu_peak(step)
        print(f"  {label}{name}: {mib(out[name])} MiB", file=sys.stderr, flush=True)
    return out


def chosen(steps: dict[str, Step], only: Sequence[str] | None) -> dict[str, Step]:
    """The baseline and the variants whose names contain one of ``only`` (all if None), in
    ``only``'s order."""
    if not only:
        return steps
    names = ["checkpoint, untiled"]
    names += [n for part in only for n in steps if part in n and n not in names]
    return {n: steps[n] for n in names}


def times(steps: dict[str, Step], rounds: int) -> dict[str, list[float]]:
    """Process CPU seconds per step, rounds in A B C C B A order."""
    for step in steps.values():
        step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            gc.collect()
            start = time.process_time()
            steps[name]()
            samples[name].append(time.process_time() - start)
    return samples


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(title: str, by_tokens: dict[int, dict[str, int]], scale: int) -> list[str]:
    lengths = sorted(by_tokens)
    head = " | ".join(f"{t * scale // 1024}k tokens: peak MiB (x lower)" for t in lengths)
    lines = [f"### {title}", "", f"| variant | {head} |", "|---" * (len(lengths) + 1) + "|"]
    for name in by_tokens[lengths[0]]:
        cells = []
        for t in lengths:
            base, got = by_tokens[t]["checkpoint, untiled"], by_tokens[t][name]
            cells.append(f"{mib(got)} ({base / got:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def time_table(title: str, samples: dict[str, list[float]]) -> list[str]:
    base = statistics.median(samples["checkpoint, untiled"])
    lines = [f"### {title}", "", "| variant | s/step, median (min-max) | vs untiled |"]
    lines.append("|---|---|---|")
    for name, values in samples.items():
        med = statistics.median(values)
        lines.append(
            f"| {name} | {med:.3f} ({min(values):.3f}-{max(values):.3f}) | {med / base:.3f} |"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=4, help="divide every size by this")
    parser.add_argument("--tokens", type=int, nargs="+", help="tokens at the chosen scale")
    parser.add_argument("--time-tokens", type=int, help="tokens of the timed MLP runs")
    parser.add_argument("--head-tokens", type=int, nargs="+", help="tokens of the head runs")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds")
    parser.add_argument("--no-timing", action="store_true", help="peaks only")
    parser.add_argument("--no-peaks", action="store_true", help="times only")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument(
        "--only", nargs="+", help="variants whose names contain one of these (and the baseline)"
    )
    parser.add_argument(
        "--blocks",
        nargs="+",
        default=["mlp", "head"],
        help="mlp, head, and mlp-frozen (the MLP's weights frozen: no weight gradients)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the peak runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.scale, args.tokens, args.rounds = 64, [64], 2
    if args.tokens is None:
        args.tokens = [4096 // args.scale, 8192 // args.scale, 16384 // args.scale]
    if args.time_tokens is None:
        args.time_tokens = args.tokens[len(args.tokens) // 2]
    if args.head_tokens is None:  # the head's arithmetic is 8x the MLP's: its shorter lengths
        args.head_tokens = args.tokens[:2]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "## Sequence-tiled regions (`benchmarks/tiling.py`)",
        "",
        f"- Command: `python benchmarks/tiling.py {' '.join(sys.argv[1:])}`".rstrip() + "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: "
        f"{platform.processor() or platform.machine()}, CPU only, one torch thread; "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        f"- Scale {args.scale}: every size divided by {args.scale} (hidden "
        f"{FULL['hidden'] // args.scale}, intermediate {FULL['intermediate'] // args.scale}, "
        f"vocabulary {FULL['vocab'] // args.scale}); bytes are 1/{args.scale**2} of the full "
        "size's, ratios the full size's. Token columns are named at full size.",
        "",
    ]
    blocks = (
        ("mlp", "MLP layer", mlp_steps, args.tokens, args.time_tokens),
        ("head", "LM head + loss", head_steps, args.head_tokens, args.head_tokens[0]),
        (
            "mlp-frozen",
            "MLP layer, weights frozen (no weight gradients)",
            functools.partial(mlp_steps, frozen=True),
            args.tokens,
            args.time_tokens,
        ),
    )
    for key, title, make, lengths, timed in blocks:
        if key not in args.blocks:
            continue
        if not args.no_peaks:
            torch.set_num_threads(args.threads)  # a peak does not depend on the threads
            by_tokens = {
                t: peaks(chosen(make(t, args.scale), args.only), f"{title}, {t} tokens: ")
                for t in lengths
            }
            lines += [*table(f"{title}: step peak", by_tokens, args.scale), ""]
            print("\n".join(lines), flush=True)
            torch.set_num_threads(1)
        if not args.no_timing:
            steps = chosen(make(timed, args.scale), args.only or ["8 chunks"])
            samples = times(steps, args.rounds)
            label = f"{title}: step time at {timed * args.scale // 1024}k tokens"
            lines += [*time_table(label, samples), ""]
            print("\n".join(lines[-len(samples) - 4 :]), flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
