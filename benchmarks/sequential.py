"""``checkpoint_sequential`` strategies on a 64-layer chain of unequal layers.

Usage (from the repository root)::

    python benchmarks/sequential.py          # table on stdout, plot in docs/
    python benchmarks/sequential.py --quick  # a smoke run (16 layers, one round)

Method. One thread. The chain: 64 parameter-free layers ``tanh(x @ W)`` (``W`` a fixed buffer),
widths cycling 256, 1024, 256, 2048, 512, 128, 1024, 256 on a batch of 64, so layers differ in
output bytes (x16) and in time (x64). Variants: no checkpoint; torch's
``torch.utils.checkpoint.checkpoint_sequential`` with 2, 4, 8, 16 segments; ours with
``"balanced"`` (4, 8), ``"sqrt"``, ``"log"`` and ``"optimal"`` at three budgets (the predicted peak
of ``"sqrt"``, halfway to the floor, and 1.1 x the floor); and torch's own non-reentrant
``checkpoint`` driven through the same nested schedules (``"log"`` and the tightest
``"optimal"``), to separate what the schedule gives from what our frame gives. Per variant:
*kept* = bytes an outer saved-tensors hook sees kept for backward (``benchmarks/_memory.py``),
*peak* = the allocator's peak over forward + backward (profiler memory events, above the step's
start), *time* = median process CPU time of a forward + backward over interleaved rounds
(A B B A ...), as a ratio to the un-checkpointed step measured in the same rounds. Costs for
``"optimal"`` are measured once by ``sequential_schedule`` and reused.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

from _memory import allocator_bytes, saved_bytes

import checkpointing
from checkpointing import SequentialSchedule
from checkpointing._schedule import Segment, memory_floor

WIDTHS = (256, 1024, 256, 2048, 512, 128, 1024, 256)
BATCH = 64


class Mix(torch.nn.Module):
    """``tanh(x @ W)`` with a fixed buffer ``W``: no parameters, so the peak is activations."""

    def __init__(self, width_in: int, width_out: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("w", torch.randn(width_in, width_out, generator=gen) / width_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).tanh()


def make_chain(depth: int) -> list[torch.nn.Module]:
    """``depth`` Mix layers with widths cycling through ``WIDTHS``."""
    widths = [WIDTHS[i % len(WIDTHS)] for i in range(depth)]
    ins = [WIDTHS[-1], *widths[:-1]]
    return [Mix(a, b, seed=i) for i, (a, b) in enumerate(zip(ins, widths, strict=True))]


def torch_nested(layers: list[torch.nn.Module], schedule: SequentialSchedule) -> Any:
    """Run ``schedule`` with torch's own non-reentrant ``checkpoint`` at every level."""

    def run(segments: tuple[Segment, ...], x: torch.Tensor) -> torch.Tensor:
        for segment in segments:
            if segment.checkpointed:
                inner = segment.children or (Segment(segment.start, segment.end, False),)
                x = tc.checkpoint(lambda t, inner=inner: run(inner, t), x, use_reentrant=False)
            else:
                for i in segment.layers():
                    x = layers[i](x)
        return x

    return lambda x: run(schedule.segments, x)


@dataclass
class Variant:
    """One way to run the chain: its label, its forward, and (ours) its schedule."""

    label: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    schedule: SequentialSchedule | None = None


