"""``python benchmarks/planner.py --sweep``: the plan across a budget sweep against the hand
strategies, measured, one panel per model family.

Families: the ``--compile`` comparison's five (W2 at batch 2, the tiny Hugging Face Llama, the
GPT-2-style decoder with dropout, the small ViT, the tiny Hugging Face GPT-NeoX with hidden
dropout) and a Hugging Face GPT-2 of the same size (4 layers, hidden 256, dropout 0.1, batch
2 x 128 tokens, its loss from ``labels``). One thread, float32, training mode.

Method, per family. One profile, then ``POINTS`` budgets evenly in bytes from the floor to the
bytes kept without checkpointing (``search.profiled``: what ``plan_sweep`` runs); the plans are
checked against the sweep's promise (NOTE [Budget sweep], Rule 2). Configurations: the
un-checkpointed step twice ("none", "none again": the A/A control), each distinct plan (plans of
equal decisions are timed once) and each hand strategy of ``hands()``: ``planner.HAND`` installed
on the model's blocks (the regions the planner finds, without the tail), and torch's
``checkpoint_sequential`` strategies as chains of those blocks. Each runs on its own copy of
the model, installed once; kept bytes are ``saved_tensors_report().activation_bytes`` of one
step (what the planner counts). Time: ``WARM`` untimed steps each, then ``--sweep-rounds`` rounds,
every configuration once per round in an order rotated each round; a sample is one step's CPU
time (``planner.sample``: forward, the loss, backward, after ``gc.collect()``); a round's ratio
is a configuration's sample over that round's "none" sample; reported: the median ratio over
the rounds, with the 25th-75th percentile range.

The figure: per family, x = the budget (of the bytes kept without checkpointing); left axis:
kept bytes (the plan's measured, a line, with the budget itself dashed); right axis: step time
over the un-checkpointed step's (the plan's, a line; each hand strategy a marker at its own kept
bytes, the budget it just fits). A hand marker below the plan's time line at its x beats the
plan there.
"""

from __future__ import annotations

import copy
import gc
import itertools
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import checkpointing
from checkpointing._chain import checkpoint_chain
from checkpointing._planning.search import find_regions, profiled

POINTS = 12
WARM = 2
TOKENS = {"bos_token_id": 0, "eos_token_id": 0}  # inside the small vocabulary (GPT-2's 50256 warns)


def gpt2_workload() -> Any:
    import transformers
    from planner import Workload

    torch.manual_seed(6)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=8, n_positions=256, vocab_size=1024, use_cache=False, **TOKENS
    )
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(1024, (2, 128), generator=torch.Generator().manual_seed(1))
    key = "GPT-2 (4 layers, hidden 256, dropout 0.1, seq 128, batch 2)"
    return Workload(key, model, (ids,), {"labels": ids}, lambda output: output.loss)


def families() -> dict[str, Callable[[], Any]]:
    """The six families' workloads, by short name."""
    from planner import WORKLOADS

    return {**WORKLOADS, "gpt2": gpt2_workload}


def blocks_of(model: nn.Module) -> nn.Module:
    """The container of the blocks the planner finds (the model itself for a Sequential): the
    hand strategies iterate it."""
    prefix = find_regions(model, None)[0][0].rpartition(".")[0]
    return model.get_submodule(prefix) if prefix else model


