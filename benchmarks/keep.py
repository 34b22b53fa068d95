"""Kept spans side by side: ``checkpointing.keep`` against selective checkpointing and torch_remat.

Usage (from the repository root)::

    python benchmarks/keep.py                  # the full run, about 2 minutes
    python benchmarks/keep.py --quick          # smoke run, under a minute (timings are noise)
    python benchmarks/keep.py --rounds 51      # steadier medians
    python benchmarks/keep.py --quick --no-timing   # the checks only (bytes and gradients)

Every workload keeps one op's activations inside a region that recomputes the rest, five ways:
torch's ``checkpoint(use_reentrant=False)`` recomputing everything (the baseline every ratio is
taken against), ours recomputing everything, ours with selective checkpointing (a policy that
saves the one matmul), ours with ``checkpointing.keep`` around that matmul (the replay skips it,
NOTE [Kept spans]), and Meta's torch_remat 0.2.2: ``torch_remat.checkpoint()`` with
``torch_remat.region(matmul, name, recompute=False)``, plus ``recompute_needs_tensor`` on its
output, as torch_remat's ``region`` docstring requires when a plain op reads it in the replay
(without it the replay reads a placeholder and raises). torch_remat's checkpoint without a
region is shown too: it separates the region's cost from its checkpoint's. torch_remat is
optional (``bench`` dependency group); without it its rows are left out and a note says so.

Workloads. W3k: one checkpoint around ``torch.mm`` of 8x8 then 200 tiny elementwise ops (W3's
``tiny_ops``): the per-op cost, overhead = (step - un-checkpointed step) / 201 ops. W4k: 500
checkpoints in a chain (200 with ``--quick``), each around ``sin(mm(h, w))`` on 8x8: the
per-call cost, overhead = (step - un-checkpointed step) / calls. T4: 4 hand-written pre-norm
transformer blocks (d 64, 4 heads, 2 x 32 tokens, dropout 0.1 after attention, in the MLP and
after it), one checkpoint per block, keeping the attention output projection and the MLP's first
matmul (SAC: ``tag`` + ``save_only_these_names``; keep and torch_remat: around the same
``F.linear`` calls).

Method (as ``run.py``, whose helpers this reuses). One thread. A step is: gradients set to
``None``, forward, ``backward`` of a sum. Every configuration is warmed up, then timed in rounds
in A B B A order; a sample is ``inner`` steps after a ``gc.collect()``, read on the process's
CPU clock (the wall clock's ratio is shown beside). Reported: median (min-max) over rounds, the
ratio of medians to torch's, and the min-max of the per-round ratios; for the overhead targets,
also the min-max of the per-round overhead ratios. Note: torch_remat never preserves the RNG
state (its ``preserve_rng_state`` must be False); torch and ours preserve it (their default),
which costs each call a CPU RNG state read.

Checks on T4 (outside the timed rounds). Kept bytes: the CPU allocator's bytes held at the end
of the forward (``_memory.allocator_bytes``: everything a step keeps for backward, by any means),
and above the same library's full recompute; beside it, ``saved_tensors_report``'s
``kept_bytes``. Gradients: every variant's gradients (input and parameters) against the
un-checkpointed step's, with dropout on, the same seed before each forward; ``torch.equal``.
Exit status 1 when keep's gradients are not bitwise equal or its kept bytes differ from the
SAC's; torch_remat's gradients are reported, not checked (no RNG hook: its dropout differs).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

from _memory import allocator_bytes
from _workloads import tiny_ops
from run import Config, cpu_model, size, source_state, spread, time_configs

import checkpointing
from checkpointing.policies import as_context_fn, save_only_these_names, save_ops, tag

Forward = Callable[[], Tensor]
# How a body marks the op to keep: mark(name, fn, *args) runs fn(*args) the variant's way.
Mark = Callable[..., Tensor]
Body = Callable[[Tensor, Mark], Tensor]

VARIANTS = ("none", "torch", "full", "sac", "keep", "remat full", "remat region")
LABELS = {
    "none": "no checkpoint",
    "torch": "torch non-reentrant (baseline)",
    "full": "ours, full recompute",
    "sac": "ours, SAC keeping the matmul",
    "keep": "ours, keep(matmul)",
    "remat full": "torch_remat, full recompute",
    "remat region": "torch_remat, region(matmul, recompute=False)",
}
REMAT_VERSION = "0.2.2"  # the release pinned in pyproject.toml's bench group


def plain_mark(name: str, fn: Callable[..., Tensor], *args: Any) -> Tensor:
    """Run the op as it is (full recompute, and SAC by op)."""
    return fn(*args)


def tag_mark(name: str, fn: Callable[..., Tensor], *args: Any) -> Tensor:
    """Run the op and name its output for ``save_only_these_names``."""
    return tag(fn(*args), name)


def keep_mark(name: str, fn: Callable[..., Tensor], *args: Any) -> Tensor:
    """Run the op as a kept span."""
    return checkpointing.keep(fn, *args)


def remat_mark(remat: ModuleType) -> Mark:
    """torch_remat's SAVE region around the op, built once per name (its best form)."""
    regions: dict[tuple[str, Callable[..., Tensor]], Callable[..., Tensor]] = {}

    def mark(name: str, fn: Callable[..., Tensor], *args: Any) -> Tensor:
        region = regions.get((name, fn))
        if region is None:
            region = regions[(name, fn)] = remat.region(fn, name, recompute=False)
        out = region(*args)
        remat.recompute_needs_tensor(out)  # read by a plain op in the replay (its docstring)
        return out

    return mark


