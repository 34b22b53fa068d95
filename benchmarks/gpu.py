"""Device memory and step time of ``checkpointing`` against ``torch.utils.checkpoint`` on a GPU.

Usage (from the repository root)::

    python3 benchmarks/gpu.py                                # CUDA, full sizes (~1-2 min, H200)
    python3 benchmarks/gpu.py --out benchmarks/GPU.md        # the report also written to a file
    python3 benchmarks/gpu.py --device cpu --quick           # smoke run of the harness on CPU

Workloads. MLP: 16 x (Linear 4096->4096 + GELU + dropout 0.1), batch 2048, float32 (TF32 as
torch's settings say; the header prints them). Transformer: 8 x nn.TransformerEncoderLayer
(d_model 1024, 16 heads, feed-forward 2048, dropout 0.1, batch_first), sequence 2048, batch 8,
under ``torch.autocast(dtype=torch.bfloat16)``. ``--quick`` shrinks both to seconds on a CPU.

Variants, one checkpoint per block (``_workloads._chain``, as W1/W2 of ``run.py``): none;
non-reentrant, torch's and ours; SAC that saves the matmuls (``_libs``: torch's op list, our
``save_matmuls()``); ours with the same matmul outputs offloaded to pinned host memory
(``offload_ops``; torch has no eager offload, so this row is compared with torch's SAC); and, on
the MLP only, ours with ``gradient_checkpoint_scope`` around each block's Linear+GELU (the GELU
input is recomputed; compared with torch's non-reentrant). The transformer has no scope row: a
scope needs a place inside the layer's code.

Method. A step: gradients set to ``None``, forward, ``loss.backward()``. Every variant gets
``--warmup`` steps, then ``--repeats`` rounds, each round one step of every variant, the next
round in reverse order (A B B A ..., as ``run.py``); a step's time is the wall clock between two
device synchronizations, so it includes the device's work. Reported: median (min-max), the ratio
of the medians ours/torch and the range of the per-round ratios. Memory, from one more step per
variant, relative to what is in use before it (parameters, inputs; gradients are ``None``, so
they count in the peak): *peak* is ``torch.cuda.max_memory_allocated`` over forward and backward,
*held* is ``torch.cuda.memory_allocated`` right after the forward (what is kept for backward,
plus the loss). On CPU both come from the profiler's allocator events (``_memory.py``).
Gradients: one step per variant from one seed, compared with the un-checkpointed step bit for
bit; that step is run twice, to show whether the kernels repeat themselves at all (flash
attention's backward does not, by default); a mismatch prints max |diff| / max |plain| beside
that plain-against-plain noise. The offload row's notes add, from its memory step, the copy
time the overlap did not hide (``OffloadStats.unhidden_copy_seconds``, CUDA events around each
wait of the compute stream for a restore) and its step time over ours saving the same matmuls
("offload vs keep": the policy's own offload, no planner ``host_budget``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# Run as a script: the helpers sit beside this file; the source tree is the fallback for an
# uninstalled ``checkpointing``.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

from _libs import MATMUL_OPS, Library, ours_library, policy_source, torch_library
from _memory import allocator_bytes
from _workloads import Forward, Variant, Workload, _chain
from run import cpu_model, make_step, ms, size, source_state

from checkpointing import OffloadStats, policies

SEED = 20
# Blocks per workload as built (quick or full): the half-offload row cycles through them.
DEPTH: dict[str, int] = {}


@dataclass
class Case:
    """One row: a variant of a workload under one library, with what was measured."""

    label: str
    side: str  # "ours", "torch", or "-" for the un-checkpointed step
    versus: str | None  # the label of the torch row this one is compared with
    forward: Forward = field(repr=False)
    times: list[float] = field(default_factory=list)
    held: int = 0
    peak: int = 0
    grads: str = ""
    offload_stats: OffloadStats | None = field(default=None, repr=False)
    offloaded: tuple[int, int] = (0, 0)  # bytes to host and back in the memory step
    # in the memory step: seconds the compute stream waited for restores (CUDA events), the
    # restores that waited, all restores
    unhidden: tuple[float, int, int] = (0.0, 0, 0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds: a smoke run")
    parser.add_argument("--workloads", default="mlp,transformer", help="comma list")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 11; quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant (default 2; quick 1)")
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 11)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False (use --device cpu)")
    return args


# ----------------------------------------------------------------------------- workloads


def mlp(device: torch.device, quick: bool) -> Workload:
    """16 x (Linear 4096 + GELU + dropout 0.1), batch 2048, float32 (quick: 4 x 256, batch 64)."""
    depth, width, batch = (4, 256, 64) if quick else (16, 4096, 2048)
    torch.manual_seed(SEED)
    layers = [
        (nn.Linear(width, width, device=device), nn.GELU(), nn.Dropout(0.1)) for _ in range(depth)
    ]
    blocks = nn.Sequential(*(nn.Sequential(*layer) for layer in layers))
    x = torch.randn(batch, width, device=device, requires_grad=True)
    DEPTH["MLP"] = depth

    def build(variant: Variant, lib: Library, is_ours: bool) -> Forward | None:
        if variant == "scope":
            return _scoped_blocks(layers, x, lib) if is_ours else None
        return _chain(blocks, x, variant, lib)

    return Workload(
        key="MLP",
        title=f"{depth} x (Linear {width}->{width} + GELU + dropout 0.1), batch {batch}, float32",
        params=list(blocks.parameters()),
        inputs=[x],
        variants=("none", "non-reentrant", "sac", "scope"),
        build=build,
    )


def _scoped_blocks(
    layers: list[tuple[nn.Linear, nn.GELU, nn.Dropout]], x: Tensor, lib: Library
) -> Forward | None:
    """Each block's Linear+GELU inside ``gradient_checkpoint_scope`` (the GELU's saved input is
    recomputed), its dropout outside (so the next block's input is kept, not chained tapes)."""
    scope = lib.scope
    if scope is None:
        return None

    def forward() -> Tensor:
        h = x
        for linear, gelu, dropout in layers:
            with scope():
                h = gelu(linear(h))
            h = dropout(h)
        return h.sum()

    return forward


def transformer(device: torch.device, quick: bool) -> Workload:
    """8 x TransformerEncoderLayer(1024, 16 heads, dropout 0.1), seq 2048, batch 8, bf16 autocast
    (quick: 2 x (64, 4 heads), seq 32, batch 2)."""
    depth, d_model, heads, seq, batch = (2, 64, 4, 32, 2) if quick else (8, 1024, 16, 2048, 8)
    torch.manual_seed(SEED + 1)
    blocks = nn.Sequential(
        *(
            nn.TransformerEncoderLayer(d_model, heads, batch_first=True, device=device)
            for _ in range(depth)
        )
    ).train()
    x = torch.randn(batch, seq, d_model, device=device, requires_grad=True)
    DEPTH["Transformer"] = depth

    def build(variant: Variant, lib: Library, is_ours: bool) -> Forward:
        return _under_autocast(_chain(blocks, x, variant, lib), device.type)

    return Workload(
        key="Transformer",
        title=f"{depth} x TransformerEncoderLayer(d_model {d_model}, {heads} heads, dropout 0.1), "
        f"seq {seq}, batch {batch}, bfloat16 autocast",
        params=list(blocks.parameters()),
        inputs=[x],
        variants=("none", "non-reentrant", "sac"),
        build=build,
    )


def _under_autocast(forward: Forward, device_type: str) -> Forward:
    """``forward`` run under bfloat16 autocast (the loss too; backward runs outside it)."""

    def run() -> Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return forward()

    return run


WORKLOADS: dict[str, Callable[[torch.device, bool], Workload]] = {
    "mlp": mlp,
    "transformer": transformer,
}


def cases_for(
    workload: Workload, ours: Library, theirs: Library, stats: OffloadStats
) -> list[Case]:
    """The rows of ``workload`` that apply, in table order (the offload row adds its bytes to
    ``stats``)."""
    offload = offload_library(ours, stats)
    half_stats = OffloadStats()
    depth = DEPTH.get(workload.key)
    half = offload_library(ours, half_stats, first_of=depth) if depth else None
    plan: list[tuple[str, str, str | None, Variant, Library, bool]] = [
        ("none", "-", None, "none", theirs, False),
        ("non-reentrant", "torch", None, "non-reentrant", theirs, False),
        ("non-reentrant", "ours", "non-reentrant", "non-reentrant", ours, True),
        ("SAC save matmuls", "torch", None, "sac", theirs, False),
        ("SAC save matmuls", "ours", "SAC save matmuls", "sac", ours, True),
        ("SAC offload matmuls", "ours", "SAC save matmuls", "sac", offload, True),
        *([(_HALF, "ours", "SAC save matmuls", "sac", half, True)] if half is not None else []),
        ("scope (Linear+GELU)", "ours", "non-reentrant", "scope", ours, True),
    ]
    cases = []
    for label, side, versus, variant, lib, is_ours in plan:
        forward = workload.forward(variant, lib, is_ours)
        if forward is not None:
            cases.append(Case(label, side, versus, forward))
            if lib is offload:
                cases[-1].offload_stats = stats
            elif lib is half:
                cases[-1].offload_stats = half_stats
    return cases


# ----------------------------------------------------------------------------- measuring


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_cases(workload: Workload, cases: list[Case], args: argparse.Namespace) -> None:
    """Warm up, then ``args.repeats`` rounds in A B B A order, one step per case per round."""
    sync = synchronizer(args.device)
    steps = [make_step(workload, case.forward) for case in cases]
    for step in steps:
        for _ in range(args.warmup):
            step()
    for round_index in range(args.repeats):
        order = list(zip(cases, steps, strict=True))
        for case, step in order if round_index % 2 == 0 else order[::-1]:
            sync()
            start = time.perf_counter()
            step()
            sync()
            case.times.append(time.perf_counter() - start)


def device_bytes(workload: Workload, forward: Forward, device: torch.device) -> tuple[int, int]:
    """(held after forward, peak over forward + backward), above the memory in use before."""
    workload.zero_grads()
    if device.type != "cuda":
        return allocator_bytes(forward)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    loss = forward()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    loss.backward()
    del loss
    torch.cuda.synchronize(device)
    return held, torch.cuda.max_memory_allocated(device) - base


def gradients(workload: Workload, forward: Forward) -> list[Tensor]:
    """The gradients of parameters and inputs after one step from ``SEED`` (then cleared)."""
    workload.zero_grads()
    torch.manual_seed(SEED)
    forward().backward()
    wrt = [*workload.params, *workload.inputs]
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in wrt]
    workload.zero_grads()
    return grads


