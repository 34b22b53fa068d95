"""``keep`` / ``keeping`` (NOTE [Kept spans]) and ``recompute_state_hooks``, against the plain run.

Every mechanism test compares with the same function run without checkpointing (gradients
bitwise, dropout included, RNG preserved); bytes are the allocator's (``allocator_support``),
compared with a selective policy keeping the same op in the same test.
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_cp
from allocator_support import allocator_step
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import checkpointing
from checkpointing import CheckpointError, keep, keeping
from checkpointing.policies import as_context_fn, save_ops

MM = torch.ops.aten.mm.default


def _params(seed: int = 0, width: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(width, width, generator=gen, requires_grad=True) for _ in range(3)]


def _grads(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients of one step, with the RNG seeded the same way every time."""
    for t in (x, *params):
        t.grad = None
    torch.manual_seed(1234)
    out = run(x)
    out.sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in (x, *params)]
    return out.detach(), grads


def _assert_bitwise(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[Any, Any]) -> None:
    assert torch.equal(a[0], b[0])
    for left, right in zip(a[1], b[1], strict=True):
        assert torch.equal(left, right)


class Calls:
    def __init__(self) -> None:
        self.count = 0


def _block(params: list[torch.Tensor], calls: Calls, p_in: float, p_span: float, p_out: float):
    w1, w2, w3 = params

    def span(h: torch.Tensor) -> torch.Tensor:
        calls.count += 1
        return F.dropout(h @ w1, p_span, True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x.sin(), p_in, True)
        h = keep(span, h)
        h = F.dropout(h.relu(), p_out, True) @ w2
        return (h.tanh() @ w3).sum(-1)

    return block


# --- the replay skips the span; gradients are the plain run's -------------------------------


@pytest.mark.parametrize("p_span", [0.0, 0.3])
@pytest.mark.parametrize("p_out", [0.0, 0.4])
def test_keep_skips_replay_and_matches_plain_run_with_dropout(p_span: float, p_out: float) -> None:
    params = _params()
    x = torch.randn(4, 16, requires_grad=True)
    calls = Calls()
    block = _block(params, calls, 0.2, p_span, p_out)
    plain = _grads(block, x, params)
    assert calls.count == 1
    ours = _grads(lambda t: checkpointing.checkpoint(block, t, use_reentrant=False), x, params)
    _assert_bitwise(ours, plain)
    assert calls.count == 2  # forward once more, never in the replay


@settings(max_examples=12, deadline=None)
@given(
    p=st.lists(st.sampled_from([0.0, 0.25, 0.5]), min_size=3, max_size=3),
    early_stop=st.booleans(),
    where=st.sampled_from(["first", "middle", "last"]),
)
def test_keep_property_gradients_bitwise(p: list[float], early_stop: bool, where: str) -> None:
    """Wherever the span sits and whatever draws random numbers, gradients are the plain run's."""
    w1, w2, w3 = _params(1)

    def span(h: torch.Tensor) -> torch.Tensor:
        return F.dropout(h @ w2, p[1], True).relu()

    def block(x: torch.Tensor) -> torch.Tensor:
        h = keep(span, x) if where == "first" else F.dropout(x @ w1, p[0], True).tanh()
        if where == "middle":
            h = keep(span, h)
        h = F.dropout(h.sin(), p[2], True)
        return keep(span, h) if where == "last" else h @ w3

    x = torch.randn(3, 16, requires_grad=True)
    plain = _grads(block, x, [w1, w2, w3])
    ours = _grads(
        lambda t: checkpointing.checkpoint(block, t, use_reentrant=False, early_stop=early_stop),
        x,
        [w1, w2, w3],
    )
    _assert_bitwise(ours, plain)


def test_keep_matches_torch_checkpoint_gradients_side_by_side() -> None:
    """Same gradients as torch's own non-reentrant checkpoint of the same function."""
    params = _params(2)
    x = torch.randn(4, 16, requires_grad=True)
    block = _block(params, Calls(), 0.1, 0.2, 0.3)
    theirs = _grads(lambda t: torch_cp.checkpoint(block, t, use_reentrant=False), x, params)
    ours = _grads(lambda t: checkpointing.checkpoint(block, t, use_reentrant=False), x, params)
    _assert_bitwise(ours, theirs)


