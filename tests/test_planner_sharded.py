"""``plan_checkpointing`` on sharded and parallel models (gloo, 2 CPU processes).

One pair of spawned workers plans, applies and trains every case: a stack of residual blocks
(Linear, tanh, dropout, Linear) sharded by FSDP2 (``fully_shard`` per block and at the root, and
also per Linear, so that FSDP2's own ops run inside the planned regions) or
split by tensor parallelism (``parallelize_module``: the first Linear column-wise, the second
row-wise, DTensor weights). Each worker writes its plans (``to_json``), their byte figures,
and the full gradients of three optimizer steps of the planned model and of the same model
without a plan, to a file; the tests compare them.

What must hold:
- Parameters, sharded (DTensor shards) or gathered (FSDP2's unsharded parameters, which its
  own ops fill during the forward), are never activations: under FSDP2 a rank's plan keeps and
  predicts exactly what the plan of the same model on one process, fed the rank's rows,
  predicts; under tensor parallelism what that of the model with half the hidden width (each
  rank's column shard) predicts.
- Both ranks get one plan (``to_json`` equal).
- The planned model trains as the plain one: gradients equal bit for bit at every step
  (dropout included: the CPU RNG is seeded alike before each step, and the plan preserves it).

The spawned pair is bounded: collectives time out after ``dist_support.TIMEOUT`` and the whole
run after ``RUN_TIMEOUT`` seconds (the workers are then killed and the tests fail).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist_support import SPAWNED_ONCE, WORLD_SIZE, case_result, run_cases, spawned_results
from parallel_support import BlockStack
from torch import nn

import checkpointing
from checkpointing._planning import search

WIDTH = 32
HIDDEN = 128
DEPTH = 4
BATCH = 16  # rows per rank
SEED = 4321
STEPS = 3
BUDGET = 0.5
RUN_TIMEOUT = 240.0  # seconds for the whole pair; a healthy run takes ~20 s on 2 busy cores

pytestmark = SPAWNED_ONCE


class Block(nn.Module):
    """``x + down(dropout(tanh(up(x))))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, hidden)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(hidden, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(x))))  # type: ignore[no-any-return]


class Net(BlockStack):
    """``DEPTH`` blocks and a linear head, float64, the same weights on every rank."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__(functools.partial(Block, hidden), DEPTH, WIDTH)


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _batch(rank: int) -> torch.Tensor:
    """FSDP2: each rank its own rows; TP: rank 0's rows on both (its input is replicated)."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(WORLD_SIZE * BATCH, WIDTH, generator=gen, dtype=torch.float64)
    return rows[rank::WORLD_SIZE]


def _plan(model: nn.Module, x: torch.Tensor) -> checkpointing.ActivationPlan:
    return checkpointing.plan_checkpointing(
        model, (x,), budget=BUDGET, loss_fn=_loss, timing_steps=0
    )