class Checkpointers:
    """``run(variant, body, h)``: ``body(h, mark)`` inside the variant's checkpoint; SAC with
    ``sac_context`` and ``sac_mark``; torch_remat's rows only where it is installed."""

    def __init__(
        self, sac_context: Callable[[], Any], sac_mark: Mark, remat: ModuleType | None
    ) -> None:
        self.sac_context, self.sac_mark, self.remat = sac_context, sac_mark, remat
        self.variants = VARIANTS if remat is not None else VARIANTS[:5]
        self._remat_mark = remat_mark(remat) if remat is not None else plain_mark
        self._remat_bodies: dict[int, Callable[..., Tensor]] = {}

    def run(self, variant: str, body: Body, h: Tensor) -> Tensor:
        if variant == "none":
            return body(h, plain_mark)
        if variant == "torch":
            return torch_checkpoint.checkpoint(body, h, plain_mark, use_reentrant=False)
        ours = functools.partial(checkpointing.checkpoint, use_reentrant=False)
        if variant == "full":
            return ours(body, h, plain_mark)
        if variant == "sac":
            return ours(body, h, self.sac_mark, context_fn=self.sac_context)
        if variant == "keep":
            return ours(body, h, keep_mark)
        mark = plain_mark if variant == "remat full" else self._remat_mark
        return self._remat_body(body)(h, mark)

    def _remat_body(self, body: Body) -> Callable[..., Tensor]:
        """``torch_remat.checkpoint()(body)``, built once per body (its best form)."""
        wrapped = self._remat_bodies.get(id(body))
        if wrapped is None and self.remat is not None:
            wrapped = self._remat_bodies[id(body)] = self.remat.checkpoint()(body)
        if wrapped is None:
            raise RuntimeError("benchmarks/keep.py: a torch_remat row without torch_remat")
        return wrapped


@dataclass
class Workload:
    """One benchmark problem: a forward per variant, and what a step's overhead is divided by."""

    key: str
    title: str
    tensors: list[Tensor]  # inputs and parameters: their gradients are reset each step
    forwards: dict[str, Forward]
    units: int = 0  # ops per region (per-op overhead) or calls (per-call); 0: no overhead row
    unit: str = ""

    def zero_grads(self) -> None:
        for tensor in self.tensors:
            tensor.grad = None


def w3_keep(ckpt: Checkpointers, ops: int = 200) -> Workload:
    """W3k: one checkpoint around an 8x8 matmul then ``ops`` tiny elementwise ops."""
    torch.manual_seed(31)
    x = torch.randn(8, 8, requires_grad=True)
    w = nn.Parameter(torch.randn(8, 8) / 8**0.5)
    scale = nn.Parameter(torch.rand(8, 8) + 0.5)

    def body(h: Tensor, mark: Mark) -> Tensor:
        return tiny_ops(mark("mm", torch.mm, h, w), scale, ops)

    forwards = {v: _bound(ckpt, v, body, x) for v in ckpt.variants}
    title = f"one checkpoint around mm (8x8) + {ops} tiny ops"
    return Workload("W3k", title, [x, w, scale], forwards, units=ops + 1, unit="op")


def _bound(ckpt: Checkpointers, variant: str, body: Body, x: Tensor) -> Forward:
    return lambda: ckpt.run(variant, body, x).sum()


