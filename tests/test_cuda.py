"""On a CUDA device: what the CPU suite cannot see.

The CUDA RNG replayed in recompute (every mechanism), the pinned host copies and the device
memory of offload, the peak and held device memory of a checkpointed stack, autocast on CUDA,
and the planner's offload (``host_budget``), which only runs on an accelerator. Every test
compares with the run without checkpointing and, for the parity features, with
``torch.utils.checkpoint`` side by side. Device memory is read with ``torch.cuda``'s allocator
counters, synchronized around each read, after a warm-up step of the same code (cuBLAS allocates
its workspaces through the caching allocator, once per thread).
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from frame_support import assert_tensors_equal
from torch import Tensor, nn

import checkpointing
from checkpointing import CheckpointPolicy, OffloadStats, _offload, policies
from checkpointing._compat import TorchDispatchMode, tree_leaves

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
aten = torch.ops.aten

Run = Callable[..., Tensor]
"""How a test runs one region: ``run(fn, *args)`` returns ``fn(*args)``, checkpointed or not."""


def _plain(fn: Callable[..., Tensor], *args: Any) -> Tensor:
    return fn(*args)


def _ours(**options: Any) -> Run:
    return functools.partial(checkpointing.checkpoint, **options)


def _theirs(**options: Any) -> Run:
    return functools.partial(torch_checkpoint.checkpoint, **options)


# Per mechanism: (our options, torch's options). Selective checkpointing saves the matmuls: ours
# through the policy, torch's through the list of the same overloads.
_MECHANISMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "non-reentrant": ({"use_reentrant": False}, {"use_reentrant": False}),
    "reentrant": ({"use_reentrant": True}, {"use_reentrant": True}),
    "selective": (
        {
            "use_reentrant": False,
            "context_fn": functools.partial(
                checkpointing.create_selective_checkpoint_contexts, policies.save_matmuls()
            ),
        },
        {
            "use_reentrant": False,
            "context_fn": functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, list(policies.MATMUL_OPS)
            ),
        },
    ),
}


@dataclass
class _Step:
    """One forward+backward on a device: gradients, bytes, and the device's RNG state after."""

    grads: list[Tensor]
    held: int
    """Device bytes the forward allocated and still holds when it returns (the loss included)."""
    peak: int
    """Peak device bytes over forward and backward, above what was in use before the step."""
    rng: Tensor


def _measured(forward: Callable[[], Tensor], wrt: Sequence[Tensor]) -> _Step:
    """Run ``forward`` and backward from its loss, ``.grad`` of ``wrt`` cleared first (so the
    gradients count in the peak); memory is read on the device of ``wrt[0]``."""
    device = wrt[0].device
    for tensor in wrt:
        tensor.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    loss = forward()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    loss.backward()
    del loss
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return _Step(_taken_grads(wrt), held, peak, torch.cuda.get_rng_state(device))


def _taken_grads(wrt: Sequence[Tensor]) -> list[Tensor]:
    """The ``.grad`` of each tensor, cleared on the tensor (a later backward would otherwise
    accumulate into the very tensors returned)."""
    grads = []
    for tensor in wrt:
        assert tensor.grad is not None, "backward gave this tensor no gradient"
        grads.append(tensor.grad)
        tensor.grad = None
    return grads


def _leaves(*shapes: tuple[int, ...], device: torch.device = CUDA) -> list[Tensor]:
    """Fresh float32 leaves that require grad, scaled by 1/sqrt(last dim), drawn from their own
    generator (the global RNG is untouched)."""
    gen = torch.Generator(device).manual_seed(0)
    return [
        (torch.randn(*shape, device=device, generator=gen) / shape[-1] ** 0.5).requires_grad_()
        for shape in shapes
    ]


# --- CUDA RNG: every mechanism replays the draws ---------------------------------------------