def test_keep_outside_any_checkpoint_is_a_plain_call() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    assert torch.equal(keep(torch.matmul, x, w), x @ w)
    assert keep(lambda a, b=1: a + b, 1, b=2) == 3


@pytest.mark.parametrize("variant", ["reentrant", "torch", "scope", "user hooks"])
def test_keep_is_a_plain_call_where_no_frame_of_ours_is_on_top(variant: str) -> None:
    params = _params(3)
    calls = Calls()
    block = _block(params, calls, 0.0, 0.2, 0.0)
    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, x, params)
    if variant == "reentrant":
        run = functools.partial(checkpointing.checkpoint, block, use_reentrant=True)
    elif variant == "torch":
        run = functools.partial(torch_cp.checkpoint, block, use_reentrant=False)
    elif variant == "scope":

        def run(t: torch.Tensor) -> torch.Tensor:
            with checkpointing.gradient_checkpoint_scope():
                return block(t)
    else:

        def run(t: torch.Tensor) -> torch.Tensor:
            def inner(u: torch.Tensor) -> torch.Tensor:
                with torch.autograd.graph.saved_tensors_hooks(lambda v: v, lambda v: v):
                    return block(u)

            return checkpointing.checkpoint(inner, t, use_reentrant=False)

    calls.count = 0
    _assert_bitwise(_grads(run, x, params), plain)
    if variant in ("reentrant", "torch"):
        assert calls.count == 2  # the span re-ran with the region: it was a plain call
    elif variant == "user hooks":
        assert calls.count == 1  # the user's hooks kept everything: nothing to recompute


# --- bytes: a kept matmul costs what a policy keeping it costs ------------------------------


def _linear_block(w1: torch.Tensor, w2: torch.Tensor, kept: bool):
    def block(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        h = keep(F.linear, h, w1) if kept else F.linear(h, w1)
        return (h.relu() * w2.sum(0)).cos()  # no second matmul: save_ops(mm) keeps one

    return block


def test_kept_matmul_holds_the_bytes_a_policy_keeping_it_holds() -> None:
    """Allocator bytes held at the end of forward: keep(linear) on a 3-d input (the matmul
    saves a view of its input, routed back to recompute) equals save_ops(mm) and is more than
    full recompute by the matmul's output."""
    torch.manual_seed(0)
    w1 = torch.randn(64, 64, requires_grad=True)
    w2 = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(4, 32, 64, requires_grad=True)
    kept = _linear_block(w1, w2, True)
    plain = _linear_block(w1, w2, False)

    def held(run: Callable[[], torch.Tensor]) -> int:
        return allocator_step(lambda: run().sum()).held

    full = held(lambda: checkpointing.checkpoint(plain, x, use_reentrant=False))
    by_keep = held(lambda: checkpointing.checkpoint(kept, x, use_reentrant=False))
    by_policy = held(
        lambda: checkpointing.checkpoint(
            plain, x, use_reentrant=False, context_fn=as_context_fn(save_ops(MM))
        )
    )
    output_bytes = 4 * 32 * 64 * 4
    assert by_keep == by_policy
    assert by_keep == full + output_bytes
    grads_keep = torch.autograd.grad(
        checkpointing.checkpoint(kept, x, use_reentrant=False).sum(), (x, w1, w2)
    )
    grads_plain = torch.autograd.grad(plain(x).sum(), (x, w1, w2))
    for a, b in zip(grads_keep, grads_plain, strict=True):
        assert torch.equal(a, b)


def test_keep_after_the_last_saved_tensor_is_never_replayed_and_holds_no_output() -> None:
    """Early stop: a span after the region's last recomputed tensor is never reached by the
    replay, so its outputs are not held (NOTE [Kept spans], Rule 3)."""
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)
    calls = Calls()

    def tail(h: torch.Tensor) -> torch.Tensor:
        calls.count += 1
        return (h @ w).sum()

    def block(t: torch.Tensor) -> torch.Tensor:
        return keep(tail, t.sin())

    out = checkpointing.checkpoint(block, x, use_reentrant=False)
    out.backward()
    assert calls.count == 1
    expected = torch.autograd.grad((x.sin() @ w).sum(), x)[0]
    assert torch.equal(x.grad, expected)  # type: ignore[arg-type]


