"""Functional collectives under selective checkpointing (gloo, 2 CPU processes), against torch's.

NOTE [Collectives under selective checkpointing] (``checkpointing/_selective/collectives.py``):
a collective is kept whatever the policy answers, unless it answers ``MUST_RECOMPUTE``, and the
ranks of a group check once per op that they agree. One pair of spawned workers runs every case
on a tensor-parallel-like region (a column-parallel matmul, then ``all_reduce``, ``all_gather``,
``reduce_scatter`` and ``all_to_all_single`` from ``torch.distributed._functional_collectives``,
and their ``_autograd`` and ``_coalesced`` variants in a second region), counts the collectives
that run during backward with a dispatch mode around it, and writes the counts, the gradients
and the errors to a file per rank. The tests compare: kept by default (our policies, a user's
policy, under our checkpoint and torch's, eager and under ``torch.compile``): no collective
re-run, as many as the plain run's backward; torch's own selective checkpointing re-runs them;
an explicit ``MUST_RECOMPUTE`` re-runs them too, with the same gradients; ranks that disagree
both get the error; the report shows the kept collectives' bytes. Gradients are compared bitwise
with the plain distributed run (same ops in the same order on each rank).

Time is bounded: the group's timeout is 60 s (``dist_support.TIMEOUT``), the agreement waits 3 s
here for a rank that never answers, and the parent kills the pair past ``LIMIT`` seconds.
"""

from __future__ import annotations

import functools
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_support import (
    WORLD_SIZE,
    CollectiveLaunches,
    case_result,
    gloo_group,
    launches_collective,
    spawned_results,
)
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import (
    create_selective_checkpoint_contexts as torch_contexts,
)

import checkpointing
from checkpointing import CheckpointError, CheckpointPolicy, create_selective_checkpoint_contexts
from checkpointing.policies import as_context_fn, save_matmuls, save_nothing

