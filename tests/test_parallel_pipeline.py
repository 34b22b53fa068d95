"""Pipeline schedules (``torch.distributed.pipelining``, gloo, 2 CPU processes) with our
checkpointing, side by side with torch's.

One pair of spawned workers runs every (schedule, case): GPipe and 1F1B with one stage per rank,
interleaved 1F1B, interleaved zero-bubble and ZBV zero-bubble with two stages per rank (four
residual blocks with dropout, one per stage; ZBV places them in a V: rank 0 holds stages 0 and
3). Each case checkpoints every stage module: ``checkpoint_module`` alone, ``checkpoint_module``
with a selective policy (``save_matmuls``) whose forward runs under ``split_backward()`` (the
zero-bubble schedules backward each stage in an input-gradient and a weight-gradient pass), and
torch's composable ``checkpoint`` with and without its selective contexts. One step of four
microbatches from the same seed; each worker writes its stages' gradients (or the error).

Gradients are compared bitwise with the plain pipeline of the same schedule: the same ops in the
same order, dropout masks replayed from the preserved RNG state. Torch fails both zero-bubble
schedules (torch 2.13: the composable ``checkpoint`` re-enters a spent context manager in the
second pass; its selective checkpoint raises "backward an extra time"), and a failed step leaves
the ranks out of step, so torch's cases are not run there; tests/test_split_backward.py shows
its selective failure without processes.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import releases
import torch
import torch.distributed as dist
from dist_support import SPAWNED_ONCE, WORLD_SIZE, case_result, run_cases, spawned_results
from parallel_support import assert_grads_equal, ours_sac_context, torch_sac_context
from torch import nn
from torch.distributed._composable import checkpoint as torch_composable_checkpoint
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

import checkpointing
from checkpointing._selective.recompute import split_backward

pytestmark = SPAWNED_ONCE

WIDTH = 8
HIDDEN = 16
MICROBATCHES = 4
ROWS = 8  # the global batch; two rows per microbatch
SEED = 1234

# schedule -> (class, stages per rank: stage indices of rank 0 and of rank 1)
SCHEDULES: dict[str, tuple[Any, tuple[tuple[int, ...], tuple[int, ...]]]] = {
    "gpipe": (ScheduleGPipe, ((0,), (1,))),
    "1f1b": (Schedule1F1B, ((0,), (1,))),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, ((0, 2), (1, 3))),
    "interleaved_zero_bubble": (ScheduleInterleavedZeroBubble, ((0, 2), (1, 3))),
    "zbv_zero_bubble": (ScheduleZBVZeroBubble, ((0, 3), (1, 2))),
}
CASES = ("plain", "ours_module", "ours_sac", "torch_module", "torch_sac")
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble")
# torch 2.11's ZBV schedule sets up its stages on gloo with a send from rank 1 to itself (the
# V's two middle stages share it), which gloo refuses ("Pair is not connected"); 2.13 runs it.
ZBV_ON_GLOO = releases.TORCH >= (2, 13)


class Block(nn.Module):
    """``x + down(tanh(dropout(up(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.drop = nn.Dropout(0.25)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.drop(self.up(x))))  # type: ignore[no-any-return]


def _blocks(n_stages: int) -> list[nn.Module]:
    """One block per stage, the same weights on every rank and for every case."""
    torch.manual_seed(0)
    return [Block().double() for _ in range(n_stages)]


def _checkpointed(block: nn.Module, case: str) -> nn.Module:
    if case == "ours_module":
        return checkpointing.checkpoint_module(block)
    if case == "ours_sac":
        return checkpointing.checkpoint_module(block, context_fn=ours_sac_context)
    if case == "torch_module":
        return torch_composable_checkpoint(block)  # type: ignore[no-any-return]
    if case == "torch_sac":
        return torch_composable_checkpoint(  # type: ignore[no-any-return]
            block, context_fn=torch_sac_context
        )
    return block


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)


def _run(rank: int, schedule_name: str, case: str) -> dict[str, torch.Tensor]:
    """One step of ``schedule_name``; this rank's stages' gradients by global name."""
    schedule_class, placement = SCHEDULES[schedule_name]
    n_stages = sum(len(p) for p in placement)
    blocks = _blocks(n_stages)
    mine = placement[rank]
    stages = [
        PipelineStage(
            _checkpointed(blocks[i], case),
            i,
            n_stages,
            torch.device("cpu"),
            group=dist.group.WORLD,
        )
        for i in mine
    ]
    if len(stages) == 1:
        schedule = schedule_class(stages[0], MICROBATCHES, loss_fn=_loss)
    else:
        schedule = schedule_class(stages, MICROBATCHES, loss_fn=_loss)
    x, target = _data()
    kwargs: dict[str, Any] = {}
    if n_stages - 1 in mine:
        kwargs = {"target": target, "losses": []}
    args = (x,) if 0 in mine else ()
    torch.manual_seed(SEED + rank)
    if case == "ours_sac":
        with split_backward():
            schedule.step(*args, **kwargs)
    else:
        schedule.step(*args, **kwargs)
    grads: dict[str, torch.Tensor] = {}
    for i in mine:
        for name, p in blocks[i].named_parameters():
            assert p.grad is not None, (schedule_name, case, i, name)
            grads[f"{i}.{name}"] = p.grad.clone()
    return grads


def _worker(rank: int, port: int, out_dir: str) -> None:
    runs = {
        f"{schedule_name}/{case}": functools.partial(_run, rank, schedule_name, case)
        for schedule_name in SCHEDULES
        for case in CASES
        if schedule_name != "zbv_zero_bubble" or ZBV_ON_GLOO
        # torch fails the zero-bubble schedules, and a failed step desynchronises the ranks
        if not (case.startswith("torch_") and schedule_name in ZERO_BUBBLE)
    }
    run_cases(rank, port, out_dir, runs)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawned_results(tmp_path_factory, "pipeline", _worker)


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_gradients_equal_the_plain_pipeline_bitwise(
    schedule_name: str, case: str, results: list[dict[str, Any]]
) -> None:
    """Each checkpointed pipeline's gradients equal the plain one's, bit for bit, on both
    ranks; torch's selective case on a zero-bubble schedule is skipped (it fails there)."""
    key = f"{schedule_name}/{case}"
    if schedule_name == "zbv_zero_bubble" and not ZBV_ON_GLOO:
        pytest.skip("torch before 2.13 cannot set up ZBV stages on gloo (see ZBV_ON_GLOO)")
    if case.startswith("torch_") and schedule_name in ZERO_BUBBLE:
        pytest.skip("torch's checkpoint fails the zero-bubble schedules (module docstring)")
    for rank in range(WORLD_SIZE):
        got = case_result(results, key, rank)
        want = case_result(results, f"{schedule_name}/plain", rank)
        assert_grads_equal(got, want, f"{key} on rank {rank}")
