"""Compressed saves: bytes kept per format, and what compression does to a small training run.

Three measurements, each decision side by side with the exact one in the same process:

1. Bytes: one step of a small GPT (2 layers, width 128, sequence 64, batch 16), every block
   checkpointed under ``save_matmuls()`` (exact) or ``compress_ops(*MATMUL_OPS, to=...)``; a
   ``saved_tensors_report`` gives the bytes kept (activations, each storage once) and the bytes
   kept compressed; ``OffloadStats`` gives the bytes an offloading policy moves to host memory,
   exact (``offload_ops``) and compressed (``compress_ops(..., offload=True)``).
2. Accuracy: does a decision's 300-step training end within 1 % of the exact run's loss? The
   design below was fixed before any compressed run of it was looked at (from the control
   alone), and it is the same for every decision; nothing is tuned per decision.

   - Model and tasks: a GPT of 2 layers, width 64, 4 heads, every block checkpointed; ``copy``
     or ``reverse`` 16 digits after a separator, a fifth of the target digits replaced by
     random ones, so the loss has a floor (the targets' entropy, 0.867 nats).
   - Training: 300 Adam steps, batch 32, gradients clipped to norm 1, the learning rate warmed
     up linearly over 30 steps to 6e-3 and decayed to zero by a cosine at step 300. The decay
     to zero ends every run settled instead of mid-spike. (Chosen on exact and control runs
     alone, seed 0-1: a peak of 1e-3 or 3e-3 leaves copy mid-way down at step 300, held-out
     loss 2.06 and 1.08; 6e-3 reaches 0.93 on copy, 0.95-0.98 on reverse, and the control
     matches the exact run to 4 digits. An earlier design, a constant 3e-3, amplified the
     control's 1e-6 into final losses 3-5 % apart through loss spikes: it could not tell 1 %
     from noise.)
   - Final loss (the measure): the loss of the final weights on 64 held-out batches (2,048
     sequences, 32,768 target digits), the same for every run. The mean training loss of the
     last 20 steps is reported beside it.
   - Seeds 0 .. ``--seeds`` - 1 (10 by default; ``--first-seed`` moves the start; a study cut
     short reports the seeds every decision in its table finished, run seed by seed, never
     fewer than 8): per seed, the initial weights and the batches are the same for every
     decision. A decision's gap per seed: its final loss minus the exact run's (same seed), in
     percent of the exact runs' mean; over the seeds, the mean gap, its standard error, and
     the 95 % confidence interval (Student's t on seeds - 1 degrees of freedom) of the paired
     differences.
   - Verdict per decision and task: *within 1 %* when the interval lies inside (-1 %, +1 %),
     *outside* when it lies wholly beyond one of them, *undecided* otherwise.
   - Control: the exact run with its initial weights multiplied by 1 + 1e-6 (a few float32
     roundings), measured like a decision: what numerics that differ at all do to the measure.
     The design can decide the question only where the control's interval sits well inside
     +-1 %; the control is reported whatever it shows.
   - Decisions: bf16, fp16, fp8 with a per-tensor and a per-row scale, int8 per row, every
     matmul output compressed; and fp8 per tensor on the linear layers' outputs only (``mm``,
     ``addmm``) with the attention products (``bmm``) kept exactly.

   ``--plot`` draws each decision's mean training-loss curve to ``docs/compression_loss.png``.
3. Gradient error of one step: what compression does to one gradient, free of a trajectory's
   noise, per format, compressing every matmul output or the linear layers' only.

Run: ``PYTHONPATH=. python benchmarks/compression.py --plot`` (10 seeds x 2 tasks x 8 decisions
= 160 training runs, 35-65 s each on one busy CPU core; ``--save runs.json`` keeps every
finished run, ``--load`` resumes from them and merges several files, ``--tasks`` or
``--first-seed`` splits the work between processes, ``--only`` trains and tables some decisions
alone; nothing is timed, so no lock is needed).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

import checkpointing
from checkpointing.policies import (
    MATMUL_OPS,
    as_context_fn,
    compress_ops,
    either,
    offload_ops,
    save_matmuls,
    save_ops,
)

EXACT, NUDGED = "exact (save_matmuls)", "exact, weights nudged"
LINEARS = "fp8, linears only"
# A decision: the format compress_ops is given (None: exact); LINEARS compresses the linear
# layers' outputs only, keeping the attention products exact.
DECISIONS: dict[str, Any] = {
    EXACT: None,
    NUDGED: None,  # the control: the exact run, its initial weights times (1 + 1e-6)
    "bf16": {"to": "bf16"},
    "fp16": {"to": "fp16"},
    "fp8, per tensor": {"to": "fp8"},
    "fp8, per row": {"to": "fp8", "scale": "row"},
    "int8, per row": {"to": "int8"},
    LINEARS: {"to": "fp8"},
}


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(attention.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, blocks, each block checkpointed under ``context_fn``."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)
        self.context_fn: Any = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            if self.context_fn is None:
                x = checkpointing.checkpoint(block, x, use_reentrant=False)
            else:
                x = checkpointing.checkpoint(
                    block, x, use_reentrant=False, context_fn=self.context_fn
                )
        return self.head(self.norm(x))


def policy_for(kwargs: dict[str, Any] | None, *, linears_only: bool = False, **extra: Any) -> Any:
    """Every matmul output kept exactly (``kwargs`` None) or compressed as ``kwargs`` say; with
    ``linears_only`` the linear layers' outputs compressed and the attention products exact."""
    if kwargs is None:
        return save_matmuls()
    if linears_only:
        aten = torch.ops.aten
        return either(save_ops(aten.bmm), compress_ops(aten.mm, aten.addmm, **kwargs, **extra))
    return compress_ops(*MATMUL_OPS, **kwargs, **extra)