def _random_layer(
    x: Tensor, w: Tensor, around: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
) -> Tensor:
    """Dropout and ``rand_like`` on CUDA (drawn inside ``around()``), then a matmul and tanh."""
    with around():
        h = F.dropout(x @ w, 0.5, training=True)
        h = h * torch.rand_like(h)
    return torch.tanh(h @ w)


def _random_step(run: Run, layer: Callable[..., Tensor] = _random_layer) -> _Step:
    """Three random layers in a chain, each run by ``run``, from the same seed every time. Each
    layer has its own weight: reentrant checkpoint adds up the gradient of a weight shared by
    several regions in another order than autograd does, which is not bit-identical."""
    x, *ws = _leaves(*[(256, 256)] * 4)

    def forward() -> Tensor:
        torch.manual_seed(1)  # seeds every CUDA device too
        h = x
        for w in ws:
            h = run(layer, h, w)
        return h.sum()

    return _measured(forward, [x, *ws])


@pytest.mark.parametrize("mechanism", list(_MECHANISMS))
def test_cuda_draws_are_replayed_bit_identically(mechanism: str) -> None:
    """Dropout and rand_like on CUDA: ours and torch's gradients equal the plain run's bit for
    bit, and both keep less than it (the regions really are checkpointed)."""
    ours_options, torch_options = _MECHANISMS[mechanism]
    plain = _random_step(_plain)
    ours = _random_step(_ours(**ours_options))
    theirs = _random_step(_theirs(**torch_options))
    assert_tensors_equal(ours.grads, plain.grads, "ours")
    assert_tensors_equal(theirs.grads, plain.grads, "torch")
    assert ours.held < plain.held
    assert ours.held <= theirs.held


def test_scope_replays_cuda_draws_bit_identically() -> None:
    """Draws made on CUDA inside gradient_checkpoint_scope are replayed exactly: gradients and
    the CUDA RNG stream equal the plain run's, and the scope keeps less than it."""
    scoped = functools.partial(_random_layer, around=checkpointing.gradient_checkpoint_scope)
    plain = _random_step(_plain)
    with checkpointing.gradient_checkpoint_session():
        ours = _random_step(_plain, scoped)
    assert_tensors_equal(ours.grads, plain.grads, "scope")
    assert torch.equal(ours.rng, plain.rng)
    assert ours.held < plain.held


def test_without_preserved_rng_state_recompute_draws_other_numbers() -> None:
    """preserve_rng_state=False: recompute draws new CUDA numbers, so the gradients differ from
    the plain run's (ours exactly as torch's do)."""
    plain = _random_step(_plain)
    ours = _random_step(_ours(use_reentrant=False, preserve_rng_state=False))
    theirs = _random_step(_theirs(use_reentrant=False, preserve_rng_state=False))
    assert not torch.equal(ours.grads[1], plain.grads[1])
    assert_tensors_equal(ours.grads, theirs.grads, "ours vs torch")


# --- Device state: the inputs' device RNG, autocast on CUDA -----------------------------------

_DEVICES = [
    pytest.param(0, id="cuda:0"),
    pytest.param(
        1,
        id="cuda:1",
        marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    ),
]


