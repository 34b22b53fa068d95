"""Benchmark ``checkpointing`` against ``torch.utils.checkpoint``, side by side in one process.

Usage (from the repository root)::

    python benchmarks/run.py                      # the full run (RESULTS.md), 6-9 minutes
    python benchmarks/run.py --quick              # smoke run, under a minute (W1, W2, W5 shrunk)
    python benchmarks/run.py --workloads W3,W4 --repeats 15
    python benchmarks/run.py --aa                 # A/A run: torch against itself (noise floor)
    python benchmarks/run.py --profile ours --workloads W3,W4   # pyinstrument call trees

Method. One thread (``torch.set_num_threads(1)``). A *step* is: gradients set to ``None``,
forward, ``loss.backward()`` on a sum loss; both libraries run the same model on the same inputs.
Every configuration (workload x variant x library, plus the shared un-checkpointed baseline) is
warmed up, then timed in rounds: round r runs the configurations in order, round r+1 in reverse
order (A B B A ...), so slow drifts of a shared machine hit both libraries alike. A sample is
``inner`` consecutive steps (calibrated per workload so a sample lasts about ``--sample-seconds``)
after a ``gc.collect()``; the time of a step is the sample's time over ``inner``. Reported: the
median with min-max over rounds, the ratio of medians ours/torch, and the min-max of the per-round
ratios (a direct view of the noise). Every sample is read on two clocks: the process's CPU time
(the default for the tables) and the wall clock (its ratio is shown beside). On a machine shared
with other jobs, wall time also counts the moments our single thread waits for a core; CPU time
does not, so it measures the cost of the code with far less noise (contention still leaks in
through caches and memory bandwidth). ``--clock wall`` reports wall time instead.

Memory is measured once per configuration, outside the timed rounds, by the three instruments of
``_memory.py`` (validated by ``validate_memory.py``). The overhead table gives, for W3 and W4, the
median time above the un-checkpointed baseline; the last section lists the issue's targets that
this run did not meet (time ratio above 1 + ``--tolerance``, bytes kept above torch's, W3/W4
overhead of non-reentrant and SAC above half of torch's).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Run as a script: the helpers sit beside this file; the source tree is the fallback for an
# uninstalled ``checkpointing`` (an installed one, as under ``nox``, comes first).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

from _libs import Library, ours_library, policy_source, torch_library
from _memory import StepMemory, measure
from _workloads import Forward, Variant, Workload, build_workloads

OVERHEAD_WORKLOADS = ("W3", "W4")
OVERHEAD_VARIANTS: tuple[Variant, ...] = ("non-reentrant", "sac")


@dataclass
class Config:
    """One timed thing: a workload's variant under one library (``side`` is ours/torch/both)."""

    variant: Variant
    side: str
    step: Callable[[], None] = field(repr=False)
    forward: Forward = field(repr=False)
    saved_inside: Callable[[], AbstractContextManager[Any]] = field(
        default=contextlib.nullcontext, repr=False
    )
    times: dict[str, list[float]] = field(default_factory=lambda: {"cpu": [], "wall": []})
    memory: StepMemory | None = None


@dataclass
class Row:
    """What the tables print for one workload and variant; ``None`` where it does not apply."""

    workload: str
    variant: Variant
    ours: list[float] | None
    torch: list[float] | None
    other_ratio: float | None  # the ratio of medians by the other clock
    ours_memory: StepMemory | None
    torch_memory: StepMemory | None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: shrunk, 3 rounds, no Python heap pass"
    )
    parser.add_argument("--workloads", default="W1,W2,W3,W4,W5", help="comma list, e.g. W1,W3")
    parser.add_argument(
        "--repeats", type=int, help="timed rounds (default 11, x3 for W3 and W4; quick 3)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    parser.add_argument("--sample-seconds", type=float, help="time per sample (default 0.1)")
    parser.add_argument("--tolerance", type=float, default=0.03, help="noise allowed in ratios")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="which time the tables report (default: process CPU time, see the docstring)",
    )
    parser.add_argument("--aa", action="store_true", help="A/A run: 'ours' is torch too")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory passes")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    parser.add_argument(
        "--profile",
        choices=("ours", "torch"),
        help="instead of timing, print pyinstrument call trees of this library's steps",
    )
    parser.add_argument("--variants", help="with --profile: comma list of variants to profile")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 11)
    args.sample_seconds = args.sample_seconds or (0.05 if args.quick else 0.1)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    return args


