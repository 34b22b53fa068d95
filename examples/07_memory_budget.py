"""Fit a memory budget: plan a small transformer for three budgets, apply, measure, check.

For each budget, ``plan_checkpointing`` profiles a step and chooses which blocks to checkpoint
and which op outputs inside them to keep; the example prints each plan, measures the activation
bytes really kept (``saved_tensors_report``) and checks that the gradients equal the run without
checkpointing (bit for bit, dropout included). Asked for a plot (``--plot PATH``, needs
matplotlib), it draws the plan's predicted frontier (kept bytes against recompute time, as a share
of recomputing every region, so that a busy machine shifts it little), the three budgets and the
three measured points; the README's docs/planner_example.png is made that way. Without ``--plot`` it
writes no file.

Run: python examples/07_memory_budget.py [--plot docs/planner_example.png]
"""

import argparse

import torch
from torch import nn

import checkpointing

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--plot", metavar="PATH", help="draw the frontier and the plans to PATH")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(
    *(nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True) for _ in range(4))
).train()
x = torch.randn(4, 32, 64, requires_grad=True)


def step() -> tuple[checkpointing.SavedTensorsReport, list[torch.Tensor]]:
    """One forward+backward with fixed dropout draws; the report and the gradients."""
    torch.manual_seed(1)
    with checkpointing.saved_tensors_report() as report:
        loss = model(x).sum()
        grads = torch.autograd.grad(loss, [x, *model.parameters()])
    return report, list(grads)


plain, expected = step()
print(f"without checkpointing: {plain.activation_bytes / 1024:.1f} KiB of activations kept\n")
points = []
for budget in (0.25, 0.5, 0.75):
    plan = checkpointing.plan_checkpointing(model, x, budget=budget)
    print(plan, "\n")
    plan.apply(model)
    report, grads = step()
    plan.remove(model)
    print(
        f"budget {budget}: measured {report.activation_bytes / 1024:.1f} KiB kept "
        f"(budget {plan.budget_bytes / 1024:.1f} KiB), {report.recompute_ops} ops recomputed\n"
    )
    assert report.activation_bytes <= plan.budget_bytes * 1.02
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    # Recompute as a share of checkpointing every region (the frontier's costliest point), both
    # from this plan's own profile: on a busy machine the milliseconds of two profiles differ.
    share = 100 * plan.recompute_ms / max(ms for _, ms in plan.frontier())
    points.append((budget, plan.budget_bytes, report.activation_bytes, share))

if args.plot:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    frontier = plan.frontier()  # the last plan's: the model and its profile, as the others'
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(
        [b / 1024 for b, _ in frontier],
        [100 * ms / max(ms for _, ms in frontier) for _, ms in frontier],
        ".-",
        color="tab:blue",
        label="predicted frontier (kept against recompute)",
    )
    for index, (budget, budget_bytes, measured, share) in enumerate(points):
        colour = plt.get_cmap("tab10")(index + 1)
        ax.axvline(budget_bytes / 1024, color=colour, linestyle="--", linewidth=1)
        ax.annotate(
            f"budget {budget:g}\n= {budget_bytes / 1024:.0f} KiB",
            (budget_bytes / 1024, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -4),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color=colour,
        )
        ax.plot(
            measured / 1024,
            share,
            "o",
            color=colour,
            markersize=8,
            label=f"plan at {budget:g} (its own profile)",
        )
    ax.axvline(plain.activation_bytes / 1024, color="black", linestyle=":", linewidth=1)
    ax.set_xlabel("activations kept for backward (KiB; measured for the plans)")
    ax.set_ylabel("predicted recompute time (% of recomputing all)")
    ax.set_title(
        "plan_checkpointing: 4 x TransformerEncoderLayer(64), batch 4 x 32\n"
        "three budgets (fractions of the memory kept without checkpointing, dotted line)",
        fontsize=10,
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    ax.grid(alpha=0.3)
    fig.savefig(args.plot, dpi=100, bbox_inches="tight")
    print(f"plot: {args.plot}")
