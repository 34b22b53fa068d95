"""Planning leaves a sharded or replicated model as it found it, and its next step is the plain
one (gloo: 2 CPU processes, and 4 for a 2x2 mesh).

The model is the layout of FSDP2's tutorial: an input projection and a BatchNorm owned by the
root, a stack of residual blocks (Linear, tanh, dropout, Linear), and a head owned by the root.
Sharded by FSDP2 (``fully_shard`` per block and at the root; also per Linear, "nested"), by
tensor parallelism alone (the blocks' Linears column- and row-wise), by both on a 2x2 mesh, or
replicated by DDP (plain, ``find_unused_parameters=True``, ``static_graph=True``).

Each sharding is planned (``plan_checkpointing(model, x, budget=0.7)``) in three ways:
- ``fresh``: shard, plan, apply, then one training step;
- ``accumulated``: shard, one step whose gradients stay in ``.grad``, plan, apply, one more step
  (gradient accumulation across the planning);
- ``plan_first``: plan and apply on the model before it is sharded, then shard, then one step.

What must hold, on every rank:
- Planning changes nothing: parameters (values, and the very objects the model registers, so
  FSDP2 is back in its sharded state), every ``.grad`` (the same objects, None still None,
  FSDP2's and DDP's accumulated gradients bit for bit), buffers (BatchNorm's statistics), the
  CPU RNG state, and DDP's switches.
- The planned step's full gradients equal those of the same sharded run without a plan, bit for
  bit (dropout included: the CPU RNG is seeded alike before each step).

Each set of workers is bounded: collectives time out after ``dist_support.TIMEOUT`` and the
whole run after ``RUN_TIMEOUT`` seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist_support import SPAWNED_ONCE, case_result, run_cases, spawned_results
from torch import nn

import checkpointing

WIDTH = 16
HIDDEN = 128
DEPTH = 3
BATCH = 8  # rows per data-parallel rank
SEED = 2024
BUDGET = 0.7
RUN_TIMEOUT = 420.0  # seconds for a whole set of workers, on 2 cores shared with other work
ORDERS = ("fresh", "accumulated", "plan_first")

pytestmark = SPAWNED_ONCE


class Block(nn.Module):
    """``x + down(dropout(tanh(up(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(x))))  # type: ignore[no-any-return]


class Net(nn.Module):
    """An input projection and a BatchNorm, ``DEPTH`` blocks, a head; float64, the same weights
    on every rank and in every case."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)  # type: ignore[arg-type]


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh((torch.distributed.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_nested(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh((torch.distributed.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block.up, mesh=mesh)
        fully_shard(block.down, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _split(block: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _tensor_parallel(model: nn.Module) -> nn.Module:
    mesh = _mesh((torch.distributed.get_world_size(),))
    for block in _blocks(model):
        _split(block, mesh)
    return model


def _fsdp2_tp(model: nn.Module) -> nn.Module:
    """2x2 mesh: the blocks split over ``tp``, everything sharded over ``dp`` (torchtitan's
    order)."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh((2, 2), ("dp", "tp"))
    for block in _blocks(model):
        _split(block, mesh["tp"])
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _ddp(**options: Any) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(model, **options)

    return wrap


# sharding -> (how, the data-parallel index of a rank's rows)
Sharding = tuple[Callable[[nn.Module], nn.Module], Callable[[int], int]]
PAIR: dict[str, Sharding] = {
    "fsdp2": (_fsdp2, lambda rank: rank),
    "fsdp2_nested": (_fsdp2_nested, lambda rank: rank),
    "tp": (_tensor_parallel, lambda rank: 0),
    "ddp": (_ddp(), lambda rank: rank),
    "ddp_unused": (_ddp(find_unused_parameters=True), lambda rank: rank),
    "ddp_static": (_ddp(static_graph=True), lambda rank: rank),
}
FOUR: dict[str, Sharding] = {
    "fsdp2_tp": (_fsdp2_tp, lambda rank: rank // 2),
    "fsdp2": (_fsdp2, lambda rank: rank),
    "ddp": (_ddp(), lambda rank: rank),
}
WORLDS: dict[int, dict[str, Sharding]] = {2: PAIR, 4: FOUR}
# Refused with a message (and the model left as found): a static graph's first step is the one
# that records it, which the planner's measured steps must not be.
REFUSED = {("ddp_static", "fresh")}


def _batch(index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(4 * BATCH, WIDTH, generator=gen, dtype=torch.float64)[index::4]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _step(model: nn.Module, x: torch.Tensor, number: int) -> None:
    """One training step's forward and backward; its gradients accumulate into ``.grad``."""
    torch.manual_seed(SEED + number)
    model(x).pow(2).mean().backward()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else _full(p.grad) for name, p in model.named_parameters()}


def _state(model: nn.Module) -> dict[str, Any]:
    """What planning must leave as it found: values here, objects by identity (``_objects``)."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    return {
        "parameters": {name: _full(p) for name, p in model.named_parameters()},
        "grads": _grads(model),
        "buffers": {name: b.detach().clone() for name, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
        "switches": (
            (model.require_backward_grad_sync, model.require_forward_param_sync) if ddp else ()
        ),
    }


def _objects(model: nn.Module) -> list[object]:
    """The parameter objects the model registers and their ``.grad`` objects (FSDP2 registers
    its sharded parameters between steps and its gathered ones during a step)."""
    return [o for p in model.parameters() for o in (p, p.grad)]


def _planned(name: str, sharding: Sharding, order: str, rank: int) -> dict[str, Any]:
    shard, rows = sharding
    x = _batch(rows(rank))
    model = Net()
    if order != "plan_first":
        model = shard(model)
    if order == "accumulated":
        _step(model, x, 0)
    before, objects = _state(model), _objects(model)
    refused, checkpointed = "", 0
    try:
        plan = checkpointing.plan_checkpointing(model, x, budget=BUDGET)
    except ValueError as error:
        if (name, order) not in REFUSED:
            raise
        refused = str(error)
    same = [a is b for a, b in zip(objects, _objects(model), strict=True)]
    after = _state(model)
    if not refused:
        plan.apply(model)
        checkpointed = sum(1 for d in plan.regions if d.checkpoint)
    if order == "plan_first":
        model = shard(model)
    _step(model, x, 1)
    return {
        "before": before,
        "after": after,
        "same_objects": all(same),
        "checkpointed": checkpointed,
        "refused": refused,
        "grads": _grads(model),
    }


def _plain(sharding: Sharding, accumulated: bool, rank: int) -> dict[str, Any]:
    shard, rows = sharding
    x = _batch(rows(rank))
    model = shard(Net())
    if accumulated:
        _step(model, x, 0)
    _step(model, x, 1)
    return {"grads": _grads(model)}


def _worker(rank: int, port: int, out_dir: str, world: int) -> None:
    cases: dict[str, Callable[[], Any]] = {}
    for name, sharding in WORLDS[world].items():
        for accumulated in (False, True):
            cases[f"{name}/plain/{accumulated}"] = functools.partial(
                _plain, sharding, accumulated, rank
            )
        for order in ORDERS:
            cases[f"{name}/{order}"] = functools.partial(_planned, name, sharding, order, rank)
    run_cases(rank, port, out_dir, cases, world)


_RESULTS: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    """Per world size, every case's results per rank from one set of spawned workers (spawned
    when a test first asks for that size)."""

    def results(world: int) -> list[dict[str, Any]]:
        if world not in _RESULTS:
            _RESULTS[world] = spawned_results(
                tmp_path_factory,
                f"planner_state_{world}",
                functools.partial(_worker, world=world),
                world,
                limit=RUN_TIMEOUT,
            )
        return _RESULTS[world]

    return results


CASES = [
    pytest.param(world, name, order, id=f"{world}-{name}-{order}")
    for world, shardings in WORLDS.items()
    for name in shardings
    for order in ORDERS
]


def _assert_same(got: Any, want: Any, where: str) -> None:
    """Bitwise the same nested dicts of tensors (None where None)."""
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for key, value in want.items():
            _assert_same(got[key], value, f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {got!r} where a tensor was"
        assert torch.equal(got, want), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize(("world", "sharding", "order"), CASES)
def test_planning_leaves_the_model_as_found(
    world: int, sharding: str, order: str, worlds: Callable[[int], list[dict[str, Any]]]
) -> None:
    """Parameters, ``.grad`` (None still None; an accumulated step's bit for bit), buffers, the
    RNG state, DDP's switches, and the registered objects are those from before planning."""
    results = worlds(world)
    for rank in range(world):
        got = case_result(results, f"{sharding}/{order}", rank)
        if (sharding, order) in REFUSED:
            for phrase in ("checkpointing.plan_checkpointing:", "static_graph=True", "Fix:"):
                assert phrase in got["refused"]
        else:
            assert got["checkpointed"] > 0, "the budget must make the plan checkpoint something"
        _assert_same(got["after"], got["before"], f"rank {rank}")
        assert got["same_objects"], f"rank {rank}: the model registers other parameter objects"
        grads = got["before"]["grads"].values()
        if order == "accumulated":
            assert all(g is not None for g in grads), "the first step must leave gradients"
        else:
            assert all(g is None for g in grads)


@pytest.mark.parametrize(("world", "sharding", "order"), CASES)
def test_step_after_planning_is_the_plain_step(
    world: int, sharding: str, order: str, worlds: Callable[[int], list[dict[str, Any]]]
) -> None:
    """The planned model's gradients equal the plain sharded run's, bit for bit: after one step,
    or (``accumulated``) after the step before planning and the one after it."""
    results = worlds(world)
    for rank in range(world):
        got = case_result(results, f"{sharding}/{order}", rank)["grads"]
        want = case_result(results, f"{sharding}/plain/{order == 'accumulated'}", rank)["grads"]
        assert list(got) == list(want)
        for name, value in want.items():
            mine = got[name]
            assert value is not None, (rank, name)
            assert mine is not None, (rank, name)
            ratio = (mine.norm() / value.norm()).item()
            assert torch.equal(mine, value), f"rank {rank}: {name} is {ratio:.3f}x the plain one"