# --- what the replay is served; in-place changes are errors, never wrong gradients -------------


def test_output_changed_in_place_after_the_span_raises_at_replay() -> None:
    w = torch.randn(8, 8, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = keep(torch.matmul, x.sin(), w)
        h.mul_(2)
        return h.relu().cos()

    out = checkpointing.checkpoint(
        block, torch.randn(2, 8, requires_grad=True), use_reentrant=False
    )
    with pytest.raises(CheckpointError, match=r"modified in place after the span.*out of place"):
        out.sum().backward()


def test_kept_tensor_changed_in_place_raises_autograds_error() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    inside: list[torch.Tensor] = []

    def span(t: torch.Tensor) -> torch.Tensor:
        e = (t @ w).exp()  # exp saves its output: kept
        inside.append(e)
        return e * 2

    def block(x: torch.Tensor) -> torch.Tensor:
        out = keep(span, x.sin()).cos()
        inside.pop().add_(1)
        return out

    out = checkpointing.checkpoint(
        block, torch.randn(2, 8, requires_grad=True), use_reentrant=False
    )
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_replay_taking_another_path_is_a_clear_error() -> None:
    w = torch.randn(8, 8, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        span = torch.matmul if not checkpointing.is_recomputing() else torch.mul
        h = keep(span, x.sin(), w)
        return h.relu().sum()

    out = checkpointing.checkpoint(
        block, torch.randn(8, 8, requires_grad=True), use_reentrant=False
    )
    with pytest.raises(CheckpointError, match="same path in replay as in forward"):
        out.backward()


def test_served_outputs_keep_structure_and_requires_grad() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    seen: list[object] = []

    def span(t: torch.Tensor) -> dict[str, Any]:
        return {"a": (t @ w, t.detach() + 1), "n": 3, "v": t.t()}

    def block(x: torch.Tensor) -> torch.Tensor:
        out = keep(span, x.sin())
        if checkpointing.is_recomputing():
            seen.append(out)
        a, b = out["a"]
        return (a.relu() * b + out["v"].t().exp()).sum() * out["n"]

    x = torch.randn(8, 8, requires_grad=True)
    checkpointing.checkpoint(block, x, use_reentrant=False).backward()
    expected = torch.autograd.grad(block(x), x)[0]
    assert torch.equal(x.grad, expected)  # type: ignore[arg-type]
    (served,) = seen
    assert served["n"] == 3
    assert served["a"][0].requires_grad
    assert not served["a"][1].requires_grad


# --- nesting -------------------------------------------------------------------------------


def test_nesting_has_defined_behaviour() -> None:
    """A span in a span is inert (the outer keeps all); a checkpoint in a span stays
    checkpointed (its inputs kept); a span in a nested checkpoint belongs to it."""
    params = _params(4)
    w1, w2, w3 = params
    inner_calls, outer_calls = Calls(), Calls()

    def inner(t: torch.Tensor) -> torch.Tensor:
        inner_calls.count += 1
        return F.dropout(t @ w2, 0.3, True).tanh()

    def span(t: torch.Tensor) -> torch.Tensor:
        outer_calls.count += 1
        h = keep(inner, t @ w1)
        return checkpointing.checkpoint(
            lambda u: F.dropout(u.exp(), 0.2, True), h, use_reentrant=False
        )

    def block(x: torch.Tensor) -> torch.Tensor:
        h = keep(span, F.dropout(x.sin(), 0.1, True))
        inner_region = checkpointing.checkpoint(
            lambda u: keep(inner, u.cos()) @ w3, h, use_reentrant=False
        )
        return inner_region.sum(-1)

    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, x, params)
    inner_calls.count = outer_calls.count = 0
    ours = _grads(lambda t: checkpointing.checkpoint(block, t, use_reentrant=False), x, params)
    _assert_bitwise(ours, plain)
    assert outer_calls.count == 1  # the outer span ran in forward only
    # inner ran twice in forward (inert in the outer span, kept in the nested region), and
    # never in backward: the outer replay skips its span and stops early where the nested
    # region's input is saved; the nested region's recompute skips its own span
    assert inner_calls.count == 2


# --- selective checkpointing and spans compose; foreign contexts make spans plain calls ------


def test_keep_inside_a_selective_policy_region() -> None:
    params = _params(5)
    block = _block(params, Calls(), 0.2, 0.2, 0.2)
    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, x, params)
    ours = _grads(
        lambda t: checkpointing.checkpoint(
            block, t, use_reentrant=False, context_fn=as_context_fn(save_ops(MM))
        ),
        x,
        params,
    )
    _assert_bitwise(ours, plain)