def difference(got: list[Tensor], expected: list[Tensor]) -> float:
    """max |got - expected| / max |expected| over all tensors (0.0: bit-identical)."""
    if all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
        return 0.0
    diff = max(
        float((a.float() - b.float()).abs().max()) for a, b in zip(got, expected, strict=True)
    )
    scale = max(float(b.float().abs().max()) for b in expected)
    return diff / scale if scale > 0 else float("inf")


def check_gradients(workload: Workload, cases: list[Case]) -> None:
    """Fill ``case.grads``: "bit-identical" or the relative difference, beside the noise of two
    un-checkpointed steps (see the module docstring)."""
    plain = gradients(workload, cases[0].forward)
    noise = difference(gradients(workload, cases[0].forward), plain)
    cases[0].grads = "reference" if noise == 0 else f"reference (repeat differs: {noise:.1e})"
    for case in cases[1:]:
        found = difference(gradients(workload, case.forward), plain)
        case.grads = "bit-identical" if found == 0 else f"differ: {found:.1e} (noise {noise:.1e})"


def run_workload(workload: Workload, cases: list[Case], args: argparse.Namespace) -> None:
    """Time, measure and check every case of ``workload`` (progress on stderr)."""
    started = time.perf_counter()
    time_cases(workload, cases, args)
    timed = time.perf_counter()
    for case in cases:
        stats = case.offload_stats
        if stats is not None:
            stats.reset()
            stats.time_copies = True  # CUDA events around each wait: the memory step only
        case.held, case.peak = device_bytes(workload, case.forward, args.device)
        if stats is not None:
            stats.time_copies = False
            case.offloaded = (stats.offloaded_bytes, stats.restored_bytes)
            seconds = stats.unhidden_copy_seconds  # read after the step's synchronization
            case.unhidden = (seconds, stats.waited_restores, stats.restored_tensors)
    check_gradients(workload, cases)
    print(
        f"# {workload.key}: timing {timed - started:.0f} s ({args.repeats} rounds), memory and "
        f"gradients {time.perf_counter() - timed:.0f} s",
        file=sys.stderr,
    )