pytestmark = [
    pytest.mark.once,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

LIMIT = 240.0  # seconds for the whole pair, spawn included
WIDTH = 4
SEED = 7


def _tp_region(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, group: Any) -> torch.Tensor:
    """A tensor-parallel-like block: every functional collective once, matmuls between them."""
    from torch.distributed import _functional_collectives as funcol

    h = funcol.all_reduce(x @ w1, "sum", group).tanh()  # row-parallel output
    g = funcol.all_gather_tensor(h, 0, group) @ w2  # sequence-parallel gather
    s = funcol.reduce_scatter_tensor(g.sin(), "sum", 0, group)
    return funcol.all_to_all_single(s, None, None, group).cos() * 2  # type: ignore[no-any-return]


def _variants_region(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, group: Any
) -> torch.Tensor:
    """The ``_autograd`` and ``_coalesced`` variants."""
    from torch.distributed import _functional_collectives as funcol

    a, b = funcol.all_reduce_coalesced([x @ w1, (x @ w2).tanh()], "sum", group)
    g = funcol.all_gather_tensor_autograd(a.tanh(), 0, group) @ w2
    s = funcol.reduce_scatter_tensor_autograd(g.sin(), "sum", 0, group)
    t = funcol.all_to_all_single_autograd(s, None, None, group)
    return t.cos() * 2 + b.sum()  # type: ignore[no-any-return]


def _collective_recomputed(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmuls, recompute the collectives explicitly, and the rest as one pleases."""
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    if launches_collective(op) or getattr(op, "namespace", "") == "_c10d_functional":
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> TorchPolicy:
    """A user's policy (torch's enum): matmuls kept, everything else PREFER_RECOMPUTE."""
    if op == torch.ops.aten.mm.default:
        return TorchPolicy.MUST_SAVE
    return TorchPolicy.PREFER_RECOMPUTE


Region = Callable[..., torch.Tensor]


def _runs(group: Any) -> dict[str, Callable[[Region, tuple[torch.Tensor, ...]], torch.Tensor]]:
    """Case -> how it runs a region on its inputs."""

    def ours(context_fn: Any) -> Callable[[Region, tuple[torch.Tensor, ...]], torch.Tensor]:
        return lambda region, xs: checkpointing.checkpoint(
            region, *xs, group, use_reentrant=False, context_fn=context_fn
        )

    def compiled(
        run: Callable[[Region, tuple[torch.Tensor, ...]], torch.Tensor],
    ) -> Callable[[Region, tuple[torch.Tensor, ...]], torch.Tensor]:
        """``run`` under ``torch.compile`` (aot_eager: the partitioner reads the policy's tags)."""
        return lambda region, xs: torch.compile(
            lambda *inputs: run(region, inputs), backend="aot_eager", fullgraph=False
        )(*xs)

    user = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    return {
        "plain": lambda region, xs: region(*xs, group),
        "torch_sac": lambda region, xs: torch_checkpoint(
            region,
            *xs,
            group,
            use_reentrant=False,
            context_fn=functools.partial(torch_contexts, _keep_matmuls),
        ),
        "ours_user_policy": ours(user),
        "ours_save_matmuls": ours(as_context_fn(save_matmuls())),
        "ours_save_nothing": ours(as_context_fn(save_nothing())),
        "ours_under_torch_checkpoint": lambda region, xs: torch_checkpoint(
            region, *xs, group, use_reentrant=False, context_fn=as_context_fn(save_matmuls())
        ),
        "ours_must_recompute": ours(
            functools.partial(create_selective_checkpoint_contexts, _collective_recomputed)
        ),
        "ours_compiled": compiled(ours(as_context_fn(save_matmuls()))),
        "torch_compiled": compiled(
            lambda region, xs: torch_checkpoint(
                region,
                *xs,
                group,
                use_reentrant=False,
                context_fn=functools.partial(torch_contexts, _keep_matmuls),
            )
        ),
        "ours_compiled_must_recompute": compiled(
            ours(functools.partial(create_selective_checkpoint_contexts, _collective_recomputed))
        ),
        "torch_must_recompute": lambda region, xs: torch_checkpoint(
            region,
            *xs,
            group,
            use_reentrant=False,
            context_fn=functools.partial(torch_contexts, _collective_recomputed),
        ),
    }


def _inputs(rank: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(SEED + rank)
    return tuple(
        torch.randn(WIDTH, WIDTH, dtype=torch.float64, generator=generator, requires_grad=True)
        for _ in range(3)
    )


def _step(run: Callable[..., torch.Tensor], region: Region, rank: int) -> dict[str, Any]:
    xs = _inputs(rank)
    loss = run(region, xs).sum()
    counter = CollectiveLaunches()
    with counter:
        loss.backward()
    return {"grads": [x.grad for x in xs], "launched": counter.launched}


def _worker(rank: int, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # funcol's renamed functions
    from checkpointing._selective import collectives

    results: dict[str, Any] = {}
    with gloo_group(rank, port):
        world = dist.group.WORLD
        for region_name, region in (("tp", _tp_region), ("variants", _variants_region)):
            for case, run in _runs(world).items():
                key = f"{region_name}/{case}"
                try:
                    results[key] = _step(run, region, rank)
                except Exception:
                    results[key] = {"error": traceback.format_exc()}
        # The ranks disagree: rank 0 keeps the collectives, rank 1 recomputes them. A fresh
        # group, so that its first call is checked (the agreement is once per group and op).
        fresh = dist.new_group([0, 1], backend="gloo")
        policy = _keep_matmuls if rank == 0 else _collective_recomputed
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        try:
            _step(
                lambda region, xs: checkpointing.checkpoint(
                    region, *xs, fresh, use_reentrant=False, context_fn=context_fn
                ),
                _tp_region,
                rank,
            )
            results["disagree"] = {"error": None}
        except CheckpointError as error:
            results["disagree"] = {"error": str(error)}
        # A rank that checkpoints no region: the other waits (3 s here) and says so.
        collectives.AGREEMENT_TIMEOUT = __import__("datetime").timedelta(seconds=3)  # type: ignore[misc]
        lonely = dist.new_group([0, 1], backend="gloo")

        def one_collective(x: torch.Tensor) -> torch.Tensor:
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(x * 2, "sum", lonely).sin()  # type: ignore[no-any-return]

        x = _inputs(rank)[0]
        try:
            if rank == 0:
                checkpointing.checkpoint(
                    one_collective, x, use_reentrant=False, context_fn=as_context_fn(save_matmuls())
                )
            else:
                one_collective(x)
            results["absent"] = {"error": None}
        except CheckpointError as error:
            results["absent"] = {"error": str(error)}
        # The report shows the bytes of the kept collectives.
        try:
            results["report"] = _report(rank, world)
        except Exception:
            results["report"] = {"error": traceback.format_exc()}
        dist.barrier()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _report(rank: int, group: Any) -> dict[str, Any]:
    """The report of a watched step, and the one walked from the loss of another."""
    context_fn = as_context_fn(save_matmuls())
    with checkpointing.saved_tensors_report() as report:
        xs = _inputs(rank)
        loss = checkpointing.checkpoint(
            _tp_region, *xs, group, use_reentrant=False, context_fn=context_fn
        ).sum()
        loss.backward()
    xs = _inputs(rank)
    loss = checkpointing.checkpoint(
        _tp_region, *xs, group, use_reentrant=False, context_fn=context_fn
    ).sum()
    walked = checkpointing.saved_tensors_report(loss)
    loss.backward()
    return {
        form: {
            "collective_bytes": got.collective_bytes,
            "rows": [(r.op, r.nbytes, r.decision, r.collective) for r in got.records],
            "summary": str(got),
        }
        for form, got in (("watched", report), ("walked", walked))
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawned_results(tmp_path_factory, "collectives", _worker, limit=LIMIT)


REGIONS = ("tp", "variants")
KEPT = (
    "ours_user_policy",
    "ours_save_matmuls",
    "ours_save_nothing",
    "ours_under_torch_checkpoint",
    "ours_compiled",
)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("case", KEPT)
def test_kept_by_default_none_re_run(
    results: list[dict[str, Any]], region: str, case: str, rank: int
) -> None:
    plain = case_result(results, f"{region}/plain", rank)
    got = case_result(results, f"{region}/{case}", rank)
    assert got["launched"] == plain["launched"]  # backward's own collectives, nothing more
    for ours, reference in zip(got["grads"], plain["grads"], strict=True):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("case", ["torch_sac", "torch_compiled"])
def test_torch_re_runs_what_its_policy_does_not_keep(
    results: list[dict[str, Any]], region: str, case: str, rank: int
) -> None:
    plain = case_result(results, f"{region}/plain", rank)
    got = case_result(results, f"{region}/{case}", rank)
    assert len(got["launched"]) > len(plain["launched"])
    for theirs, reference in zip(got["grads"], plain["grads"], strict=True):
        assert torch.equal(theirs, reference)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("region", REGIONS)
def test_must_recompute_re_runs_them_as_torch_does(
    results: list[dict[str, Any]], region: str, rank: int
) -> None:
    plain = case_result(results, f"{region}/plain", rank)
    ours = case_result(results, f"{region}/ours_must_recompute", rank)
    theirs = case_result(results, f"{region}/torch_must_recompute", rank)
    compiled = case_result(results, f"{region}/ours_compiled_must_recompute", rank)
    assert len(ours["launched"]) > len(plain["launched"])
    assert sorted(ours["launched"]) == sorted(theirs["launched"])
    assert len(compiled["launched"]) > len(plain["launched"])
    for run in (ours, compiled):
        for got, reference in zip(run["grads"], plain["grads"], strict=True):
            assert torch.equal(got, reference)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_ranks_that_disagree_all_get_the_error(results: list[dict[str, Any]], rank: int) -> None:
    error = results[rank]["disagree"]["error"]
    assert error is not None, "no error though rank 1 recomputes what rank 0 keeps"
    assert "disagree on whether to recompute the collective _c10d_functional.all_reduce" in error
    assert "rank(s) 1 recompute it" in error
    assert "rank(s) 0 keep it" in error
    assert "Fix:" in error


def test_a_rank_without_a_region_is_named(results: list[dict[str, Any]]) -> None:
    error = results[0]["absent"]["error"]
    assert error is not None
    assert "rank(s) 1 of process group" in error
    assert "Fix: checkpoint the same regions" in error
    assert results[1]["absent"]["error"] is None  # it ran no region: it was never asked


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("form", ["watched", "walked"])
def test_report_shows_the_kept_collectives(
    results: list[dict[str, Any]], form: str, rank: int
) -> None:
    got = case_result(results, "report", rank)[form]
    rows = got["rows"]
    collective = [row for row in rows if row[3]]
    # all_reduce, all_gather, reduce_scatter, all_to_all: each output kept once
    assert sorted(row[0] for row in collective) == sorted(
        f"_c10d_functional::{name}"
        for name in (
            "all_reduce",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_to_all_single",
        )
    )
    assert all(row[2] == "saved" for row in collective)
    assert got["collective_bytes"] == sum(row[1] for row in collective) > 0
    assert "kept collective outputs" in got["summary"]
