"""FSDP2 with hook-based checkpointing: `checkpoint_module` on every block, then `fully_shard`.

Two CPU processes (gloo, 127.0.0.1) train the same small MLP stack, each on its own half of the
batch, once without and once with checkpointing. Each rank prints the activation bytes its
forward keeps for backward; the gradients (gathered with `full_tensor()`) are asserted equal.

Run: python examples/06_fsdp2_composable.py
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import checkpointing

WIDTH, DEPTH, BATCH = 128, 4, 32  # BATCH rows per rank


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(x))))  # type: ignore[no-any-return]


def step(rank: int, use_checkpoint: bool) -> tuple[int, dict[str, torch.Tensor]]:
    """One training step under FSDP2; returns the activation bytes kept and the full gradients."""
    torch.manual_seed(0)  # the same weights in both runs
    model = nn.Sequential(*(Block() for _ in range(DEPTH)), nn.Linear(WIDTH, 1))
    mesh = init_device_mesh("cpu", (2,))
    for block in model[:-1]:
        if use_checkpoint:
            checkpointing.checkpoint_module(block)  # hooks: names and state_dict keys unchanged
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    x = torch.randn(2 * BATCH, WIDTH, generator=torch.Generator().manual_seed(1))[rank::2]
    torch.manual_seed(2)  # the same dropout masks in both runs
    with checkpointing.saved_tensors_report() as report:
        loss = model(x).pow(2).mean()
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}  # type: ignore[union-attr]
    return report.activation_bytes, grads


def worker(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plain_bytes, plain_grads = step(rank, use_checkpoint=False)
        ckpt_bytes, ckpt_grads = step(rank, use_checkpoint=True)
        lines: list[str | None] = [None, None]
        dist.all_gather_object(
            lines,
            f"rank {rank}: activations kept for backward: {plain_bytes / 2**10:7.1f} KiB without "
            f"checkpointing, {ckpt_bytes / 2**10:7.1f} KiB with checkpoint_module",
        )
        if rank == 0:
            print("\n".join(str(line) for line in lines))
        assert all(torch.equal(plain_grads[k], ckpt_grads[k]) for k in plain_grads)
        assert ckpt_bytes < plain_bytes
        if rank == 0:
            print("gradients identical on both ranks")
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, during which gloo's threads sometimes
    # abort the process (SIGABRT) after the group was destroyed.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    mp.spawn(worker, args=(free_port,), nprocs=2)
