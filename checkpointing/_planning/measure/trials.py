"""Timing candidate plans on the model itself (NOTE [Planner measure], Rule M12).

Owns running a few real steps with each candidate plan installed, interleaved so that a slow
spell on a shared machine hits them alike, and naming the fastest. Which plans are candidates is
``plan``'s business; installing one is ``ActivationPlan.apply``'s.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import torch
from torch import nn

from ..._trees import tensors
from ..._untouched import untouched
from .profile import plain_step, step_setting

_SURE: Final = 0.01  # the sign test's level for stopping early


class Installable(Protocol):
    def apply(self, model: nn.Module) -> nn.Module: ...

    def remove(self, model: nn.Module) -> nn.Module: ...


def time_plans(
    model: nn.Module,
    plans: Sequence[Installable],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    steps: int,
) -> list[float]:
    """Per plan, its step time relative to the others: over at most ``steps`` rounds, the median of
    its forward+backward step's seconds divided by the round's mean over the plans that ran in
    it. Every round runs every plan still in the race once, the order turned by one each round,
    after a warm-up round not counted. The garbage collector is off during the race (none runs
    in a step); its youngest generation is collected between rounds (a full collection of a
    large process costs more than a small model's round). Dividing by the round's mean takes out
    what a slow spell of a shared machine does to all alike. A plan leaves the race once the
    fastest so far was faster than it in so many rounds that a coin would have done it with a
    chance below ``_SURE`` (a sign test; seven rounds at the least); the rounds end when one is
    left. Gradients go nowhere (``autograd.grad``); the model, ``.grad`` and the RNG states are
    left as they were (Rule M7), and no plan is left applied."""
    inputs = list(tensors((args, kwargs)))
    wrt, _device, synchronize = step_setting(model, inputs)
    relative: list[list[float]] = [[] for _ in plans]
    rounds: list[dict[int, float]] = []
    racing = list(range(len(plans)))
    collecting = gc.isenabled()
    gc.disable()
    try:
        with untouched([model], inputs), torch.enable_grad(), torch.inference_mode(False):
            for round_ in range(1 + steps):
                gc.collect(0)
                seconds: dict[int, float] = {}
                turn = round_ % len(racing)
                for index in racing[turn:] + racing[:turn]:
                    plans[index].apply(model)
                    try:
                        seconds[index] = _step(model, args, kwargs, loss_fn, wrt, synchronize)
                    finally:
                        plans[index].remove(model)
                middle = statistics.fmean(seconds.values())
                if round_ and middle > 0:
                    rounds.append(seconds)
                    for index, taken in seconds.items():
                        relative[index].append(taken / middle)
                    racing = _still_racing(relative, rounds, racing)
                    if len(racing) == 1:
                        break
    finally:
        if collecting:
            gc.enable()
    return [statistics.median(r) if r else 1.0 for r in relative]


def _still_racing(
    relative: list[list[float]], rounds: list[dict[int, float]], racing: list[int]
) -> list[int]:
    """The plans of ``racing`` that the one of least median so far has not yet beaten in so
    many of the rounds both ran that a fair coin would win that many with a chance of at most
    ``_SURE`` (the sign test)."""
    best = min(racing, key=lambda index: statistics.median(relative[index]))
    kept = []
    for other in racing:
        both = [r for r in rounds if other in r and best in r]
        wins = sum(r[best] < r[other] for r in both)
        count = len(both)
        tail = sum(math.comb(count, k) for k in range(wins, count + 1)) / 2**count
        if other == best or tail > _SURE:
            kept.append(other)
    return kept


def _step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    wrt: list[torch.Tensor],
    synchronize: Callable[[], None] | None,
) -> float:
    """The seconds of one ``plain_step`` (the device synchronized around it)."""
    if synchronize is not None:
        synchronize()
    start = time.perf_counter()
    plain_step(model, args, kwargs, loss_fn, wrt)
    if synchronize is not None:
        synchronize()
    return time.perf_counter() - start
