"""``plan_checkpointing`` against hand-written policies at the same memory budget.

Usage (from the repository root)::

    python benchmarks/planner.py            # W1 and W2 (reduced sizes), plot in docs/
    python benchmarks/planner.py --compile  # instead: torch.compile's activation_memory_budget

Method. One thread. Hand policies: full checkpointing, ``save_matmuls``, every second matmul
saved, every n-th layer checkpointed (n = 2, 3, 4), each installed with ``checkpoint_module`` per
block; plans at budgets 0.1 ... 0.9 of the bytes kept without checkpointing. Every configuration
runs on its own copy of the model, installed once (no install or warm-up between samples). Kept
bytes: ``saved_tensors_report().activation_bytes`` of one step (the count the planner plans with:
every storage ops made in the step, dropout masks included); a hand policy *fits* a budget when
its measured bytes are at most the plan's budget in bytes.

Time: a sample is one step's CPU time (``time.process_time``) after ``gc.collect()`` (the
objects made during setup frozen first, so that collection stays short); every configuration
runs ``WARM_STEPS`` untimed steps first.
1. Ranking (``--rank-rounds``): every hand policy once per round, the order rotated each round;
   per budget the fastest fitting hand policy by median, plus every fitting one within
   ``CONTENDER_MARGIN`` of it (all are compared; the table shows the one the plan fares worst
   against). The ranking's samples are not used again, so picking a winner does not favour it.
2. Pairs (``--quads``): per budget, the plan (A) and each contender (B) in tight quads, A B B A
   and B A A B in turn; a quad's ratio is A's two samples over B's two. Every comparison gets
   one quad per round, the comparisons' order rotated each round. The A/A control is measured
   the same way: the un-checkpointed step on two copies of the model ("none" / "none again").
Reported: the median of the per-quad ratios with a bootstrap 95 % confidence interval
(``BOOTSTRAP`` resamples of the quads). *Faster*: the interval lies wholly below 1 and below the
A/A's interval; *slower*: wholly above 1 (noted when still inside the A/A's); else *same*.

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
import copy
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from checkpointing._planning.plan import _RegionContexts
from checkpointing._planning.profile import profile_step
from checkpointing._planning.solver import solve
from checkpointing._selective import CheckpointPolicy

BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MATMULS = policies.MATMUL_OPS
WARM_STEPS = 2
CONTENDER_MARGIN = 0.05  # hand policies this close to the fastest fitting one are compared too
BOOTSTRAP = 2000
AA = ("none", "none again")
# Rounds of quads per workload (--quads overrides): the whole run takes about 8 minutes on the
# shared 2-core box. W2 runs at batch 1 (the --compile comparison at batch 2): its step is half
# as long, so twice as many quads fit, and its A/A interval is tighter than with fewer, longer
# samples.
QUADS = {"W1": 40, "W2": 32}


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


Installer = Callable[[nn.Module], None]


def blocks_policy(context_fn: Any = None, every: int = 1) -> Installer:
    """Checkpoint every ``every``-th block (with ``context_fn`` if given)."""

    def install(model: nn.Module) -> None:
        for i, block in enumerate(model):
            if i % every == 0:
                if context_fn is None:
                    checkpointing.checkpoint_module(block)
                else:
                    checkpointing.checkpoint_module(block, context_fn=context_fn)

    return install


def plan_installer(plan: checkpointing.ActivationPlan) -> Installer:
    """Install a copy of ``plan``'s decisions (the plan itself is bound to the profiled model)."""

    def install(model: nn.Module) -> None:
        checkpointing.ActivationPlan.from_json(plan.to_json()).apply(model)

    return install


def no_checkpoint(model: nn.Module) -> None:
    """The un-checkpointed step: nothing to install."""


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


def sample(model: nn.Module, x: torch.Tensor) -> float:
    """CPU seconds of one step, garbage collected before."""
    gc.collect()
    start = time.process_time()
    step(model, x)
    return time.process_time() - start


def kept(model: nn.Module, x: torch.Tensor) -> int:
    """Activation bytes kept by one step, from ``saved_tensors_report``."""
    with checkpointing.saved_tensors_report() as report:
        step(model, x)
    return report.activation_bytes


