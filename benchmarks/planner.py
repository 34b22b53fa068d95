"""``plan_checkpointing`` against hand-written policies at the same memory budget.

Usage (from the repository root)::

    python benchmarks/planner.py            # W1 and W2 (reduced sizes), plot in docs/
    python benchmarks/planner.py --compile  # instead: torch.compile's activation_memory_budget

Method. One thread. For each workload, every hand policy (full checkpointing, ``save_matmuls``,
every second matmul saved, every n-th layer checkpointed for n = 2, 3, 4) and the plan at each
budget (0.1 ... 0.9 of the bytes kept without checkpointing) is installed with
``checkpoint_module`` per block; its kept activation bytes come from ``saved_tensors_report``
(the count the planner plans with: every storage ops made in the step, masks included). Time:
each round runs every configuration once (the next round in reverse order); a configuration's
sample is the faster of two steps' CPU time (``time.process_time``) after a warm-up step. At each
budget the plan is compared with the fastest hand policy (median over rounds) whose measured
bytes fit the same budget in bytes (no tolerance: both sides use one count); the ratio is the
median over rounds of the per-round ratio. The un-checkpointed step is timed twice per round
("none" and "none again"): the spread of their per-round ratio is the noise of the machine.

``--compile`` (slow: inductor compiles the model once per budget; no timing then): W2 under
``torch.compile`` (inductor) with ``activation_memory_budget`` 1.0, 0.5 and 0.25 beside the plan
at budgets 0.5 and 0.25 (equal numbers mean different things: see ``compile_table``); for each,
the bytes the step keeps for backward and the FLOPs recomputed (``FlopCounterMode`` over the
backward, minus the eager un-checkpointed backward's; for the plans, the report's count of what
recompute runs, which agrees with it on full checkpointing). Kept bytes: for the compiled step,
an outer saved-tensors hook (unique storages, parameters and input left out; the compiled
graph's saved tensors reach it); for the plans, the report (the hook misses a selective cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

import checkpointing
from checkpointing import _compat, policies
from checkpointing._planning.plan import policy_seconds_per_op
from checkpointing._planning.profile import profile_step
from checkpointing._planning.solver import solve
from checkpointing._selective import CheckpointPolicy

BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MATMULS = policies.MATMUL_OPS


class EverySecondMatmul:
    """torchtitan's selective policy: save every second matmul of a region, recompute the rest."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in MATMULS:
            self.count += 1
            if self.count % 2 == 0:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def every_second_matmul() -> tuple[Any, Any]:
    return checkpointing.create_selective_checkpoint_contexts(EverySecondMatmul())


def w1(depth: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(depth)))
    return model, torch.randn(64, 1024, requires_grad=True)


def w2(depth: int, batch: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(2)
    model = nn.Sequential(
        *(nn.TransformerEncoderLayer(256, 8, dropout=0.1, batch_first=True) for _ in range(depth))
    ).train()
    return model, torch.randn(batch, 128, 256, requires_grad=True)


Installer = Callable[[nn.Module], Callable[[], None]]


def blocks_policy(context_fn: Any = None, every: int = 1) -> Installer:
    """Checkpoint every ``every``-th block (with ``context_fn`` if given); returns the undo."""

    def install(model: nn.Module) -> Callable[[], None]:
        chosen = [b for i, b in enumerate(model) if i % every == 0]
        for block in chosen:
            if context_fn is None:
                checkpointing.checkpoint_module(block)
            else:
                checkpointing.checkpoint_module(block, context_fn=context_fn)

        def undo() -> None:
            for block in chosen:
                checkpointing.remove_checkpoint_module(block)

        return undo

    return install


def plan_installer(plan: checkpointing.ActivationPlan) -> Installer:
    """Install ``plan``; the undo removes it."""

    def install(model: nn.Module) -> Callable[[], None]:
        plan.apply(model)

        def undo() -> None:
            plan.remove(model)

        return undo

    return install


HAND: dict[str, Installer] = {
    "full": blocks_policy(),
    "save_matmuls": blocks_policy(policies.as_context_fn(policies.save_matmuls())),
    "every 2nd matmul": blocks_policy(every_second_matmul),
    "every 2 layers": blocks_policy(every=2),
    "every 3 layers": blocks_policy(every=3),
    "every 4 layers": blocks_policy(every=4),
}


def step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).sum().backward()


