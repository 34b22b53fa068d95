"""The planner at real size: a GPT-2-small-shaped model, planned against its own training step.

Usage (from the repository root; it times, so hold the benchmark lock on a shared machine)::

    flock /work/bench.lock python benchmarks/planner_scale.py
    python benchmarks/planner_scale.py --layers 2 --tokens 64   # a quick smaller run
    flock /work/bench.lock python benchmarks/planner_scale.py --sweep 12  # one profile, 12 budgets

Model: Hugging Face ``GPT2LMHeadModel`` from a ``GPT2Config`` (12 layers, 768 wide, 12 heads,
1024 positions, 50257 tokens, random weights, ``use_cache=False``), training mode (dropout on),
float32, batch 2 x 512 tokens, the loss from ``labels``. One thread (``torch.set_num_threads``),
so that a shared machine's load counts less.

Method. ``--warm`` untimed plain steps (forward, backward, ``zero_grad``), then ``--steps``
timed ones: the step time is their median. Then ``plan_checkpointing`` at each budget of
``--budgets``, one call each, timed the same way, with the ``checkpointing.planner`` logger at
``INFO`` printing its progress. Times are both CPU seconds (``time.process_time``) and wall
seconds; ratios are planning over a plain step, measured in the same process under the same
load. The first call also pays torch's lazy imports (the dispatch modes load ``torch._dynamo``).

``--sweep N`` instead plans N budgets from the floor to 1.0 (evenly in bytes) from one profile:
first the profile alone (``search.profiled``, what ``plan_sweep`` runs once) and the N solves on
it, each part timed and its resident peak measured as above; then one ``plan_sweep`` call at the
same N budgets, timed whole, whose plans must equal the first ones to the byte of their JSON.
Every plan is checked against the sweep's promise (NOTE [Budget sweep], Rule 2), and the table
prints each plan's kept bytes, cost and decisions.

Memory: the process's resident high-water mark (``VmHWM``), reset before each measured part
through ``/proc/self/clear_refs`` (Linux): the peak during that part, and that peak less the
resident bytes just before it (what the part added above the model, the process and the memory
the allocator kept from earlier steps). Printed for each plain step's maximum and for each
planning call.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))

import checkpointing


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> bool:
    """Reset the resident high-water mark; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def measured(action: Callable[[], Any]) -> tuple[Any, float, float, int, int]:
    """``action()``'s result, CPU seconds, wall seconds, the resident bytes it added at its peak
    and the process's resident peak during it (-1, -1 where the peak cannot be reset)."""
    resettable = _reset_peak()
    before = _status_bytes("VmRSS")
    cpu, wall = time.process_time(), time.perf_counter()
    result = action()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = _status_bytes("VmHWM") if resettable else -1
    return result, cpu, wall, peak - before if resettable else -1, peak