def variants(layers: list[torch.nn.Module], x: torch.Tensor) -> list[Variant]:
    """Every configuration of the benchmark, in table order."""
    ours = checkpointing.checkpoint_sequential
    out = [Variant("none", lambda t: torch.nn.Sequential(*layers)(t))]
    for segments in (2, 4, 8, 16):
        out.append(
            Variant(
                f"torch segments={segments}",
                lambda t, s=segments: tc.checkpoint_sequential(layers, s, t, use_reentrant=False),
            )
        )
    measured = checkpointing.sequential_schedule(layers, None, x, strategy="sqrt")
    costs = measured.costs
    assert costs is not None
    plans: list[tuple[str, SequentialSchedule]] = []
    for segments in (4, 8):
        plans.append((f"balanced {segments}", _plan(layers, x, "balanced", segments, costs)))
    plans.append(("sqrt", measured))
    log = _plan(layers, x, "log", None, costs)
    plans.append(("log", log))
    floor = memory_floor(costs, measured.input_bytes)
    sqrt_peak = measured.peak_bytes or floor
    for name, budget in (
        ("optimal @ sqrt's peak", sqrt_peak),
        ("optimal @ halfway", (sqrt_peak + floor) // 2),
        ("optimal @ 1.1 floor", int(floor * 1.1)),
    ):
        schedule = checkpointing.sequential_schedule(
            layers, None, x, strategy="optimal", budget=budget, costs=costs
        )
        plans.append((name, schedule))
    for name, schedule in plans:
        out.append(
            Variant(
                name,
                lambda t, s=schedule: ours(layers, None, t, use_reentrant=False, strategy=s),
                schedule,
            )
        )
    out.append(Variant("torch nested, log schedule", torch_nested(layers, log), log))
    tight = plans[-1][1]
    out.append(Variant("torch nested, optimal @ 1.1 floor", torch_nested(layers, tight), tight))
    return out


def _plan(
    layers: list[torch.nn.Module], x: torch.Tensor, strategy: Any, segments: int | None, costs: Any
) -> SequentialSchedule:
    return checkpointing.sequential_schedule(layers, segments, x, strategy=strategy, costs=costs)


def step_times(runs: list[Variant], x: torch.Tensor, rounds: int) -> list[float]:
    """Median CPU seconds of forward + backward per variant, interleaved A B B A rounds."""
    samples: list[list[float]] = [[] for _ in runs]
    for variant in runs:  # warm-up
        variant.forward(x).sum().backward()
    for r in range(rounds):
        order = list(range(len(runs)))
        for i in order if r % 2 == 0 else reversed(order):
            x.grad = None
            started = time.process_time()
            runs[i].forward(x).sum().backward()
            samples[i].append(time.process_time() - started)
    return [statistics.median(s) for s in samples]


def rockmate_status() -> str:
    """Whether rockmate (rotor's successor) can run here, in one line."""
    try:
        import rockmate  # noqa: F401
    except Exception as exc:  # reported as the reason, whatever it is
        return f"rockmate does not import: {type(exc).__name__}: {exc}"
    return "rockmate imports"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 layers, one round, no plot")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    depth, rounds = (16, 1) if args.quick else (64, args.rounds)
    layers = make_chain(depth)
    x = torch.randn(BATCH, WIDTHS[-1], requires_grad=True)
    runs = variants(layers, x)
    buffers = [layer.w for layer in layers]
    rows = []
    for variant in runs:
        kept, _ = saved_bytes(lambda v=variant: v.forward(x).sum(), buffers)
        _, peak = allocator_bytes(lambda v=variant: v.forward(x).sum())
        rows.append((variant, kept, peak))
    times = step_times(runs, x, rounds)
    base = times[0]
    print(f"{depth}-layer chain, batch {BATCH}, {rounds} rounds; {rockmate_status()}")
    header = f"{'variant':36} {'kept MiB':>9} {'peak MiB':>9} {'pred peak':>9} {'time/none':>9}"
    print(header)
    for (variant, kept, peak), seconds in zip(rows, times, strict=True):
        predicted = variant.schedule.peak_bytes if variant.schedule is not None else None
        pred = f"{predicted / 2**20:9.2f}" if predicted is not None else f"{'':9}"
        print(
            f"{variant.label:36} {kept / 2**20:9.2f} {peak / 2**20:9.2f} {pred} "
            f"{seconds / base:9.2f}"
        )
    if not args.quick:
        plot(rows, [t / base for t in times])


def plot(rows: list[tuple[Variant, int, int]], ratios: list[float]) -> None:
    """Backward peak and kept bytes against step time, one marker per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharex=True)
    for (variant, kept, peak), ratio in zip(rows, ratios, strict=True):
        family = variant.label.split(" ")[0]
        marker = {"none": "s", "torch": "x", "balanced": "o", "sqrt": "D", "log": "^"}.get(
            family, "*"
        )
        color = "tab:red" if variant.label.startswith("torch") else "tab:blue"
        if family == "none":
            color = "black"
        for axis, value in ((axes[0], peak), (axes[1], kept)):
            axis.scatter(ratio, value / 2**20, marker=marker, color=color, s=50)
            axis.annotate(
                variant.label,
                (ratio, value / 2**20),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    axes[0].set_title("allocator peak over forward + backward")
    axes[1].set_title("activations kept from forward to backward")
    for axis in axes:
        axis.set_xlabel("step time / un-checkpointed step (CPU time)")
        axis.set_ylabel("MiB")
        axis.grid(alpha=0.3)
    fig.suptitle("checkpoint_sequential on 64 unequal layers (blue: checkpointing, red: torch)")
    fig.tight_layout()
    out = Path(__file__).resolve().parent.parent / "docs" / "sequential_strategies.png"
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