def w4_keep(ckpt: Checkpointers, calls: int = 500) -> Workload:
    """W4k: ``calls`` checkpoints in a chain, each around ``sin(mm(h, w))`` on 8x8."""
    torch.manual_seed(41)
    x = torch.randn(8, 8, requires_grad=True)
    w = nn.Parameter(torch.randn(8, 8) / 8**0.5)

    def body(h: Tensor, mark: Mark) -> Tensor:
        return torch.sin(mark("mm", torch.mm, h, w))

    def chain(variant: str) -> Forward:
        def forward() -> Tensor:
            h = x
            for _ in range(calls):
                h = ckpt.run(variant, body, h)
            return h.sum()

        return forward

    forwards = {v: chain(v) for v in ckpt.variants}
    title = f"{calls} checkpoints around sin(mm) (8x8)"
    return Workload("W4k", title, [x, w], forwards, units=calls, unit="call")


class Block(nn.Module):
    """A pre-norm transformer block; ``mark`` runs its attention output projection and its
    MLP's first matmul (the ops the variants keep)."""

    def __init__(self, d: int = 64, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.p = heads, p

    def forward(self, x: Tensor, mark: Mark) -> Tensor:
        b, t, d = x.shape
        h = self.ln1(x).reshape(b * t, d)
        qkv = self.qkv(h).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = mark("attn_out", F.linear, a.transpose(1, 2).reshape(b * t, d), *_wb(self.out))
        x = x + F.dropout(a, self.p, self.training).reshape(b, t, d)
        h = mark("mlp_in", F.linear, self.ln2(x).reshape(b * t, d), *_wb(self.fc1))
        h = self.fc2(F.dropout(F.gelu(h), self.p, self.training))
        return x + F.dropout(h, self.p, self.training).reshape(b, t, d)


def _wb(linear: nn.Linear) -> tuple[Tensor, Tensor]:
    return linear.weight, linear.bias


def t4_transformer(ckpt: Checkpointers, depth: int = 4) -> Workload:
    """T4: ``depth`` pre-norm blocks with dropout, one checkpoint per block."""
    torch.manual_seed(7)
    blocks = nn.ModuleList(Block() for _ in range(depth)).train()
    x = torch.randn(2, 32, 64, requires_grad=True)

    def stack(variant: str) -> Forward:
        def forward() -> Tensor:
            h = x
            for block in blocks:
                h = ckpt.run(variant, block, h)
            return h.sum()

        return forward

    forwards = {v: stack(v) for v in ckpt.variants}
    title = f"{depth} pre-norm blocks (d 64, 4 heads, 2 x 32 tokens, dropout 0.1)"
    return Workload("T4", title, [x, *blocks.parameters()], forwards)


# ----------------------------------------------------------------------------- measuring


@dataclass
class Timed:
    """The timings of one workload: per variant, seconds per step by clock and round."""

    workload: Workload
    configs: dict[str, Config]
    rounds: int
    inner: int


def time_workload(workload: Workload, args: argparse.Namespace, rounds: int) -> Timed:
    """Every variant of ``workload`` timed in interleaved rounds (``run.time_configs``)."""
    configs = {
        variant: Config(variant, "ours", _step(workload, forward), forward)  # run.py's record
        for variant, forward in workload.forwards.items()
    }
    started = time.perf_counter()
    inner = time_configs(list(configs.values()), args, rounds)
    print(
        f"# {workload.key}: timing {time.perf_counter() - started:.0f} s "
        f"({rounds} rounds, inner={inner})",
        file=sys.stderr,
    )
    return Timed(workload, configs, rounds, inner)


def _step(workload: Workload, forward: Forward) -> Callable[[], None]:
    def step() -> None:
        workload.zero_grads()
        forward().backward()

    return step


@dataclass
class Checked:
    """T4's checks for one variant: bytes held after forward (twice), report bytes, gradients."""

    held: tuple[int, int]
    peak: int
    report_kept: int | None
    grads_equal: bool
    max_diff: float


def check_transformer(workload: Workload) -> dict[str, Checked]:
    """Kept bytes and gradients of every variant of T4 (see the module docstring)."""
    reference = _grads(workload, workload.forwards["none"])
    checked = {}
    for variant, forward in workload.forwards.items():
        grads = _grads(workload, forward)
        diffs = [(a - b).abs().max().item() for a, b in zip(grads, reference, strict=True)]
        equal = all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        held = []
        for _ in range(2):  # twice: a count that moves between steps is a finding of its own
            workload.zero_grads()
            first_held, peak = allocator_bytes(forward)
            held.append(first_held)
        checked[variant] = Checked(
            (held[0], held[1]), peak, _report_kept(workload, forward), equal, max(diffs)
        )
    workload.zero_grads()
    return checked


def _grads(workload: Workload, forward: Forward) -> list[Tensor]:
    workload.zero_grads()
    torch.manual_seed(1234)
    forward().backward()
    return [t.grad.clone() if t.grad is not None else torch.zeros(()) for t in workload.tensors]


def _report_kept(workload: Workload, forward: Forward) -> int | None:
    """``saved_tensors_report``'s ``kept_bytes`` of a watched step, or None without one."""
    report_api = getattr(checkpointing, "saved_tensors_report", None)
    if report_api is None:
        return None
    workload.zero_grads()
    with report_api() as report:
        forward().backward()
    workload.zero_grads()
    return int(report.kept_bytes)


# ----------------------------------------------------------------------------- reporting


def time_table(timed: list[Timed]) -> list[str]:
    """Markdown lines: step time per variant, ratio to torch's (CPU and wall)."""
    lines = [
        "| workload | variant | ms: median (min-max) | / torch | per-round / torch "
        "| / torch by wall clock |",
        "|---|---|---|---|---|---|",
    ]
    for t in timed:
        base = t.configs["torch"].times
        for variant, config in t.configs.items():
            cpu = config.times["cpu"]
            cells = ["", "", ""]
            if variant not in ("none", "torch"):
                per_round = [a / b for a, b in zip(cpu, base["cpu"], strict=True)]
                cells = [
                    f"{_ratio(cpu, base['cpu']):.2f}",
                    f"{min(per_round):.2f}-{max(per_round):.2f}",
                    f"{_ratio(config.times['wall'], base['wall']):.2f}",
                ]
            lines.append(
                f"| {t.workload.key} | {LABELS[variant]} | {spread(cpu)} | {' | '.join(cells)} |"
            )
    return lines


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def overhead(t: Timed, variant: str) -> float:
    """Median seconds above the un-checkpointed step, per op or per call."""
    times, floor = t.configs[variant].times["cpu"], t.configs["none"].times["cpu"]
    return (statistics.median(times) - statistics.median(floor)) / t.workload.units


def overhead_table(timed: list[Timed]) -> list[str]:
    """Markdown lines: overhead per op (W3k) or per call (W4k), and its ratio to torch's."""
    lines = [
        "| workload | variant | overhead us per op/call | / torch's overhead |",
        "|---|---|---|---|",
    ]
    for t in timed:
        if not t.workload.units:
            continue
        torch_overhead = overhead(t, "torch")
        for variant in t.configs:
            if variant == "none":
                continue
            mine = overhead(t, variant)
            share = f"{mine / torch_overhead:.2f}" if torch_overhead > 0 else "n/a"
            lines.append(
                f"| {t.workload.key} | {LABELS[variant]} | {mine * 1e6:.2f} / {t.workload.unit} "
                f"| {share} |"
            )
    return lines


def _per_round_share(t: Timed, variant: str, other: str) -> tuple[float, float]:
    """Min-max over rounds of (variant - none) / (other - none)."""
    none = t.configs["none"].times["cpu"]
    mine, theirs = t.configs[variant].times["cpu"], t.configs[other].times["cpu"]
    shares = [(a - n) / (b - n) for a, b, n in zip(mine, theirs, none, strict=True) if b > n]
    return (min(shares), max(shares)) if shares else (float("nan"), float("nan"))


def overhead_targets(timed: list[Timed]) -> list[str]:
    """The issue's overhead targets, one line each, met or not."""
    goals = [("W3k", "sac", 0.6), ("W4k", "remat region", 1.0), ("W4k", "sac", 1.0)]
    lines = []
    for key, other, limit in goals:
        t = next((t for t in timed if t.workload.key == key), None)
        if t is None or other not in t.configs:
            lines.append(f"- {key}: keep against {LABELS[other]}: not measured in this run")
            continue
        share = overhead(t, "keep") / overhead(t, other)
        low, high = _per_round_share(t, "keep", other)
        verdict = "met" if share <= limit else "NOT MET"
        bound = f"<= {limit:.2f}" if limit < 1 else "< 1"
        lines.append(
            f"- {key}: keep's overhead / {LABELS[other]}'s = {share:.2f} (target {bound}; "
            f"per round {low:.2f}-{high:.2f}): {verdict}"
        )
    return lines


def memory_table(checked: dict[str, Checked]) -> list[str]:
    """Markdown lines of T4's checks: bytes kept by each variant and its gradients."""
    lines = [
        "| variant | held after forward | kept above its full recompute | peak over step "
        "| saved_tensors_report kept_bytes | gradients bitwise equal to no checkpoint |",
        "|---|---|---|---|---|---|",
    ]
    for variant, c in checked.items():
        base = _full_of(variant)
        above = "" if base is None else size(c.held[0] - checked[base].held[0])
        moved = "" if c.held[0] == c.held[1] else f" (then {size(c.held[1])})"
        report = "n/a" if c.report_kept is None else size(c.report_kept)
        grads = "yes" if c.grads_equal else f"no (max abs diff {c.max_diff:.2e})"
        lines.append(
            f"| {LABELS[variant]} | {size(c.held[0])}{moved} | {above} | {size(c.peak)} "
            f"| {report} | {grads} |"
        )
    return lines


def _full_of(variant: str) -> str | None:
    """The full-recompute variant of the same library, the floor of 'kept above'."""
    if variant in ("sac", "keep"):
        return "full"
    return "remat full" if variant == "remat region" else None


def checks(checked: dict[str, Checked]) -> tuple[list[str], bool]:
    """The correctness lines for T4, and whether keep passed them all."""
    keep, sac = checked["keep"], checked["sac"]
    same_bytes = keep.held == sac.held and keep.held[0] == keep.held[1]
    lines = [
        f"- keep's bytes held after forward equal the SAC's: {'yes' if same_bytes else 'NO'} "
        f"({size(keep.held[0])} / {size(sac.held[0])}, to the byte: "
        f"{keep.held[0]} / {sac.held[0]})",
        f"- keep's gradients bitwise equal to no checkpoint, dropout on: "
        f"{'yes' if keep.grads_equal else 'NO'}",
    ]
    for variant in ("full", "sac", "remat full", "remat region"):
        if variant in checked:
            equal = checked[variant].grads_equal
            lines.append(
                f"- {LABELS[variant]}: gradients bitwise equal: {'yes' if equal else 'no'}"
                + ("" if equal else f" (max abs diff {checked[variant].max_diff:.2e})")
            )
    return lines, same_bytes and keep.grads_equal


# ----------------------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds, W4k shrunk")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 33; quick 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    parser.add_argument("--sample-seconds", type=float, help="time per sample (default 0.1)")
    parser.add_argument("--no-timing", action="store_true", help="the checks only (T4)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 33)
    args.sample_seconds = args.sample_seconds or (0.03 if args.quick else 0.1)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    return args


def load_remat() -> tuple[ModuleType | None, str]:
    """torch_remat, or None; and a line saying which (or why its rows are missing)."""
    try:
        remat = importlib.import_module("torch_remat")
    except ImportError:
        return None, (
            f"torch_remat is not installed: its rows are left out "
            f"(`pip install torch_remat=={REMAT_VERSION}`, or the bench dependency group)"
        )
    version = importlib.metadata.version("torch_remat")
    pinned = "" if version == REMAT_VERSION else f" (NOT the pinned {REMAT_VERSION})"
    return remat, f"torch_remat {version}{pinned}"


def header(args: argparse.Namespace, remat_line: str, workloads: list[Workload]) -> list[str]:
    """Markdown lines describing the run."""
    mode = "QUICK (smoke run: timings are noise)" if args.quick else "full run"
    lines = [
        f"- command: `{' '.join(['python benchmarks/keep.py', *sys.argv[1:]])}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores visible, "
        f"torch threads {torch.get_num_threads()}",
        f"- python {platform.python_version()}, torch {torch.__version__}, "
        f"source: {source_state()}; {remat_line}",
        f"- {mode}, {args.rounds} rounds, {args.warmup} warm-up steps, times by the CPU clock",
    ]
    lines += [f"- {w.key}: {w.title}" for w in workloads]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its report; 1 when one of keep's checks fails."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    remat, remat_line = load_remat()
    by_op = Checkpointers(as_context_fn(save_ops(torch.ops.aten.mm.default)), plain_mark, remat)
    by_name = Checkpointers(
        as_context_fn(save_only_these_names("attn_out", "mlp_in")), tag_mark, remat
    )
    transformer = t4_transformer(by_name)
    timed_workloads = [w3_keep(by_op), w4_keep(by_op, 200 if args.quick else 500), transformer]
    report = header(args, remat_line, timed_workloads)
    if remat is None:
        report += ["", f"Note: {remat_line}."]
    if not args.no_timing:
        timed = [time_workload(w, args, args.rounds) for w in timed_workloads]
        report += ["", "### Time per step (CPU clock)", "", *time_table(timed)]
        report += ["", "### Overhead above the un-checkpointed step", "", *overhead_table(timed)]
        report += ["", "### Overhead targets", "", *overhead_targets(timed)]
    checked = check_transformer(transformer)
    check_lines, passed = checks(checked)
    report += ["", "### T4: bytes kept for backward and gradients", "", *memory_table(checked)]
    report += ["", "### Checks", "", *check_lines]
    print("\n".join(report))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