def test_selective_checkpoint_inside_a_span_keeps_its_policy() -> None:
    """A checkpoint inside a span is a region of its own: its selective policy sees its ops
    (a span hides its ops only from the policy of the region it belongs to)."""
    params = _params(10)
    w1, w2, w3 = params
    inner_ops: list[str] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if not ctx.is_recompute:
            inner_ops.append(str(op))
        return checkpointing.CheckpointPolicy.PREFER_RECOMPUTE

    def inner(u: torch.Tensor) -> torch.Tensor:
        return F.dropout(u @ w2, 0.2, True).tanh()

    def span(t: torch.Tensor) -> torch.Tensor:
        h = checkpointing.checkpoint(
            inner, t @ w1, use_reentrant=False, context_fn=as_context_fn(policy)
        )
        return h.relu()

    def block(x: torch.Tensor) -> torch.Tensor:
        return (keep(span, x.sin()) @ w3).cos()

    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, x, params)
    inner_ops.clear()
    ours = _grads(lambda t: checkpointing.checkpoint(block, t, use_reentrant=False), x, params)
    _assert_bitwise(ours, plain)
    assert "aten.mm.default" in inner_ops


def test_foreign_context_fn_makes_spans_plain_calls_and_says_so() -> None:
    params = _params(6)
    calls = Calls()
    block = _block(params, calls, 0.0, 0.2, 0.1)
    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, x, params)
    context_fn = functools.partial(
        torch_cp.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    calls.count = 0
    checkpointing._keep._warned_foreign.clear()
    with pytest.warns(UserWarning, match="context_fn that is not checkpointing's"):
        ours = _grads(
            lambda t: checkpointing.checkpoint(
                block, t, use_reentrant=False, context_fn=context_fn
            ),
            x,
            params,
        )
    _assert_bitwise(ours, plain)
    assert calls.count == 2


# --- every entry point -----------------------------------------------------------------------


class KeptBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = keep(self.a, self.drop(x.sin()))
        return self.b(self.drop(h.relu()))


@pytest.mark.parametrize("entry", ["checkpoint_module", "wrapper", "sequential", "decorator"])
def test_keep_in_every_entry_point(entry: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(KeptBlock(), KeptBlock())
    x = torch.randn(3, 16, requires_grad=True)
    params = list(model.parameters())
    plain = _grads(model, x, params)
    if entry == "checkpoint_module":
        for block in model:
            checkpointing.checkpoint_module(block)
        run: Callable[[torch.Tensor], torch.Tensor] = model
    elif entry == "wrapper":
        run = nn.Sequential(*[checkpointing.checkpoint_wrapper(b) for b in model])
    elif entry == "sequential":
        run = functools.partial(checkpointing.checkpoint_sequential, model, 2, use_reentrant=False)
    else:
        run = checkpointing.checkpoint(use_reentrant=False)(model.forward)
    _assert_bitwise(_grads(run, x, params), plain)


def test_with_block_keeps_what_it_saves_and_replays_without_storing() -> None:
    params = _params(7)
    w1, w2, w3 = params
    calls = Calls()

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        with keeping("mlp"):
            calls.count += 1
            h = F.dropout(h @ w1, 0.3, True).relu()
        return (F.dropout(h, 0.2, True) @ w2).tanh() @ w3

    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, x, params)
    calls.count = 0
    _assert_bitwise(
        _grads(lambda t: checkpointing.checkpoint(block, t, use_reentrant=False), x, params), plain
    )
    assert calls.count == 2  # Python runs a with block in the replay too (Rule 7)


def test_decorator_form_names_the_span_in_the_report() -> None:
    w = torch.randn(8, 8, requires_grad=True)

    @keeping("proj")
    def project(t: torch.Tensor) -> torch.Tensor:
        return (t @ w).exp()

    x = torch.randn(4, 8, requires_grad=True)
    with checkpointing.saved_tensors_report() as report:
        out = checkpointing.checkpoint(lambda t: project(t.sin()).cos(), x, use_reentrant=False)
    regions = {record.region for record in report.records}
    assert any(region.startswith("keep(proj) in checkpoint(") for region in regions)
    out.sum().backward()


def test_reports_count_what_a_span_holds_as_a_policy_keeping_it() -> None:
    """Both report forms (watching the step, and from the loss) count the span's held output:
    kept bytes equal a selective policy keeping the same matmul, and the rows name the span."""
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)

    def kept(t: torch.Tensor) -> torch.Tensor:
        return keep(torch.mm, t.sin(), w).relu()

    def plain(t: torch.Tensor) -> torch.Tensor:
        return torch.mm(t.sin(), w).relu()

    with checkpointing.saved_tensors_report() as watched_keep:
        loss_keep = checkpointing.checkpoint(kept, x, use_reentrant=False).sum()
    with checkpointing.saved_tensors_report() as watched_sac:
        loss_sac = checkpointing.checkpoint(
            plain, x, use_reentrant=False, context_fn=as_context_fn(save_ops(MM))
        ).sum()
    from_loss_keep = checkpointing.saved_tensors_report(loss_keep)
    from_loss_sac = checkpointing.saved_tensors_report(loss_sac)
    assert watched_keep.kept_bytes == watched_sac.kept_bytes
    assert from_loss_keep.kept_bytes == from_loss_sac.kept_bytes == watched_keep.kept_bytes
    for report in (watched_keep, from_loss_keep):
        (row,) = [r for r in report.records if r.op == "span output"]
        assert row.region.startswith("keep(mm) in checkpoint(")
        assert row.nbytes == 32 * 64 * 4
    loss_keep.backward()