# --- 1. Bytes -----------------------------------------------------------------------------------


@dataclass
class Bytes:
    activations: int
    compressed: int
    to_host: int


def measure_bytes(name: str) -> Bytes:
    torch.manual_seed(0)
    model = GPT(vocab=32, width=128, layers=2, heads=4, length=64)
    tokens = torch.randint(0, 32, (16, 64))
    kwargs, linears_only = DECISIONS[name], name == LINEARS
    model.context_fn = as_context_fn(policy_for(kwargs, linears_only=linears_only))
    with checkpointing.saved_tensors_report() as report:
        model(tokens).square().mean().backward()
    stats = checkpointing.OffloadStats()
    if kwargs is None:
        offloading = offload_ops(*MATMUL_OPS)
    else:
        offloading = policy_for(kwargs, linears_only=linears_only, offload=True)
    model.context_fn = as_context_fn(offloading, offload_stats=stats)
    model(tokens).square().mean().backward()
    return Bytes(
        report.activation_bytes, report.bytes_by_decision()["compressed"], stats.offloaded_bytes
    )


# --- 2. Accuracy --------------------------------------------------------------------------------

STEPS, BATCH, DIGITS, VOCAB = 300, 32, 16, 12  # tokens 0-9, 10 = separator
NOISE = 0.2
LEARNING_RATE, WARMUP = 6e-3, 30  # the peak, reached after WARMUP steps; cosine to 0 at STEPS
HELD_OUT_BATCHES = 64
TASKS = ("copy", "reverse")


