"""Expert-parallel mixture of experts (gloo, 2 CPU processes) with our checkpointing, side by side
with torch's.

Each rank holds two of the four experts and routes its own tokens: a linear router, softmax,
top-2; the routed copies are sorted by expert, the counts exchanged (``all_to_all_single``), the
tokens sent to their experts' ranks and back (``all_to_all_single_autograd``), and combined by
their routing weights. Experts have dropout. The whole MoE layer is the checkpointed region (as
torchtitan checkpoints a whole block): the recompute re-runs routing, the exchanges and the
experts, on both ranks alike. Cases: ``checkpointing.checkpoint``, ``checkpoint_module``,
``checkpoint_module`` with a selective policy (``save_matmuls``), and torch's equivalents; two
steps, float64, each worker writes its gradients (the router's and its own experts').

Gradients are compared bitwise with the plain expert-parallel run (the same ops and exchanges;
dropout replayed from the preserved RNG state) and with torch's equivalent.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils.checkpoint as torch_checkpoint
from dist_support import SPAWNED_ONCE, WORLD_SIZE, case_result, run_cases, spawned_results
from parallel_support import ByFunction, assert_grads_equal, ours_sac_context, torch_sac_context
from torch import nn
from torch.distributed._composable import checkpoint as torch_composable_checkpoint

import checkpointing

pytestmark = SPAWNED_ONCE

WIDTH = 8
HIDDEN = 12
LOCAL_EXPERTS = 2
EXPERTS = LOCAL_EXPERTS * WORLD_SIZE
TOP_K = 2
TOKENS = 10  # per rank
STEPS = 2
SEED = 1234
# case -> the torch case it must equal bitwise (all must equal "plain")
CASES: dict[str, str | None] = {
    "plain": None,
    "torch_function": None,
    "ours_function": "torch_function",
    "torch_module": None,
    "ours_module": "torch_module",
    "torch_sac": None,
    "ours_sac": "torch_sac",
}


class MoE(nn.Module):
    """``x + sum_k weight_k * expert_k(x)`` over the top-``TOP_K`` experts, experts split over
    the ranks (this rank holds experts ``rank * LOCAL_EXPERTS + e``)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        w1 = torch.randn(EXPERTS, WIDTH, HIDDEN) * 0.3
        w2 = torch.randn(EXPERTS, HIDDEN, WIDTH) * 0.3
        mine = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
        self.w1 = nn.Parameter(w1[mine].clone())
        self.w2 = nn.Parameter(w2[mine].clone())
        self.drop = nn.Dropout(0.2)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        assert group is not None
        weight, expert = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        flat_expert = expert.reshape(-1)
        order = flat_expert.argsort(stable=True)
        token = order // TOP_K
        routed = x[token]  # grouped by expert, so by destination rank
        counts = torch.bincount(flat_expert, minlength=EXPERTS)
        # received[s, e]: tokens that rank s sends to this rank's expert e
        received = funcol.all_to_all_single(counts, None, None, group).view(WORLD_SIZE, -1)
        send_splits = counts.view(WORLD_SIZE, LOCAL_EXPERTS).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        arrived = funcol.all_to_all_single_autograd(routed, recv_splits, send_splits, group)
        outputs = [
            self._expert(chunk, i % LOCAL_EXPERTS)
            for i, chunk in enumerate(arrived.split(received.reshape(-1).tolist()))
        ]
        back = funcol.all_to_all_single_autograd(
            torch.cat(outputs), send_splits, recv_splits, group
        )
        gates = weight.reshape(-1)[order].unsqueeze(1)
        return x + torch.zeros_like(x).index_add(0, token, back * gates)

    def _expert(self, tokens: torch.Tensor, e: int) -> torch.Tensor:
        return torch.tanh(self.drop(tokens @ self.w1[e])) @ self.w2[e]


CHECKPOINT_LAYER: dict[str, Any] = {
    "torch_function": functools.partial(ByFunction, checkpoint=torch_checkpoint.checkpoint),
    "ours_function": functools.partial(ByFunction, checkpoint=checkpointing.checkpoint),
    "torch_module": torch_composable_checkpoint,
    "ours_module": checkpointing.checkpoint_module,
    "torch_sac": functools.partial(torch_composable_checkpoint, context_fn=torch_sac_context),
    "ours_sac": functools.partial(checkpointing.checkpoint_module, context_fn=ours_sac_context),
}


def _input(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(TOKENS, WIDTH, generator=gen, dtype=torch.float64)


def _run(rank: int, case: str) -> dict[str, torch.Tensor]:
    layer = MoE(rank)
    apply = CHECKPOINT_LAYER.get(case)
    net = apply(layer) if apply is not None else layer
    for step in range(STEPS):
        torch.manual_seed(SEED + 10 * step + rank)
        net(_input(rank, step)).pow(2).mean().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    assert all(g is not None for g in grads.values()), case
    return grads  # type: ignore[return-value]


def _worker(rank: int, port: int, out_dir: str) -> None:
    run_cases(rank, port, out_dir, {case: functools.partial(_run, rank, case) for case in CASES})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawned_results(tmp_path_factory, "moe", _worker)


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
def test_gradients_equal_the_plain_expert_parallel_run_bitwise(
    case: str, results: list[dict[str, Any]]
) -> None:
    """Router and expert gradients equal the plain run's, bit for bit, on both ranks."""
    for rank in range(WORLD_SIZE):
        assert_grads_equal(
            case_result(results, case, rank), case_result(results, "plain", rank), case
        )


@pytest.mark.parametrize("case", [c for c, twin in CASES.items() if twin])
def test_gradients_equal_torchs_bitwise(case: str, results: list[dict[str, Any]]) -> None:
    """Ours gives bit for bit the gradients of torch's equivalent."""
    twin = CASES[case]
    assert twin is not None
    for rank in range(WORLD_SIZE):
        assert_grads_equal(
            case_result(results, case, rank), case_result(results, twin, rank), f"{case} vs {twin}"
        )


def test_the_experts_and_the_router_learn(results: list[dict[str, Any]]) -> None:
    """The harness can fail: every expert of each rank got tokens (nonzero gradients), and the
    ranks' router gradients differ (each routes its own tokens)."""
    for rank in range(WORLD_SIZE):
        grads = case_result(results, "plain", rank)
        for e in range(LOCAL_EXPERTS):
            assert grads["w1"][e].abs().sum() > 0, (rank, e)
    routers = [case_result(results, "plain", rank)["router.weight"] for rank in range(WORLD_SIZE)]
    assert not torch.equal(routers[0], routers[1])