def test_offload_policy_counts_and_matches_plain_run() -> None:
    stats = checkpointing.OffloadStats()
    w = torch.randn(8, 8, requires_grad=True)
    span = keeping(
        "off", policy=checkpointing.CheckpointPolicy.MUST_CPU_OFFLOAD, offload_stats=stats
    )(lambda t: (t @ w).exp())
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpointing.checkpoint(lambda t: span(t.sin()).cos(), x, use_reentrant=False)
    out.sum().backward()
    expected = torch.autograd.grad((x.sin() @ w).exp().cos().sum(), x)[0]
    assert torch.equal(x.grad, expected)  # type: ignore[arg-type]
    assert stats.offloaded_bytes == stats.restored_bytes == 4 * 8 * 4


def test_retain_graph_and_graph_exec_group_replay_spans_again() -> None:
    params = _params(8)
    block = _block(params, Calls(), 0.1, 0.2, 0.3)
    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, x, params)
    torch.manual_seed(1234)
    out = checkpointing.checkpoint(block, x, use_reentrant=False)
    first = torch.autograd.grad(out.sum(), (x, *params), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (x, *params))
    for a, b, c in zip(first, second, plain[1], strict=True):
        assert torch.equal(a, c)
        assert torch.equal(b, c)


# --- errors ----------------------------------------------------------------------------------


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(TypeError, match=r"keep: expected a callable.*got int"):
        keep(3, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not mark it"):
        keeping(policy=checkpointing.CheckpointPolicy.MUST_RECOMPUTE)
    with pytest.raises(TypeError, match="non-empty str"):
        keeping("")
    with pytest.raises(TypeError, match=r"recompute_state_hooks must be objects.*got int"):
        checkpointing.checkpoint(
            torch.sin,
            torch.ones(1, requires_grad=True),
            use_reentrant=False,
            recompute_state_hooks=3,
        )


# --- no leaks --------------------------------------------------------------------------------


def test_spans_leave_nothing_behind() -> None:
    """The frame, its span and what the span held die with the graph, by reference counting
    alone (no cycle through the span's hooks or outputs)."""
    w = torch.randn(8, 8, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        x = torch.randn(4, 8, requires_grad=True)
        out = checkpointing.checkpoint(
            lambda t: keep(lambda u: (u @ w).exp(), t.sin()).cos(), x, use_reentrant=False
        )
        unpack = out.grad_fn._raw_saved_self.unpack_hook  # cos saved the span's output
        frame = unpack.args[0]
        (span,) = frame.spans
        frame_probe = weakref.ref(frame)
        output_probe = weakref.ref(span.outputs.alias)
        del unpack, frame, span
        out.sum().backward()
        del out
        assert frame_probe() is None
        assert output_probe() is None
    finally:
        gc.enable()


# --- recompute_state_hooks -------------------------------------------------------------------


class CounterRng:
    """User state a custom random kernel reads: a counter advanced per draw."""

    def __init__(self) -> None:
        self.counter = 0

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.counter)
        self.counter += 1
        return (torch.rand(like.shape, generator=gen) > 0.3).to(like.dtype)

    def snapshot(self) -> int:
        return self.counter

    def restore(self, state: int) -> None:
        self.counter = state


def _counter_block(rng: CounterRng, w: torch.Tensor, kept: bool):
    def span(h: torch.Tensor) -> torch.Tensor:
        return (h @ w) * rng.draw(h)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x.sin() * rng.draw(x)
        h = keep(span, h) if kept else span(h)
        return (h.relu() * rng.draw(h)).tanh()

    return block


@pytest.mark.parametrize(
    ("kept", "use_reentrant", "hooked"),
    [(False, False, True), (True, False, True), (False, True, True), (True, False, False)],
)
def test_state_hooks_restore_user_state_for_recompute(
    kept: bool, use_reentrant: bool, hooked: bool
) -> None:
    """With the hook, recompute sees the forward's state at its start and after each skipped
    span, and the caller's state is left alone; without it (the control, so that this test can
    fail) the gradients differ."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    rng = CounterRng()
    block = _counter_block(rng, w, kept)
    expected = torch.autograd.grad(block(x).sum(), (x, w))
    rng.counter = 0
    hooks = rng if hooked else None
    out = checkpointing.checkpoint(
        block, x, use_reentrant=use_reentrant, recompute_state_hooks=hooks
    )
    rng.counter = 100  # the caller moves on; recompute must not see it, nor disturb it
    out.sum().backward()  # (reentrant checkpoints refuse autograd.grad)
    same = [torch.equal(a, b) for a, b in zip((x.grad, w.grad), expected, strict=True)]
    assert all(same) if hooked else not all(same)
    if hooked:
        assert rng.counter == 100


@pytest.mark.parametrize("entry", ["checkpoint_module", "wrapper", "sequential"])
def test_state_hooks_on_every_entry_point(entry: str) -> None:
    rng = CounterRng()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = keep(self.lin, x * rng.draw(x))
            return h.relu() * rng.draw(h)

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 8, requires_grad=True)
    params = list(model.parameters())
    expected = torch.autograd.grad(model(x).sum(), (x, *params))
    rng.counter = 0
    if entry == "checkpoint_module":
        for block in model:
            checkpointing.checkpoint_module(block, recompute_state_hooks=[rng])
        out = model(x)
    elif entry == "wrapper":
        wrapped = nn.Sequential(
            *[checkpointing.checkpoint_wrapper(b, recompute_state_hooks=[rng]) for b in model]
        )
        out = wrapped(x)
    else:
        out = checkpointing.checkpoint_sequential(
            model, 2, x, use_reentrant=False, recompute_state_hooks=rng
        )
    got = torch.autograd.grad(out.sum(), (x, *params))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_readme_recipe_runs_as_written() -> None:
    """docs/guide/keep.md ("Keep by code"): its example runs as written."""
    page = (Path(checkpointing.__file__).parent.parent / "docs" / "guide" / "keep.md").read_text()
    section = page[page.index("# Keep by code") :]
    recipe = section[section.index("```python") + len("```python") : section.index("```\n", 20)]
    namespace: dict[str, Any] = {}
    exec(compile(recipe, "docs/guide/keep.md", "exec"), namespace)
    assert namespace["x"].grad is not None


def test_keep_under_threads_is_isolated() -> None:
    from thread_support import run_threads

    params = _params(9)

    def work(index: int) -> None:
        block = _block(params, Calls(), 0.0, 0.0, 0.0)
        x = torch.randn(4, 16, requires_grad=True, generator=torch.Generator().manual_seed(index))
        expected = torch.autograd.grad(block(x).sum(), x)[0]
        for _ in range(5):
            out = checkpointing.checkpoint(block, x, use_reentrant=False)
            assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected)

    with warnings.catch_warnings():
        run_threads(work, 4)