@pytest.mark.parametrize("index", _DEVICES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_rng_of_the_inputs_device_is_restored_after_a_reseed(index: int, reentrant: bool) -> None:
    """Inputs on cuda:<index> (the current device stays 0): recompute replays that device's
    draws though every CUDA generator was reseeded between forward and backward, then leaves
    the reseeded stream in place; as torch does, and with the plain run's gradients."""
    device = torch.device("cuda", index)

    def step(run: Run) -> _Step:
        x, w = _leaves((256, 256), (256, 256), device=device)

        def forward() -> Tensor:
            torch.manual_seed(2)
            loss = run(_random_layer, x, w).sum()
            torch.cuda.manual_seed_all(99)
            return loss

        return _measured(forward, [x, w])

    plain = step(_plain)
    ours = step(_ours(use_reentrant=reentrant))
    theirs = step(_theirs(use_reentrant=reentrant))
    assert_tensors_equal(ours.grads, plain.grads, "ours")
    assert_tensors_equal(theirs.grads, plain.grads, "torch")
    assert torch.equal(ours.rng, plain.rng)
    assert torch.equal(theirs.rng, plain.rng)


def _mixed_layer(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    return F.dropout(F.gelu(x @ w1), 0.1, training=True) @ w2


@pytest.mark.parametrize("mechanism", list(_MECHANISMS))
def test_cuda_autocast_is_restored_in_recompute(mechanism: str) -> None:
    """Regions run under torch.autocast("cuda", bfloat16) and backward outside it: recompute
    runs in bfloat16 again, and gradients equal the plain run's and torch's bit for bit."""
    ours_options, torch_options = _MECHANISMS[mechanism]

    def step(run: Run) -> _Step:
        x, *ws = _leaves((512, 256), *[(256, 1024), (1024, 256)] * 2)

        def forward() -> Tensor:
            torch.manual_seed(3)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = x
                for w1, w2 in zip(ws[::2], ws[1::2], strict=True):
                    h = run(_mixed_layer, h, w1, w2)
            assert h.dtype == torch.bfloat16
            return h.float().sum()

        return _measured(forward, [x, *ws])

    plain = step(_plain)
    assert_tensors_equal(step(_ours(**ours_options)).grads, plain.grads, "ours")
    assert_tensors_equal(step(_theirs(**torch_options)).grads, plain.grads, "torch")


# --- Offload to pinned host memory -----------------------------------------------------------


class _HostStorages(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Every host storage an op makes while the mode is on, by address: (pinned, bytes).

    Entered before the checkpoint, it sits below the selective modes on the dispatch stack, so
    it also sees the ops they run themselves (the host copy, ``empty_like(pin_memory=True)``).
    Private access (torch's ``TorchDispatchMode``, through ``checkpointing._compat`` as in the
    other tests): the cache entries that hold the copies are private, and torch's public pinned
    memory counters (``torch.cuda.host_memory_stats``) changed their keys between releases.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.storages: dict[int, tuple[bool, int]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, Tensor) and leaf.device.type == "cpu":
                storage = leaf.untyped_storage()
                self.storages[storage.data_ptr()] = (leaf.is_pinned(), storage.nbytes())
        return out


def _three_matmuls(x: Tensor, w: Tensor) -> Tensor:
    return ((x @ w).relu() @ w).sigmoid() @ w


def _offload_step(
    policy: policies.Policy | None,
    stats: OffloadStats | None = None,
    watch: AbstractContextManager[Any] | None = None,
    *,
    n: int = 1024,
    regions: int = 4,
) -> _Step:
    """``regions`` checkpointed regions of three n x n matmuls under ``policy`` (plain without)."""
    x, w = _leaves((n, n), (n, n))
    context_fn = None if policy is None else policies.as_context_fn(policy, offload_stats=stats)

    def forward() -> Tensor:
        h = x
        with watch or contextlib.nullcontext():
            for _ in range(regions):
                if context_fn is None:
                    h = _three_matmuls(h, w)
                else:
                    h = checkpointing.checkpoint(
                        _three_matmuls, h, w, use_reentrant=False, context_fn=context_fn
                    )
        return h.sum()

    return _measured(forward, [x, w])


def test_offload_copies_to_pinned_memory_counts_bytes_and_keeps_no_device_copy() -> None:
    """offload_ops(mm) on CUDA: every host copy is pinned, OffloadStats counts the bytes both
    ways, the device keeps no more than full recompute (less than saving the mms), and the
    gradients equal the plain run's."""
    n, regions = 1024, 4
    mm_bytes = n * n * 4
    _offload_step(policies.offload_ops(aten.mm.default))  # warm-up
    plain = _offload_step(None)
    saved = _offload_step(policies.save_ops(aten.mm.default))
    recomputed = _offload_step(policies.save_nothing())
    stats, host = OffloadStats(), _HostStorages()
    with _offload.installed(_offload.Engine(_offload.CudaBackend())):  # an empty pinned pool
        offloaded = _offload_step(policies.offload_ops(aten.mm.default), stats, host)

    assert_tensors_equal(offloaded.grads, plain.grads, "offload")
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (3 * regions, 3 * regions * mm_bytes)
    # Early stop: backward needs no output of a region's last mm, so recompute ends before it.
    assert (stats.restored_tensors, stats.restored_bytes) == (2 * regions, 2 * regions * mm_bytes)
    pinned = [nbytes for is_pinned, nbytes in host.storages.values() if is_pinned]
    unpinned = [nbytes for is_pinned, nbytes in host.storages.values() if not is_pinned]
    assert (len(pinned), sum(pinned)) == (stats.offloaded_tensors, stats.offloaded_bytes)
    assert not [nbytes for nbytes in unpinned if nbytes >= mm_bytes], host.storages
    # Copies still in flight when the forward ends hold their device tensors: at most the last
    # two regions' (NOTE [Host copies off the critical path], Rule 2).
    assert offloaded.held <= recomputed.held + 2 * 3 * mm_bytes
    assert recomputed.held < saved.held
    assert saved.held - offloaded.held >= (regions - 2) * 3 * mm_bytes


def test_offloaded_bf16_tag_comes_back_to_the_device() -> None:
    """offload_these_names under CUDA autocast: the tagged bfloat16 matmul output goes to host
    and back (counted), and gradients equal the plain run's and torch's (which recomputes)."""
    regions, rows, width = 3, 512, 1024

    def layer(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        return F.gelu(policies.tag(x @ w1, "h")) @ w2

    def step(run: Run) -> _Step:
        # Weights of their own per region: autocast caches the cast of a weight for the next
        # region, and recompute, which has no such cache, would run a cast the forward did not
        # (torch's "not found in storage" error, in both libraries).
        x, *ws = _leaves((rows, width), *[(width, width)] * (2 * regions))

        def forward() -> Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = x
                for w1, w2 in zip(ws[::2], ws[1::2], strict=True):
                    h = run(layer, h, w1, w2)
            return h.float().sum()

        return _measured(forward, [x, *ws])

    stats = OffloadStats()
    ours = _ours(
        use_reentrant=False,
        context_fn=policies.as_context_fn(policies.offload_these_names("h"), offload_stats=stats),
    )
    theirs = _theirs(
        use_reentrant=False,
        context_fn=functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts,
            policies.offload_these_names("h"),
        ),
    )
    plain = step(_plain)
    assert_tensors_equal(step(ours).grads, plain.grads, "ours")
    assert_tensors_equal(step(theirs).grads, plain.grads, "torch")
    h_bytes = rows * width * 2  # bfloat16
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (regions, regions * h_bytes)
    assert (stats.restored_tensors, stats.restored_bytes) == (regions, regions * h_bytes)


# --- Peak and held device memory of a checkpointed stack ---------------------------------------


def _mlp(depth: int, width: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(
        *(
            nn.Sequential(
                nn.Linear(width, hidden, device=CUDA),
                nn.GELU(),
                nn.Linear(hidden, width, device=CUDA),
                nn.Dropout(0.1),
            )
            for _ in range(depth)
        )
    )


def test_stack_memory_below_plain_and_not_above_torch() -> None:
    """8 MLP blocks with dropout, one checkpoint each: held and peak device bytes are below the
    plain run's and not above torch's non-reentrant checkpoint; gradients are all equal."""
    blocks = _mlp(depth=8, width=1024, hidden=4096)
    (x,) = _leaves((2048, 1024))
    wrt = [*blocks.parameters(), x]

    def step(run: Run) -> _Step:
        def forward() -> Tensor:
            torch.manual_seed(5)
            h = x
            for block in blocks:
                h = run(block, h)
            return h.sum()

        return _measured(forward, wrt)

    runs = {
        "plain": _plain,
        "ours": _ours(use_reentrant=False),
        "torch": _theirs(use_reentrant=False),
    }
    for run in runs.values():
        step(run)  # warm-up: cuBLAS workspaces of the forward and the backward thread
    plain, ours, theirs = (step(run) for run in runs.values())
    assert_tensors_equal(ours.grads, plain.grads, "ours")
    assert_tensors_equal(theirs.grads, plain.grads, "torch")
    assert ours.held < plain.held, (ours.held, plain.held)
    assert ours.peak < plain.peak, (ours.peak, plain.peak)
    assert ours.held <= theirs.held, (ours.held, theirs.held)
    assert ours.peak <= theirs.peak, (ours.peak, theirs.peak)


# --- The planner's offload (host_budget) ----------------------------------------------------------


class _Skinny(nn.Module):
    """``x + tanh(down(gelu(up(x))))`` with a very wide hidden layer: the down projection is an
    expensive matmul with a small output, which moving to host and back beats recomputing."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False, device=CUDA)
        self.down = nn.Linear(hidden, width, bias=False, device=CUDA)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.down(F.gelu(self.up(x))))


def test_planner_offloads_with_a_host_budget_fits_the_budget_and_keeps_gradients() -> None:
    """plan_checkpointing(host_budget=...) on CUDA at the floor budget: the plan offloads the
    down projections, applies, keeps no more device bytes than its budget (measured and
    reported), offloads at run time, and gives the plain run's gradients bit for bit."""
    width, hidden = 256, 1 << 18  # down: 34 GFLOP for a 256 KiB output
    model = nn.Sequential(*(_Skinny(width, hidden) for _ in range(3)))
    (x,) = _leaves((width, width))
    wrt = [*model.parameters(), x]

    def forward() -> Tensor:
        out: Tensor = model(x)
        return out.sum()

    floor = checkpointing.plan_checkpointing(model, x, budget=1.0).floor_bytes
    plan = checkpointing.plan_checkpointing(model, x, budget=floor, host_budget=1 << 30)
    # Per region: the down projection (the second mm) moves 2 x 256 KiB instead of re-running
    # 34 GFLOP; the up projection's 256 MiB output would cost more to move than to recompute.
    up, down = ("aten.mm.default", 0), ("aten.mm.default", 1)
    assert all(down in r.offload and up not in r.offload for r in plan.regions), str(plan)
    assert plan.kept_bytes <= plan.budget_bytes == floor

    _measured(forward, wrt)  # warm-up
    plain = _measured(forward, wrt)
    plan.apply(model)
    try:
        _measured(forward, wrt)  # warm-up of the recompute
        planned = _measured(forward, wrt)
        with checkpointing.saved_tensors_report() as report:
            forward().backward()
    finally:
        plan.remove(model)
    assert_tensors_equal(planned.grads, plain.grads, "planned")
    slack = 1 << 20  # the loss and the allocator's rounding of each block to 512 bytes
    assert planned.held <= plan.budget_bytes + slack < plain.held, str(plan)
    assert report.activation_bytes <= plan.budget_bytes, str(report)
    mms = [r.shape for r in report.records if r.decision == "offloaded" and r.op == "mm"]
    assert mms == [(width, width)] * 3, str(report)


def test_planner_times_its_candidate_plans_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 23 on CUDA: with prices moved far enough to give other plans, the candidates are
    timed (the device synchronized around each step) and the plan returned is exact: the
    plain run's gradients bit for bit, dropout included, and the bytes within the budget."""
    from checkpointing._planning import search

    monkeypatch.setattr(search, "_PERTURBED", ((0.0, 0.0), (1000.0, 0.0), (1.0, 10.0)))
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True) for _ in range(3))
    ).cuda()
    (x,) = _leaves((2, 32, 64))
    wrt = [*model.parameters(), x]

    def grads() -> Sequence[Tensor]:
        torch.manual_seed(7)
        return torch.autograd.grad(model(x).sum(), wrt)

    plain = grads()
    plan = checkpointing.plan_checkpointing(model, x, budget=0.5, timing_steps=3)
    assert len(plan.timed) >= 2, str(plan)
    plan.apply(model)
    try:
        planned = grads()
        with checkpointing.saved_tensors_report() as report:
            model(x).sum().backward()
    finally:
        plan.remove(model)
    assert_tensors_equal(planned, plain, "planned")
    assert report.activation_bytes <= plan.budget_bytes, str(plan)


def test_report_on_oom_prints_the_report_when_cuda_runs_out_of_memory() -> None:
    """A real out-of-memory error (a request larger than the device): the allocator's observer
    prints the report once, with the request, each region's held bytes and its rows; the error
    itself leaves the block unchanged (NOTE [Out-of-memory report])."""

    def region(t: Tensor) -> Tensor:
        return t.sin().exp()

    x = torch.randn(256, 256, device=CUDA, requires_grad=True)
    out = io.StringIO()
    free, total = torch.cuda.mem_get_info()
    y = None
    with pytest.raises(torch.OutOfMemoryError), checkpointing.report_on_oom(file=out):  # noqa: PT012
        y = checkpointing.checkpoint(region, x.cos(), use_reentrant=False).sum()
        torch.empty(total + free, dtype=torch.uint8, device=CUDA)  # more than the device has
    text = out.getvalue()
    assert text.count("checkpointing.report_on_oom:") == 1, text
    assert "CUDA out of memory on device" in text, text
    assert "bytes requested" in text, text
    name = f"checkpoint({region.__qualname__})"
    assert f"inputs of {name}" in text, text
    assert "recomputed" in text, text
    input_bytes = 256 * 256 * 4
    assert f"{input_bytes:>16,}  inputs of {name}" in text, text
    assert y is not None
    y.backward()  # the graph is whole: the report recomputed nothing
    assert x.grad is not None


# --- Host copies off the critical path (NOTE [Host copies off the critical path]) ----------------


def _settled(engine: _offload.Engine) -> dict[str, int]:
    torch.cuda.synchronize()
    engine.poll()
    return engine.pending()


_CLEAN = {"in_flight": 0, "retiring": 0, "held_bytes": 0, "timings": 0}


def _offload_stack(x: Tensor, w: Tensor, stats: OffloadStats | None, regions: int = 4) -> Tensor:
    context_fn = policies.as_context_fn(policies.offload_ops(aten.mm.default), offload_stats=stats)
    h = x
    for _ in range(regions):
        if stats is None:
            h = _three_matmuls(h, w)
        else:
            h = checkpointing.checkpoint(
                _three_matmuls, h, w, use_reentrant=False, context_fn=context_fn
            )
    return h.sum()


def _grads_of(loss_fn: Callable[[Tensor, Tensor], Tensor], n: int = 512) -> list[Tensor]:
    x, w = _leaves((n, n), (n, n))
    loss_fn(x, w).backward()
    return [x.grad, w.grad]  # type: ignore[list-item]  # both leaves got one


def test_overlapped_offload_gradients_are_the_plain_runs_and_nothing_is_held() -> None:
    """Side-stream copies and prefetch: gradients bit for bit the plain run's, every restore
    counted, and once the device is done nothing is in flight, prefetched or retiring."""
    engine = _offload.Engine(_offload.CudaBackend())
    with _offload.installed(engine):
        stats = OffloadStats(time_copies=True)
        got = _grads_of(lambda x, w: _offload_stack(x, w, stats))
        assert _settled(engine) == _CLEAN
    assert_tensors_equal(got, _grads_of(lambda x, w: _offload_stack(x, w, None)), "overlap")
    assert stats.restored_tensors == 8
    assert stats.waited_restores <= stats.restored_tensors
    assert stats.unhidden_copy_seconds >= 0.0


def _mutating_region(x: Tensor, w: Tensor) -> Tensor:
    h = x @ w  # offloaded
    h.mul_(2)  # written in place right after: may run before the side-stream copy
    return (h.sin() @ w).sum()


def test_tensor_overwritten_in_place_after_offload_restores_the_offload_value() -> None:
    """An mm output offloaded then multiplied in place: the recompute gets the value it had
    when it was offloaded (the snapshot, or the op run again), so gradients are the plain
    run's bit for bit."""
    context_fn = policies.as_context_fn(policies.offload_ops(aten.mm.default))

    def ours(x: Tensor, w: Tensor) -> Tensor:
        return checkpointing.checkpoint(
            _mutating_region, x, w, use_reentrant=False, context_fn=context_fn
        )

    for _ in range(3):
        assert_tensors_equal(_grads_of(ours), _grads_of(_mutating_region), "in place")


def test_backward_on_another_stream_gets_the_plain_runs_gradients() -> None:
    """Forward on the default stream, backward on a user stream: the restores are waited for on
    the stream that uses them."""
    x, w = _leaves((512, 512), (512, 512))
    stats = OffloadStats()
    loss = _offload_stack(x, w, stats)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    assert_tensors_equal(
        [x.grad, w.grad], _grads_of(lambda a, b: _offload_stack(a, b, None)), "other stream"
    )
    assert stats.restored_tensors == 8


def test_kept_span_offload_survives_two_backwards_with_retain_graph() -> None:
    """keeping(policy=MUST_CPU_OFFLOAD): a retained graph's second backward restores the span's
    host copies again; gradients are the plain run's twice over."""

    def region(x: Tensor, w: Tensor) -> Tensor:
        with checkpointing.keeping("mm", policy=CheckpointPolicy.MUST_CPU_OFFLOAD):
            h = (x @ w).sin()
        return (h @ w).tanh()

    def run(checkpointed: bool) -> list[Tensor]:
        x, w = _leaves((256, 256), (256, 256))
        h = x
        for _ in range(3):
            h = (
                checkpointing.checkpoint(region, h, w, use_reentrant=False)
                if checkpointed
                else region(h, w)
            )
        loss = h.sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad, w.grad]  # type: ignore[list-item]  # both leaves got one

    engine = _offload.Engine(_offload.CudaBackend())
    with _offload.installed(engine):
        got = run(True)
    assert_tensors_equal(got, run(False), "two backwards")
    assert _settled(engine) == _CLEAN