def rank(models: dict[str, nn.Module], x: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """One sample per configuration per round, the order rotated each round."""
    names = list(models)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(sample(models[name], x))
    return samples


def quads(
    models: dict[str, nn.Module],
    x: torch.Tensor,
    comparisons: list[tuple[str, str]],
    rounds: int,
) -> tuple[dict[tuple[str, str], list[float]], dict[str, list[float]]]:
    """Per comparison (a, b), one quad per round (A B B A, then B A A B): the ratio of a's two
    samples to b's; the comparisons' order rotated each round. Also every sample per config."""
    ratios: dict[tuple[str, str], list[float]] = {pair: [] for pair in comparisons}
    samples: dict[str, list[float]] = {}
    for round_ in range(rounds):
        shift = round_ % len(comparisons)
        for a, b in comparisons[shift:] + comparisons[:shift]:
            seconds = {a: 0.0, b: 0.0} if a != b else {}
            for name in (a, b, b, a) if round_ % 2 == 0 else (b, a, a, b):
                taken = sample(models[name], x)
                seconds[name] += taken
                samples.setdefault(name, []).append(taken)
            ratios[(a, b)].append(seconds[a] / seconds[b])
    return ratios, samples


@dataclass(frozen=True)
class Estimate:
    """The median of per-quad ratios with its bootstrap 95 % confidence interval."""

    median: float
    low: float
    high: float
    count: int

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def estimate(ratios: list[float], seed: int = 0) -> Estimate:
    """Median and percentile-bootstrap 95 % interval (``BOOTSTRAP`` resamples, seeded)."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP)
    )
    low, high = medians[int(0.025 * BOOTSTRAP)], medians[int(0.975 * BOOTSTRAP) - 1]
    return Estimate(statistics.median(ratios), low, high, len(ratios))


def verdict(ratio: Estimate, control: Estimate) -> str:
    """*faster*: the interval lies wholly below 1 and below the A/A's; *slower*: wholly above 1
    (noted when it is still inside the A/A's interval); else *same*."""
    if ratio.high < 1 and ratio.high < control.low:
        return "faster"
    if ratio.low > 1:
        return "slower" if ratio.low > control.high else "slower (inside the A/A interval)"
    return "same"


def describe(plan: checkpointing.ActivationPlan) -> str:
    """The plan's regions: checkpointed whole, with a selective policy (SAC), or kept."""
    whole = sum(r.checkpoint and not r.save for r in plan.regions)
    partial = sum(r.checkpoint and bool(r.save) for r in plan.regions)
    return f"{whole} whole, {partial} SAC, {len(plan.regions) - whole - partial} kept"


def run(
    key: str, model: nn.Module, x: torch.Tensor, rank_rounds: int, rounds: int
) -> dict[str, Any]:
    """Plan at every budget, measure every configuration's bytes, rank the hand policies, then
    time each plan against its contenders and the A/A control in quads."""
    plans = {}
    for budget in BUDGETS:
        try:
            plans[budget] = checkpointing.plan_checkpointing(model, x, budget=budget)
        except ValueError:
            continue
    reference = checkpointing.plan_checkpointing(model, x, budget=1.0)
    installers: dict[str, Installer] = {"none": no_checkpoint, "none again": no_checkpoint}
    installers.update(HAND)
    installers.update({f"plan {b}": plan_installer(p) for b, p in plans.items()})
    models = {}
    for name, install in installers.items():
        models[name] = copy.deepcopy(model)
        install(models[name])
    nbytes = {name: kept(m, x) for name, m in models.items()}
    for m in models.values():
        for _ in range(WARM_STEPS):
            step(m, x)
    gc.collect()
    gc.freeze()  # what exists now is never collected: each sample's gc.collect() stays short
    ranking = rank({n: models[n] for n in ("none", *HAND)}, x, rank_rounds)
    hand_seconds = {n: statistics.median(ranking[n]) for n in ("none", *HAND)}
    contenders: dict[float, list[str]] = {}
    for budget in plans:
        limit = int(budget * reference.baseline_bytes)
        fitting = sorted((hand_seconds[n], n) for n in HAND if nbytes[n] <= limit)
        if fitting:
            fastest = fitting[0][0]
            contenders[budget] = [n for s, n in fitting if s <= fastest * (1 + CONTENDER_MARGIN)]
    comparisons = [AA] + [(f"plan {b}", n) for b, names in contenders.items() for n in names]
    ratios, samples = quads(models, x, comparisons, rounds)
    gc.unfreeze()
    return {
        "key": key,
        "baseline": reference.baseline_bytes,
        "floor": reference.floor_bytes,
        "plans": plans,
        "bytes": nbytes,
        "hand_seconds": hand_seconds,
        "contenders": contenders,
        "ratios": {pair: estimate(r) for pair, r in ratios.items()},
        "samples": samples,
    }


def relative_times(result: dict[str, Any]) -> dict[str, float]:
    """Step time over the un-checkpointed step's: the ranking's medians for the hand policies;
    for a plan, its hand policy's times its median ratio to it (the quads measure the ratio,
    not the step), or, where no hand policy fits, its median over "none"'s in the quads."""
    times = {n: s / result["hand_seconds"]["none"] for n, s in result["hand_seconds"].items()}
    samples = result["samples"]
    for budget in result["plans"]:
        name = f"plan {budget}"
        hand = worst_contender(result, budget)
        if hand is None:
            times[name] = statistics.median(samples[name]) / statistics.median(samples["none"])
        else:
            times[name] = times[hand] * result["ratios"][(name, hand)].median
    return times


def worst_contender(result: dict[str, Any], budget: float) -> str | None:
    """The compared hand policy the plan at ``budget`` fares worst against (None: none fits)."""
    names = result["contenders"].get(budget)
    if not names:
        return None
    return max(names, key=lambda n: result["ratios"][(f"plan {budget}", n)].median)


def table(result: dict[str, Any]) -> list[str]:
    base, nbytes = result["baseline"], result["bytes"]
    control = result["ratios"][AA]
    relative = relative_times(result)
    lines = [
        f"### {result['key']}: the plan against the best hand policy that fits",
        "",
        f"Bytes kept without checkpointing: {base:,}; smallest reachable: {result['floor']:,}. "
        f"A/A control (none / none again): {control} ({control.count} quads).",
        "",
        "| budget | plan: kept bytes | plan: regions | plan: step / none | best hand policy "
        "(fits) | its kept bytes | plan / hand, median [95 % CI] | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for budget in BUDGETS:
        if budget not in result["plans"]:
            lines.append(f"| {budget} | below the floor | | | | | | |")
            continue
        name = f"plan {budget}"
        plan_cells = (
            f"{nbytes[name]:,} | {describe(result['plans'][budget])} | {relative[name]:.3f}"
        )
        worst = worst_contender(result, budget)
        if worst is None:
            lines.append(f"| {budget} | {plan_cells} | none fits | | | |")
            continue
        names = result["contenders"][budget]
        ratio = result["ratios"][(name, worst)]
        others = [n for n in names if n != worst]
        also = f" (also: {', '.join(others)})" if others else ""
        lines.append(
            f"| {budget} | {plan_cells} | {worst}{also} | {nbytes[worst]:,} | {ratio} | "
            f"{verdict(ratio, control)} |"
        )
    lines.append("")
    lines.append(
        "Hand policies (ranking phase, step / none): "
        + ", ".join(f"{n} {nbytes[n]:,} B / {relative[n]:.3f}" for n in ("none", *HAND))
        + "."
    )
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    for ax, result in zip(axes if len(results) > 1 else [axes], results, strict=True):
        nbytes, base = result["bytes"], result["baseline"]
        relative = relative_times(result)
        plan_points = sorted(
            (nbytes[n] / base, relative[n]) for n in relative if n.startswith("plan")
        )
        ax.plot(*zip(*plan_points, strict=True), "o-", label="plan_checkpointing (measured)")
        for name in ("none", *HAND):
            ax.plot(nbytes[name] / base, relative[name], "s")
            ax.annotate(name, (nbytes[name] / base, relative[name]), fontsize=8)
        ax.set_xlabel("activation bytes kept / without checkpointing")
        ax.set_ylabel("step CPU time / without checkpointing")
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
    full = copy.deepcopy(model)
    HAND["full"](full)
    with checkpointing.saved_tensors_report() as report:
        counted = backward_flops(full(x).sum()) - plain_backward
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
    profile = profile_step(model, blocks, (x,), {}, None, _RegionContexts({}))
    problem = profile.problem(profile.policy_seconds_per_op)
    start = time.process_time()
    baseline = solve(problem, 0).baseline_bytes
    solve(problem, int(0.3 * baseline))
    return (time.process_time() - start) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank-rounds", type=int, default=12)
    parser.add_argument("--quads", type=int, default=0, help="rounds of quads (0: per workload)")
    parser.add_argument("--only", choices=("W1", "W2"), help="one workload only")
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
    workloads = {
        "W1": ("W1 (8 x Linear 1024 + GELU, batch 64)", lambda: w1(8), QUADS["W1"]),
        "W2": (
            "W2 (4 x TransformerEncoderLayer 256, seq 128, batch 1)",
            lambda: w2(4, 1),
            QUADS["W2"],
        ),
    }
    results = []
    for name, (key, build, default_quads) in workloads.items():
        if args.only not in (None, name):
            continue
        start = time.perf_counter()
        result = run(key, *build(), args.rank_rounds, args.quads or default_quads)
        print("\n".join(table(result)))
        print(f"({time.perf_counter() - start:.0f} s)\n")
        results.append(result)
    print(f"solve time, 32 TransformerEncoderLayer blocks: {1e3 * solve_time():.0f} ms per solve")
    if args.only is None:
        try:
            plot(results, Path(args.plot))
            print(f"plot: {args.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
