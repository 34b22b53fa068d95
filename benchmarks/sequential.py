"""``checkpoint_sequential`` strategies on a 64-layer chain of unequal layers.

Usage (from the repository root)::

    python benchmarks/sequential.py          # table on stdout, plot in docs/
    python benchmarks/sequential.py --quick  # a smoke run (16 layers, one round)
    python benchmarks/sequential.py --from-results  # only the plot, from RESULTS.md's table

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
    parser.add_argument(
        "--from-results",
        action="store_true",
        help="run nothing: draw the plot from the table recorded in benchmarks/RESULTS.md",
    )
    args = parser.parse_args()
    if args.from_results:
        plot(recorded_points())
        return
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
        plot(
            [
                (variant.label, kept / 2**20, peak / 2**20, seconds / base)
                for (variant, kept, peak), seconds in zip(rows, times, strict=True)
            ]
        )


Point = tuple[str, float, float, float]  # (label, kept MiB, peak MiB, step time / none)

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PLOT = Path(__file__).resolve().parent.parent / "docs" / "sequential_strategies.png"
_SECTION = "## checkpoint_sequential strategies"


def recorded_points(results: Path = RESULTS) -> list[Point]:
    """The variants of the table recorded in ``RESULTS.md`` (the section above), as points."""
    text = results.read_text()
    section = text[text.index(_SECTION) :]
    points = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[1].replace(".", "").isdigit():
            continue  # not a row of the table (text, the header or its rule)
        label = cells[0].replace("`", "")
        points.append((label, float(cells[1]), float(cells[2]), float(cells[4])))
    if not points:
        raise SystemExit(f"no table of variants found under {_SECTION!r} in {results}")
    return points


_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {  # colour, then a marker per member
    "none": ("black", ("s",)),
    "torch": ("tab:red", ("o", "s", "D", "v")),
    "ours": ("tab:blue", ("o", "s", "D", "^")),
    "optimal": ("tab:green", ("*", "P", "X")),
    "nested": ("tab:orange", ("^", "X")),
}


def _family(label: str) -> str:
    if label == "none":
        return "none"
    if "nested" in label:
        return "nested"
    if label.startswith("torch"):
        return "torch"
    return "optimal" if "optimal" in label else "ours"


def plot(points: list[Point], out: Path = PLOT, depth: int = 64) -> None:
    """Allocator peak and kept bytes against step time: one marker per variant, named in a
    legend under the axes (labels beside the markers overlapped where variants coincide)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 7.2), sharex=True)
    members: dict[str, int] = {}
    for label, kept, peak, ratio in points:
        family = _family(label)
        colour, markers = _FAMILIES[family]
        marker = markers[members.get(family, 0) % len(markers)]
        members[family] = members.get(family, 0) + 1
        for axis, value in ((axes[0], peak), (axes[1], kept)):
            axis.scatter(
                ratio,
                value,
                marker=marker,
                color=colour,
                s=110 if marker == "*" else 55,
                alpha=0.75,
                edgecolors="white",
                linewidths=0.6,
                label=label,
            )
    axes[0].set_title("allocator peak over forward + backward")
    axes[1].set_title("activations kept from forward to backward")
    for axis in axes:
        axis.set_xlabel("step time / un-checkpointed step (CPU time, ratio)")
        axis.set_ylabel("memory (MiB)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(
        f"checkpoint_sequential on {depth} unequal layers: memory against step time\n"
        '(red: torch\'s checkpoint_sequential; blue: ours; green: ours, "optimal"; orange: '
        "torch's checkpoint nested on our schedules)",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
