"""Gloo processes on localhost for the distributed tests: a free port, the group's setup, and the
workers' results.

Spawning costs seconds (each process imports torch), so a test file spawns one set of workers
(a pair, or four for a 2x2 mesh) for all its cases and reads their results back from files.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
# A collective that one rank never joins (it raised) fails after this instead of hanging.
TIMEOUT = timedelta(seconds=60)
# The marks of a test file whose cases run in one spawned set of workers (a module's fixture).
SPAWNED_ONCE = [
    pytest.mark.once,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def gloo_group(rank: int, port: int, world_size: int = WORLD_SIZE) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size``-process gloo group on 127.0.0.1, one thread
    each."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_world(
    world_size: int, worker: Callable[..., None], *args: Any, limit: float | None = None
) -> None:
    """Run ``worker(rank, port, *args)`` in ``world_size`` spawned processes; raise if any
    fails. With a ``limit``, the processes are killed and the test fails past ``limit``
    seconds (spawn included), for workers that may hang on a collective."""
    context = mp.start_processes(
        _then_exit,
        args=(worker, free_port(), *args),
        nprocs=world_size,
        join=limit is None,
        start_method="spawn",
    )
    if limit is None:
        return
    deadline = time.monotonic() + limit
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"the workers of {worker.__module__} ran past {limit:.0f} s")


def spawn_pair(worker: Callable[..., None], *args: Any, limit: float | None = None) -> None:
    """Run ``worker(rank, port, *args)`` in 2 spawned processes; raise if either fails (and
    past ``limit`` seconds where one is given, as ``spawn_world``)."""
    spawn_world(WORLD_SIZE, worker, *args, limit=limit)


def run_cases(
    rank: int,
    port: int,
    out_dir: str,
    cases: Mapping[str, Callable[[], Any]],
    world_size: int = WORLD_SIZE,
) -> None:
    """In a worker, inside ``gloo_group``: run every case in order, a barrier after each, and
    write this rank's results as ``out_dir/rank<rank>.pt``: a case's result, or
    ``{"error": traceback}`` where it raised (the tests of that case report it; the other cases
    still run)."""
    with gloo_group(rank, port, world_size):
        results: dict[str, Any] = {}
        for key, run in cases.items():
            try:
                results[key] = run()
            except Exception:
                results[key] = {"error": traceback.format_exc()}
            dist.barrier()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def spawned_results(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    worker: Callable[[int, int, str], None],
    world_size: int = WORLD_SIZE,
    limit: float | None = None,
) -> list[dict[str, Any]]:
    """Run ``worker(rank, port, out_dir)`` in ``world_size`` spawned processes (as
    ``spawn_world``, ``out_dir`` a new folder named after ``name``) and read back, per rank, the
    results it wrote as ``run_cases`` writes them."""
    out_dir = tmp_path_factory.mktemp(name)
    spawn_world(world_size, worker, str(out_dir), limit=limit)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


def case_result(results: list[dict[str, Any]], key: str, rank: int) -> dict[str, Any]:
    """Case ``key``'s result on ``rank``; fails with the worker's traceback where it raised."""
    got = results[rank][key]
    assert "error" not in got, f"{key} failed on rank {rank}:\n{got['error']}"
    return got  # type: ignore[no-any-return]


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


# Collective launches, counted apart from the package's own list of collectives on purpose: a
# test that reads the package's list could not see the package's list go wrong.
_WAITS = frozenset({"wait_tensor", "wait_tensors", "_wrap_tensor_autograd"})


def launches_collective(func: Any) -> bool:
    """A functional collective's launch (not a wait): what a re-run in backward would cost."""
    namespace = getattr(func, "namespace", "")
    return namespace.startswith("_c10d_functional") and func.overloadpacket.__name__ not in _WAITS


class CollectiveLaunches(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the collective launches while it is active (their names in ``launched``)."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if launches_collective(func):
            self.launched.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
