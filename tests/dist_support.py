"""Two gloo processes on localhost for the distributed tests: a free port and the group's setup.

Spawning costs seconds (each process imports torch), so a test file spawns one pair of workers
for all its cases and reads their results back from files.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
# A collective that one rank never joins (it raised) fails after this instead of hanging.
TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def gloo_group(rank: int, port: int) -> Iterator[None]:
    """This process as ``rank`` of a 2-process gloo group on 127.0.0.1, one thread each."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_pair(worker: Callable[..., None], *args: Any) -> None:
    """Run ``worker(rank, port, *args)`` in 2 spawned processes; raise if either fails."""
    mp.start_processes(
        _then_exit,
        args=(worker, free_port(), *args),
        nprocs=WORLD_SIZE,
        join=True,
        start_method="spawn",
    )


def _then_exit(rank: int, worker: Callable[..., None], port: int, *args: Any) -> None:
    """Run the worker; once it has succeeded, end the process without Python's teardown.

    After a gloo group was destroyed, the interpreter's teardown aborted both processes now and
    then ("terminate called without an active exception", SIGABRT, after
    ``destroy_process_group()`` had returned in both: 1 run in 2 to 7 of test_ddp after
    test_fsdp2 and the examples on 2026-11-24). The results are written by then; an exception
    in ``worker`` still reaches the parent through ``start_processes`` as before."""
    worker(rank, port, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
