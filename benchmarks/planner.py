"""``plan_checkpointing`` against hand-written policies, against torch.compile, and against itself.

Usage (from the repository root)::

    python benchmarks/planner.py            # W1 and W2 (reduced sizes); --plot PATH: a figure
    python benchmarks/planner.py --compile  # instead: torch.compile's activation_memory_budget
    python benchmarks/planner.py --solve-time          # the solver on 32 tiny-Llama layers
    python benchmarks/planner.py --planning-time       # planning / a plain step, W2 and GPT-2
    python benchmarks/planner.py --cost-model          # the cost model's constants, this CPU
    python benchmarks/planner.py --from-results --plot PATH  # the W1/W2 tables of RESULTS.md
    python benchmarks/planner.py --sweep    # plan_sweep's 12 budgets against HAND, six families
    python benchmarks/planner.py --sweep-quads gpt2  # the plan at block strategies' bytes, quads
    python benchmarks/planner.py --sweep-quads decoder --sweep-quads-at 18507722  # at a budget
    PYTHONPATH=old/checkout python benchmarks/planner.py --dump-plans DIR  # its W1/W2 plans
    python benchmarks/planner.py --ab DIR   # this checkout's plans against DIR's, timed

Method. One thread. Hand policies: full checkpointing, ``save_matmuls``, ``save_attention``, every
second matmul saved, every n-th layer checkpointed (n = 2, 3, 4), each installed with
``checkpoint_module`` per block (``HAND``; ``hand_prices``: each in the planner's own terms,
priced by its cost model), and with ``--hand`` torch's ``checkpoint_sequential`` with two
segments and with segments of two blocks (``SEQUENTIAL``: one frame per segment, joined regions
in the planner's terms); plans at budgets 0.1 ... 0.9 of the bytes kept without checkpointing.
Every configuration runs on its own copy of the model, installed once (no install or warm-up
between samples). Kept bytes: ``saved_tensors_report().activation_bytes`` of one step (the count
the planner plans with: every storage ops made in the step, dropout masks included); a hand
policy *fits* a budget when its measured bytes are at most the plan's budget in bytes.

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

``--ab DIR`` times this checkout's default plans of W1 and W2 (A) against the plans in ``DIR``
at the same budgets (B), written by ``--dump-plans DIR`` run on another checkout (its package
first on ``PYTHONPATH``), in the same quads beside the same A/A control (``--quads``, default
24 rounds): the "step time no slower than the previous planner's" check.

``--compile`` (slow: inductor compiles each model once per budget; no timing then): W2, a tiny
Hugging Face Llama, a GPT-2-style decoder with dropout, a small ViT and a tiny Hugging Face
GPT-NeoX with hidden dropout (``--workloads``), each under ``torch.compile`` (inductor) at
``activation_memory_budget`` 1.0, 0.7, 0.5, 0.3 and 0.2 (``--compile-budgets``),
and beside each, our plans at the bytes the compiled step kept: ``objective="flops"`` at those
bytes and at 2 % more (the target's tolerance), ``objective="time"`` at those bytes. For each:
the bytes kept for backward, and the FLOPs recomputed: a plain FLOP-counting dispatch mode over
the backward (``FlopCount``: the planner's formulas, attention included), minus the eager
un-checkpointed backward's; it leaves a selective recompute's op sequence alone (torch's
``FlopCounterMode`` does not), so ours and the compiler's are counted alike, and ours agree
with the plans' predictions to the FLOP. Kept bytes: for the compiled step, an outer
saved-tensors hook (unique storages, parameters, buffers and inputs left out; the compiled
graph's saved tensors reach it); for the plans, the report (the hook misses a selective cache).
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import re
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

import checkpointing
from checkpointing import _compat, policies
from checkpointing._planning.apply.plan import _RegionContexts
from checkpointing._planning.measure.flops import FlopCount
from checkpointing._planning.measure.profile import profile_step, tail_regions
from checkpointing._planning.measure.recorded_spans import span_problems
from checkpointing._planning.search import (
    _cheapest,
    _Measured,
    _regions_and_tail,
    _variants,
    find_regions,
)
from checkpointing._planning.solve.problem import (
    Choice,
    Problem,
    join_breaks,
    kept_bytes,
    recompute_cost,
)
from checkpointing._planning.solve.solver import baseline_bytes, floor_bytes
from checkpointing._selective import SAC_IGNORED_OPS, CheckpointPolicy

try:
    from checkpointing._planning.measure.flops import op_flops
except ImportError:  # --dump-plans on a checkout from before the planner counted FLOPs itself
    op_flops = None

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


def sequential_segments(segments: int = 0, size: int = 0) -> Installer:
    """``checkpoint_sequential`` on the model (an ``nn.Sequential`` of blocks): ``segments``
    segments, or as many as fit of ``size`` blocks each; all but the last checkpointed, each in
    one frame (one input and one RNG state kept per segment). Ours, the drop-in for torch's:
    the report sees its RNG states (torch's holds them where no saved-tensors hook looks, so
    its measured bytes would read 5,056 fewer than it keeps)."""

    def install(model: nn.Module) -> None:
        blocks = list(model)
        count = segments or len(blocks) // size

        def forward(x: torch.Tensor) -> torch.Tensor:
            return checkpointing.checkpoint_sequential(blocks, count, x, use_reentrant=False)

        model.forward = forward  # this instance's, not its class's

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
    "save_attention": blocks_policy(policies.as_context_fn(policies.save_attention())),
    "every 2nd matmul": blocks_policy(every_second_matmul),
    "every 2 layers": blocks_policy(every=2),
    "every 3 layers": blocks_policy(every=3),
    "every 4 layers": blocks_policy(every=4),
}


# torch's ``checkpoint_sequential`` with segments of several blocks, for ``--hand`` (W2 is an
# ``nn.Sequential``; the sweep installs the same strategies as chains, ``planner_sweep.hands``).
SEQUENTIAL: dict[str, Installer] = {
    "checkpoint_sequential, 2 segments": sequential_segments(segments=2),
    "checkpoint_sequential, 2 blocks per segment": sequential_segments(size=2),
}


def _whole_every(every: int) -> Callable[[Problem, int], Choice]:
    return lambda problem, block: Choice(block % every == 0)


def _keeping(ops: frozenset[str], nth: int = 1) -> Callable[[Problem, int], Choice]:
    """A selective policy on the block: keep every ``nth`` output of ``ops`` (counted within
    the block, as ``EverySecondMatmul`` counts), recompute the rest; it skips nothing."""

    def choose(problem: Problem, block: int) -> Choice:
        units = problem.regions[block].units
        matching = [i for i, unit in enumerate(units) if unit.key[0] in ops]
        return Choice(True, frozenset(matching[nth - 1 :: nth]))

    return choose


_MATMUL_NAMES = frozenset(str(op) for op in policies.MATMUL_OPS)
_ATTENTION_NAMES = frozenset(str(op) for op in policies.ATTENTION_OPS)
# Each hand policy of ``HAND`` in the planner's own terms: the choice it makes for the block at
# a position (its regions are the model's blocks, each checkpointed alone; the tail's regions
# are kept), priced by the same cost model as the plan (``hand_choices``). "full" is also
# torch's ``checkpoint_sequential`` with one block per segment, but for its last block kept.
HAND_CHOICES: dict[str, Callable[[Problem, int], Choice]] = {
    "full": _whole_every(1),
    "save_matmuls": _keeping(_MATMUL_NAMES),
    "save_attention": _keeping(_ATTENTION_NAMES),
    "every 2nd matmul": _keeping(_MATMUL_NAMES, 2),
    "every 2 layers": _whole_every(2),
    "every 3 layers": _whole_every(3),
    "every 4 layers": _whole_every(4),
}


def hand_choices(problem: Problem, blocks: int) -> dict[str, tuple[Choice, ...]]:
    """Every hand policy of ``HAND_CHOICES`` as the planner's choices on ``problem`` (a
    problem without recorded spans) whose first ``blocks`` regions are the model's blocks: the
    blocks as each policy treats them, the rest (the tail's regions) kept; and torch's
    ``checkpoint_sequential`` with one block per segment (every block but the last whole), with
    two segments and with segments of two blocks (``SEQUENTIAL``: each segment's blocks but the
    first joined to the one before, Rule S9; where the problem lets them join)."""
    found = {
        name: tuple(
            choose(problem, index) if index < blocks else Choice(False)
            for index in range(len(problem.regions))
        )
        for name, choose in HAND_CHOICES.items()
    }
    found["checkpoint_sequential, a block per segment"] = tuple(
        Choice(index < blocks - 1) for index in range(len(problem.regions))
    )
    for name, size in (
        ("checkpoint_sequential, 2 segments", blocks // 2),
        ("checkpoint_sequential, 2 blocks per segment", 2),
    ):
        covered = size * (blocks // size - 1) if size else 0  # the last segment runs plainly
        segments = tuple(
            Choice(index < covered, joined=index < covered and index % size != 0)
            for index in range(len(problem.regions))
        )
        if covered and not join_breaks(problem, segments):  # Rule S9: where blocks may join
            found[name] = segments
    return found


# The hand policies that install a selective policy on every block, whatever it keeps.
SELECTIVE = frozenset({"save_matmuls", "save_attention", "every 2nd matmul"})


def hand_prices(problem: Problem, blocks: int) -> dict[str, tuple[int, float]]:
    """Every hand policy's (kept bytes, recompute cost) by the planner's own count and cost
    model (``recompute_cost``: what the solver minimizes), a selective policy's modes charged
    on every block where it installs one, also where it keeps nothing (Rule S3)."""
    prices = {}
    for name, choices in hand_choices(problem, blocks).items():
        cost = recompute_cost(problem, choices)
        if name in SELECTIVE:
            idle = sum(
                region.policy_seconds
                for region, choice in zip(problem.regions, choices, strict=True)
                if choice.checkpoint and not choice.saved
            )
            cost += problem.objective.cost(idle, 0)
        prices[name] = (kept_bytes(problem, choices), cost)
    return prices


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
    x: torch.Tensor | Callable[[nn.Module], float],
    comparisons: list[tuple[str, str]],
    rounds: int,
) -> tuple[dict[tuple[str, str], list[float]], dict[str, list[float]]]:
    """Per comparison (a, b), one quad per round (A B B A, then B A A B): the ratio of a's two
    samples to b's; the comparisons' order rotated each round. Also every sample per config.
    A sample is ``sample(model, x)``, or ``x(model)`` where the step is not ``model(x)``'s."""
    sampled = x if callable(x) else lambda model: sample(model, x)
    ratios: dict[tuple[str, str], list[float]] = {pair: [] for pair in comparisons}
    samples: dict[str, list[float]] = {}
    for round_ in range(rounds):
        shift = round_ % len(comparisons)
        for a, b in comparisons[shift:] + comparisons[:shift]:
            seconds = {a: 0.0, b: 0.0} if a != b else {}
            for name in (a, b, b, a) if round_ % 2 == 0 else (b, a, a, b):
                taken = sampled(models[name])
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
    """The plan's regions: checkpointed whole (of them, joined to the one before: one frame,
    Rule S9), with a selective policy (SAC), or kept."""
    whole = sum(r.checkpoint and not r.save for r in plan.regions)
    partial = sum(r.checkpoint and bool(r.save) for r in plan.regions)
    joined = sum(r.joined for r in plan.regions)
    chains = f" ({joined} joined)" if joined else ""
    return f"{whole} whole{chains}, {partial} SAC, {len(plan.regions) - whole - partial} kept"


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
    # The plan at each hand policy's own bytes (an int budget): the comparison at equal memory.
    at_hand = {n: checkpointing.plan_checkpointing(model, x, budget=nbytes[n]) for n in HAND}
    for n, plan in at_hand.items():
        models[f"plan at {n}"] = copy.deepcopy(model)
        plan_installer(plan)(models[f"plan at {n}"])
        nbytes[f"plan at {n}"] = kept(models[f"plan at {n}"], x)
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
    comparisons += [(f"plan at {n}", n) for n in HAND]
    ratios, samples = quads(models, x, comparisons, rounds)
    gc.unfreeze()
    return {
        "key": key,
        "baseline": reference.baseline_bytes,
        "floor": reference.floor_bytes,
        "plans": plans,
        "at_hand": at_hand,
        "bytes": nbytes,
        "hand_seconds": hand_seconds,
        "contenders": contenders,
        "ratios": {pair: estimate(r) for pair, r in ratios.items()},
        "samples": samples,
    }


def hand_run(key: str, model: nn.Module, x: torch.Tensor, rounds: int) -> list[str]:
    """``--hand``: the plan at each hand policy's own bytes, and at each of ``BUDGETS``, against
    that hand policy (at a budget: the fitting one the cost model prices cheapest), predicted
    (both priced by the planner's cost model, ``hand_prices``; the plan's cost with its frames'
    charge, as the solver minimizes) and measured (quads, beside the A/A control), as a table."""
    named, tail = _regions_and_tail(model, None, (x,), {}, "plan_checkpointing")
    profile = profile_step(model, named, (x,), {}, None, tail=tail, warmed=True)
    measured = _Measured.of(profile, "time", len(named), tail, spans=True)
    problems = [problem for _, problem, _ in _variants(measured, 1.0, 1.0)]
    # The hands priced where blocks may join (Rule S9), whether or not the plans may.
    prices = hand_prices(_variants(measured, 1.0, 1.0, joins=True)[0][1], len(named) - tail)
    hands = {**HAND, **SEQUENTIAL}
    models: dict[str, nn.Module] = {}
    for name, install in {"none": no_checkpoint, "none again": no_checkpoint, **hands}.items():
        models[name] = copy.deepcopy(model)
        install(models[name])
    nbytes = {name: kept(m, x) for name, m in models.items()}
    baseline = baseline_bytes(problems[0])
    budgets = {f"plan at {n}": (nbytes[n], n) for n in hands}
    for share in BUDGETS:
        fitting = [(prices[n][1], n) for n in hands if nbytes[n] <= int(share * baseline)]
        if fitting:
            budgets[f"plan {share}"] = (int(share * baseline), min(fitting)[1])
    predicted = {}
    for name, (budget, _) in budgets.items():
        plan = checkpointing.plan_checkpointing(model, x, budget=budget)
        models[name] = copy.deepcopy(model)
        plan_installer(plan)(models[name])
        nbytes[name] = kept(models[name], x)
        index, found = _cheapest(problems, budget)
        predicted[name] = (recompute_cost(problems[index], found.choices), describe(plan))
    for m in models.values():
        for _ in range(WARM_STEPS):
            step(m, x)
    gc.collect()
    gc.freeze()
    comparisons = [AA, *((name, hand) for name, (_, hand) in budgets.items())]
    ratios, _ = quads(models, x, comparisons, rounds)
    gc.unfreeze()
    control = estimate(ratios[AA])
    lines = [
        f"{key}: A/A control (none / none again): {control} ({control.count} quads)",
        "",
        "| plan | against | its kept bytes | predicted: plan / hand | plan: kept bytes "
        "| plan: regions | measured: plan / hand, median [95 % CI] | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (_, hand) in budgets.items():
        ratio = estimate(ratios[(name, hand)])
        cost, regions = predicted[name]
        lines.append(
            f"| {name} | {hand} | {nbytes[hand]:,} | {cost / prices[hand][1]:.3f} "
            f"| {nbytes[name]:,} | {regions} | {ratio} | {verdict(ratio, control)} |"
        )
    return lines


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
    for hand in result["at_hand"]:
        times[f"plan at {hand}"] = times[hand] * result["ratios"][(f"plan at {hand}", hand)].median
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
        f"#### {result['key']}: the plan against the best hand policy that fits",
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
    lines += [
        "",
        f"{_AT_HAND_HEADING} ({result['key'].split(' ')[0]})",
        "",
        "| hand policy | its kept bytes | its step / none | plan: kept bytes | plan: regions | "
        "plan: step / none | plan / hand, median [95 % CI] | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for hand, plan in result["at_hand"].items():
        name = f"plan at {hand}"
        ratio = result["ratios"][(name, hand)]
        lines.append(
            f"| {hand} | {nbytes[hand]:,} | {relative[hand]:.3f} | {nbytes[name]:,} | "
            f"{describe(plan)} | {relative[name]:.3f} | {ratio} | {verdict(ratio, control)} |"
        )
    return lines


Panel = tuple[
    str,
    int,
    list[tuple[float, int, float]],
    dict[str, tuple[int, float]],
    dict[str, tuple[int, float]],
]
"""One workload's plot: its title, the bytes kept without checkpointing, the plans (budget,
kept bytes, step / none), the hand policies (kept bytes, step / none) by name, and the plan
at each hand policy's own bytes (kept bytes, step / none) by that policy's name."""

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
# The plot reads the latest run, recorded under this heading with "#### W1"/"#### W2" parts.
_RECORDED = "### Rerun: the plan also at each hand policy's own bytes"
_AT_HAND_HEADING = "**The plan at each hand policy's own bytes**"
_HAND_POINT = re.compile(r"([A-Za-z0-9_ ]+?) ([\d,]+) B / (\d+\.\d+)")


def panel_of(result: dict[str, Any]) -> Panel:
    """The plot's data of one workload's run."""
    nbytes, relative = result["bytes"], relative_times(result)
    plans = [(b, nbytes[f"plan {b}"], relative[f"plan {b}"]) for b in sorted(result["plans"])]
    hands = {name: (nbytes[name], relative[name]) for name in ("none", *HAND)}
    at_hand = {n: (nbytes[f"plan at {n}"], relative[f"plan at {n}"]) for n in HAND}
    return result["key"], result["baseline"], plans, hands, at_hand


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def recorded_panels(results: Path = RESULTS) -> list[Panel]:
    """The W1 and W2 tables of the run recorded in ``RESULTS.md`` under the heading named
    above, as panels."""
    text = results.read_text()
    section = text[text.index(_RECORDED) :].split("\n## ")[0]
    panels = []
    for part in [p.split("\n### ")[0] for p in section.split("\n#### ")[1:3]]:
        key = part.split(":", 1)[0].strip()
        baseline = int(re.search(r"without checkpointing: ([\d,]+)", part)[1].replace(",", ""))  # type: ignore[index]  # the recorded text has it
        plans, at_hand = [], {}
        for line in part.splitlines():
            cells = _cells(line)
            if len(cells) == 8 and re.fullmatch(r"[\d.]+", cells[0]) and cells[1][:1].isdigit():
                plans.append((float(cells[0]), int(cells[1].replace(",", "")), float(cells[3])))
            if len(cells) == 8 and cells[0] in HAND:
                at_hand[cells[0]] = (int(cells[3].replace(",", "")), float(cells[5]))
        hand_text = " ".join(part[part.index("Hand policies") :].split("\n\n")[0].split())
        hand_text = hand_text.split(":", 1)[1]
        hands = {
            m[1].strip(): (int(m[2].replace(",", "")), float(m[3]))
            for m in _HAND_POINT.finditer(hand_text)
        }
        panels.append((key, baseline, plans, hands, at_hand))
    if len(panels) != 2:
        raise SystemExit(f"expected the W1 and W2 tables under {_RECORDED!r} in {results}")
    return panels


def plot(panels: list[Panel], path: Path) -> None:
    """Step time against kept bytes: the plans at the budgets 0.1-0.9 as a line (each point
    marked with its budget); each hand policy a marker of its own, named in the legend, joined
    by a dotted line to the plan made at that policy's own bytes (a hollow circle), so that
    each hand policy is compared with the plan at equal memory."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.6), squeeze=False)
    markers = ("s", "D", "^", "v", "P", "X", "h", "<")
    for ax, (key, baseline, plans, hands, at_hand) in zip(axes[0], panels, strict=True):
        xs = [kept / baseline for _, kept, _ in plans]
        ys = [ratio for _, _, ratio in plans]
        ax.plot(xs, ys, "o-", color="tab:blue", label="plan at budget 0.1 ... 0.9", zorder=3)
        for (budget, _, _), x, y in zip(plans, xs, ys, strict=True):
            ax.annotate(
                f"{budget:g}",
                (x, y),
                xytext=(-5, -5),  # below left: the line runs down to the right
                textcoords="offset points",
                ha="right",
                va="top",
                fontsize=8,
                color="tab:blue",
            )
        for index, (name, (kept, ratio)) in enumerate(hands.items()):
            color = plt.get_cmap("tab10")(index + 1)
            if name in at_hand:
                plan_kept, plan_ratio = at_hand[name]
                ax.plot(
                    [kept / baseline, plan_kept / baseline],
                    [ratio, plan_ratio],
                    ":",
                    color=color,
                    linewidth=1.5,
                    zorder=2,
                )
                ax.scatter(
                    plan_kept / baseline,
                    plan_ratio,
                    marker="o",
                    s=70,
                    facecolors="white",
                    edgecolors=color,
                    linewidths=1.8,
                    zorder=4,
                )
            ax.scatter(
                kept / baseline,
                ratio,
                marker=markers[index % len(markers)],
                s=60,
                color=color,
                edgecolors="white",
                linewidths=0.6,
                label=name,
                zorder=5,
            )
        ax.scatter(
            [],
            [],
            marker="o",
            s=70,
            facecolors="white",
            edgecolors="gray",
            linewidths=1.8,
            label="plan at that policy's bytes (dotted)",
        )
        ax.set_title(key, fontsize=10)
        ax.margins(x=0.1)  # room for the budget labels left of the points
        ax.set_xlabel(
            "activations kept / kept without checkpointing (ratio; 1.0 = "
            f"{baseline / 2**20:.1f} MiB)"
        )
        ax.set_ylabel("step CPU time / without checkpointing (ratio)")
        ax.grid(alpha=0.3)
        ax.legend(
            fontsize=8, loc="upper right", title="blue labels: plan budgets", title_fontsize=8
        )
    fig.suptitle(
        "plan_checkpointing against hand-written policies: step time against memory kept\n"
        "(compare each hand policy with the hollow circle its dotted line leads to: "
        "the plan at the same bytes)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


COMPILE_BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.2)
OBJECTIVES = ("flops", "time")
# The target: at the compiler's kept bytes (+-2 %), no more recomputed FLOPs. Plans are made at
# its bytes and, for the FLOP objective, at 2 % more; a plan keeping fewer bytes is no worse.
BYTES_TOLERANCE = 0.02
PLANNED = (("flops", 1.0), ("flops", 1.0 + BYTES_TOLERANCE), ("time", 1.0))


@dataclass
class Workload:
    """A model, one step's inputs and its loss (for the compiler comparison)."""

    key: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]

    def loss(self, model: nn.Module | Callable[..., Any] | None = None) -> torch.Tensor:
        run = self.model if model is None else model  # (a compiled module has no truth value)
        return self.loss_fn(run(*self.args, **self.kwargs))

    def exclude(self) -> list[torch.Tensor]:
        """The storages that are no activations: parameters, buffers and inputs."""
        inputs = [t for t in (*self.args, *self.kwargs.values()) if isinstance(t, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *inputs]


def sum_loss(output: Any) -> torch.Tensor:
    return output.sum()


def w2_workload() -> Workload:
    model, x = w2(4, 2)
    return Workload(
        "W2 (4 x TransformerEncoderLayer 256, seq 128, batch 2)", model, (x,), {}, sum_loss
    )


def llama_workload() -> Workload:
    """A tiny Hugging Face Llama (4 layers, hidden 256), its loss computed inside forward."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(1024, (2, 128), generator=torch.Generator().manual_seed(1))
    return Workload(
        "tiny HF Llama (4 layers, hidden 256, seq 128, batch 2)",
        model,
        (ids,),
        {"labels": ids},
        lambda output: output.loss,
    )


class DecoderBlock(nn.Module):
    """A GPT-2 style block: pre-norm causal attention and GELU MLP, dropout on the attention
    weights and on both residual branches."""

    def __init__(self, dim: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        p = self.p if self.training else 0.0
        a = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(nn.functional.gelu(self.fc(self.norm2(x)))))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 1024, dim: int = 256, heads: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def decoder_workload() -> Workload:
    torch.manual_seed(3)
    model = Decoder().train()
    ids = torch.randint(1024, (2, 128), generator=torch.Generator().manual_seed(1))
    targets = ids.roll(-1, dims=1)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Workload(
        "decoder (4 x GPT-2 block 256, dropout 0.1, seq 128, batch 2)", model, (ids,), {}, loss
    )


class VitBlock(nn.Module):
    """A ViT block: pre-norm attention and GELU MLP, no dropout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.norm2(x))))