def make_step(workload: Workload, forward: Forward) -> Callable[[], None]:
    """One training step: gradients to ``None``, forward, backward."""

    def step() -> None:
        workload.zero_grads()
        forward().backward()

    return step


def configs_for(workload: Workload, ours: Library, theirs: Library) -> list[Config]:
    """The baseline plus every (variant, library) pair that applies to ``workload``."""
    configs = []
    for variant in workload.variants:
        sides = (
            [("both", theirs, False)]
            if variant == "none"
            else [
                ("ours", ours, True),
                ("torch", theirs, False),
            ]
        )
        for side, lib, is_ours in sides:
            forward = workload.forward(variant, lib, is_ours)
            if forward is None:
                continue
            config = Config(variant, side, make_step(workload, forward), forward)
            if variant == "scope" and is_ours and lib.session is not None:
                config.saved_inside = lib.session  # see _memory's docstring
            configs.append(config)
    return configs


def sample(step: Callable[[], None], inner: int) -> dict[str, float]:
    """Seconds per step over ``inner`` consecutive steps, after a collection, by both clocks:
    the process's CPU time and the wall clock."""
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(inner):
        step()
    return {
        "cpu": (time.process_time() - cpu) / inner,
        "wall": (time.perf_counter() - wall) / inner,
    }


def time_configs(configs: list[Config], args: argparse.Namespace, rounds: int) -> int:
    """Warm up, calibrate ``inner`` on the slowest configuration, then time ``rounds`` rounds
    in A B B A order. Returns ``inner``, the steps per sample (the same for every configuration).
    """
    for config in configs:
        for _ in range(args.warmup):
            config.step()
    slowest = max(sample(config.step, 1)["wall"] for config in configs)
    inner = max(1, round(args.sample_seconds / slowest))
    for round_index in range(rounds):
        order = configs if round_index % 2 == 0 else configs[::-1]
        for config in order:
            for clock, seconds in sample(config.step, inner).items():
                config.times[clock].append(seconds)
    return inner


def _median_ratio(ours: list[float], theirs: list[float]) -> float:
    return statistics.median(ours) / statistics.median(theirs)


def rows_for(workload: Workload, configs: list[Config], clock: str) -> list[Row]:
    """Group the configurations of ``workload`` into one row per variant (times by ``clock``)."""
    other = "wall" if clock == "cpu" else "cpu"
    by_key = {(c.variant, c.side): c for c in configs}
    rows = []
    for variant in workload.variants:
        if variant == "none":
            ours = theirs = by_key[("none", "both")]
        else:
            ours, theirs = by_key.get((variant, "ours")), by_key.get((variant, "torch"))
        both = variant != "none" and ours is not None and theirs is not None
        rows.append(
            Row(
                workload=workload.key,
                variant=variant,
                ours=ours.times[clock] if ours else None,
                torch=theirs.times[clock] if theirs else None,
                other_ratio=(
                    _median_ratio(ours.times[other], theirs.times[other])
                    if both and ours and theirs
                    else None
                ),
                ours_memory=ours.memory if ours else None,
                torch_memory=theirs.memory if theirs else None,
            )
        )
    return rows


def run_workload(
    workload: Workload, ours: Library, theirs: Library, args: argparse.Namespace
) -> tuple[list[Row], tuple[int, int]]:
    """Time (and measure) every configuration of ``workload``; return its rows, its number of
    rounds and ``inner``."""
    configs = configs_for(workload, ours, theirs)
    started = time.perf_counter()
    rounds = args.repeats * (1 if args.quick else workload.rounds_factor)
    inner = time_configs(configs, args, rounds)
    timed = time.perf_counter()
    if not args.no_memory:
        for config in configs:
            config.memory = measure(
                config.forward,
                workload.params,
                workload.zero_grads,
                config.saved_inside,
                python_heap=not args.quick,
            )
    print(
        f"# {workload.key}: timing {timed - started:.0f} s ({rounds} rounds, inner={inner}), "
        f"memory {time.perf_counter() - timed:.0f} s",
        file=sys.stderr,
    )
    return rows_for(workload, configs, args.clock), (rounds, inner)


# ----------------------------------------------------------------------------- formatting