def kept(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(activation bytes kept, FLOPs recomputed) of one step, from ``saved_tensors_report``."""
    with checkpointing.saved_tensors_report() as report:
        step(model, x)
    return report.activation_bytes, report.recompute_flops


def time_configs(
    model: nn.Module, x: torch.Tensor, configs: dict[str, Installer], repeats: int
) -> dict[str, list[float]]:
    """Per config, one sample per round: the faster of two steps' CPU seconds after a warm-up
    step; rounds in alternating order."""
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            undo = configs[name](model)
            step(model, x)  # warm
            samples = []
            for _ in range(2):
                start = time.process_time()
                step(model, x)
                samples.append(time.process_time() - start)
            times[name].append(min(samples))
            undo()
    return times


def run(key: str, model: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    plans = {}
    for budget in BUDGETS:
        try:
            plans[budget] = checkpointing.plan_checkpointing(model, x, budget=budget)
        except ValueError:
            continue
    reference = checkpointing.plan_checkpointing(model, x, budget=1.0)
    none: Installer = lambda m: lambda: None  # noqa: E731
    configs: dict[str, Installer] = {"none": none, "none again": none, **HAND}
    for budget, plan in plans.items():
        configs[f"plan {budget}"] = plan_installer(plan)
    measured = {}
    for name, install in configs.items():
        undo = install(model)
        measured[name] = kept(model, x)
        undo()
    samples = time_configs(model, x, configs, repeats)
    return {
        "key": key,
        "baseline": reference.baseline_bytes,
        "floor": reference.floor_bytes,
        "frontier": reference.frontier(),
        "plans": plans,
        "bytes": {n: b for n, (b, _) in measured.items()},
        "flops": {n: f for n, (_, f) in measured.items()},
        "samples": samples,
        "seconds": {n: statistics.median(t) for n, t in samples.items()},
    }


def paired(samples: dict[str, list[float]], a: str, b: str) -> list[float]:
    """Per-round ratios of ``a``'s sample to ``b``'s, sorted."""
    return sorted(x / y for x, y in zip(samples[a], samples[b], strict=True))


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def table(result: dict[str, Any]) -> list[str]:
    base = result["baseline"]
    seconds, nbytes, samples = result["seconds"], result["bytes"], result["samples"]
    noise = paired(samples, "none again", "none")
    lines = [
        f"### {result['key']}: the plan against the best hand policy that fits",
        "",
        f"Bytes kept without checkpointing: {base:,}; smallest reachable: {result['floor']:,}. "
        f"Noise: the un-checkpointed step timed twice per round, per-round ratio median "
        f"{statistics.median(noise):.3f}, 10-90 % {quantile(noise, 0.1):.3f}-"
        f"{quantile(noise, 0.9):.3f} ({len(noise)} rounds).",
        "",
        "| budget | plan: kept bytes | plan: regions | plan: step ms | best hand policy (fits) "
        "| its kept bytes | its step ms | plan / hand (10-90 %) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for budget in BUDGETS:
        limit = int(budget * base)
        fitting = [n for n in HAND if nbytes[n] <= limit]
        best = min(fitting, key=lambda n: seconds[n]) if fitting else None
        name = f"plan {budget}"
        if name not in seconds:
            lines.append(f"| {budget} | below the floor | | | {best or 'none fits'} | | | |")
            continue
        plan = result["plans"][budget]
        whole = sum(r.checkpoint and not r.save for r in plan.regions)
        partial = sum(r.checkpoint and bool(r.save) for r in plan.regions)
        regions = f"{whole} whole, {partial} SAC, {len(plan.regions) - whole - partial} kept"
        if best:
            ratios = paired(samples, name, best)
            hand = (
                f"{best} | {nbytes[best]:,} | {1e3 * seconds[best]:.1f} | "
                f"{statistics.median(ratios):.2f} ({quantile(ratios, 0.1):.2f}-"
                f"{quantile(ratios, 0.9):.2f})"
            )
        else:
            hand = "none fits | | | "
        lines.append(
            f"| {budget} | {nbytes[name]:,} | {regions} | {1e3 * seconds[name]:.1f} | {hand} |"
        )
    lines.append("")
    lines.append(
        "Hand policies: "
        + ", ".join(f"{n} {nbytes[n]:,} B / {1e3 * seconds[n]:.1f} ms" for n in ("none", *HAND))
        + "."
    )
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    for ax, result in zip(axes if len(results) > 1 else [axes], results, strict=True):
        seconds, nbytes, base = result["seconds"], result["bytes"], result["baseline"]
        plan_points = sorted(
            (nbytes[n] / base, 1e3 * seconds[n]) for n in seconds if n.startswith("plan")
        )
        ax.plot(*zip(*plan_points, strict=True), "o-", label="plan_checkpointing (measured)")
        for name in ("none", *HAND):
            ax.plot(nbytes[name] / base, 1e3 * seconds[name], "s")
            ax.annotate(name, (nbytes[name] / base, 1e3 * seconds[name]), fontsize=8)
        ax.set_xlabel("activation bytes kept / without checkpointing")
        ax.set_ylabel("step time, ms (CPU)")
        ax.set_title(result["key"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


COMPILE_BUDGETS = (1.0, 0.5, 0.25)


def hooked_bytes(forward: Callable[[], torch.Tensor], exclude: list[torch.Tensor]) -> Any:
    """(the loss, bytes of the unique storages an outer saved-tensors hook sees while
    ``forward`` runs), ``exclude``'s storages left out. A checkpoint's own hook sits above this
    one, and a selective cache keeps tensors by reference: for our plans the report counts."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    with saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    return loss, sum(seen.values())


def backward_flops(loss: torch.Tensor) -> int:
    """FLOPs ``torch.utils.flop_counter`` counts in ``loss``'s backward (recompute included)."""
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return int(counter.get_total_flops())


def compile_side_by_side(model: nn.Module, x: torch.Tensor) -> list[dict[str, Any]]:
    """Kept bytes and recomputed FLOPs: eager without checkpointing, our plans, and
    ``torch.compile`` (inductor) at each ``activation_memory_budget``."""
    exclude = [*model.parameters(), x]

    def eager() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return model(x).sum()

    loss, plain_hooked = hooked_bytes(eager, exclude)
    plain_backward = backward_flops(loss)
    rows = [{"name": "eager, no checkpoint", "kept": plain_hooked, "flops": 0, "compile_s": 0.0}]
    # The check: for whole-block checkpoint, the report's recompute FLOPs and FlopCounterMode's
    # backward FLOPs above the plain backward must agree.
    full = HAND["full"](model)
    with checkpointing.saved_tensors_report() as report:
        model.zero_grad(set_to_none=True)
        counted = backward_flops(model(x).sum()) - plain_backward
    full()
    check = (report.recompute_flops, counted)
    for budget in COMPILE_BUDGETS[1:]:
        rows.append(planned(model, x, budget))
    compiled_rows = []
    for budget in COMPILE_BUDGETS:
        torch.compiler.reset()
        with _compat.compile_activation_memory_budget(budget):
            compiled = torch.compile(model, backend="inductor")
            start = time.perf_counter()
            step(compiled, x)  # compiles forward and backward under this budget
            compile_seconds = time.perf_counter() - start

            def forward(compiled: Any = compiled) -> torch.Tensor:
                model.zero_grad(set_to_none=True)
                return compiled(x).sum()

            loss, kept_bytes = hooked_bytes(forward, exclude)
            flops = backward_flops(loss) - plain_backward
        compiled_rows.append(
            {
                "name": f"torch.compile, activation_memory_budget={budget}",
                "kept": kept_bytes,
                "flops": flops,
                "compile_s": compile_seconds,
            }
        )
    torch.compiler.reset()
    rows += compiled_rows
    for row in compiled_rows[1:]:  # the plan at the bytes torch.compile kept
        rows.append(planned(model, x, row["kept"]))
    rows[0]["check"] = check
    return rows


def planned(model: nn.Module, x: torch.Tensor, budget: float | int) -> dict[str, Any]:
    """The row of our plan at ``budget``: kept bytes and recomputed FLOPs, from the report."""
    plan = checkpointing.plan_checkpointing(model, x, budget=budget)
    plan.apply(model)
    with checkpointing.saved_tensors_report() as report:
        step(model, x)
    plan.remove(model)
    what = f"budget={budget}" if isinstance(budget, float) else f"budget={budget:,} bytes"
    return {
        "name": f"plan_checkpointing, {what}",
        "kept": report.activation_bytes,
        "flops": report.recompute_flops,
        "compile_s": 0.0,
    }


def compile_table(key: str, rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]["kept"]
    lines = [
        f"### {key}: plan_checkpointing beside torch.compile's activation_memory_budget",
        "",
        "| configuration | kept bytes | of eager's | recomputed GFLOPs | compile s |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['kept']:,} | {row['kept'] / base:.3f} | "
            f"{row['flops'] / 1e9:.3f} | {row['compile_s']:.0f} |"
        )
    lines.append("")
    lines.append(
        "Our budget is a fraction of the bytes eager mode keeps without checkpointing; torch's "
        "is a fraction of the way from its own floor (0.0: the whole compiled graph recomputed, "
        "only its inputs kept) to its default min-cut partition (1.0), so equal numbers are not "
        "equal budgets: compare the kept bytes. Recomputed FLOPs: for the plans, the report's "
        "(FlopCounterMode over a SAC region's backward changes its recompute's op sequence, "
        "and torch's SAC and ours then raise); for torch.compile, FlopCounterMode over the "
        "backward minus the eager plain backward. The two agree on full checkpointing: "
        f"{rows[0]['check'][0] / 1e9:.3f} and {rows[0]['check'][1] / 1e9:.3f} GFLOPs."
    )
    return lines


def solve_time(depth: int = 32) -> float:
    """Seconds to solve a profiled ``depth``-block W2-style model (profile not counted)."""
    model, x = w2(depth, 1)
    blocks = [(str(i), b) for i, b in enumerate(model)]
    problem = profile_step(model, blocks, (x,), {}, None).problem(policy_seconds_per_op())
    start = time.process_time()
    baseline = solve(problem, 0).baseline_bytes
    solve(problem, int(0.3 * baseline))
    return (time.process_time() - start) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default="docs/planner_pareto.png")
    parser.add_argument("--compile", action="store_true", help="the torch.compile comparison")
    parser.add_argument("--compile-depth", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compile:
        depth = args.compile_depth
        key = f"W2 ({depth} x TransformerEncoderLayer 256, seq 128, batch 2)"
        print("\n".join(compile_table(key, compile_side_by_side(*w2(depth, 2)))))
        return
    results = [run("W1 (8 x Linear 1024 + GELU, batch 64)", *w1(8), args.repeats)]
    results.append(
        run("W2 (4 x TransformerEncoderLayer 256, seq 128, batch 2)", *w2(4, 2), args.repeats)
    )
    for result in results:
        print("\n".join(table(result)))
        print()
    print(f"solve time, 32 TransformerEncoderLayer blocks: {1e3 * solve_time():.0f} ms per solve")
    try:
        plot(results, Path(args.plot))
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
