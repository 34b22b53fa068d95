"""What the draw guard of a planned region costs (NOTE [Planner apply], Rule A3).

A region planned without draws is checkpointed without an RNG state, under a ``DrawGuard``: its
hooks read the generators before and after each forward, and where one moved the call's
recompute runs under an alarm, a dispatch mode that checks every op for a draw. Measured here,
per region call, on a model of tiny regions planned at its floor (every region checkpointed):

* ``guard``: a step (forward and backward) with the plan as applied (draw-free regions, each
  under its guard), against the same plan with every region marked drawing (an RNG state
  captured and restored, no guard): the difference per region call;
* ``alarm``: a recompute under the alarm against one without, per op (what a call pays where
  another thread drew while it ran).

Timing: minima of rounds, one process; run under ``flock /work/bench.lock`` on a shared box.

    python benchmarks/draw_guard.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

import checkpointing
from checkpointing._planning.apply.draws import DrawCall, guarded_replay

WIDTH = 64
ROWS = 16
DEPTH = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)))


def _best(run: Callable[[], object], repeats: int, rounds: int) -> float:
    """The least mean seconds per call of ``run`` over ``rounds`` rounds of ``repeats``."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def guard_cost(repeats: int, rounds: int) -> dict[str, float]:
    """Seconds per step: the plan as applied (guards), the same regions checkpointed bare
    (``checkpoint_module``, no RNG state, no guard) and the plan with every region marked
    drawing (an RNG state each, no guard)."""
    model, x = _model(), torch.randn(ROWS, WIDTH)
    floor = checkpointing.plan_checkpointing(model, (x,), budget=1.0, timing_steps=0).floor_bytes
    plan = checkpointing.plan_checkpointing(model, (x,), budget=floor, timing_steps=0)
    assert all(r.checkpoint and not r.draws for r in plan.regions), str(plan)
    drawing = checkpointing.ActivationPlan.from_json(
        plan.to_json().replace('"draws": false', '"draws": true')
    )
    assert all(r.draws for r in drawing.regions)

    def step() -> None:
        model(x).sum().backward()

    def bare() -> float:
        for block in model:
            checkpointing.checkpoint_module(block, preserve_rng_state=False)
        try:
            return _best(step, repeats, rounds)
        finally:
            for block in model:
                checkpointing.remove_checkpoint_module(block)

    def applied(each: checkpointing.ActivationPlan) -> float:
        each.apply(model)
        try:
            return _best(step, repeats, rounds)
        finally:
            each.remove(model)

    return {"guard": applied(plan), "bare": bare(), "state": applied(drawing)}


def alarm_cost(repeats: int, rounds: int, ops: int = 64) -> tuple[float, float]:
    """Seconds per op of a chain of small ops run under the alarm, and without it."""
    x = torch.randn(ROWS, WIDTH)

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y + 1.0

    def alarmed() -> None:
        call = DrawCall()
        call.suspect = True
        with guarded_replay(call, None, "bench"):
            chain()

    return _best(alarmed, repeats, rounds) / ops, _best(chain, repeats, rounds) / ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = guard_cost(args.repeats, args.rounds)
    print(", ".join(f"{name} {seconds * 1e6:.0f} us" for name, seconds in steps.items()))
    for other in ("bare", "state"):
        per_call = (steps["guard"] - steps[other]) / DEPTH
        print(f"guard - {other}, per region call: {per_call * 1e6:+.1f} us")
    under, plain = alarm_cost(args.repeats, args.rounds)
    print(f"alarm per op: {under * 1e6:.2f} us against {plain * 1e6:.2f} us without")


if __name__ == "__main__":
    main()
