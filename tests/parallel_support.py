"""Gloo groups of any size on localhost, for the parallelism tests (``tests/test_parallel_*``).

``dist_support`` spawns pairs; a 2x2 mesh (FSDP2 x TP) needs four processes. Same contract: the
worker runs as ``worker(rank, port, *args)`` in spawned processes, one thread each, writes its
results to files, and a failure in any process reaches the parent.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_support import TIMEOUT, _then_exit, free_port


@contextmanager
def gloo_world(rank: int, port: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size``-process gloo group on 127.0.0.1."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_world(world_size: int, worker: Callable[..., None], *args: Any) -> None:
    """Run ``worker(rank, port, *args)`` in ``world_size`` spawned processes; raise if any
    fails (each ends without Python's teardown once it succeeded, as ``spawn_pair``'s)."""
    mp.start_processes(
        _then_exit,
        args=(worker, free_port(), *args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
