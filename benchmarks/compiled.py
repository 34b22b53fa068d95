"""Compiled step time: our checkpoint against torch's under ``torch.compile``, side by side.

Usage (from the repository root)::

    python benchmarks/compiled.py                 # inductor, CPU, about 3 minutes
    python benchmarks/compiled.py --backend aot_eager --rounds 9

While dynamo traces, our entry points hand the region to torch's checkpoint (NOTE [Compiled
regions] in ``checkpointing/_compiled.py``), so both libraries should compile to the same graph
and the ratio should be 1 within noise. The third library, "ours, eager regions", is what we did
before that: dynamo left our ``checkpoint`` out (a graph break around every region) and the
regions ran eagerly with our hooks; it is reproduced here by wrapping our ``checkpoint`` in
``torch.compiler.disable``.

Method. One thread. Models: "mlp" (4 blocks of Linear 256->1024, GELU, Linear 1024->256 with a
residual, batch 64) and "encoder" (4 ``nn.TransformerEncoderLayer`` d=128, 4 heads, ff 512,
dropout 0, batch 4 x 64 tokens); each checkpointed per block ("full") or per block with
``save_matmuls()`` ("sac"; torch's side: its SAC keeping the same ops, ``MATMUL_OPS``).
A step is: gradients set to ``None``, the compiled forward, ``backward`` of a sum. Every
configuration is compiled and warmed up first; then in rounds, each configuration runs one
sample (``--inner`` steps, the process's CPU time) in an order that alternates each round
(A B C, C B A, ...). Reported: the median step time per library, the ratio of medians ours/torch
and the min-max of the per-round ratios (the noise), and the graph and break counts of
``torch._dynamo.explain`` per library.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import checkpointing
from checkpointing.policies import MATMUL_OPS, as_context_fn, save_matmuls


class MlpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    """Blocks run in turn, each checkpointed with ``options`` (the subclass says by which API).
    One class per library: dynamo keys its compiled code by the code object of ``forward``."""

    def __init__(self, blocks: list[nn.Module], options: dict[str, Any]) -> None:
        super().__init__()
        self.blocks, self.options = nn.ModuleList(blocks), options


class TorchStack(Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False, **self.options)
        return x.sum()


class OursStack(Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpointing.checkpoint(block, x, use_reentrant=False, **self.options)
        return x.sum()


_eager_regions = torch.compiler.disable(checkpointing.checkpoint)


class EagerRegionsStack(Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = _eager_regions(block, x, use_reentrant=False, **self.options)
        return x.sum()


def _model(name: str, library: str, options: dict[str, Any]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        blocks: list[nn.Module] = [MlpBlock() for _ in range(4)]
        x = torch.randn(64, 256)
    else:
        blocks = [
            nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True) for _ in range(4)
        ]
        x = torch.randn(4, 64, 128)
    return _LIBRARIES[library](blocks, options), x


_LIBRARIES: dict[str, type[Stack]] = {
    "torch": TorchStack,
    "ours": OursStack,
    "ours, eager regions": EagerRegionsStack,
}
# Torch's SAC keeps what save_matmuls() keeps: the same ops, so the same decisions.
_TORCH_SAC_OPS = sorted(MATMUL_OPS, key=str)


def _options(variant: str, library: str) -> dict[str, Any]:
    """How each library checkpoints one block in ``variant``."""
    if variant == "full":
        return {}
    if library == "torch":
        return {
            "context_fn": functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, _TORCH_SAC_OPS
            )
        }
    return {"context_fn": as_context_fn(save_matmuls())}


def _step(compiled: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, x: torch.Tensor):
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        compiled(x).backward()

    return step


def _sample(step: Callable[[], None], inner: int) -> float:
    start = time.process_time()
    for _ in range(inner):
        step()
    return (time.process_time() - start) / inner


def measure(model_name: str, variant: str, backend: str, rounds: int, inner: int) -> list[str]:
    steps: dict[str, Callable[[], None]] = {}
    counts: dict[str, tuple[int, int]] = {}
    for library in _LIBRARIES:
        model, x = _model(model_name, library, _options(variant, library))
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(x)
        counts[library] = (explanation.graph_count, explanation.graph_break_count)
    torch._dynamo.reset()  # after the explains only: a reset drops every compiled model
    for library in _LIBRARIES:
        model, x = _model(model_name, library, _options(variant, library))
        compiled = torch.compile(model, backend=backend)
        steps[library] = _step(compiled, model, x)
        for _ in range(3):
            steps[library]()  # compile and warm up
    times: dict[str, list[float]] = {library: [] for library in steps}
    ratios: dict[str, list[float]] = {library: [] for library in steps if library != "torch"}
    order = list(steps)
    for r in range(rounds):
        this_round = {}
        for library in order if r % 2 == 0 else reversed(order):
            this_round[library] = _sample(steps[library], inner)
            times[library].append(this_round[library])
        for library in ratios:
            ratios[library].append(this_round[library] / this_round["torch"])
    torch_ms = statistics.median(times["torch"]) * 1e3
    rows = []
    for library in steps:
        ms = statistics.median(times[library]) * 1e3
        graphs, breaks = counts[library]
        if library == "torch":
            ratio, spread = "1", ""
        else:
            ratio = f"{ms / torch_ms:.3f}"
            spread = f"{min(ratios[library]):.3f}-{max(ratios[library]):.3f}"
        rows.append(
            f"| {model_name} | {variant} | {library} | {graphs} / {breaks} | {ms:.2f} | {ratio} "
            f"| {spread} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--models", default="mlp,encoder")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, backend {args.backend}, {args.rounds} rounds x {args.inner}")
    print()
    columns = ["model", "variant", "library", "graphs / breaks", "step ms (median)"]
    print("| " + " | ".join([*columns, "ours/torch", "per-round"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for variant in ("full", "sac"):
            for row in measure(model_name, variant, args.backend, args.rounds, args.inner):
                print(row, flush=True)


if __name__ == "__main__":
    main()
