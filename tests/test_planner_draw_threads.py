"""What a planned region draws is its own random ops, never the process's generator state
(NOTE [Planner apply], Rule A3).

Another thread drawing random numbers (a data loader's augmentation, a sampler) moves the one
CPU generator while a draw-free region runs. Neither the profile nor the applied plan may take
that for the region's draws: the plan is the same with or without the thread, the draw guard
stays silent and the gradients are the plain run's, bit for bit; the guard keeps nothing per
thread once the thread has ended. A ``Partner`` thread draws on request, so that the generator
moves inside every region call, however the machine schedules the threads.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import checkpointing
from checkpointing._planning.apply.installed import DrawGuard

WIDTH = 32
ROWS = 8
DEPTH = 3


class Partner:
    """A thread that draws from the CPU generator each time a region asks it to."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.done = threading.Event()
        self.stop = False
        self.active = False
        self.draws = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.asked.wait()
            self.asked.clear()
            if self.stop:
                return
            torch.rand(16)
            self.draws += 1
            self.done.set()

    def draw_now(self) -> None:
        """Block until the partner has drawn once (nothing while inactive)."""
        if not self.active:
            return
        self.done.clear()
        self.asked.set()
        assert self.done.wait(timeout=60), "the partner thread did not draw"

    def close(self) -> None:
        self.stop = True
        self.asked.set()
        self.thread.join(timeout=60)


class Block(nn.Module):
    """A draw-free block that lets the partner draw in the middle of its forward."""

    def __init__(self, partner: Partner) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, 4 * WIDTH)
        self.b = nn.Linear(4 * WIDTH, WIDTH)
        self.partner = partner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.partner.draw_now()
        return x + self.b(h)  # type: ignore[no-any-return]


@pytest.fixture
def partner() -> Iterator[Partner]:
    helper = Partner()
    try:
        yield helper
    finally:
        helper.close()


def _model(partner: Partner) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(partner) for _ in range(DEPTH)))


def _plan(model: nn.Module, x: torch.Tensor, budget: float) -> checkpointing.ActivationPlan:
    return checkpointing.plan_checkpointing(model, (x,), budget=budget, timing_steps=0)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _guards(model: nn.Module) -> list[DrawGuard]:
    return [
        hook.__self__
        for module in model.modules()
        for hook in module._forward_pre_hooks.values()
        if isinstance(getattr(hook, "__self__", None), DrawGuard)
    ]


def test_rule14_another_threads_draws_leave_the_plan_as_it_is(partner: Partner) -> None:
    """Planned twice, the second time with the partner drawing inside every region call: the
    same JSON, and no region drawing (the generator moved, the regions drew nothing)."""
    model, x = _model(partner), torch.randn(ROWS, WIDTH)
    alone = _plan(model, x, 0.3)
    partner.active = True
    beside = _plan(model, x, 0.3)
    assert partner.draws >= 3 * DEPTH  # three runs of the model at plan time
    assert not any(r.draws for r in beside.regions), str(beside)
    assert beside.to_json() == alone.to_json()


def test_rule14_another_threads_draws_raise_no_alarm(partner: Partner) -> None:
    """Every region checkpointed without an RNG state; the partner draws inside every forward
    and recompute: no ``CheckpointError``, and three steps' gradients are the plain run's, bit
    for bit."""
    model, x = _model(partner), torch.randn(ROWS, WIDTH)
    plain = _grads(model, x)
    plan = _plan(model, x, _plan(model, x, 0.5).floor_bytes)
    assert all(r.checkpoint and not r.draws for r in plan.regions), str(plan)
    plan.apply(model)
    partner.active = True
    try:
        for _ in range(3):
            planned = _grads(model, x)
            assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    finally:
        partner.active = False
        plan.remove(model)
    assert partner.draws >= 3 * 2 * DEPTH  # forward and recompute of every region, per step


def test_rule14_the_guard_keeps_nothing_per_ended_thread(partner: Partner) -> None:
    """Forty threads, one after another, each run a step of the applied model: afterwards every
    guard holds the per-thread state of no thread but the main one (CPython's
    ``threading.local`` keeps one dict per living thread that used it)."""
    model, x = _model(partner), torch.randn(ROWS, WIDTH)
    plan = _plan(model, x, _plan(model, x, 0.5).floor_bytes)
    plan.apply(model)
    params = list(model.parameters())
    errors: list[BaseException] = []

    def step() -> None:
        try:
            torch.autograd.grad(model(x).pow(2).mean(), params)
        except BaseException as error:  # reported below, in the main thread
            errors.append(error)

    try:
        step()
        for _ in range(40):
            thread = threading.Thread(target=step)
            thread.start()
            thread.join()
        assert not errors, errors
        gc.collect()
        guards = _guards(model)
        assert len(guards) == DEPTH
        for guard in guards:
            per_thread = [r for r in gc.get_referents(guard.local) if isinstance(r, dict)]
            assert sum(len(d) for d in per_thread) <= 1, per_thread
    finally:
        plan.remove(model)
