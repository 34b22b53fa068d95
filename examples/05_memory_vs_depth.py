"""Bytes kept for backward against depth: none, full, sqrt(n) segments and save_matmuls.

Prints a table; asked for a plot (`--plot PATH`, needs matplotlib: `pip install matplotlib`, or
the `plot` dependency group) it also draws it, as docs/memory_vs_depth.png in the README was
made. Without `--plot` it writes no file.

Run: python examples/05_memory_vs_depth.py [--plot docs/memory_vs_depth.png]
"""

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import checkpointing
from checkpointing import policies

WIDTH, BATCH, DEPTHS = 64, 32, (4, 9, 16, 25, 36)
Strategy = Callable[[nn.Sequential, torch.Tensor], torch.Tensor]


def full(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Each layer its own checkpointed region: only the region inputs are kept."""
    for layer in model:
        x = checkpointing.checkpoint(layer, x, use_reentrant=False)
    return x


def sqrt_segments(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """sqrt(n) segments: the segment inputs plus one segment's activations."""
    segments = round(math.sqrt(len(model)))
    return checkpointing.checkpoint_sequential(model, segments, x, use_reentrant=False)


def selective(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Each layer checkpointed, but its matmul output kept (save_matmuls)."""
    context_fn = policies.as_context_fn(policies.save_matmuls())
    for layer in model:
        x = checkpointing.checkpoint(layer, x, use_reentrant=False, context_fn=context_fn)
    return x


STRATEGIES: dict[str, Strategy] = {
    "no checkpoint": lambda model, x: model(x),
    "full checkpoint": full,
    "sqrt(n) segments": sqrt_segments,
    "save_matmuls": selective,
}


def layer() -> nn.Sequential:
    """A matmul followed by cheap ops: what save_matmuls keeps is only part of what is saved."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.LayerNorm(WIDTH))


def kept_activations(depth: int, strategy: Strategy) -> int:
    torch.manual_seed(depth)
    model = nn.Sequential(*[layer() for _ in range(depth)])
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    with checkpointing.saved_tensors_report() as report:
        out = strategy(model, x)
    out.sum().backward()
    return report.activation_bytes


def main(plot: str | None) -> None:
    table = {name: [kept_activations(d, s) for d in DEPTHS] for name, s in STRATEGIES.items()}
    one = BATCH * WIDTH * 4  # bytes of one activation
    print("activations kept for backward (in units of one layer's activation)")
    print(f"{'depth':<18}" + "".join(f"{d:>7}" for d in DEPTHS))
    for name, row in table.items():
        print(f"{name:<18}" + "".join(f"{b / one:>7.0f}" for b in row))
    none, ckpt, seg, sac = (table[name] for name in STRATEGIES)
    assert all(c < m < n for n, c, m in zip(none, ckpt, sac, strict=True)), "SAC is in between"
    assert seg[-1] < ckpt[-1] < none[-1], "deep: sqrt(n) segments keep the least"
    grow = DEPTHS[-1] / DEPTHS[0]  # 9x deeper
    assert none[-1] / none[0] > 0.8 * grow, "no checkpoint grows like n"
    assert seg[-1] / seg[0] < 0.5 * grow, "sqrt(n) segments grow like sqrt(n)"
    if plot is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in table.items():
        ax.plot(DEPTHS, [b / 1024 for b in row], marker="o", label=name)
    ax.set(
        xlabel="depth (Linear + GELU + LayerNorm layers)",
        ylabel="activations kept for backward (KiB)",
    )
    ax.set_title(f"checkpointing: memory vs depth (batch {BATCH}, width {WIDTH})")
    ax.legend()
    out = Path(plot)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="PATH", help="draw the table as a plot to PATH")
    main(parser.parse_args().plot)
