"""``plan_checkpointing`` against hand-written policies at the same memory budget.

Usage (from the repository root)::

    python benchmarks/planner.py            # W1 and W2 (reduced sizes), plot in docs/
    python benchmarks/planner.py --compile  # also torch.compile's activation_memory_budget on W2

Method. One thread. For each workload, every hand policy (full checkpointing, ``save_matmuls``,
every second matmul saved, every n-th layer checkpointed for n = 2, 3, 4) and the plan at each
budget (0.1 ... 0.9 of the bytes kept without checkpointing) is installed with
``checkpoint_module`` per block; its kept activation bytes come from ``saved_tensors_report``,
its step time (forward + backward) is the median CPU time (``time.process_time``) of
``--repeats`` rounds, all configurations timed in alternating order within one process. At
each budget the plan is compared with the fastest hand policy whose measured bytes fit it.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

import checkpointing
from checkpointing import policies
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
) -> dict[str, float]:
    """Median CPU seconds per step of each config, rounds in alternating order."""
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            undo = configs[name](model)
            step(model, x)  # warm
            start = time.process_time()
            step(model, x)
            step(model, x)
            times[name].append((time.process_time() - start) / 2)
            undo()
    return {name: statistics.median(t) for name, t in times.items()}


def run(key: str, model: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    plans = {}
    for budget in BUDGETS:
        try:
            plans[budget] = checkpointing.plan_checkpointing(model, x, budget=budget)
        except ValueError:
            continue
    reference = checkpointing.plan_checkpointing(model, x, budget=1.0)
    configs: dict[str, Installer] = {"none": lambda m: lambda: None, **HAND}
    for budget, plan in plans.items():
        configs[f"plan {budget}"] = plan_installer(plan)
    measured = {}
    for name, install in configs.items():
        undo = install(model)
        measured[name] = kept(model, x)
        undo()
    seconds = time_configs(model, x, configs, repeats)
    return {
        "key": key,
        "baseline": reference.baseline_bytes,
        "floor": reference.floor_bytes,
        "frontier": reference.frontier(),
        "plans": plans,
        "bytes": {n: b for n, (b, _) in measured.items()},
        "flops": {n: f for n, (_, f) in measured.items()},
        "seconds": seconds,
    }


def table(result: dict[str, Any]) -> list[str]:
    base = result["baseline"]
    lines = [
        f"### {result['key']}: the plan against the best hand policy that fits",
        "",
        f"Bytes kept without checkpointing: {base:,}; smallest reachable: {result['floor']:,}.",
        "",
        "| budget | plan: kept bytes | plan: step ms | best hand policy (fits) | its kept bytes "
        "| its step ms | plan / hand |",
        "|---|---|---|---|---|---|---|",
    ]
    seconds, nbytes = result["seconds"], result["bytes"]
    for budget in BUDGETS:
        limit = budget * base * 1.02
        fitting = [n for n in HAND if nbytes[n] <= limit]
        best = min(fitting, key=lambda n: seconds[n]) if fitting else None
        name = f"plan {budget}"
        if name not in seconds:
            lines.append(f"| {budget} | below the floor | | {best or 'none fits'} | | | |")
            continue
        hand = (
            f"{best} | {nbytes[best]:,} | {1e3 * seconds[best]:.1f} | "
            f"{seconds[name] / seconds[best]:.2f}"
            if best
            else "none fits | | | "
        )
        lines.append(f"| {budget} | {nbytes[name]:,} | {1e3 * seconds[name]:.1f} | {hand} |")
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


def solve_time(depth: int = 32) -> float:
    """Seconds to solve a profiled ``depth``-block W2-style model (profile not counted)."""
    model, x = w2(depth, 1)
    blocks = [(str(i), b) for i, b in enumerate(model)]
    problem = profile_step(model, blocks, (x,), {}, None).problem()
    start = time.process_time()
    baseline = solve(problem, 0).baseline_bytes
    solve(problem, int(0.3 * baseline))
    return (time.process_time() - start) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default="docs/planner_pareto.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
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