def digits_task(task: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``digits SEP digits`` (copy) or ``digits SEP reversed(digits)`` (reverse); the loss is
    on the second half, where a fifth of the target digits are replaced by random ones
    (``NOISE``): the loss has a floor (the targets' entropy), so a run that has learned the task
    sits on it instead of sliding towards zero, where any two runs differ by large ratios of
    tiny numbers."""
    digits = torch.randint(0, 10, (BATCH, DIGITS), generator=generator)
    separator = torch.full((BATCH, 1), 10)
    answer = digits.flip(1) if task == "reverse" else digits
    sequence = torch.cat([digits, separator, answer], dim=1)
    targets = sequence[:, 1:].clone()
    noisy = torch.rand(targets[:, DIGITS:].shape, generator=generator) < NOISE
    random = torch.randint(0, 10, noisy.shape, generator=generator)
    targets[:, DIGITS:] = torch.where(noisy, random, targets[:, DIGITS:])
    return sequence[:, :-1], targets


def learning_rate_factor(step: int) -> float:
    """The schedule: linear warmup to the peak over ``WARMUP`` steps, then a cosine to zero."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def train(task: str, name: str, seed: int) -> tuple[list[float], float]:
    """300 steps of decision ``name`` from the initial weights of ``seed`` on the batches of
    ``seed`` (the same for every decision; the control ``NUDGED``: each initial weight times
    1 + 1e-6, a few float32 roundings); the training losses, and the held-out loss after them."""
    torch.manual_seed(seed)
    model = GPT(vocab=VOCAB, width=64, layers=2, heads=4, length=2 * DIGITS + 1)
    if name == NUDGED:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1 + 1e-6)
    model.context_fn = as_context_fn(policy_for(DECISIONS[name], linears_only=name == LINEARS))
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor)
    generator = torch.Generator().manual_seed(1 + seed)
    losses = []
    for _ in range(STEPS):
        inputs, targets = digits_task(task, generator)
        logits = model(inputs)[:, DIGITS:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[:, DIGITS:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses, held_out_loss(task, model)


def held_out_loss(task: str, model: GPT) -> float:
    """The loss on ``HELD_OUT_BATCHES`` batches the training never saw (the same for every
    decision and seed), without gradients (checkpointing then runs the blocks plainly)."""
    generator = torch.Generator().manual_seed(12345)
    total = 0.0
    with torch.no_grad():
        for _ in range(HELD_OUT_BATCHES):
            inputs, targets = digits_task(task, generator)
            logits = model(inputs)[:, DIGITS:]
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[:, DIGITS:].reshape(-1))
            total += loss.item() / HELD_OUT_BATCHES
    return total


def last_steps(losses: list[float]) -> float:
    """The mean training loss of the last 20 steps."""
    return sum(losses[-20:]) / 20


def mean_sd(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


# A run: (training losses, held-out loss); runs[task][decision][seed] is one run.
Run: TypeAlias = tuple[list[float], float]
Runs: TypeAlias = dict[str, dict[str, dict[int, Run]]]


def common_seeds(decisions: dict[str, dict[int, Run]]) -> list[int]:
    """The seeds every one of ``decisions`` finished, in order: the seeds a table or a curve
    pairs them on."""
    return sorted(set.intersection(*(set(runs) for runs in decisions.values())))


def load(paths: list[str]) -> Runs:
    """The runs of ``--save`` files, merged: a seed saved in two files is the later file's. A
    file written before runs were keyed by seed lists them from seed 0."""
    runs: Runs = {}
    for path in paths:
        with open(path) as file:
            for task, decisions in json.load(file).items():
                for name, saved in decisions.items():
                    by_seed = saved if isinstance(saved, dict) else dict(enumerate(saved))
                    mine = runs.setdefault(task, {}).setdefault(name, {})
                    mine.update({int(seed): tuple(run) for seed, run in by_seed.items()})
    return runs


# Student's t, the 97.5 % quantile, by degrees of freedom: a 95 % interval is mean +- t * se.
T_975: dict[int, float] = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
    17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064,
    25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 31: 2.040, 32: 2.037,
    33: 2.035, 34: 2.032, 35: 2.030, 36: 2.028, 37: 2.026, 38: 2.024, 39: 2.023, 40: 2.021,
}  # fmt: skip
TARGET = 0.01


def t_975(freedom: int) -> float:
    """Student's t quantile for a 95 % interval on ``freedom`` degrees of freedom; past the table
    a refusal, never the normal's 1.96 (it narrows the interval: by 4 % at 30 seeds)."""
    if freedom not in T_975:
        raise ValueError(
            f"compression.py: no t quantile for {freedom} degrees of freedom ({freedom + 1} "
            f"seeds); the table T_975 covers 1-{max(T_975)}: add the quantile to it"
        )
    return T_975[freedom]


@dataclass
class Gap:
    """A decision's final loss against the exact run's over the seeds, as fractions of the exact
    runs' mean loss: the mean paired gap, its standard error, its 95 % interval, the largest
    per-seed gap by magnitude."""

    loss: float
    mean: float
    se: float
    low: float
    high: float
    largest: float

    @property
    def verdict(self) -> str:
        if self.low > -TARGET and self.high < TARGET:
            return "within 1 %"
        if self.low > TARGET or self.high < -TARGET:
            return "outside"
        return "undecided"


def gap(mine: list[float], exact: list[float]) -> Gap:
    """The paired per-seed differences ``mine - exact`` in fractions of the exact runs' mean."""
    scale = mean_sd(exact)[0]
    gaps = [(a - b) / scale for a, b in zip(mine, exact, strict=True)]
    mean, sd = mean_sd(gaps)
    se = sd / math.sqrt(len(gaps))
    t = t_975(len(gaps) - 1) if len(gaps) > 1 else math.inf
    return Gap(mean_sd(mine)[0], mean, se, mean - t * se, mean + t * se, max(gaps, key=abs))


def held_out(run: Run) -> float:
    return run[1]


def last_twenty(run: Run) -> float:
    return last_steps(run[0])


def summarise(task: str, decisions: dict[str, dict[int, Run]], *, per_seed: bool) -> None:
    """A markdown table: per decision, over the seeds every decision finished, the mean final
    loss (held-out), the mean paired gap to the exact run with its standard error and 95 %
    interval, the largest per-seed gap, the verdict, and the same gap on the last 20 training
    steps; the exact row gives the seed-to-seed spread (standard deviation). With ``per_seed``
    a second table: each seed's held-out loss, the exact run's and every other decision's gap."""
    seeds = common_seeds(decisions)
    runs = {name: [decision[seed] for seed in seeds] for name, decision in decisions.items()}
    exact = runs[EXACT]
    span = f"seeds {seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ""
    print(f"\n{task} task, {STEPS} steps, {len(seeds)} seeds ({span or seeds}):\n")
    print(
        "| decision | held-out loss | gap (se) | 95 % interval | largest | verdict "
        "| last 20 steps | gap (se) |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for name, decision in runs.items():
        if decision is exact:
            mean, sd = mean_sd([held_out(run) for run in exact])
            last, last_sd = mean_sd([last_twenty(run) for run in exact])
            print(
                f"| {name} | {mean:.4f} | seed sd {sd / mean:.2%} | | | "
                f"| {last:.4f} | seed sd {last_sd / last:.2%} |"
            )
            continue
        h = gap([held_out(run) for run in decision], [held_out(run) for run in exact])
        t = gap([last_twenty(run) for run in decision], [last_twenty(run) for run in exact])
        print(
            f"| {name} | {h.loss:.4f} | {h.mean:+.2%} ({h.se:.2%}) | "
            f"[{h.low:+.2%}, {h.high:+.2%}] | {h.largest:+.2%} | {h.verdict} "
            f"| {t.loss:.4f} | {t.mean:+.2%} ({t.se:.2%}) |"
        )
    if per_seed:
        print_per_seed(seeds, runs)


def print_per_seed(seeds: list[int], runs: dict[str, list[Run]]) -> None:
    """Per seed: the exact run's held-out loss, each other decision's gap to it (in % of the
    exact runs' mean, as the summary's gaps)."""
    exact = [held_out(run) for run in runs[EXACT]]
    scale = mean_sd(exact)[0]
    others = [name for name in runs if name != EXACT]
    print("\n| seed | exact held-out loss | " + " | ".join(f"{n}: gap" for n in others) + " |")
    print("|---:|---:|" + "---:|" * len(others))
    for row, seed in enumerate(seeds):
        gaps = [(held_out(runs[name][row]) - exact[row]) / scale for name in others]
        print(f"| {seed} | {exact[row]:.4f} | " + " | ".join(f"{g:+.2%}" for g in gaps) + " |")


# --- 3. Gradient error of one step --------------------------------------------------------------


def gradient_errors(task: str = "reverse", trained_steps: int = 150) -> None:
    """The error compression puts into one step's gradient, without a trajectory's noise: the
    exact run trained ``trained_steps`` steps, then one batch's gradient (all parameters, one
    vector) under each decision against the exact one, as ``|g - g_exact| / |g_exact|``; every
    matmul output compressed, or the linear layers' outputs only (``mm``, ``addmm``) with the
    attention products (``bmm``: scores and their product with the values) kept exactly."""
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, width=64, layers=2, heads=4, length=2 * DIGITS + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    model.context_fn = as_context_fn(save_matmuls())

    def step_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(inputs)[:, DIGITS:]
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets[:, DIGITS:].reshape(-1))

    for _ in range(trained_steps):
        loss = step_loss(*digits_task(task, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    batch = digits_task(task, torch.Generator().manual_seed(7))

    def gradient(policy: Any) -> torch.Tensor:
        model.context_fn = as_context_fn(policy)
        parameters = list(model.parameters())
        grads = torch.autograd.grad(step_loss(*batch), parameters)
        return torch.cat([g.flatten() for g in grads])

    exact = gradient(save_matmuls())
    print(f"\n3. Gradient error of one step ({task} task, after {trained_steps} exact steps)")
    print(f"{'decision':<22} {'all matmul outputs':>19} {'linears only':>13}")
    for name, kwargs in DECISIONS.items():
        if kwargs is None or name == LINEARS:  # LINEARS is fp8's second column
            continue
        linears = policy_for(kwargs, linears_only=True)
        errors = [
            ((gradient(policy) - exact).norm() / exact.norm()).item()
            for policy in (policy_for(kwargs), linears)
        ]
        print(f"{name:<22} {errors[0]:>19.2%} {errors[1]:>13.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", action="store_true", help="draw docs/compression_loss.png")
    parser.add_argument("--only", nargs="*", help="train only these decisions (and the exact)")
    parser.add_argument("--tasks", nargs="*", choices=TASKS, default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=10, help="how many seeds per decision")
    parser.add_argument("--first-seed", type=int, default=0, help="the first of them (0)")
    parser.add_argument("--per-seed", action="store_true", help="print each seed's gaps too")
    parser.add_argument("--no-bytes", action="store_true", help="skip the bytes table")
    parser.add_argument("--no-gradients", action="store_true", help="skip the gradient errors")
    parser.add_argument("--save", help="write every run's losses to this JSON file")
    parser.add_argument("--load", nargs="*", default=[], help="start from these runs (--save's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    if not args.no_bytes:
        print("\n1. Bytes kept, one step (2 layers, width 128, sequence 64, batch 16)")
        print(f"{'decision':<22} {'activations':>12} {'compressed':>11} {'to host':>10}")
        for name in DECISIONS:
            if name == NUDGED:  # the same bytes as the exact run's
                continue
            b = measure_bytes(name)
            print(f"{name:<22} {b.activations:>12,} {b.compressed:>11,} {b.to_host:>10,}")
    if not args.no_gradients:
        gradient_errors()
    runs = {task: {} for task in args.tasks} | load(args.load)
    chosen = [n for n in DECISIONS if args.only is None or n == EXACT or n in args.only]
    for seed in range(args.first_seed, args.first_seed + args.seeds):  # whole seeds if cut short
        for task in args.tasks:
            for name in chosen:
                done = runs.setdefault(task, {}).setdefault(name, {})
                if seed in done:
                    continue
                done[seed] = train(task, name, seed)
                print(f"  seed {seed} {task} {name}: {last_steps(done[seed][0]):.4f}", flush=True)
                if args.save:
                    with open(args.save, "w") as file:
                        json.dump(runs, file)
    print("\n2. Accuracy (gaps: per-seed paired differences, in % of the exact runs' mean)")
    for task, decisions in runs.items():  # with --only, the table of those decisions alone
        shown = {name: decisions[name] for name in chosen if name in decisions}
        summarise(task, shown, per_seed=args.per_seed)
    if args.plot:
        draw(runs)


def draw(runs: Runs) -> None:
    """One column per task: above, each decision's training loss averaged over the seeds every
    decision finished; below, each decision's held-out gap to the exact run with its 95 %
    interval, against the +-1 % target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(
        2, len(runs), figsize=(6.5 * len(runs), 8), squeeze=False, height_ratios=(3, 2)
    )
    for column, (task, decisions) in enumerate(runs.items()):
        curves, gaps = panels[0][column], panels[1][column]
        seeds = common_seeds(decisions)
        exact = [held_out(decisions[EXACT][seed]) for seed in seeds]
        names = [name for name in DECISIONS if name in decisions]
        for row, name in enumerate(names):
            decision = [decisions[name][seed] for seed in seeds]
            steps = zip(*(run[0] for run in decision), strict=True)
            mean = [sum(step) / len(step) for step in steps]
            color, line = {EXACT: ("black", "--"), NUDGED: ("grey", ":")}.get(name, (None, "-"))
            drawn = curves.plot(range(1, len(mean) + 1), mean, label=name, color=color, ls=line)
            if name == EXACT:
                continue
            g = gap([held_out(run) for run in decision], exact)
            gaps.errorbar(
                100 * g.mean,
                row,
                xerr=[[100 * (g.mean - g.low)], [100 * (g.high - g.mean)]],
                fmt="o",
                color=drawn[0].get_color(),
                capsize=3,
            )
        curves.set_yscale("log")
        curves.set_xlabel("step")
        curves.set_ylabel(f"training loss, mean of {len(seeds)} seeds (log)")
        curves.set_title(f"{task} task: matmul outputs exact or compressed")
        curves.legend(fontsize="small")
        gaps.axvspan(-100 * TARGET, 100 * TARGET, color="green", alpha=0.1)
        gaps.axvline(0, color="black", lw=0.8)
        gaps.set_yticks(range(1, len(names)), names[1:], fontsize="small")
        gaps.set_ylim(len(names) - 0.5, 0.5)
        gaps.set_xlabel(
            f"held-out loss gap to exact, % (mean and 95 % interval, {len(seeds)} seeds)"
        )
    figure.tight_layout()
    figure.savefig("docs/compression_loss.png", dpi=110)
    print("drew docs/compression_loss.png")


if __name__ == "__main__":
    main()