# ----------------------------------------------------------------------------- report


def _median(case: Case) -> float:
    return statistics.median(case.times)


def _ratio(mine: float, theirs: float) -> str:
    return f"{mine / theirs:.2f}" if theirs > 0 else "n/a"


def table(cases: list[Case]) -> list[str]:
    """Markdown lines of one workload's table."""
    torch_rows = {c.label: c for c in cases if c.side == "torch"}
    base = _median(cases[0])
    lines = [
        "| variant | library | step ms: median (min-max) | x none | peak | held after forward "
        "| ours/torch time | per-round ratios | ours/torch peak | ours/torch held "
        "| gradients vs none |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        times = (
            f"{ms(_median(case))} ({ms(min(case.times))}-{ms(max(case.times))})"
            if case.times
            else "n/a"
        )
        cells = [case.label, case.side, times, f"{_median(case) / base:.2f}"]
        cells += [size(case.peak), size(case.held)]
        other = torch_rows.get(case.versus) if case.versus else None
        if other is None:
            cells += ["", "", "", ""]
        else:
            per_round = [a / b for a, b in zip(case.times, other.times, strict=True)]
            versus = "" if case.versus == case.label else f" (vs torch {case.versus})"
            cells += [
                _ratio(_median(case), _median(other)) + versus,
                f"{min(per_round):.2f}-{max(per_round):.2f}",
                _ratio(case.peak, other.peak),
                _ratio(case.held, other.held),
            ]
        cells.append(case.grads)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def notes(cases: list[Case]) -> list[str]:
    """What the table does not show: the bytes the offload row moved in its memory step, the
    copy time the overlap did not hide, and offload's step time against keeping the same
    tensors on the device (ours, the same policy with save instead of offload; no planner, no
    ``host_budget``)."""
    found = {(c.label, c.side): c for c in cases}
    lines = []
    for case in cases:
        if case.offload_stats is None:
            continue
        seconds, waited, restores = case.unhidden
        lines.append(
            f"- {case.side} {case.label}: {size(case.offloaded[0])} to host and "
            f"{size(case.offloaded[1])} back in one step (OffloadStats); unhidden copy time "
            f"{ms(seconds)} ms in that step ({waited} of {restores} restores waited)"
        )
        kept = found.get(("SAC save matmuls", case.side))
        if kept is not None and case.times and kept.times:
            per_round = [a / b for a, b in zip(case.times, kept.times, strict=True)]
            lines.append(
                f"- {case.side} offload vs keep: {case.label} / SAC save matmuls = "
                f"{_ratio(_median(case), _median(kept))} step time "
                f"(per round {min(per_round):.2f}-{max(per_round):.2f})"
            )
    return lines