def _figures(plan: checkpointing.ActivationPlan) -> dict[str, Any]:
    return {
        "json": json.loads(plan.to_json()),
        "baseline": plan.baseline_bytes,
        "kept": plan.kept_bytes,
        "floor": plan.floor_bytes,
        "checkpointed": sum(1 for d in plan.regions if d.checkpoint),
    }


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _train(model: nn.Module, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` SGD steps, each from its own seed; the full gradients of each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(SEED + step)
        _loss(model(x)).backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    return grads


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_nested(model: nn.Module) -> nn.Module:
    """FSDP2 on each Linear too: its gathers and frees run inside the planned regions (and
    again in their recompute)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block.up, mesh=mesh)
        fully_shard(block.down, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tensor_parallel(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


SHARDINGS: dict[str, tuple[Callable[[nn.Module], nn.Module], int]] = {
    # sharding -> (how, the hidden width of the one-process model it must plan like)
    "fsdp2": (_fsdp2, HIDDEN),
    "fsdp2_nested": (_fsdp2_nested, HIDDEN),
    "tp": (_tensor_parallel, HIDDEN // WORLD_SIZE),
}


def _case(sharding: str, rank: int) -> dict[str, Any]:
    shard, hidden = SHARDINGS[sharding]
    x = _batch(rank if sharding.startswith("fsdp2") else 0)
    torch.manual_seed(SEED)
    single = _figures(_plan(Net(hidden), x))
    planned_model = shard(Net())
    torch.manual_seed(SEED)
    plan = _plan(planned_model, x)
    plan.apply(planned_model)
    return {
        "single": single,
        "plan": _figures(plan),
        "planned": _train(planned_model, x),
        "plain": _train(shard(Net()), x),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    # Blocks apart in every plan here: the one-process model may chain its blocks (NOTE
    # [Planner solve], Rule S9), where FSDP2's gathers run between the sharded blocks and part
    # them, so the two floors would differ by the chain, not by any parameter.
    search.JOINS = False
    cases = {sharding: functools.partial(_case, sharding, rank) for sharding in SHARDINGS}
    run_cases(rank, port, out_dir, cases)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case's results per rank, from one pair of spawned processes, in bounded time."""
    return spawned_results(tmp_path_factory, "planner_sharded", _worker, limit=RUN_TIMEOUT)


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_parameters_are_not_activations(sharding: str, results: list[dict[str, Any]]) -> None:
    """A rank's plan predicts the bytes of the one-process plan of its share of the work: no
    parameter (sharded, or gathered by FSDP2's ops during the forward) counts as kept. Under
    tensor parallelism each checkpointed block also keeps its all-reduce's output (a collective
    is kept, never re-run: NOTE [Planner measure], Rule M15), which the one-process model lacks:
    the floor, every block checkpointed, is above it by one such output per block."""
    collectives = DEPTH * BATCH * WIDTH * 8 if sharding == "tp" else 0  # float64 outputs
    for rank in range(WORLD_SIZE):
        got = case_result(results, sharding, rank)
        plan, single = got["plan"], got["single"]
        assert plan["checkpointed"] > 0, "the budget must make the plan checkpoint something"
        assert plan["baseline"] == single["baseline"], (sharding, rank, plan, single)
        assert plan["floor"] == single["floor"] + collectives, (sharding, rank, plan, single)


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_ranks_get_one_plan(sharding: str, results: list[dict[str, Any]]) -> None:
    """Both ranks choose alike, byte for byte, except the predicted peak under FSDP2.

    The peak is read off the plain step's live bytes, and under FSDP2 the two ranks' readings
    differed by 8,512 of 370,200 bytes in about half the runs on a quiet machine (the same on
    the tree before this test's last change; not the garbage collector: the same with it off).
    The cause is not found; FSDP2's communication buffers, released when gloo's own thread
    ends a collective, are the suspect. The decisions and every other figure do not read the
    peak (it is computed after choosing), so they are compared exactly and the peak within 5 %."""
    plans = [case_result(results, sharding, rank)["plan"]["json"] for rank in range(WORLD_SIZE)]
    peaks = [plan.pop("peak_bytes") for plan in plans]
    assert plans[0] == plans[1]
    if sharding.startswith("fsdp2"):
        assert abs(peaks[0] - peaks[1]) <= 0.05 * max(peaks), peaks
    else:
        assert peaks[0] == peaks[1], peaks


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_planned_model_trains_as_plain(sharding: str, results: list[dict[str, Any]]) -> None:
    """Gradients of every step equal the plain sharded run's, bit for bit (dropout included)."""
    for rank in range(WORLD_SIZE):
        got = case_result(results, sharding, rank)
        assert len(got["planned"]) == STEPS
        for step, (planned, plain) in enumerate(zip(got["planned"], got["plain"], strict=True)):
            assert list(planned) == list(plain)
            assert planned, "no gradients"
            for name, value in plain.items():
                assert torch.equal(planned[name], value), (sharding, rank, step, name)
