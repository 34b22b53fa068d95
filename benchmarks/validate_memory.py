"""Check the benchmark's memory instruments against counts known in advance.

The model is a chain of N ``torch.sin`` layers on a 1 MiB tensor (one "activation"): each layer
saves exactly its input for backward, so every quantity below is a whole number of activations.

- no checkpoint: N saved (x0 .. x(N-1));
- one checkpoint per region of k layers: one saved per region (N/k);
- ``checkpoint_sequential`` with s = round(sqrt(N)) segments (torch's segmenting: size
  k = N // s, the last segment of L = N - (s-1)k layers runs without checkpoint): (s-1) + L saved;
- held = saved - 1 in every case: x0 is saved but was allocated before the step, and the output
  xN is freed by ``sum`` (which saves nothing);
- peak: at least what is held (at least N - 1 for one region, which recomputes every layer at
  once); at most held + the layers recomputed at once (N for one region, k
  for regions or segments) + a few gradient buffers. So about N without checkpoint or with one
  region, about 2·sqrt(N) with sqrt(N) segments.

"saved" is the outer-hook count and "held"/"peak" the allocator's (see ``_memory.py``). Run:
``python benchmarks/validate_memory.py``; it prints a table and exits 1 if a count is off.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

# Run as a script: the helpers sit beside this file; the source tree is the fallback for an
# uninstalled ``checkpointing`` (an installed one, as under ``nox``, comes first).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

from _libs import Library, ours_library, torch_library
from _memory import allocator_bytes, saved_bytes
from _workloads import sqrt_segments

ACTIVATION = 1 << 20  # bytes of one float32 tensor of 262144 elements
SLACK = 64 << 10  # the loss scalar and 0-byte bookkeeping tensors fit easily
GRAD_BUFFERS = 4  # backward's temporaries (cos(x), grad * cos(x)) and x.grad


class Sin(nn.Module):
    """One layer of the chain: ``sin``, which saves its input."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x)


@dataclass(frozen=True)
class Case:
    """A way of running the chain and the activations it must keep and peak at."""

    name: str
    forward: Callable[[], Tensor]
    kept: int
    recomputed: int  # layers alive at once in backward, on top of what is held


def _regions(lib: Library, x: Tensor, n: int, k: int, reentrant: bool) -> Callable[[], Tensor]:
    """The chain with one ``checkpoint`` around every ``k`` consecutive layers."""

    def region(h: Tensor) -> Tensor:
        for _ in range(k):
            h = torch.sin(h)
        return h

    def forward() -> Tensor:
        h = x
        for _ in range(n // k):
            h = lib.checkpoint(region, h, use_reentrant=reentrant)
        return h.sum()

    return forward


def cases(lib: Library, n: int) -> list[Case]:
    """The chain of ``n`` layers run without checkpoint, by regions and by √n segments."""
    x = torch.randn(ACTIVATION // 4, requires_grad=True)
    chain = nn.Sequential(*(Sin() for _ in range(n)))
    s = sqrt_segments(n)
    k = n // s
    tail = n - (s - 1) * k
    seq_kept = (s - 1) + tail

    def sequential() -> Tensor:
        return lib.checkpoint_sequential(chain, s, x, use_reentrant=False).sum()

    regions = sqrt_segments(n)
    return [
        Case("none", lambda: chain(x).sum(), n, 0),
        Case("1 region", _regions(lib, x, n, n, False), 1, n),
        Case("1 region, reentrant", _regions(lib, x, n, n, True), 1, n),
        Case(f"{regions} regions", _regions(lib, x, n, n // regions, False), regions, n // regions),
        Case(f"sequential, {s} segments", sequential, seq_kept, k),
    ]


def check(lib: Library, n: int) -> list[str]:
    """Measure every case for ``lib``; print a row each; return the failures."""
    failures = []
    for case in cases(lib, n):
        saved, _ = saved_bytes(case.forward, [])
        held, peak = allocator_bytes(case.forward)
        held_want = case.kept - 1
        peak_high = max(held_want, case.kept - 1 + case.recomputed) + GRAD_BUFFERS
        ok_saved = abs(saved - case.kept * ACTIVATION) <= SLACK
        ok_held = abs(held - held_want * ACTIVATION) <= SLACK
        # One region recomputes every layer at once: its peak is about N like the baseline's.
        peak_low = n - 1 if case.recomputed == n else held_want
        ok_peak = peak_low * ACTIVATION - SLACK <= peak <= peak_high * ACTIVATION + SLACK
        print(
            f"| {lib.name} | {n} | {case.name} | {case.kept} | {saved / ACTIVATION:.2f} "
            f"| {held_want} | {held / ACTIVATION:.2f} | {peak_low}-{peak_high} "
            f"| {peak / ACTIVATION:.2f} | {'ok' if ok_saved and ok_held and ok_peak else 'FAIL'} |"
        )
        for label, ok in (("saved", ok_saved), ("held", ok_held), ("peak", ok_peak)):
            if not ok:
                failures.append(f"{lib.name}, N={n}, {case.name}: {label} off")
    return failures


def main() -> int:
    """Validate the instruments for torch and, when importable, for ours."""
    torch.set_num_threads(1)
    libs = [torch_library()]
    ours = ours_library()
    if ours is None:
        print("checkpointing.checkpoint is not importable yet: validating with torch only\n")
    else:
        libs.append(ours)
    print("Units: activations of 1 MiB.\n")
    print(
        "| lib | N | case | expected saved | saved | expected held | held | expected peak "
        "| peak | |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    failures = [failure for lib in libs for n in (16, 64) for failure in check(lib, n)]
    for failure in failures:
        print("FAIL:", failure)
    print("\nall counts as expected" if not failures else f"\n{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
