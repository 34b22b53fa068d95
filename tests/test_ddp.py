"""DistributedDataParallel (gloo, 2 CPU processes) with each checkpointing mechanism.

Each worker trains the same tiny model for a few SGD steps on its half of a global batch; the
parameters after training must match a single-process run on the whole batch. DDP averages the
two halves' gradients with an all-reduce, which sums in a different order than one process does,
so the comparison is ``allclose`` at 1e-6 (float64 makes the difference ~1e-16 in practice).

The reentrant variant needs ``static_graph=True`` under DDP (README, "Distributed training"):
its backward runs inside autograd's engine a second time, which DDP's default reducer takes for
a parameter being marked ready twice. That documented setup is tested too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_support import gloo_group, spawn_pair
from mechanism_support import require

import checkpointing
from checkpointing import apply_activation_checkpointing

STEPS = 3
BATCH = 8
WIDTH = 6
# Setups: (mechanism, DDP keyword arguments). All but reentrant use DDP's defaults.
SETUPS: dict[str, dict[str, Any]] = {
    "non_reentrant": {},
    "sac": {},
    "scope": {},
    "sequential": {},
    "wrapper": {},
    "module": {},
    "reentrant_static_graph": {"static_graph": True},
}
NEEDS = {"sac": "create_selective_checkpoint_contexts", "scope": "gradient_checkpoint_scope"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


class Model(torch.nn.Module):
    """Two blocks and a head; ``mechanism`` decides how the blocks are checkpointed."""

    def __init__(self, mechanism: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mechanism = mechanism
        self.blocks = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH)
        )
        self.head = torch.nn.Linear(WIDTH, 1)
        self.double()
        if mechanism == "wrapper":
            apply_activation_checkpointing(
                self.blocks, check_fn=lambda m: isinstance(m, torch.nn.Linear)
            )
        if mechanism == "module":  # the README's recipe: hooks instead of wrappers
            apply_activation_checkpointing(
                self.blocks,
                checkpoint_wrapper_fn=checkpointing.checkpoint_module,
                check_fn=lambda m: isinstance(m, torch.nn.Linear),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mechanism
        if m == "non_reentrant":
            h = checkpointing.checkpoint(self.blocks, x, use_reentrant=False)
        elif m == "reentrant_static_graph":
            h = checkpointing.checkpoint(self.blocks, x, use_reentrant=True)
        elif m == "sac":
            context_fn = _save_matmuls_context(require("create_selective_checkpoint_contexts"))
            h = checkpointing.checkpoint(self.blocks, x, use_reentrant=False, context_fn=context_fn)
        elif m == "scope":
            with require("gradient_checkpoint_scope")():
                h = self.blocks[1](self.blocks[0](x))
            h = self.blocks[2](h)
        elif m == "sequential":
            h = checkpointing.checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        else:
            h = self.blocks(x)
        return self.head(h)  # type: ignore[no-any-return]


def _save_matmuls_context(create: Any) -> Any:
    def context_fn() -> Any:
        return create([torch.ops.aten.addmm.default, torch.ops.aten.mm.default])

    return context_fn


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, BATCH, WIDTH, generator=gen, dtype=torch.float64)
    return x, x.sin().sum(-1, keepdim=True)


def _train(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in zip(xs, ys, strict=True):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


# The worker's DDP models, kept until the process ends (``dist_support._then_exit`` ends it with
# ``os._exit``): freeing a model frees its reducer, whose gloo process group joins its worker
# thread while holding the GIL, and that thread may wait for the GIL to drop a tensor: a
# deadlock seen twice in 2026-11-25 runs (the spawned rank stuck in ~ProcessGroupGloo).
_KEPT_UNTIL_EXIT: list[torch.nn.Module] = []


def _worker(rank: int, port: int, mechanisms: list[str], out_dir: str) -> None:
    """One DDP process: for each mechanism, train on rows ``rank::2`` of each batch and save
    the final parameters."""
    with gloo_group(rank, port):
        for mechanism in mechanisms:
            model = torch.nn.parallel.DistributedDataParallel(Model(mechanism), **SETUPS[mechanism])
            xs, ys = _data()
            if mechanism == "reentrant_static_graph":
                xs.requires_grad_()  # reentrant: an input must require grad (README)
            _KEPT_UNTIL_EXIT.append(model)
            _train(model, xs[:, rank::2], ys[:, rank::2])
            torch.save(model.module.state_dict(), Path(out_dir) / f"{mechanism}{rank}.pt")


def _available() -> list[str]:
    found = []
    for mechanism in SETUPS:
        try:
            if mechanism in NEEDS:
                require(NEEDS[mechanism])
        except pytest.skip.Exception:
            continue
        found.append(mechanism)
    return found


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train every available setup once, in one pair of spawned processes (spawning costs
    seconds; one spawn keeps the file fast)."""
    out_dir = tmp_path_factory.mktemp("ddp")
    spawn_pair(_worker, _available(), str(out_dir))
    return out_dir


@pytest.mark.parametrize("mechanism", list(SETUPS))
def test_ddp_matches_single_process(mechanism: str, trained: Path) -> None:
    """2 gloo processes under DDP end with the parameters of one process on the whole batch."""
    if mechanism in NEEDS:
        require(NEEDS[mechanism])
    reference = Model("plain")
    xs, ys = _data()
    _train(reference, xs, ys)
    want = reference.state_dict()
    for rank in range(2):
        got = torch.load(trained / f"{mechanism}{rank}.pt")
        assert list(got) == list(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)
