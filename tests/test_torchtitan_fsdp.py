"""``checkpointing.integrations.torchtitan`` under FSDP2 as torchtitan shards: 2 gloo ranks.

Each rank builds torchtitan's llama3 debug model (``titan_support``), applies a configurable as
torchtitan's parallelize function does (activation checkpointing first), then shards it with
torchtitan's own ``apply_fsdp_to_decoder`` over a 2-rank CPU mesh, and trains one step on its own
tokens. Ours and torchtitan's ``FullAC``/``SelectiveAC`` give bitwise the gradients of the
unwrapped sharded step, and so does the eager budget, planned inside the first sharded step
(NOTE [torchtitan budget], Rule 2; NOTE [Budget at the first step], Rule 3). One pair of
processes runs every case (``dist_support``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import releases
import torch
from dist_support import SPAWNED_ONCE, case_result, run_cases, spawned_results
from torch import nn
from torch.distributed.fsdp import FSDPModule

releases.skip_without_torchtitan_models()

from titan_support import apply_fsdp_to_decoder, build, ours, theirs  # noqa: E402 (after the skip)

pytestmark = SPAWNED_ONCE

CONFIGS: dict[str, Any] = {
    "plain": None,
    "ours-full": ours.FullAC.Config,
    "theirs-full": theirs.FullAC.Config,
    "ours-op": ours.SelectiveAC.Config,
    "theirs-op": theirs.SelectiveAC.Config,
}


def _shard(model: nn.Module) -> None:
    """Shard as torchtitan does, over both ranks. torchtitan turns FSDP's gradient division off
    (it scales by token count itself), which makes FSDP reduce with PREMUL_SUM, an op gloo
    lacks; FSDP's forced plain sum gives the same sums."""
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _sharded(config: Any) -> nn.Module:
    """The debug model checkpointed by ``config`` (None: not), then sharded as torchtitan does."""
    model = copy.deepcopy(build("llama3"))
    if config is not None:
        config().build(dump_folder="").apply(model)
    _shard(model)
    return model


def _tokens() -> torch.Tensor:
    seed = 10 + torch.distributed.get_rank()
    return torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(seed))


def _train(config: Any) -> dict[str, torch.Tensor]:
    """One step's gradients, whole (``full_tensor``), under the names of the plain model."""
    model = _sharded(config)
    model(_tokens()).float().pow(2).mean().backward()
    return {
        name.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
        for name, p in model.named_parameters()
    }


def _budget() -> dict[str, Any]:
    """The eager budget on the sharded model: planned inside the first sharded step; that step's
    and the next step's gradients, and the plan installed."""
    model = copy.deepcopy(build("llama3"))
    ac = ours.MemoryBudgetAC.Config(memory_budget=0.5).build()
    ac.apply(model)
    _shard(model)
    steps = []
    for _ in range(2):
        model(_tokens()).float().pow(2).mean().backward()
        steps.append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return {"steps": steps, "plan": ac.plan.to_json()}


def _root_parameters() -> str:
    """A sharded root that holds a parameter of its own is refused at the first step."""
    model = copy.deepcopy(build("llama3"))
    model.register_parameter("scale", nn.Parameter(torch.ones(1)))
    ours.MemoryBudgetAC.Config(memory_budget=0.5).build().apply(model)
    _shard(model)
    try:
        model(_tokens())
    except ValueError as error:
        return str(error)
    return ""


def _worker(rank: int, port: int, out_dir: str) -> None:
    cases = {name: functools.partial(_train, config) for name, config in CONFIGS.items()}
    run_cases(rank, port, out_dir, {**cases, "budget": _budget, "root": _root_parameters})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case's results per rank, from one pair of spawned processes."""
    return spawned_results(tmp_path_factory, "torchtitan_fsdp", _worker, limit=600)


@pytest.mark.parametrize("case", [name for name in CONFIGS if name != "plain"])
@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_gradients_match_the_plain_sharded_step(
    results: list[dict[str, Any]], case: str, rank: int
) -> None:
    """Ours and torchtitan's configurables, sharded by torchtitan's FSDP code: bitwise the
    gradients of the unwrapped sharded step, on each rank."""
    got, want = case_result(results, case, rank), case_result(results, "plain", rank)
    assert want
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("rank", [0, 1])
def test_budget_plans_inside_the_sharded_step(results: list[dict[str, Any]], rank: int) -> None:
    """NOTE [torchtitan budget], Rule 2, and [Budget at the first step], Rule 3: planned inside
    torchtitan's sharded model, the planning step and the next give bitwise the plain sharded
    step's gradients, and both ranks install one plan, which checkpoints a block."""
    got, want = case_result(results, "budget", rank), case_result(results, "plain", rank)
    for step in got["steps"]:
        assert step.keys() == want.keys()
        for name in want:
            assert torch.equal(step[name], want[name]), name
    assert got["plan"] == case_result(results, "budget", 0)["plan"]
    assert '"checkpoint": true' in got["plan"]


@pytest.mark.parametrize("rank", [0, 1])
def test_budget_refuses_a_sharded_root_with_parameters(
    results: list[dict[str, Any]], rank: int
) -> None:
    """NOTE [torchtitan budget], Rule 2: the error names the parameter and the fix."""
    refused = results[rank]["root"]
    assert "scale" in refused
    assert "fully_shard" in refused