def test_exception_mid_backward_leaves_nothing_pending() -> None:
    """A hook raising halfway through backward: once the graph is gone, nothing is prefetched,
    in flight or retiring, and the device memory is back where it was."""
    engine = _offload.Engine(_offload.CudaBackend())
    with _offload.installed(engine):
        x, w = _leaves((512, 512), (512, 512))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        h = _offload_stack(x, w, OffloadStats(), regions=2)
        top = checkpointing.checkpoint(
            _three_matmuls,
            x + h,
            w,
            use_reentrant=False,
            context_fn=policies.as_context_fn(policies.offload_ops(aten.mm.default)),
        )

        def fail(grad: Tensor) -> Tensor:
            raise ValueError("boom")

        h.register_hook(fail)
        with pytest.raises(ValueError, match="boom"):
            top.sum().backward()
        del h, top
        x.grad = w.grad = None
        assert _settled(engine) == _CLEAN
        assert torch.cuda.memory_allocated() == base
        assert engine.pool.free_bytes <= engine.pool.limit


def test_offload_steps_reuse_the_pinned_pool_and_leak_nothing() -> None:
    """Twenty steps after a warm-up: pinned buffers are made in the first step only, the pool
    stays within its bound, and after each step no device memory of ours is held."""
    engine = _offload.Engine(_offload.CudaBackend(), pool_bytes=64 << 20)
    x, w = _leaves((512, 512), (512, 512))
    with _offload.installed(engine):
        _offload_stack(x, w, OffloadStats()).backward()  # warm-up: cuBLAS workspaces, grads
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for _ in range(20):
            _offload_stack(x, w, OffloadStats()).backward()
            assert _settled(engine) == _CLEAN
            assert torch.cuda.memory_allocated() == base
            assert engine.pool.free_bytes <= engine.pool.limit
    assert engine.pool.made == 12