def gpt2_small(layers: int, tokens: int, batch: int) -> tuple[torch.nn.Module, Any]:
    """The model and its token ids (both seeded)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=768,
        n_head=12,
        n_positions=1024,
        vocab_size=50257,
        use_cache=False,
    )
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(50257, (batch, tokens), generator=torch.Generator().manual_seed(1))
    return model, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warm", type=int, default=2, help="untimed plain steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed plain steps (median)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--sweep", type=int, default=0, metavar="N", help="N budgets from one profile instead"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("checkpointing.planner").setLevel(logging.INFO)

    model, ids = gpt2_small(args.layers, args.tokens, args.batch)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT-2 {args.layers} x 768, {params / 1e6:.1f} M parameters, batch {args.batch} x "
        f"{args.tokens}, torch {torch.__version__}, {args.threads} thread(s)"
    )

    def loss_fn(output: Any) -> torch.Tensor:
        return output.loss  # type: ignore[no-any-return]

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(args.warm):
        step()
    steps = [measured(step) for _ in range(args.steps)]
    step_cpu = statistics.median(s[1] for s in steps)
    step_wall = statistics.median(s[2] for s in steps)
    step_added = max(s[3] for s in steps)
    step_peak = max(s[4] for s in steps)
    print(
        f"plain step: {step_cpu:.2f} s CPU, {step_wall:.2f} s wall (median of {args.steps}); "
        f"resident peak {step_peak / 2**20:.0f} MiB, {step_added / 2**20:.0f} MiB above the "
        "resident bytes before it"
    )
    if args.sweep:
        sweep(model, ids, loss_fn, args.sweep, step_cpu, step_wall)
        return
    for budget in args.budgets:

        def plan_at(b: float = budget) -> Any:
            try:
                return checkpointing.plan_checkpointing(
                    model, ids, example_kwargs={"labels": ids}, loss_fn=loss_fn, budget=b
                )
            except ValueError as error:  # below the floor: the message says where it is
                return error

        plan, cpu, wall, added, peak = measured(plan_at)
        print(
            f"budget {budget}: planning {cpu:.2f} s CPU ({cpu / step_cpu:.2f} steps), "
            f"{wall:.2f} s wall ({wall / step_wall:.2f} steps); resident peak "
            f"{peak / 2**20:.0f} MiB, {added / 2**20:.0f} MiB above the resident bytes before it"
        )
        print(plan)


def sweep(
    model: torch.nn.Module, ids: torch.Tensor, loss_fn: Any, points: int, cpu: float, wall: float
) -> None:
    """``--sweep``: the profile and ``points`` solves timed apart, then one ``plan_sweep`` call;
    the promise checked, the plans printed as a table."""
    from checkpointing._planning.search import profiled

    kwargs = {"labels": ids}

    def profile() -> Any:
        return profiled("plan_sweep", model, ids, [1.0], None, kwargs, loss_fn, None, "time", 0)

    step, p_cpu, p_wall, p_added, p_peak = measured(profile)
    baseline, floor = step.ends
    budgets = [baseline - (baseline - floor) * i // (points - 1) for i in range(points)]
    plans, s_cpu, s_wall, s_added, s_peak = measured(lambda: step.plans(budgets))
    again, a_cpu, a_wall, a_added, a_peak = measured(
        lambda: checkpointing.plan_sweep(
            model, ids, budgets=budgets, example_kwargs=kwargs, loss_fn=loss_fn
        )
    )
    rows = [
        ("profile (once)", p_cpu, p_wall, p_peak, p_added),
        (f"{points} solves on it", s_cpu, s_wall, s_peak, s_added),
        (f"plan_sweep, {points} budgets, one call", a_cpu, a_wall, a_peak, a_added),
    ]
    print(
        "| | CPU s | wall s | / plain step (CPU) | (wall) | resident peak | above before |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name, c, w, peak, added in rows:
        print(
            f"| {name} | {c:.2f} | {w:.2f} | {c / cpu:.2f} | {w / wall:.2f} | "
            f"{peak / 2**20:.0f} MiB | {added / 2**20:.0f} MiB |"
        )
    same = [a.to_json() == b.to_json() for a, b in zip(plans, again, strict=True)]
    print(f"\nplan_sweep's plans equal the profiled step's, to the JSON byte: {all(same)}")
    broken = []
    for wider, narrower in itertools.pairwise(plans):
        if narrower.kept_bytes > wider.kept_bytes or narrower.cost < wider.cost:
            broken.append(narrower.budget_bytes)
    broken += [p.budget_bytes for p in plans if p.kept_bytes > p.budget_bytes]
    print(f"the promise holds at every point: {not broken} {broken or ''}\n")
    print(
        "| budget (bytes) | of the baseline | kept (predicted) | cost | recompute ms | "
        "recompute GFLOP | regions kept whole | checkpointed whole | selective | spans |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    for plan in plans:
        whole = sum(r.checkpoint and not r.save for r in plan.regions)
        selective = sum(r.checkpoint and bool(r.save) for r in plan.regions)
        kept = len(plan.regions) - whole - selective
        spans = ", ".join(s.kind for s in plan.spans) or "none"
        print(
            f"| {plan.budget_bytes:,} | {plan.budget_bytes / baseline:.3f} | "
            f"{plan.kept_bytes:,} | {plan.cost:.4f} | {plan.recompute_ms:.1f} | "
            f"{plan.recompute_flops / 1e9:.3f} | {kept} | {whole} | {selective} | {spans} |"
        )


if __name__ == "__main__":
    main()