def checks(key: str, cases: list[Case]) -> list[str]:
    """The claims this run tests, one line each, marked met or NOT met."""
    found = {(c.label, c.side): c for c in cases}
    none = cases[0]
    claims: list[tuple[str, bool]] = []
    for case in cases[1:]:
        claims.append((f"{case.side} {case.label}: peak below none's", case.peak < none.peak))
        claims.append((f"{case.side} {case.label}: held below none's", case.held < none.held))
    for label in ("non-reentrant", "SAC save matmuls"):
        mine, theirs = found.get((label, "ours")), found.get((label, "torch"))
        if mine is not None and theirs is not None:
            claims.append((f"ours {label}: peak <= torch's", mine.peak <= theirs.peak))
            claims.append((f"ours {label}: held <= torch's", mine.held <= theirs.held))
    offload, saved = (
        found.get(("SAC offload matmuls", "ours")),
        found.get(("SAC save matmuls", "ours")),
    )
    if offload is not None and saved is not None:
        claims.append(("ours offload: held below ours SAC save", offload.held < saved.held))
    return [f"- {key}: {'met' if ok else 'NOT met'}: {claim}" for claim, ok in claims]


def device_name(device: torch.device) -> str:
    """The accelerator's name, or the CPU's model."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return cpu_model()


def header(args: argparse.Namespace, titles: list[str]) -> list[str]:
    """Markdown lines describing the run."""
    tf32 = (
        f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, "
        f"cuDNN TF32 {torch.backends.cudnn.allow_tf32}"
    )
    lines = [
        f"- command: `{' '.join(['python3 benchmarks/gpu.py', *sys.argv[1:]])}`",
        f"- date: {datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}",
        f"- device: {device_name(args.device)}; {tf32}",
        f"- python {platform.python_version()}, torch {torch.__version__}, "
        f"source: {source_state()}",
        f"- save-matmuls policy: {policy_source()}; offload: "
        "checkpointing.policies.offload_ops(the same ops)",
        f"- {'QUICK (tiny sizes)' if args.quick else 'full sizes'}; per variant: warm-up steps "
        f"{args.warmup}, timed rounds {args.repeats}, wall clock between device "
        "synchronizations",
    ]
    lines += [f"- {title}" for title in titles]
    return lines


_HALF = "SAC offload matmuls, first half of blocks"


class _FirstBlocksOffload:
    """A ``context_fn`` for a chain of ``depth`` checkpointed blocks, called once per block in
    order: the first half offload the matmul outputs, the others save them. Offloading what
    backward needs last leaves the copies of the whole second half of the forward and the
    first half of backward to hide behind."""

    def __init__(self, depth: int, stats: OffloadStats) -> None:
        self.depth, self.stats, self.calls = depth, stats, 0
        self.offload = policies.as_context_fn(
            policies.offload_ops(*MATMUL_OPS), offload_stats=stats
        )
        self.save = policies.as_context_fn(policies.save_ops(*MATMUL_OPS))

    def __call__(self) -> Any:
        block, self.calls = self.calls % self.depth, self.calls + 1
        chosen = self.offload if block < self.depth // 2 else self.save
        return chosen()


def offload_library(ours: Library, stats: OffloadStats, first_of: int | None = None) -> Library:
    """Ours, with SAC offloading the matmul outputs to host memory instead of saving them (with
    ``first_of``: only in the first half of that many blocks); the bytes moved are added to
    ``stats``."""
    if first_of is not None:
        half = _FirstBlocksOffload(first_of, stats)
        return dataclasses.replace(ours, name="ours offload first half", save_matmuls=half)
    context_fn = policies.as_context_fn(policies.offload_ops(*MATMUL_OPS), offload_stats=stats)
    return dataclasses.replace(ours, name="ours offload", save_matmuls=context_fn)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print (and with ``--out``, write) its report."""
    args = parse_args(argv)
    ours = ours_library()
    if ours is None:
        print("checkpointing.checkpoint is not importable", file=sys.stderr)
        return 2
    theirs, stats = torch_library(), OffloadStats()
    unknown = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        print(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}", file=sys.stderr)
        return 2
    report: list[str] = []
    titles = []
    for key in args.workloads.split(","):
        workload = WORKLOADS[key](args.device, args.quick)
        cases = cases_for(workload, ours, theirs, stats)
        run_workload(workload, cases, args)
        titles.append(f"{workload.key}: {workload.title}")
        report += ["", f"### {titles[-1]}", "", *table(cases), "", *notes(cases)]
        report += ["", "Checks:", "", *checks(workload.key, cases)]
        del workload, cases  # free the model before the next one is built
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    title = "## checkpointing vs torch.utils.checkpoint on a device (benchmarks/gpu.py)"
    text = "\n".join([title, "", *header(args, titles), *report])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