def ms(seconds: float) -> str:
    """Milliseconds with three significant figures."""
    value = seconds * 1e3
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def spread(times: list[float] | None) -> str:
    """``median (min-max)`` in milliseconds, or n/a."""
    if not times:
        return "n/a"
    return f"{ms(statistics.median(times))} ({ms(min(times))}-{ms(max(times))})"


def ratio(row: Row) -> float | None:
    """Ratio of the medians ours/torch, or ``None`` where a side is missing or shared."""
    if row.variant == "none" or not row.ours or not row.torch:
        return None
    return statistics.median(row.ours) / statistics.median(row.torch)


def paired(row: Row) -> str:
    """Min-max of the per-round ratios ours/torch."""
    if row.variant == "none" or not row.ours or not row.torch:
        return ""
    ratios = [a / b for a, b in zip(row.ours, row.torch, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def size(n: int | None) -> str:
    """Bytes in B, KiB or MiB."""
    if n is None:
        return "n/a"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    if abs(n) >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def time_table(rows: list[Row], clock: str) -> list[str]:
    """Markdown lines of the time table (``clock`` names the primary clock)."""
    other = "wall" if clock == "cpu" else "CPU"
    lines = [
        f"| workload | variant | ours ms: median (min-max) | torch ms: median (min-max) "
        f"| ours/torch | per-round ratios | ours/torch by {other} clock |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = ratio(row)
        torch_cell = "(same run)" if row.variant == "none" else spread(row.torch)
        lines.append(
            f"| {row.workload} | {row.variant} | {spread(row.ours)} | {torch_cell} "
            f"| {'' if r is None else f'{r:.2f}'} | {paired(row)} "
            f"| {'' if row.other_ratio is None else f'{row.other_ratio:.2f}'} |"
        )
    return lines


def _both(row: Row, show: Callable[[StepMemory], str]) -> str:
    """``ours / torch`` for one memory quantity (one value for the shared baseline)."""
    left = show(row.ours_memory) if row.ours_memory else "n/a"
    right = show(row.torch_memory) if row.torch_memory else "n/a"
    return left if row.variant == "none" else f"{left} / {right}"


def memory_table(rows: list[Row]) -> list[str]:
    """Markdown lines of the memory table (ours / torch in each cell)."""
    lines = [
        "| workload | variant | saved | saved tensors | held after forward | peak over step "
        "| Python heap held |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            _both(row, lambda m: size(m.saved)),
            _both(row, lambda m: str(m.saved_tensors)),
            _both(row, lambda m: size(m.held)),
            _both(row, lambda m: size(m.peak)),
            _both(row, lambda m: size(m.py_held)),
        ]
        lines.append(f"| {row.workload} | {row.variant} | {' | '.join(cells)} |")
    return lines


def overheads(rows: list[Row]) -> list[tuple[str, Variant, float, float]]:
    """(workload, variant, ours, torch): median seconds above the baseline, for W3 and W4."""
    found = []
    for workload in OVERHEAD_WORKLOADS:
        base = next((r for r in rows if r.workload == workload and r.variant == "none"), None)
        if base is None or not base.ours:
            continue
        floor = statistics.median(base.ours)
        for row in rows:
            if row.workload != workload or row.variant == "none" or not row.ours or not row.torch:
                continue
            ours = statistics.median(row.ours) - floor
            theirs = statistics.median(row.torch) - floor
            found.append((workload, row.variant, ours, theirs))
    return found


def overhead_table(rows: list[Row]) -> list[str]:
    """Markdown lines of the per-op / per-call overhead table (time above the baseline)."""
    lines = [
        "| workload | variant | ours overhead ms | torch overhead ms "
        "| ours/torch (target <= 0.50) |",
        "|---|---|---|---|---|",
    ]
    for workload, variant, ours, theirs in overheads(rows):
        share = f"{ours / theirs:.2f}" if theirs > 0 else "n/a (torch's overhead <= 0)"
        lines.append(f"| {workload} | {variant} | {ms(ours)} | {ms(theirs)} | {share} |")
    return lines


def targets(rows: list[Row], tolerance: float) -> list[str]:
    """The issue's targets, one line per check that is not met (or a line saying all are)."""
    misses = []
    for row in rows:
        r = ratio(row)
        if r is not None and r > 1 + tolerance:
            misses.append(f"- time: {row.workload} {row.variant}: ours/torch = {r:.2f}")
        a, b = row.ours_memory, row.torch_memory
        if row.variant != "none" and a and b:
            for label, mine, theirs in (("saved", a.saved, b.saved), ("held", a.held, b.held)):
                if mine > theirs:
                    misses.append(
                        f"- memory: {row.workload} {row.variant}: {label} {size(mine)} vs "
                        f"{size(theirs)} (+{mine - theirs} B)"
                    )
            if row.workload == "W4" and not a.held < b.held:
                misses.append(f"- memory: W4 {row.variant}: held not below torch's")
    for workload, variant, ours, theirs in overheads(rows):
        if variant in OVERHEAD_VARIANTS and theirs > 0 and ours / theirs > 0.5:
            misses.append(f"- overhead: {workload} {variant}: ours/torch = {ours / theirs:.2f}")
    return misses or [f"- all targets met (time within {tolerance:.0%})"]


def source_state() -> str:
    """The git commit of the source tree, marked dirty when it has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "checkpointing"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown (no git)"
    return f"{commit or 'unknown'}{' + uncommitted changes in checkpointing/' if dirty else ''}"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def header(
    args: argparse.Namespace, inners: dict[str, tuple[int, int]], workloads: list[Workload]
) -> list[str]:
    """Markdown lines describing the run."""
    ours = "torch.utils.checkpoint (A/A run)" if args.aa else "checkpointing"
    policy = "torch op list" if args.aa else policy_source()
    mode = "QUICK (shrunk workloads)" if args.quick else "full workloads"
    lines = [
        f"- command: `{' '.join(['python benchmarks/run.py', *sys.argv[1:]])}`",
        f"- date: {datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}",
        f"- machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores visible, "
        f"torch threads {torch.get_num_threads()}",
        f"- python {platform.python_version()}, torch {torch.__version__}, "
        f"source: {source_state()}",
        f"- ours: {ours}; save-matmuls policy: {policy}",
        f"- {mode}, {args.warmup} warm-up steps per configuration, times by the {args.clock} clock",
    ]
    for w in workloads:
        rounds, inner = inners.get(w.key, (0, 0))
        lines.append(f"- {w.key}: {w.title}; {rounds} rounds of {inner} steps per sample")
    return lines


def profile_steps(
    workloads: list[Workload], lib: Library, is_ours: bool, variants: str | None
) -> None:
    """Print a pyinstrument call tree of ``lib``'s steps (3 s each) for the chosen variants."""
    from pyinstrument import Profiler  # an optional tool (the "bench" group), only for --profile

    chosen = set(variants.split(",")) if variants else None
    for workload in workloads:
        for variant in workload.variants:
            forward = workload.forward(variant, lib, is_ours)
            if forward is None or variant == "none" or (chosen and variant not in chosen):
                continue
            step = make_step(workload, forward)
            step()
            profiler = Profiler(interval=0.0002)
            deadline = time.perf_counter() + 3.0
            with profiler:
                while time.perf_counter() < deadline:
                    step()
            print(f"\n===== {workload.key} {variant} ({lib.name}) =====")
            print(profiler.output_text(unicode=True, color=False, show_all=False))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its report."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    theirs = torch_library()
    ours = torch_library("ours (torch)") if args.aa else ours_library()
    if ours is None:
        print("checkpointing.checkpoint is not importable; use --aa to test the harness alone")
        return 2
    workloads = build_workloads(args.workloads.split(","), args.quick)
    if args.profile:
        is_ours = args.profile == "ours"
        profile_steps(workloads, ours if is_ours else theirs, is_ours, args.variants)
        return 0
    rows: list[Row] = []
    inners: dict[str, tuple[int, int]] = {}
    for workload in workloads:
        workload_rows, inners[workload.key] = run_workload(workload, ours, theirs, args)
        rows += workload_rows
    report = [
        *header(args, inners, workloads),
        "",
        f"### Time per step ({args.clock} clock)",
        "",
        *time_table(rows, args.clock),
        "",
        "### Overhead above the un-checkpointed step (W3: per op, W4: per call)",
        "",
        *overhead_table(rows),
        "",
        "### Memory (ours / torch)",
        "",
        *memory_table(rows),
        "",
        "### Targets not met",
        "",
        *targets(rows, args.tolerance),
    ]
    print("\n".join(report))
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
