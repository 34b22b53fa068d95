"""Fit a memory budget: plan a small transformer for three budgets, apply, measure, check.

For each budget, ``plan_checkpointing`` profiles a step and chooses which blocks to checkpoint
and which op outputs inside them to keep; the example prints each plan, measures the activation
bytes really kept (``saved_tensors_report``) and checks that the gradients equal the run without
checkpointing (bit for bit, dropout included). Asked for a plot (``--plot PATH``, needs
matplotlib), it draws the plan's predicted frontier and the three measured points; the README's
docs/planner_example.png is made that way. Without ``--plot`` it writes no file.

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
print(f"without checkpointing: {plain.activation_bytes:,} activation bytes kept\n")
points = []
for budget in (0.25, 0.5, 0.75):
    plan = checkpointing.plan_checkpointing(model, x, budget=budget)
    print(plan, "\n")
    plan.apply(model)
    report, grads = step()
    plan.remove(model)
    print(
        f"budget {budget}: measured {report.activation_bytes:,} bytes kept "
        f"(budget {plan.budget_bytes:,}), {report.recompute_ops} ops recomputed\n"
    )
    assert report.activation_bytes <= plan.budget_bytes * 1.02
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    points.append((report.activation_bytes, plan.recompute_ms))

if args.plot:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    frontier = plan.frontier()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([b for b, _ in frontier], [ms for _, ms in frontier], ".-", label="predicted frontier")
    ax.plot(*zip(*points, strict=True), "o", label="plans (measured bytes)")
    ax.set_xlabel("activation bytes kept")
    ax.set_ylabel("predicted recompute ms per step")
    ax.legend()
    fig.savefig(args.plot, dpi=100, bbox_inches="tight")
    print(f"plot: {args.plot}")
