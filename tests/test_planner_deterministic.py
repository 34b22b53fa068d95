"""The planner is deterministic and cheap (issue 43, points 2 and 3; NOTE [Planner
measure], Rules M8 and M12; NOTE [Planner solve], Rules S3 and S4).

A plan is a function of the model, the inputs, the budget and the options: prices come from
counted quantities and the cost model's constants (``_planning/measure/costs.py``), never from a
clock, so two calls give one plan. Planning runs the model three times (one forward, one recorded
step, one step for the peak), whatever its size. Timing candidates is opt-in
(``timing_steps > 0``), and then every rank of a default process group gets rank 0's choice.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_support import gloo_group, spawn_pair
from planner_support import SpannedEncoder, transformer
from torch import nn

from checkpointing import plan_checkpointing
from checkpointing._planning import search as search_module
from checkpointing._planning.measure.costs import costs_for
from checkpointing._planning.measure.profile import profile_step
from checkpointing._planning.measure.recorder import _drawn
from checkpointing._planning.search import find_regions


def _models(dropout: float) -> list[tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        (transformer().train(), torch.randn(2, 16, 32, requires_grad=True)),
        (SpannedEncoder(dropout).train(), torch.randint(0, 64, (2, 16))),
    ]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("objective", ["time", "flops"])
def test_two_calls_give_one_plan(dropout: float, objective: str) -> None:
    """Rule M12: the same model, inputs, budget and options give the same plan, to the byte of
    its JSON (its predicted times included), with dropout and without."""
    for model, x in _models(dropout):
        if dropout == 0.0:
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
        for budget in (0.3, 0.6):
            first = plan_checkpointing(model, x, budget=budget, objective=objective)  # type: ignore[arg-type]
            second = plan_checkpointing(model, x, budget=budget, objective=objective)  # type: ignore[arg-type]
            assert first.to_json() == second.to_json(), f"{first}\n{second}"
            assert first.timed == second.timed == ()


@pytest.mark.parametrize("regions", ["default", "predicate"])
def test_planning_runs_the_model_three_times(regions: str) -> None:
    """Issue 43 point 3: one forward (finding the tail, or warming up), one recorded step and
    one step for the peak; no timing, no policy rounds."""
    model, x = _models(0.1)[1]
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    model.register_forward_pre_hook(count)
    predicate = (
        None if regions == "default" else (lambda m: isinstance(m, nn.TransformerEncoderLayer))
    )
    plan_checkpointing(model, x, budget=0.5, regions=predicate)
    assert calls[0] == 3


def test_op_seconds_are_the_cost_model_s() -> None:
    """Rule M8: a profiled op's seconds are its dispatch, its FLOPs at the device class's rate
    and its bytes read and written at its bandwidth: a linear layer's ``mm``/``addmm``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    x = torch.randn(32, 64, requires_grad=True)
    profile = profile_step(model, find_regions(model, None), (x,), {}, None)
    costs = costs_for("cpu")
    (op,) = [op for op in profile.regions[0].ops if op.flops]
    nbytes = 4 * (32 * 64 + 128 * 64 + 128 + 32 * 128)  # input, weight, bias read; output written
    assert op.seconds == pytest.approx(costs.op(op.flops, nbytes), rel=1e-9)
    assert op.flops == 2 * 32 * 64 * 128


def test_a_draw_is_priced_by_the_numbers_it_draws() -> None:
    """Rule M8: a random op costs its bytes and, on the CPU, a price per number drawn (a CPU
    draws ~10x slower than it moves the bytes): dropout's ``bernoulli_`` one per element; a fused
    attention with dropout (CUDA's kernels) one per score, query rows times key rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).train()
    x = torch.randn(32, 64, requires_grad=True)
    profile = profile_step(model, find_regions(model, None), (x,), {}, None)
    costs = costs_for("cpu")
    assert costs.random_seconds_per_element > 0
    assert "ns per random number drawn" in costs.describe()
    (draw,) = [op for r in profile.regions for op in r.ops if op.kind == "random"]
    assert "bernoulli" in draw.op
    nbytes = 2 * 4 * 32 * 64  # its tensor read and written in place
    assert draw.seconds == pytest.approx(costs.op(0, nbytes, drawn=32 * 64), rel=1e-9)
    assert draw.seconds - costs.op(0, nbytes) == pytest.approx(32 * 64 * 6.5e-9, rel=1e-9)
    assert costs_for("cuda").random_seconds_per_element == 0.0  # memory speed there
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 24, 8)
    assert _drawn(fused, [q, k, k], (torch.empty(2, 4, 16, 8),)) == 2 * 4 * 16 * 24


def test_progress_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Planning says what it does on the ``checkpointing.planner`` logger."""
    model, x = _models(0.1)[0]
    with caplog.at_level(logging.INFO, logger="checkpointing.planner"):
        plan_checkpointing(model, x, budget=0.5)
    said = [r.getMessage() for r in caplog.records if r.name == "checkpointing.planner"]
    assert any(re.fullmatch(r"planning \w+: \d+ regions, .*", m) for m in said), said
    assert any(
        re.fullmatch(r"profiled in \d+\.\d s: \d+ ops in \d+ regions; solving \d+ variants", m)
        for m in said
    ), said
    assert any(
        re.fullmatch(r"solved in .*: candidate plans \d+, the first keeps \d+ of \d+ bytes", m)
        for m in said
    ), said


def _timed_worker(rank: int, port: int, out_dir: str) -> None:
    """Each rank's timing names another candidate fastest; rank 0's choice must win."""
    with gloo_group(rank, port):
        search_module._PERTURBED = ((0.0, 0.0), (1000.0, 0.0), (1.0, 10.0))

        def by_rank(_model: Any, plans: list[Any], *_: Any) -> list[float]:
            favourite = rank % len(plans)
            return [0.5 if i == favourite else 1.0 for i in range(len(plans))]

        search_module.time_plans = by_rank
        torch.manual_seed(0)
        model, x = transformer(), torch.randn(2, 16, 32, requires_grad=True)
        plan = plan_checkpointing(model, x, budget=0.5, timing_steps=2)
        count = len(search_module._PERTURBED)
        (Path(out_dir) / f"{rank}.json").write_text(
            json.dumps({"plan": plan.to_json(), "timed": list(plan.timed), "count": count})
        )


# Run in CI's first stage only (the `once` marker): a gloo process group, and the agreement is the
# planner's broadcast of rank 0's choice, not a path that differs between torch releases.
@pytest.mark.once
def test_timed_plans_agree_across_ranks(tmp_path: Path) -> None:
    """Rule M12: with ``timing_steps``, measured times differ between ranks; every rank of the
    default process group returns rank 0's choice (here rank 1's own timing prefers another
    candidate, so without the broadcast the ranks would differ)."""
    spawn_pair(_timed_worker, str(tmp_path))
    zero = json.loads((tmp_path / "0.json").read_text())
    one = json.loads((tmp_path / "1.json").read_text())
    assert len(zero["timed"]) >= 2
    assert zero["plan"] == one["plan"]
    assert zero["timed"] == one["timed"]