def sequential_chains(size_of: Callable[[int], int]) -> Callable[[nn.Module], None]:
    """torch's ``checkpoint_sequential`` strategy on the blocks the model's own forward calls
    (a Hugging Face model's blocks are no ``nn.Sequential`` to hand it): segments of
    ``size_of(blocks)`` blocks, all but the last checkpointed, each as one frame
    (``checkpoint_chain``: one input and one RNG state kept per segment, as torch's keeps)."""

    def install(model: nn.Module) -> None:
        blocks = list(blocks_of(model))
        size = size_of(len(blocks))
        for start in range(0, size * (len(blocks) // size - 1), size):
            if size == 1:
                checkpointing.checkpoint_module(blocks[start])
            else:
                checkpoint_chain(blocks[start : start + size], model)

    return install


def hands() -> dict[str, Callable[[nn.Module], None]]:
    """The hand strategies, each installed on a whole model: ``planner.HAND`` on its blocks, and
    ``checkpoint_sequential`` with a block per segment and with two segments (on four blocks,
    also its segments of two blocks)."""
    from planner import HAND

    found: dict[str, Callable[[nn.Module], None]] = {
        name: lambda m, install=install: install(blocks_of(m)) for name, install in HAND.items()
    }
    found["checkpoint_sequential, a block per segment"] = sequential_chains(lambda n: 1)
    found["checkpoint_sequential, 2 segments"] = sequential_chains(lambda n: n // 2)
    return found


def one_step(work: Any, model: nn.Module) -> None:
    """One training step of ``work``'s loss on ``model`` (a copy of its model)."""
    model.zero_grad(set_to_none=True)
    work.loss(model).backward()


def kept_bytes(work: Any, model: nn.Module) -> int:
    """``saved_tensors_report().activation_bytes`` of one step (what the planner counts)."""
    with checkpointing.saved_tensors_report() as report:
        one_step(work, model)
    return report.activation_bytes


def sampled(work: Any, model: nn.Module) -> float:
    """One step's CPU seconds, the garbage collected before."""
    gc.collect()
    start = time.process_time()
    one_step(work, model)
    return time.process_time() - start


@dataclass
class Measured:
    """One configuration: its measured kept bytes and step-time ratios (one per round)."""

    kept: int
    ratios: list[float]

    @property
    def time(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        quartiles = statistics.quantiles(self.ratios, n=4)
        return quartiles[0], quartiles[2]


@dataclass
class SweepResult:
    """One family's sweep: the plans by budget, their configuration's name, every measured
    configuration, and whether the promise held."""

    key: str
    baseline: int
    floor: int
    plans: list[checkpointing.ActivationPlan]
    plan_names: list[str]
    measured: dict[str, Measured]
    promise: bool


def _promise(plans: list[checkpointing.ActivationPlan]) -> bool:
    """NOTE [Budget sweep], Rule 2, over plans of falling budgets."""
    within = all(plan.kept_bytes <= plan.budget_bytes for plan in plans)
    monotone = all(
        b.kept_bytes <= a.kept_bytes and b.cost >= a.cost for a, b in itertools.pairwise(plans)
    )
    return within and monotone


def sweep(work: Any, rounds: int) -> SweepResult:
    """One family: plan the sweep, install every configuration, measure bytes and time."""
    from planner import plan_installer

    model = work.model
    step = profiled(
        "plan_sweep", model, work.args, [1.0], None, work.kwargs, work.loss_fn, None, "time", 0
    )
    baseline, floor = step.ends
    budgets = [baseline - (baseline - floor) * i // (POINTS - 1) for i in range(POINTS)]
    plans = step.plans(budgets)
    installers: dict[str, Callable[[nn.Module], None]] = {
        "none": lambda m: None,
        "none again": lambda m: None,
    }
    plan_names, seen = [], {}
    for plan in plans:
        decisions = (plan.regions, plan.spans)
        name = seen.setdefault(repr(decisions), f"plan {plan.budget_bytes / baseline:.3f}")
        plan_names.append(name)
        installers.setdefault(name, plan_installer(plan))
    installers.update(hands())
    models = {}
    for name, install in installers.items():
        models[name] = copy.deepcopy(model)
        install(models[name])

    nbytes = {}
    for name, m in models.items():
        nbytes[name] = kept_bytes(work, m)
        for _ in range(WARM):
            one_step(work, m)
    gc.collect()
    gc.freeze()
    seconds: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(sampled(work, models[name]))
    gc.unfreeze()
    measured = {
        name: Measured(
            nbytes[name], [s / n for s, n in zip(seconds[name], seconds["none"], strict=True)]
        )
        for name in models
    }
    return SweepResult(work.key, baseline, floor, plans, plan_names, measured, _promise(plans))


def table(result: SweepResult) -> list[str]:
    """One family's tables: the plan at each budget, then the hand strategies."""
    from planner import describe

    base = result.measured["none"].kept
    aa = result.measured["none again"]
    lines = [
        f"#### {result.key}",
        "",
        f"Bytes kept without checkpointing: {result.baseline:,} (predicted), {base:,} "
        f"(measured); the floor: {result.floor:,} ({result.floor / result.baseline:.3f}). The "
        f"promise holds at every budget: {'yes' if result.promise else 'NO'}. A/A control "
        f"(none again / none): {aa.time:.3f} [{aa.spread[0]:.3f}, {aa.spread[1]:.3f}].",
        "",
        "| budget | budget bytes | plan: kept (predicted) | kept (measured) | of none's | regions "
        "| cost | step / none [IQR] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for plan, name in zip(result.plans, result.plan_names, strict=True):
        m = result.measured[name]
        lines.append(
            f"| {plan.budget_bytes / result.baseline:.3f} | {plan.budget_bytes:,} | "
            f"{plan.kept_bytes:,} | {m.kept:,} | {m.kept / base:.3f} | {describe(plan)} | "
            f"{plan.cost:.5f} | {m.time:.3f} [{m.spread[0]:.3f}, {m.spread[1]:.3f}] |"
        )
    lines += [
        "",
        "| hand strategy | kept (measured) | of none's | step / none [IQR] | the plan at the "
        "smallest budget that holds it: step / none |",
        "|---|---|---|---|---|",
    ]
    for hand in hands():
        m = result.measured[hand]
        fitting = [
            (plan, name)
            for plan, name in zip(result.plans, result.plan_names, strict=True)
            if plan.budget_bytes >= m.kept
        ]
        beside = ""
        if fitting:
            plan, name = fitting[-1]
            share = plan.budget_bytes / result.baseline
            beside = f"{result.measured[name].time:.3f} (budget {share:.3f})"
        lines.append(
            f"| {hand} | {m.kept:,} | {m.kept / base:.3f} | {m.time:.3f} "
            f"[{m.spread[0]:.3f}, {m.spread[1]:.3f}] | {beside or 'below the floor'} |"
        )
    lines.append("")
    return lines


# The hand strategies ``--sweep-quads`` sets the plan beside: the block strategies, where the
# sweep's comparison at the next swept budget is too coarse to tell a few per cent apart.
BLOCK_STRATEGIES = ("every 2 layers", "every 3 layers", "checkpoint_sequential, 2 segments")


def quads_at_strategies(name: str, rounds: int, budgets: Sequence[int] = ()) -> list[str]:
    """``--sweep-quads NAME``: on family ``name``, the plan (``plan_sweep`` from one profile) at
    each of ``BLOCK_STRATEGIES``' measured kept bytes against that strategy, or with ``budgets``
    (``--sweep-quads-at``, in bytes: a sweep's budgets) the plan at each against every one of
    them, predicted (both by the planner's cost model: ``hand_prices``, the plan's ``cost``) and
    measured in ``rounds`` quads (A B B A, then B A A B; a sample one step's CPU time), beside
    the A/A control, as a table."""
    from planner import describe, estimate, hand_prices, plan_installer, quads, verdict

    from checkpointing._planning.search import _variants

    torch.set_num_threads(1)
    work = families()[name]()
    installers = hands()
    models = {"none": copy.deepcopy(work.model), "none again": copy.deepcopy(work.model)}
    for strategy in BLOCK_STRATEGIES:
        models[strategy] = copy.deepcopy(work.model)
        installers[strategy](models[strategy])

    nbytes = {key: kept_bytes(work, m) for key, m in models.items()}
    step = profiled(
        "plan_sweep", work.model, work.args, [1.0], None, work.kwargs, work.loss_fn, None, "time", 0
    )
    problem = _variants(step.measured, 1.0, 1.0, joins=True)[0][1]
    prices = hand_prices(problem, len(list(blocks_of(work.model))))
    at = list(budgets) or [nbytes[s] for s in BLOCK_STRATEGIES]
    names = [f"plan at {b:,} bytes" for b in budgets] or [f"plan at {s}" for s in BLOCK_STRATEGIES]
    plans = dict(zip(names, step.plans(at), strict=True))
    for key, plan in plans.items():
        models[key] = copy.deepcopy(work.model)
        plan_installer(plan)(models[key])
        nbytes[key] = kept_bytes(work, models[key])
    for m in models.values():
        for _ in range(WARM):
            one_step(work, m)
    pairs = [("none again", "none")] + (
        [(key, s) for key in names for s in BLOCK_STRATEGIES]
        if budgets
        else list(zip(names, BLOCK_STRATEGIES, strict=True))
    )
    gc.collect()
    gc.freeze()
    ratios, _ = quads(models, lambda m: sampled(work, m), pairs, rounds)
    gc.unfreeze()
    control = estimate(ratios[pairs[0]])
    where = "the given budgets" if budgets else "each block strategy's bytes"
    lines = [
        f"#### {work.key}: the plan at {where}, {rounds} quads",
        "",
        f"A/A control (none again / none): {control}.",
        "",
        "| plan | against | hand: bytes | hand: predicted | plan: kept bytes (measured) | "
        "plan: predicted | plan: regions | plan / hand, median [95 % CI] | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a, b in pairs[1:]:
        ratio = estimate(ratios[(a, b)])
        plan = plans[a]
        lines.append(
            f"| {a} | {b} | {nbytes[b]:,} | {prices[b][1]:.5f} | {nbytes[a]:,} | {plan.cost:.5f} "
            f"| {describe(plan)} | {ratio} | {verdict(ratio, control)} |"
        )
    return lines


Panel = tuple[str, list[tuple[float, float, float]], dict[str, tuple[float, float]]]
"""One family's figure: its title, the plans (budget, kept bytes, step time: all relative to
the run without checkpointing) and the hand strategies (kept bytes, step time) by name."""

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
# The figure reads the run recorded under this heading, one "#### <family>" part per family.
RECORDED = "## The plan across a budget sweep"


def panel_of(result: SweepResult) -> Panel:
    """The figure's data of one family's run."""
    base = result.measured["none"].kept
    plans = []
    for plan, name in zip(result.plans, result.plan_names, strict=True):
        m = result.measured[name]
        plans.append((plan.budget_bytes / result.baseline, m.kept / base, m.time))
    strategies = {h: (result.measured[h].kept / base, result.measured[h].time) for h in hands()}
    return result.key, plans, strategies


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def recorded_panels(results: Path = RESULTS) -> list[Panel]:
    """The families' tables recorded in ``RESULTS.md`` under ``RECORDED``, as panels."""
    text = results.read_text()
    section = text[text.index(RECORDED) :].split("\n## ")[0]
    panels = []
    for part in section.split("\n#### ")[1:]:
        key = part.split("\n", 1)[0].strip()
        plans, strategies = [], {}
        for line in part.splitlines():
            cells = _cells(line)
            if len(cells) == 8 and re.fullmatch(r"\d\.\d+", cells[0]):
                time = float(cells[7].split(" ")[0])
                plans.append((float(cells[0]), float(cells[4]), time))
            if len(cells) == 5 and re.fullmatch(r"[\d,]+", cells[1]):
                strategies[cells[0]] = (float(cells[2]), float(cells[3].split(" ")[0]))
        panels.append((key, plans, strategies))
    return panels


def plot(panels: list[Panel], path: Path) -> None:
    """One panel per family (see the module's docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    columns = 3
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 4.6 * rows), squeeze=False)
    markers = ("s", "D", "^", "v", "P", "X", "h", "<", ">")
    handles: dict[str, Any] = {}
    for ax, (key, plans, strategies) in zip(axes.flat, panels, strict=False):
        xs = [budget for budget, _, _ in plans]
        ax.plot(xs, xs, "--", color="tab:blue", alpha=0.4, linewidth=1, label="the budget")
        kept = [k for _, k, _ in plans]
        ax.plot(xs, kept, "o-", color="tab:blue", ms=4, label="plan: kept bytes")
        ax.set_ylabel("kept bytes / without checkpointing", color="tab:blue")
        ax.set_xlabel("budget / bytes kept without checkpointing")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        right = ax.twinx()
        times = [t for _, _, t in plans]
        right.plot(xs, times, "o-", color="tab:red", ms=4, label="plan: step time")
        for index, (name, point) in enumerate(strategies.items()):
            right.scatter(
                *point,
                marker=markers[index % len(markers)],
                s=55,
                color=plt.get_cmap("tab10")(index + 2),
                edgecolors="black",
                linewidths=0.5,
                label=name,
                zorder=5,
            )
        right.set_ylabel("step CPU time / without checkpointing", color="tab:red")
        ax.set_title(key, fontsize=9)
        for side in (ax, right):
            for handle, label in zip(*side.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, handle)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.legend(
        list(handles.values()), list(handles), loc="lower center", ncol=-(-len(handles) // 2)
    )
    fig.suptitle(
        "plan_sweep: 12 budgets from the floor to 1.0, one profile per family: kept bytes (blue, "
        "left) and step time (red, right) against the budget;\neach hand strategy at its own "
        "kept bytes and step time (a marker below the red line at its x is faster than the plan "
        "there)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=80)


def main(names: list[str], rounds: int, path: Path | None) -> None:
    """``--sweep``: every family in ``names``, its tables printed, the figure at ``path``."""
    torch.set_num_threads(1)
    found = families()
    results = []
    for name in names:
        result = sweep(found[name](), rounds)
        print("\n".join(table(result)), flush=True)
        results.append(result)
    if path is not None:
        plot([panel_of(result) for result in results], path)
        print(f"plot: {path}")
