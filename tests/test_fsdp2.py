"""FSDP2 (``fully_shard``, gloo, 2 CPU processes) with our checkpointing, against torch's.

One pair of spawned workers runs every case: a stack of residual blocks (Linear, dropout, tanh,
Linear), checkpointed per block in one of several ways (``checkpoint_module``, the wrappers,
selective checkpointing, and weight noise in a ``gradient_checkpoint_scope``; the hooks and
wrappers both before and after ``fully_shard``), sharded with ``fully_shard`` per block and at
the root, two forward/backward steps on the rank's own half of a global batch. Each worker writes
the accumulated full gradients (``p.grad.full_tensor()``) and the bytes that the first forward
leaves alive for backward of every case to a file; the tests compare them.

Data and randomness, consciously: rank ``r`` feeds rows ``r::2`` of the global batch, and the CPU
RNG is seeded identically on both ranks before every step (each step its own seed), so both ranks
draw the same dropout masks and weight noise. FSDP2 averages the two ranks' gradients; the
single-process reference does the same sums in the test process: one plain run per half and
step, from that step's seed, averaged over halves. Ours against torch's equivalent under
``fully_shard`` is compared bitwise (same ops, same reduction); against the single process to
1e-12 (float64; the reduction adds in another order).

Bytes: a dispatch mode records every storage that an aten op allocates during the first forward,
and counts those still alive when it returns (FSDP2's own buffers left out). Unlike an outer
saved-tensors hook, this sees what a selective-checkpoint cache keeps, ours or torch's alike.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_support import WORLD_SIZE, gloo_group, spawned_results
from parallel_support import BlockStack
from torch import nn
from torch.distributed._composable import checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as torch_checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.reductions import StorageWeakRef

import checkpointing
from checkpointing import _compat
from checkpointing.policies import MATMUL_OPS, save_matmuls

WIDTH = 8
HIDDEN = 16
DEPTH = 3
BATCH = 4  # rows per rank
NOISE = 0.05
SEED = 1234
STEPS = 2  # gradients accumulate over both: the hooks must leave nothing behind between steps

# Case -> the single-process run it must match (and, if any, torch's equivalent it must match
# bitwise under fully_shard).
CASES: dict[str, tuple[str, str | None]] = {
    "plain": ("plain", None),
    "torch_module": ("plain", None),
    "ours_module": ("plain", "torch_module"),
    "torch_module_after_shard": ("plain", None),
    "ours_module_after_shard": ("plain", "torch_module_after_shard"),
    "torch_wrapper": ("plain", None),
    "ours_wrapper": ("plain", "torch_wrapper"),
    "torch_wrapper_after_shard": ("plain", None),
    "ours_wrapper_after_shard": ("plain", "torch_wrapper_after_shard"),
    "torch_sac": ("plain", None),
    "ours_sac": ("plain", "torch_sac"),
    "noise_plain": ("noise", None),
    "noise_scope": ("noise", "noise_plain"),
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


class Block(nn.Module):
    """``x + down(tanh(dropout(up(x))))``; ``noise`` adds weight noise to ``up`` (plainly or in
    a ``gradient_checkpoint_scope``, README "The scope API")."""

    def __init__(self, noise: str) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.drop = nn.Dropout(0.25)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.noise = noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.up.weight
        if self.noise == "scope":
            with checkpointing.gradient_checkpoint_scope():
                weight = weight + NOISE * torch.randn_like(weight)
        elif self.noise == "plain":
            weight = weight + NOISE * torch.randn_like(weight)
        hidden = torch.tanh(self.drop(F.linear(x, weight, self.up.bias)))
        return x + self.down(hidden)  # type: ignore[no-any-return]


class Net(BlockStack):
    """``DEPTH`` blocks and a linear head, float64, the same weights for every case."""

    def __init__(self, noise: str = "none") -> None:
        super().__init__(functools.partial(Block, noise), DEPTH, WIDTH)


def _global_batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(WORLD_SIZE * BATCH, WIDTH, generator=gen, dtype=torch.float64)


def _loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).pow(2).mean()  # type: ignore[no-any-return]


def _name(parameter_name: str) -> str:
    """The unwrapped name (wrappers add ``_checkpoint_wrapped_module.`` to their parent's)."""
    return parameter_name.replace("_checkpoint_wrapped_module.", "")


def _torch_sac_context() -> Any:
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(sorted(MATMUL_OPS, key=str))


def _prepare(case: str) -> nn.Module:
    """The case's model: checkpointed per block, then (or, ``*_after_shard``, first) sharded."""
    net = Net(noise=case.removeprefix("noise_") if case.startswith("noise_") else "none")
    checkpoint_block: dict[str, Any] = {
        "torch_module": torch_checkpoint,
        "ours_module": checkpointing.checkpoint_module,
        "torch_wrapper": torch_checkpoint_wrapper,
        "ours_wrapper": checkpointing.checkpoint_wrapper,
        "torch_sac": functools.partial(torch_checkpoint, context_fn=_torch_sac_context),
        "ours_sac": functools.partial(
            checkpointing.checkpoint_module,
            context_fn=functools.partial(
                checkpointing.create_selective_checkpoint_contexts, save_matmuls()
            ),
        ),
    }
    after_shard = case.endswith("_after_shard")
    apply = checkpoint_block.get(case.removesuffix("_after_shard"))
    blocks = net.blocks
    if apply is not None and not after_shard:
        for i, block in enumerate(list(blocks)):
            blocks[i] = apply(block)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    if apply is not None and after_shard:
        for i, block in enumerate(list(blocks)):
            blocks[i] = apply(block)
    return net


class _NewStorages(_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """The storages that aten ops allocate (an output sharing no input's storage), less FSDP2's
    own buffers (any storage an ``fsdp::`` or ``c10d::`` op touches: all-gather buffers and
    unsharded parameters, whose lifetime follows FSDP's communication, not autograd).

    Storages are told apart by weak references (equal for the same storage, also across
    resizes; holding them keeps an address from being reused), not by data pointers, which the
    allocator reuses as soon as a buffer is freed.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.allocated: dict[StorageWeakRef, int] = {}
        self.fsdp_buffers: set[StorageWeakRef] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_ref(t) for t in _compat.tree_leaves((args, kwargs)) if _is_tensor(t)}
        outputs = [t for t in _compat.tree_leaves(out) if _is_tensor(t)]
        if func.namespace != "aten":
            self.fsdp_buffers.update(inputs, map(_ref, outputs))
            return out
        for t in outputs:
            ref = _ref(t)
            if ref not in inputs:
                self.allocated.setdefault(ref, t.untyped_storage().nbytes())
        return out

    def bytes_alive(self) -> int:
        """Bytes of the recorded storages still alive, FSDP2's buffers left out."""
        return sum(
            nbytes
            for ref, nbytes in self.allocated.items()
            if ref not in self.fsdp_buffers and not ref.expired()
        )


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def _ref(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


@contextmanager
def _bytes_alive_after() -> Iterator[list[int]]:
    """Bytes of the storages that ops allocated in the block and that are still alive at its
    end: what autograd and checkpoint caches (ours or torch's) keep from forward to backward."""
    mode = _NewStorages()
    alive = [0]
    with mode:
        yield alive
    alive[0] = mode.bytes_alive()


def _run_case(case: str, x: torch.Tensor) -> dict[str, Any]:
    """``STEPS`` forwards and backwards of ``case`` under ``fully_shard``, each from its own
    seed: the accumulated full gradients, and the bytes kept from the first forward."""
    net = _prepare(case)
    torch.manual_seed(SEED)
    with _bytes_alive_after() as alive:
        loss = _loss(net, x)
    loss.backward()
    for step in range(1, STEPS):
        torch.manual_seed(SEED + step)
        _loss(net, x).backward()
    grads = {
        _name(name): p.grad.full_tensor()  # type: ignore[union-attr]
        for name, p in net.named_parameters()
    }
    return {"grads": grads, "bytes_alive": alive[0]}


def _worker(rank: int, port: int, out_dir: str) -> None:
    """Run every case on rows ``rank::2``; write each case's result (or its traceback)."""
    with gloo_group(rank, port):
        x = _global_batch()[rank::WORLD_SIZE]
        results: dict[str, Any] = {}
        for case in CASES:
            try:
                results[case] = _run_case(case, x)
            except Exception:  # reported by the test of that case
                results[case] = {"error": traceback.format_exc()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case's results per rank, from one pair of spawned processes."""
    return spawned_results(tmp_path_factory, "fsdp2", _worker)


@functools.cache
def _single_process(noise: str) -> dict[str, torch.Tensor]:
    """Gradients of one process without checkpointing: each step on each rank's half from that
    step's seed, averaged over ranks as FSDP2's reduce-scatter averages them."""
    net = Net(noise=noise)
    batch = _global_batch()
    for step in range(STEPS):
        for rank in range(WORLD_SIZE):
            torch.manual_seed(SEED + step)
            _loss(net, batch[rank::WORLD_SIZE]).backward()
    return {name: p.grad / WORLD_SIZE for name, p in net.named_parameters()}  # type: ignore[operator]


def _case(results: list[dict[str, Any]], case: str, rank: int) -> dict[str, Any]:
    got = results[rank][case]
    assert "error" not in got, f"{case} failed on rank {rank}:\n{got['error']}"
    return got  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_single_process(case: str, results: list[dict[str, Any]]) -> None:
    """Under fully_shard, full gradients on both ranks equal one process without checkpointing."""
    want = _single_process("plain" if CASES[case][0] == "noise" else "none")
    for rank in range(WORLD_SIZE):
        got = _case(results, case, rank)["grads"]
        assert list(got) == list(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("case", [c for c, (_, twin) in CASES.items() if twin])
def test_gradients_equal_torchs_bitwise(case: str, results: list[dict[str, Any]]) -> None:
    """Under fully_shard, ours gives bit for bit the gradients of torch's equivalent."""
    twin = CASES[case][1]
    assert twin is not None
    for rank in range(WORLD_SIZE):
        got, want = _case(results, case, rank)["grads"], _case(results, twin, rank)["grads"]
        assert list(got) == list(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), f"{case} vs {twin}: {name}"


@pytest.mark.parametrize("case", [c for c, (_, twin) in CASES.items() if twin])
def test_saved_bytes_at_most_torchs(case: str, results: list[dict[str, Any]]) -> None:
    """Activation bytes kept per rank: ours <= torch's equivalent (the scope: < no scope), and
    every checkpointed case < the plain run's."""
    twin = CASES[case][1]
    assert twin is not None
    plain = "noise_plain" if case.startswith("noise_") else "plain"
    for rank in range(WORLD_SIZE):
        ours = _case(results, case, rank)["bytes_alive"]
        theirs = _case(results, twin, rank)["bytes_alive"]
        baseline = _case(results, plain, rank)["bytes_alive"]
        assert ours <= theirs, (case, rank, ours, theirs)
        assert ours < baseline, (case, rank, ours, baseline)