class Vit(nn.Module):
    def __init__(self, dim: int = 192, heads: int = 3, depth: int = 4, classes: int = 100) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=8, stride=8)
        self.position = nn.Parameter(torch.randn(1, 16, dim) * 0.02)
        self.blocks = nn.Sequential(*(VitBlock(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def vit_workload() -> Workload:
    torch.manual_seed(4)
    model = Vit().train()
    images = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(16) % 100
    return Workload(
        "ViT (4 x block 192, 16 patches, batch 16)",
        model,
        (images,),
        {},
        lambda logits: nn.functional.cross_entropy(logits, labels),
    )


def gpt_neox_workload() -> Workload:
    """A tiny Hugging Face GPT-NeoX (4 layers, hidden 256, hidden dropout 0.1), its loss
    computed inside forward."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        hidden_dropout=0.1,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.GPTNeoXForCausalLM(config).train()
    ids = torch.randint(1024, (2, 128), generator=torch.Generator().manual_seed(1))
    return Workload(
        "tiny HF GPT-NeoX (4 layers, hidden 256, hidden dropout 0.1, seq 128, batch 2)",
        model,
        (ids,),
        {"labels": ids},
        lambda output: output.loss,
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "W2": w2_workload,
    "llama": llama_workload,
    "decoder": decoder_workload,
    "vit": vit_workload,
    "gpt_neox": gpt_neox_workload,
}


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
    """FLOPs of ``loss``'s backward, recompute included."""
    with FlopCount() as counter:
        loss.backward()
    return counter.flops


def compile_side_by_side(
    work: Workload, budgets: tuple[float, ...] = COMPILE_BUDGETS
) -> list[dict[str, Any]]:
    """Kept bytes and recomputed FLOPs (backward FLOPs above the eager plain backward's) of
    ``torch.compile`` (inductor) at each ``activation_memory_budget``, and beside each, our
    plans at the bytes it kept, one per objective."""
    model = work.model
    exclude = work.exclude()

    def eager() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return work.loss()

    loss, plain_kept = hooked_bytes(eager, exclude)
    plain_backward = backward_flops(loss)
    rows = [{"name": "eager, no checkpoint", "kept": plain_kept, "flops": 0, "predicted": 0}]
    for budget in budgets:
        torch.compiler.reset()
        with _compat.compile_activation_memory_budget(budget):
            compiled = torch.compile(model, backend="inductor")
            model.zero_grad(set_to_none=True)
            work.loss(compiled).backward()  # compiles forward and backward under this budget

            def forward(compiled: Any = compiled) -> torch.Tensor:
                model.zero_grad(set_to_none=True)
                return work.loss(compiled)

            loss, kept_bytes = hooked_bytes(forward, exclude)
            flops = backward_flops(loss) - plain_backward
        rows.append({"name": f"torch.compile, budget {budget}", "kept": kept_bytes, "flops": flops})
        for objective, share in PLANNED:
            rows.append(planned(work, int(share * kept_bytes), objective, plain_backward))
        print(*(f"{r['name']}: {r['kept']}, {r['flops']}" for r in rows[-4:]), sep="\n")
    torch.compiler.reset()
    return rows


def planned(work: Workload, budget: int, objective: str, plain_backward: int) -> dict[str, Any]:
    """Our plan at ``budget`` bytes: kept bytes (the report), recomputed FLOPs (measured as for
    the compiler, and predicted), predicted peak."""
    model = work.model
    try:
        plan = checkpointing.plan_checkpointing(
            model,
            work.args,
            example_kwargs=work.kwargs,
            loss_fn=work.loss_fn,
            budget=budget,
            objective=objective,  # type: ignore[arg-type]
        )
    except ValueError:
        return {
            "name": f"plan, objective={objective}",
            "kept": None,
            "flops": None,
        }
    plan.apply(model)
    try:
        model.zero_grad(set_to_none=True)
        with checkpointing.saved_tensors_report() as report:
            loss = work.loss()
        flops = backward_flops(loss) - plain_backward
    finally:
        plan.remove(model)
    return {
        "name": f"plan, objective={objective}, budget {budget:,} B",
        "kept": report.activation_bytes,
        "flops": flops,
        "predicted": plan.recompute_flops,
        "plan": plan,
    }


def compile_table(key: str, rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]["kept"]
    lines = [
        f"### {key}: plan_checkpointing beside torch.compile's activation_memory_budget",
        "",
        "| configuration | kept bytes | of eager's | recomputed GFLOP (measured) | predicted | "
        "<= compiler's FLOPs at <= its bytes + 2 % |",
        "|---|---|---|---|---|---|",
    ]
    compiled: dict[str, Any] = {}
    for row in rows:
        if row["kept"] is None:
            lines.append(f"| {row['name']} | below the floor | | | | no |")
            continue
        verdict = ""
        if row["name"].startswith("torch.compile"):
            compiled = row
        elif row["name"].startswith("plan"):
            fits = row["kept"] <= (1 + BYTES_TOLERANCE) * compiled["kept"]
            verdict = "yes" if fits and row["flops"] <= compiled["flops"] else "no"
        predicted = f"{row['predicted'] / 1e9:.3f}" if "predicted" in row else ""
        lines.append(
            f"| {row['name']} | {row['kept']:,} | {row['kept'] / base:.3f} | "
            f"{row['flops'] / 1e9:.3f} | {predicted} | {verdict} |"
        )
    lines.append("")
    return lines


def solve_time(depth: int = 32) -> dict[str, float]:
    """Seconds to solve a profiled ``depth``-layer tiny HF Llama (profile not counted) as
    ``plan_checkpointing`` does, per objective: the floor read off every span variant's options
    (Rule M11), then every variant solved at a budget and the cheapest kept, the mean over budgets
    0.3 and 0.7 of the baseline."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=depth,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(1024, (2, 128), generator=torch.Generator().manual_seed(1))
    kwargs = {"labels": ids}
    blocks = find_regions(model, None)
    tail = tail_regions(model, blocks, (ids,), kwargs)
    profile = profile_step(
        model, blocks + tail, (ids,), kwargs, lambda o: o.loss, tail=len(tail), warmed=True
    )
    times = {}
    for objective in OBJECTIVES:
        weights = profile.objective(objective)
        policy = profile.policy_seconds_per_op
        ends = range(len(blocks), len(blocks) + len(tail))
        late = frozenset(profile.late)
        base = profile.problem(policy, weights)
        variants = [p for _, p in span_problems(base, profile.spans, ends, policy, late)]
        trailed = profile.trailed()  # Rule M13 (a Llama's pre-norm blocks have none)
        if trailed is not None:
            step, trails = trailed
            cut = step.problem(policy, weights)
            recorded = span_problems(cut, profile.spans, ends, policy, late, trails)
            variants += [p for _, p in recorded]
        start = time.process_time()
        baseline = baseline_bytes(variants[0])
        min(floor_bytes(problem) for problem in variants)
        floor_seconds = time.process_time() - start
        start = time.process_time()
        for share in (0.3, 0.7):
            _cheapest(variants, int(share * baseline))
        times[objective] = floor_seconds + (time.process_time() - start) / 2
    return times


def _best(run: Callable[[], Any], repeats: int, rounds: int = 7) -> float:
    """The fastest of ``rounds`` rounds' median seconds of ``run`` (``repeats`` calls each)."""
    rounds_seconds = []
    for _ in range(rounds):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        rounds_seconds.append(statistics.median(times))
    return min(rounds_seconds)


class _OpCount(_compat.TorchDispatchMode):  # type: ignore[misc]
    """Counts the ops a forward runs (as the selective modes count them)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in SAC_IGNORED_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def cost_model() -> dict[str, float]:
    """``--cost-model``: the constants of ``checkpointing/_planning/measure/costs.py`` on this
    machine (one thread): a large ``mm``'s FLOP rate; a large ``add``'s bytes (read and written) per
    second; what a large ``bernoulli_`` costs per element beyond those bytes; a one-element
    ``add``'s seconds (dispatch and its autograd node); the selective modes' price per op (a W2
    block's forward inside the forward mode ``apply`` installs against plain, doubled for the
    replay); what a checkpointed block costs beyond its ops, per op (W2 steps with every block
    checkpointed against plain, less the blocks' forward); and a recorded span call beyond its
    ops (a layer norm recorded between a product and a linear layer, against unrecorded)."""
    from checkpointing import checkpoint_module, gradient_checkpoint_scope
    from checkpointing._scope import gradient_checkpoint_session

    torch.manual_seed(0)
    found: dict[str, float] = {}
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    found["flops_per_second"] = 2 * 512**3 / _best(lambda: torch.mm(a, b), 5)
    big = torch.randn(4 * 1024 * 1024)
    found["bytes_per_second"] = 3 * big.nbytes / _best(lambda: torch.add(big, big), 5)
    # A draw beyond its bytes: bernoulli_ in place, priced as read and written like any op.
    drawn = _best(lambda: big.bernoulli_(0.9), 5) - 2 * big.nbytes / found["bytes_per_second"]
    found["random_seconds_per_element"] = max(0.0, drawn / big.numel())
    one = torch.randn(1, requires_grad=True)  # an autograd node, as in a training step
    found["dispatch_seconds"] = _best(lambda: torch.add(one, one), 2000)
    model, x = w2(4, 1)
    block = model[0]
    with torch.no_grad(), _OpCount() as counter:
        block(x)
    ops = counter.count

    def forward() -> None:
        block(x)

    def under_policy() -> None:
        mode, _ = _RegionContexts({})()
        with mode:
            block(x)

    plain = _best(forward, 10)
    selective = _best(under_policy, 10)
    found["policy_seconds_per_op"] = max(0.0, 2 * (selective - plain) / ops)
    model_plain = copy.deepcopy(model)
    for child in model:
        checkpoint_module(child)

    def plain_step() -> None:
        model_plain(x).sum().backward()

    def checkpointed_step() -> None:
        model(x).sum().backward()

    blocks_forward = _best(lambda: model_plain(x), 5)
    extra = _best(checkpointed_step, 5) - _best(plain_step, 5) - blocks_forward
    found["frame_seconds_per_op"] = max(0.0, extra / (ops * len(model)))
    norm, linear = nn.LayerNorm(64), nn.Linear(64, 64)
    h0 = torch.randn(1, 32, 64, requires_grad=True)

    def unrecorded() -> None:
        linear(norm(h0 * 2.0)).sum().backward()

    def recorded() -> None:
        with gradient_checkpoint_session():
            h = h0 * 2.0
            with gradient_checkpoint_scope() as scope:
                y = norm(h)
            loss = linear(y).sum()
            scope.exit_saved_tensors_hooks_scope()
        loss.backward()

    found["span_call_seconds"] = max(0.0, _best(recorded, 50) - _best(unrecorded, 50))
    return found


def planning_time() -> list[str]:
    """``--planning-time``: ``plan_checkpointing``'s CPU seconds (``time.process_time``, one
    thread, so that a shared machine's load counts less; default options, budget 0.5) against
    one plain training step's (the median of 7 after 3 untimed), and how many times the plan
    ran the model (a forward pre-hook), on W2 and a 12-layer tiny GPT-2."""
    import transformers

    def gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=12, n_embd=128, n_head=4, vocab_size=1024, n_positions=256, use_cache=False
        )
        ids = torch.randint(1024, (4, 128), generator=torch.Generator().manual_seed(1))
        model = transformers.GPT2LMHeadModel(config).train()
        return model, (ids,), {"labels": ids}, lambda output: output.loss

    def w2_setting() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
        model, x = w2(4, 1)
        return model, (x,), {}, None

    return [
        _planning_ratio(name, *build())
        for name, build in (("W2", w2_setting), ("GPT-2, 12 layers", gpt2))
    ]


def _planning_ratio(
    name: str, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Any
) -> str:
    """One ``--planning-time`` line."""
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    def plain_step() -> None:
        output = model(*args, **kwargs)
        (sum_loss(output) if loss_fn is None else loss_fn(output)).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        plain_step()
    steps = []
    for _ in range(7):
        start = time.process_time()
        plain_step()
        steps.append(time.process_time() - start)
    step_seconds = statistics.median(steps)
    from checkpointing._planning import search

    solving = [0.0]
    solve_plainly, floor_plainly = search.solve, search.floor_bytes

    def timed(plainly: Any) -> Any:
        def run(*solve_args: Any) -> Any:
            start = time.process_time()
            try:
                return plainly(*solve_args)
            finally:
                solving[0] += time.process_time() - start

        return run

    handle = model.register_forward_pre_hook(count)
    # This process only: the solver's share of the planning time (the floors and the solves).
    search.solve, search.floor_bytes = timed(solve_plainly), timed(floor_plainly)
    seconds = []
    try:
        for _ in range(2):  # the first call in a process also imports what torch loads lazily
            solving[0] = 0.0
            calls[0] = 0
            start = time.process_time()
            checkpointing.plan_checkpointing(
                model, args, example_kwargs=kwargs, loss_fn=loss_fn, budget=0.5
            )
            seconds.append(time.process_time() - start)
    finally:
        search.solve, search.floor_bytes = solve_plainly, floor_plainly
        handle.remove()
    cold, warm = seconds
    return (
        f"{name}: plain step {1e3 * step_seconds:.1f} ms; planning {cold:.2f} s in a fresh "
        f"process, {warm:.2f} s again, of which solving {solving[0]:.2f} s; ratio without the "
        f"solve {(warm - solving[0]) / step_seconds:.1f} (with it {warm / step_seconds:.1f}, "
        f"fresh {cold / step_seconds:.1f}); model runs {calls[0]}"
    )


def dump_plans(directory: Path, objective: str | None) -> None:
    """Write the plan of W1 and W2 at every budget as JSON (``--dump-plans``; the default
    objective, or ``--objective``): run it on an older checkout (``PYTHONPATH=that/checkout``),
    or with the other objective, to time its plans with ``--ab``."""
    directory.mkdir(parents=True, exist_ok=True)
    print(f"planning with {Path(checkpointing.__file__).parent}")
    options = {} if objective is None else {"objective": objective}
    for name, build in (("W1", lambda: w1(8)), ("W2", lambda: w2(4, 1))):
        model, x = build()
        for budget in BUDGETS:
            try:
                plan = checkpointing.plan_checkpointing(model, x, budget=budget, **options)
            except ValueError:
                continue
            (directory / f"{name}_{budget}.json").write_text(plan.to_json())
            print(f"{name} {budget}: {describe(plan)}, {plan.kept_bytes:,} bytes")


def ab(directory: Path, rounds: int, objective: str | None) -> None:
    """``--ab``: this checkout's default plan (B... A) against the plan in ``directory`` at the
    same budget (written by ``--dump-plans`` on another checkout), in quads beside the A/A
    control, as ``run`` times plans against hand policies."""
    for name, build in (("W1", lambda: w1(8)), ("W2", lambda: w2(4, 1))):
        model, x = build()
        installers: dict[str, Installer] = {"none": no_checkpoint, "none again": no_checkpoint}
        plans = {}
        for budget in BUDGETS:
            path = directory / f"{name}_{budget}.json"
            if not path.exists():
                continue
            old = checkpointing.ActivationPlan.from_json(path.read_text())
            options = {} if objective is None else {"objective": objective}
            new = checkpointing.plan_checkpointing(model, x, budget=budget, **options)
            plans[budget] = (new, old)
            installers[f"new {budget}"] = plan_installer(new)
            installers[f"old {budget}"] = plan_installer(old)
        models = {}
        for key, install in installers.items():
            models[key] = copy.deepcopy(model)
            install(models[key])
        nbytes = {key: kept(m, x) for key, m in models.items()}
        for m in models.values():
            for _ in range(WARM_STEPS):
                step(m, x)
        comparisons = [AA] + [(f"new {b}", f"old {b}") for b in plans]
        gc.collect()
        gc.freeze()
        ratios, _ = quads(models, x, comparisons, rounds)
        gc.unfreeze()
        control = estimate(ratios[AA])
        print(f"### {name}: this checkout's plan (new) against the saved one (old)\n")
        print(f"A/A control: {control} ({control.count} quads)\n")
        print(
            "| budget | old: kept bytes, regions | new: kept bytes, regions | new / old | verdict |"
        )
        print("|---|---|---|---|---|")
        for budget, (new, old) in plans.items():
            ratio = estimate(ratios[(f"new {budget}", f"old {budget}")])
            print(
                f"| {budget} | {nbytes[f'old {budget}']:,}, {describe(old)} | "
                f"{nbytes[f'new {budget}']:,}, {describe(new)} | {ratio} | "
                f"{verdict(ratio, control)} |"
            )
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank-rounds", type=int, default=12)
    parser.add_argument("--quads", type=int, default=0, help="rounds of quads (0: per workload)")
    parser.add_argument("--only", choices=("W1", "W2"), help="one workload only")
    parser.add_argument(
        "--plot", help="W1/W2: draw the plans and hand policies here (the docs show the sweep's)"
    )
    parser.add_argument(
        "--from-results",
        action="store_true",
        help="run nothing: draw --plot from the W1/W2 tables recorded in benchmarks/RESULTS.md",
    )
    parser.add_argument("--compile", action="store_true", help="the torch.compile comparison")
    parser.add_argument(
        "--sweep", action="store_true", help="a budget sweep per family (planner_sweep.py)"
    )
    parser.add_argument("--sweep-rounds", type=int, default=15, help="--sweep: timed rounds")
    parser.add_argument(
        "--sweep-families",
        default="W2,llama,decoder,vit,gpt_neox,gpt2",
        help="--sweep: which (comma-separated)",
    )
    parser.add_argument("--sweep-plot", default="docs/planner_sweep.png")
    parser.add_argument(
        "--sweep-quads",
        metavar="FAMILY",
        help="the plan at each block strategy's bytes against it, in quads (planner_sweep.py)",
    )
    parser.add_argument(
        "--sweep-quads-at",
        metavar="BYTES",
        help="--sweep-quads: the plans at these budgets (bytes, comma-separated) instead, each "
        "against every block strategy",
    )
    parser.add_argument(
        "--hand", action="store_true", help="W2: the plan at each hand policy's bytes against it"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="--compile: which (comma-separated)"
    )
    parser.add_argument(
        "--compile-budgets",
        default=",".join(map(str, COMPILE_BUDGETS)),
        help="--compile: which activation_memory_budget values (comma-separated)",
    )
    parser.add_argument("--solve-time", action="store_true", help="only time the solver")
    parser.add_argument(
        "--cost-model", action="store_true", help="measure the cost model's constants"
    )
    parser.add_argument(
        "--planning-time", action="store_true", help="planning time against a plain step"
    )
    parser.add_argument("--dump-plans", type=Path, help="write W1/W2 default plans as JSON")
    parser.add_argument("--ab", type=Path, help="time this checkout's plans against those")
    parser.add_argument(
        "--objective", choices=("time", "flops"), help="--dump-plans/--ab: plan with this one"
    )
    args = parser.parse_args()
    if args.sweep_quads:
        import planner_sweep

        budgets = [int(b) for b in (args.sweep_quads_at or "").split(",") if b]
        lines = planner_sweep.quads_at_strategies(args.sweep_quads, args.quads or 40, budgets)
        print("\n".join(lines))
        return
    if args.sweep:  # the figure from RESULTS.md with --from-results, else the measured sweep
        import planner_sweep

        if args.from_results:
            planner_sweep.plot(planner_sweep.recorded_panels(), Path(args.sweep_plot))
            print(f"plot: {args.sweep_plot}")
        else:
            torch.set_num_threads(1)
            families = args.sweep_families.split(",")
            planner_sweep.main(families, args.sweep_rounds, Path(args.sweep_plot))
        return
    if args.from_results:
        if args.plot is None:
            parser.error("--from-results draws the W1/W2 figure: name its file with --plot PATH")
        plot(recorded_panels(), Path(args.plot))
        print(f"plot: {args.plot}")
        return
    torch.set_num_threads(1)
    if args.dump_plans is not None:
        dump_plans(args.dump_plans, args.objective)
        return
    if args.ab is not None:
        ab(args.ab, args.quads or 24, args.objective)
        return
    if args.cost_model:
        for name, value in cost_model().items():
            print(f"{name}: {value:.4g}")
        return
    if args.planning_time:
        print("\n".join(planning_time()))
        return
    if args.solve_time:
        for objective, seconds in solve_time().items():
            print(
                f"solve time (every span variant), 32-layer tiny Llama, objective {objective}: "
                f"{1e3 * seconds:.0f} ms"
            )
        return
    if args.hand:
        model, x = w2(4, 1)
        key = "W2 (4 x TransformerEncoderLayer 256, seq 128, batch 1)"
        print("\n".join(hand_run(key, model, x, args.quads or QUADS["W2"])))
        return
    if args.compile:
        for name in args.workloads.split(","):
            work = WORKLOADS[name]()
            start = time.perf_counter()
            budgets = tuple(float(b) for b in args.compile_budgets.split(","))
            rows = compile_side_by_side(work, budgets)
            print("\n".join(compile_table(work.key, rows)))
            print(f"({time.perf_counter() - start:.0f} s)\n", flush=True)
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
    if args.only is None and args.plot is not None:
        try:
            plot([panel_of(result) for result in results], Path(args.plot))
            print(f"plot: {args.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
