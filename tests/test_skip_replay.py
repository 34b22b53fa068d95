"""Skipping ops in the replay: the memory planner's private ``SKIP_IN_REPLAY`` answer.

Tests named ``test_rule14_*`` prove NOTE [Selective checkpoint cache], Rule 14
(``checkpointing/_selective/skip.py``). A per-call policy answers by (op, occurrence), as the
planner's ``_KeyedPolicy`` does; the keys are found by recording what the forward asks. Each
run is compared with the run without checkpointing (bitwise, same seed) and, where the answer
is a parity question, with ``torch.utils.checkpoint``; the ops run in backward are counted
with a dispatch mode, so "skipped" and "replayed" are observed, not assumed.
"""

from __future__ import annotations

import functools
import gc
import types
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from frame_support import assert_tensors_equal, backward_counting, counting_ops
from garbage_support import gc_disabled  # noqa: F401  (a fixture)
from hypothesis import given
from hypothesis import strategies as st
from strategies import SacChain, sac_chains
from torch.utils._python_dispatch import TorchDispatchMode

import checkpointing
from checkpointing._selective import (
    SKIP_IN_REPLAY,
    TAG_OP,
    CheckpointPolicy,
    OffloadStats,
    OpPolicyBase,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
    replay_taint,
)
from checkpointing._selective.cache import _Blank
from checkpointing._selective.skip import _forgetter, _Taint, may_skip
from checkpointing.policies import tag

aten = torch.ops.aten
Key = tuple[Any, int]
Grads = tuple[torch.Tensor | None, ...]
SEED = 7
SKIPPED_BUT_SAVED = "skipped in the replay as unneeded"
FIX = "re-plan with plan_checkpointing"


# --- Helpers ---------------------------------------------------------------------------------


class KeyedPolicy:
    """The decision for each (op, occurrence), PREFER_RECOMPUTE elsewhere (the planner's
    ``_KeyedPolicy``); a fresh one per region call."""

    def __init__(self, decisions: dict[Key, object]) -> None:
        self.decisions = decisions
        self.counts: Counter[Any] = Counter()

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        index = self.counts[op]
        self.counts[op] = index + 1
        return self.decisions.get((op, index), CheckpointPolicy.PREFER_RECOMPUTE)


def keyed(decisions: dict[Key, object], **options: Any) -> Callable[[], Any]:
    """A ``context_fn`` making our contexts around a fresh ``KeyedPolicy``."""
    return lambda: create_selective_checkpoint_contexts(KeyedPolicy(decisions), **options)


class _Recording:
    def __init__(self) -> None:
        self.keys: list[Key] = []
        self.counts: Counter[Any] = Counter()

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        self.keys.append((op, self.counts[op]))
        self.counts[op] += 1
        return CheckpointPolicy.PREFER_RECOMPUTE


def keys_of(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[Key]:
    """The (op, occurrence) keys a policy is asked about in ``fn``'s forward, in order."""
    recording = _Recording()
    checkpointing.checkpoint(
        fn,
        x,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(recording),
    )
    return recording.keys


def nth(keys: list[Key], op: Any, n: int) -> Key:
    """The key of ``op``'s ``n``-th call, checked to exist (so a test cannot pass vacuously)."""
    assert (op, n) in keys, f"{op} call {n} not in the forward: {keys}"
    return op, n


def run(
    fn: Callable[[torch.Tensor], torch.Tensor],
    leaves: Sequence[torch.Tensor],
    how: str,
    decisions: dict[Key, object] | None = None,
    **options: Any,
) -> tuple[Grads, Counter[str]]:
    """One seeded forward and backward of ``fn(leaves[0])``, plain, under torch's checkpoint or
    ours with a ``KeyedPolicy``: every leaf's gradient and the ops run in backward."""
    x = leaves[0]
    torch.manual_seed(SEED)
    if how == "plain":
        out = fn(x)
    elif how == "torch":
        out = torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    else:
        context_fn = keyed(decisions or {})
        out = checkpointing.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn, **options)
    return backward_counting(out, leaves)


class Decoder(torch.nn.Module):
    """A decoder block's MLP: ``x + dropout(lin2(gelu(lin1(x))))``. Dropout's multiply saves only
    its mask, so backward never needs ``lin2``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.lin2 = torch.nn.Linear(16, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.lin2(F.gelu(self.lin1(x))), 0.1, True)


def decoder() -> tuple[Decoder, list[torch.Tensor]]:
    """The block and its leaves: the input, then the parameters."""
    model = Decoder()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    return model, [x, *model.parameters()]


def lin2_key(model: Decoder, x: torch.Tensor) -> Key:
    keys = keys_of(model, x)
    assert [k for k in keys if k[0] is aten.addmm.default] == [
        (aten.addmm.default, 0),
        (aten.addmm.default, 1),
    ]
    return nth(keys, aten.addmm.default, 1)


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    return x.requires_grad_(), w.requires_grad_()


def raises_skip_error(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: Key) -> str:
    """Run ``fn`` under ours skipping ``key``: it must raise our error; its message."""
    out = checkpointing.checkpoint(
        fn, x, use_reentrant=False, context_fn=keyed({key: SKIP_IN_REPLAY})
    )
    with pytest.raises(checkpointing.CheckpointError) as caught:
        out.sum().backward()
    assert x.grad is None  # no gradient, right or wrong, reached the input
    assert replay_taint() is None
    return str(caught.value)


# --- The decoder block -----------------------------------------------------------------------


def test_rule14_decoder_skip_is_bitwise_exact_and_really_skips_the_matmul() -> None:
    """Skipping lin2's matmul: gradients (input and parameters) bitwise equal to the plain run
    and to torch's checkpoint, and the replay runs one matmul fewer (a blank instead)."""
    model, leaves = decoder()
    key = lin2_key(model, leaves[0])
    plain, _ = run(model, leaves, "plain")
    theirs, _ = run(model, leaves, "torch")
    skipped, counts = run(model, leaves, "ours", {key: SKIP_IN_REPLAY})
    replayed, baseline = run(model, leaves, "ours", {})
    assert_tensors_equal(theirs, plain, "torch")
    assert_tensors_equal(skipped, plain, "ours, skipping")
    assert_tensors_equal(replayed, plain, "ours")
    assert counts["aten.addmm.default"] == baseline["aten.addmm.default"] - 1
    assert counts["aten.empty_strided.default"] == baseline["aten.empty_strided.default"] + 1
    assert counts["aten.bernoulli_.float"] == 1  # the mask is still drawn, from the same state


def test_rule14_skipping_the_dropout_multiply_before_a_saved_add() -> None:
    """The dropout multiply's output only feeds an add the policy saves: skipping both the
    matmul and the multiply stays exact, and both ops leave the replay (early stop off: with
    it the replay ends at the multiply, which saves the last tensor)."""
    model, leaves = decoder()
    keys = keys_of(model, leaves[0])
    add = nth(keys, aten.add.Tensor, 0)
    mul = nth(keys, aten.mul.Tensor, 0)
    skips = {lin2_key(model, leaves[0]): SKIP_IN_REPLAY, mul: SKIP_IN_REPLAY}
    saved = {add: CheckpointPolicy.MUST_SAVE}
    plain, _ = run(model, leaves, "plain")
    grads, counts = run(model, leaves, "ours", {**skips, **saved}, early_stop=False)
    _, baseline = run(model, leaves, "ours", saved, early_stop=False)
    assert_tensors_equal(grads, plain)
    assert counts["aten.addmm.default"] == baseline["aten.addmm.default"] - 1
    assert counts["aten.mul.Tensor"] == baseline["aten.mul.Tensor"] - 1


def test_rule14_retained_graph_gets_blanks_again() -> None:
    """Blanks are never consumed (Rule 6): with only skips kept, a retained graph backs up
    twice and accumulates exactly what the plain run does."""
    model, leaves = decoder()
    key = lin2_key(model, leaves[0])

    def twice(out: torch.Tensor) -> Grads:
        loss = out.sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads = tuple(t.grad for t in leaves)
        for t in leaves:
            t.grad = None
        return grads

    torch.manual_seed(SEED)
    plain = twice(model(leaves[0]))
    torch.manual_seed(SEED)
    context_fn = keyed({key: SKIP_IN_REPLAY})
    ours = twice(
        checkpointing.checkpoint(model, leaves[0], use_reentrant=False, context_fn=context_fn)
    )
    assert_tensors_equal(ours, plain)


def test_rule14_a_consumed_entry_still_raises_on_a_second_backward_like_torch() -> None:
    """A skip beside a saved output: the second backward is still Rule 6's error, as torch's
    selective checkpoint saving the same output gives it."""
    model, leaves = decoder()
    keys = keys_of(model, leaves[0])
    gelu = nth(keys, aten.gelu.default, 0)
    decisions = {lin2_key(model, leaves[0]): SKIP_IN_REPLAY, gelu: CheckpointPolicy.MUST_SAVE}
    errors = []
    for out in (
        checkpointing.checkpoint(
            model, leaves[0], use_reentrant=False, context_fn=keyed(decisions)
        ),
        torch_checkpoint.checkpoint(
            model,
            leaves[0],
            use_reentrant=False,
            context_fn=lambda: torch_checkpoint.create_selective_checkpoint_contexts(
                [aten.gelu.default]
            ),
        ),
    ):
        loss = out.sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError) as caught:
            loss.backward()
        errors.append(caught.value)
    assert [type(e) for e in errors] == [RuntimeError, RuntimeError]
    assert all("backward an extra time" in str(e) for e in errors)


def test_rule14_determinism_check_still_passes() -> None:
    """``determinism_check="default"`` compares what the replay saves; blanks change none of it."""
    model, leaves = decoder()
    key = lin2_key(model, leaves[0])
    plain, _ = run(model, leaves, "plain")
    grads, _ = run(model, leaves, "ours", {key: SKIP_IN_REPLAY}, determinism_check="default")
    assert_tensors_equal(grads, plain)


class _SkipMatmuls(OpPolicyBase):
    def answer_for_op(self, op: Any, /) -> Any:
        return SKIP_IN_REPLAY if op is aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def test_rule14_an_op_only_policy_may_skip() -> None:
    """An op-only policy answering the skip for an op: every call is checked as it comes (the
    CHECK plan), and the replay skips the matmul."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t + F.dropout(t @ w, 0.5, True)

    plain, _ = run(fn, (x, w), "plain")
    torch.manual_seed(SEED)
    out = checkpointing.checkpoint(
        fn,
        x,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(_SkipMatmuls()),
    )
    with counting_ops() as counts:
        out.sum().backward()
    assert_tensors_equal((x.grad, w.grad), plain)
    assert counts["aten.mm.default"] == 2  # the two gradient matmuls; the forward's is skipped
    assert counts["aten.empty_strided.default"] == 1  # a blank stood for it


# --- Where a skip answer is replayed as a recompute -----------------------------------------


def test_rule14_random_op_answered_skip_is_recomputed() -> None:
    """A draw answered SKIP is recomputed (Rule 10): the mask it makes is saved by the multiply,
    and replays bit-identically."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t @ w) * torch.rand_like(t)

    key = nth(keys_of(fn, x), aten.rand_like.default, 0)
    plain, _ = run(fn, (x, w), "plain")
    grads, counts = run(fn, (x, w), "ours", {key: SKIP_IN_REPLAY})
    assert_tensors_equal(grads, plain)
    assert counts["aten.rand_like.default"] == 1


def test_rule14_dropout_draw_answered_skip_is_recomputed() -> None:
    """Dropout's in-place draw answered SKIP (with lin2's matmul) is recomputed: exact."""
    model, leaves = decoder()
    keys = keys_of(model, leaves[0])
    draw = nth(keys, aten.bernoulli_.float, 0)
    plain, _ = run(model, leaves, "plain")
    decisions = {draw: SKIP_IN_REPLAY, lin2_key(model, leaves[0]): SKIP_IN_REPLAY}
    grads, counts = run(model, leaves, "ours", decisions)
    assert_tensors_equal(grads, plain)
    assert counts["aten.bernoulli_.float"] == 1


def test_rule14_view_answered_skip_is_replayed() -> None:
    """A view shares its input's storage: answered SKIP, it is replayed (the sine saves it)."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t @ w).t().sin()

    key = nth(keys_of(fn, x), aten.t.default, 0)
    plain, _ = run(fn, (x, w), "plain")
    grads, _ = run(fn, (x, w), "ours", {key: SKIP_IN_REPLAY})
    assert_tensors_equal(grads, plain)


@torch.library.custom_op("checkpointing_skip_test::bump", mutates_args=("counter",))
def bump(x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Adds 1 to ``counter`` (declared written) and returns a fresh tensor."""
    counter.add_(1)
    return x * 2


def test_rule14_op_writing_an_argument_is_replayed() -> None:
    """An op writing an argument and returning a fresh tensor nobody needs: answered SKIP, it
    is replayed all the same (the write is part of the replay), as torch's checkpoint does."""
    x, w = _weights()
    counters = {how: torch.zeros(()) for how in ("ours", "torch")}

    def region(counter: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            bump(t.detach(), counter)
            return (t @ w).sin()

        return fn

    key = nth(
        keys_of(region(torch.zeros(())), x), torch.ops.checkpointing_skip_test.bump.default, 0
    )
    plain, _ = run(region(torch.zeros(())), (x, w), "plain")
    grads, _ = run(region(counters["ours"]), (x, w), "ours", {key: SKIP_IN_REPLAY})
    run(region(counters["torch"]), (x, w), "torch")
    assert_tensors_equal(grads, plain)
    assert counters["ours"].item() == counters["torch"].item() == 2


def test_rule14_tag_answered_skip_keeps_nothing() -> None:
    """A tag answered SKIP is a recompute: nothing is handed to its producer (which would
    otherwise be kept), and the producer replays."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return tag(t @ w, "proj").sin()

    key = nth(keys_of(fn, x), TAG_OP, 0)
    stats = OffloadStats()
    plain, _ = run(fn, (x, w), "plain")
    _, baseline = run(fn, (x, w), "ours", {})
    out = checkpointing.checkpoint(
        fn, x, use_reentrant=False, context_fn=keyed({key: SKIP_IN_REPLAY}, offload_stats=stats)
    )
    with counting_ops() as counts:
        out.sum().backward()
    assert_tensors_equal((x.grad, w.grad), plain)
    assert counts["aten.mm.default"] == baseline["aten.mm.default"]
    assert stats == OffloadStats()


def test_rule14_ordered_effect_answered_skip_is_kept() -> None:
    """An op with an ordered side effect answered SKIP is kept, as a recompute-preferring answer
    is (Rule 12), not skipped."""
    pairs: list[Any] = []

    def context_fn() -> Any:
        pairs.append(keyed({(aten._print.default, 0): SKIP_IN_REPLAY})())
        return pairs[-1]

    def fn(t: torch.Tensor) -> torch.Tensor:
        torch.ops.aten._print.default("")
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    out = checkpointing.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    record = pairs[0][0].cache.records[id(aten._print.default)]
    assert record.kept is not None
    assert not isinstance(record.kept[0], _Blank)
    out.sum().backward()


def _skip_sines(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> Any:
    return SKIP_IN_REPLAY if op is aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE


def test_rule14_under_torch_compile_a_skip_is_prefer_recompute() -> None:
    """Under a tracing compiler (Rule 9) a skip is tagged PREFER_RECOMPUTE, which the
    partitioner may honour: aot_eager compiles the region (a skip of an output backward needs,
    even) and its gradients equal eager's."""
    x, w = _weights()
    context_fn = functools.partial(create_selective_checkpoint_contexts, _skip_sines)

    def fn(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (t @ u).sin() @ u

    def step(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(fn, t, u, use_reentrant=False, context_fn=context_fn)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    try:
        compiled(x, w).sum().backward()
    finally:
        torch._dynamo.reset()
    got = (x.grad, w.grad)
    x.grad = w.grad = None
    fn(x, w).sum().backward()
    assert_tensors_equal(got, (x.grad, w.grad))


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.to_sparse(),
        lambda t: t.clone().as_subclass(_Sub),
        lambda t: torch.complex(t, t).conj(),
        lambda t: t.view(-1),  # shares the input's storage, though the schema says it does not
    ],
    ids=["sparse", "subclass", "conjugate", "shares-storage"],
)
def test_rule14_odd_or_aliasing_outputs_are_never_skipped(make: Callable[..., Any]) -> None:
    """``may_skip`` refuses outputs a blank cannot stand for."""
    x = torch.randn(3, 3)
    assert may_skip(aten.clone.default, (x,), {}, x.clone())
    assert may_skip(aten.cat.default, ([x, x],), {}, (x.clone(), 1))
    assert not may_skip(aten.clone.default, (x,), {}, make(x))
    assert not may_skip(aten.clone.default, (x,), {}, (x.clone(), make(x)))


def test_rule14_replay_not_guarded_by_our_frame_runs_the_op() -> None:
    """Our contexts under torch's checkpoint: its pack hook does not refuse tainted tensors,
    so a (wrong) skip is replayed instead: right gradients, the op runs."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t @ w)

    key = nth(keys_of(fn, x), aten.tanh.default, 0)
    out = torch_checkpoint.checkpoint(
        fn, x, use_reentrant=False, context_fn=keyed({key: SKIP_IN_REPLAY})
    )
    with counting_ops() as counts:
        out.sum().backward()
    got = (x.grad, w.grad)
    x.grad = w.grad = None
    assert_tensors_equal(got, run(fn, (x, w), "plain")[0])
    assert counts["aten.tanh.default"] == 1


def test_rule14_kept_spans_compose_with_skips() -> None:
    """A kept span's ops are invisible to the policy; the skip of the op after it still holds."""
    model, leaves = decoder()

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = checkpointing.keep(lambda u: F.gelu(model.lin1(u)), t)
        return t + F.dropout(model.lin2(h), 0.1, True)

    key = nth(keys_of(fn, leaves[0]), aten.addmm.default, 0)  # lin2's: lin1's is in the span
    plain, _ = run(fn, leaves, "plain")
    grads, counts = run(fn, leaves, "ours", {key: SKIP_IN_REPLAY})
    assert_tensors_equal(grads, plain)
    assert counts["aten.addmm.default"] == 0


# --- The safety net: a wrong skip raises ----------------------------------------------------


def test_rule14_skipped_output_saved_by_backward_raises() -> None:
    """tanh saves its output: skipping it is refused when the replay saves the blank."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t @ w)

    message = raises_skip_error(fn, x, nth(keys_of(fn, x), aten.tanh.default, 0))
    assert SKIPPED_BUT_SAVED in message
    assert FIX in message
    assert "aten.tanh.default" in message
    assert "saved tensor #" in message


def test_rule14_matmul_feeding_a_saved_matmul_input_raises() -> None:
    """The second matmul saves its input, the first's output: skipping the first raises."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t @ w) @ w

    message = raises_skip_error(fn, x, nth(keys_of(fn, x), aten.mm.default, 0))
    assert "aten.mm.default (its call #0 in the region)" in message


def test_rule14_taint_follows_ops_run_on_a_blank() -> None:
    """A tensor computed from a blank (through a view, a product, an exp) is tainted too."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return ((t @ w).t() * 2).exp()  # exp saves its output

    message = raises_skip_error(fn, x, nth(keys_of(fn, x), aten.mm.default, 0))
    assert SKIPPED_BUT_SAVED in message


class CountingTaint(_Taint):
    """A taint that notes the arguments it looks at for tainted storages."""

    def __init__(self) -> None:
        super().__init__()
        self.checks: list[tuple[Any, ...]] = []

    def origin_in(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        self.checks.append(args)
        return super().origin_in(args, kwargs)


def test_rule14_a_freed_storage_leaves_the_taint() -> None:
    """A tainted storage leaves the taint when its last tensor is freed, not before (a view
    keeps it); once nothing tainted is alive, an op runs without looking at its arguments; a
    storage tainted again is still refused."""
    taint = CountingTaint()
    try:
        blank = torch.empty(4, 4)
        taint.mark(blank, "mm (its call #0 in the region)")
        view = blank.t()
        del blank
        gc.collect()
        assert taint.origin_of(view) == "mm (its call #0 in the region)"
        taint.mark(view * 2, "again")  # a temporary: marked, then freed at once
        del view
        assert taint.storages == {}
        fresh = torch.ones(4, 4)
        assert taint.origin_of(fresh) is None
        assert torch.equal(taint.run(aten.mul.Tensor, (fresh, fresh), {}), fresh)
        assert taint.checks == []
        taint.mark(fresh, "mm (its call #1 in the region)")
        with pytest.raises(checkpointing.CheckpointError, match="its call #1"):
            taint.run(aten.nonzero.default, (fresh,), {})
    finally:
        taint.end()


def test_rule14_a_freed_storage_does_not_untaint_the_one_that_took_its_id() -> None:
    """The callback of a freed storage's reference removes its own entry only: a storage made
    later at the same address (same ``id``) and tainted keeps its entry."""
    tensor = torch.ones(2)
    storage = tensor.untyped_storage()
    key = id(storage)
    # Two distinct references (with callbacks: a plain ``weakref.ref`` is shared); the first
    # stands for the freed storage's.
    earlier = weakref.ref(storage, lambda _ref: None)
    storages = {key: (weakref.ref(storage, lambda _ref: None), "mm (its call #1 in the region)")}
    _forgetter(storages, key)(earlier)
    assert storages[key][1] == "mm (its call #1 in the region)"
    _forgetter(storages, key)(storages[key][0])
    assert storages == {}


def test_rule14_taint_reaches_views_made_before_an_in_place_write() -> None:
    """Taint is by storage: a view taken before its base is written from a blank is refused."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        base = t * 1
        view = base.view(-1)
        base.add_(t @ w)
        return view.sin()

    message = raises_skip_error(fn, x, nth(keys_of(fn, x), aten.mm.default, 0))
    assert SKIPPED_BUT_SAVED in message


def test_rule14_taint_flows_through_a_kept_block_in_the_replay() -> None:
    """A ``with keeping():`` block re-runs in the replay past the modes' bookkeeping; what it
    computes from a blank is still tainted."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t @ w
        with checkpointing.keeping():
            g = h * 2
        return g.sin()

    message = raises_skip_error(fn, x, nth(keys_of(fn, x), aten.mm.default, 0))
    assert SKIPPED_BUT_SAVED in message


_LIBRARY = torch.library.Library("checkpointing_skip_test", "DEF")  # type: ignore[no-untyped-call]
_LIBRARY.define("positives(Tensor x) -> int")  # type: ignore[no-untyped-call]
_LIBRARY.impl("positives", lambda t: int((t > 0).sum()), "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

READERS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda h: h.sum().item(),
    "bool": lambda h: bool(h.sum() > 0),
    "equal": lambda h: torch.equal(h, h),
    "nonzero": lambda h: torch.nonzero(h),
    "op returning an int": lambda h: torch.ops.checkpointing_skip_test.positives(h),
}


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_rule14_reading_a_tainted_value_raises(read: Callable[[torch.Tensor], object]) -> None:
    """Data-dependent reads of a blank's values (control flow on garbage) are refused, though
    the blank itself feeds nothing backward needs."""
    x, w = _weights()

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t @ w
        read(h)
        return t.sin() + h

    key = nth(keys_of(fn, x), aten.mm.default, 0)
    assert_tensors_equal(
        run(fn, (x, w), "ours", {})[0], run(fn, (x, w), "plain")[0], "without the skip"
    )
    message = raises_skip_error(fn, x, key)
    assert "read the values of a tensor computed from the output of aten.mm.default" in message
    assert FIX in message


def test_rule14_what_a_checkpoint_nested_in_the_replay_keeps_is_not_refused() -> None:
    """A checkpoint nested in the replay builds a graph backward never uses: a blank reaching
    it by closure (a selective one saving from it) or as a keyword input is no error, and the
    gradients are exact (early stop off, so that the replay reaches the nested regions)."""
    x, w = _weights()
    saves = [aten.mul.Tensor, aten.sin.default]

    def by_keyword(u: torch.Tensor, *, k: torch.Tensor) -> torch.Tensor:
        return (u * k).sin()

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t @ w
        by_closure = checkpointing.checkpoint(
            lambda u: (u * h).sin(),
            t,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(saves),
        )
        return by_closure + checkpointing.checkpoint(by_keyword, t, k=h, use_reentrant=False)

    key = nth(keys_of(fn, x), aten.mm.default, 0)
    plain, _ = run(fn, (x, w), "plain")
    grads, _ = run(fn, (x, w), "ours", {key: SKIP_IN_REPLAY}, early_stop=False)
    assert_tensors_equal(grads, plain)


@given(
    chain=sac_chains(max_steps=6),
    answers=st.lists(
        st.sampled_from(
            [SKIP_IN_REPLAY, CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE]
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_rule14_any_skip_either_raises_or_is_exact(chain: SacChain, answers: list[object]) -> None:
    """Whatever is skipped, backward gives the plain run's gradients bitwise or our error:
    never a wrong gradient."""
    calls = iter(range(10_000))

    def policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        return answers[next(calls) % len(answers)]

    x, w = chain.inputs()
    torch.manual_seed(SEED)
    chain(x, w).sum().backward()
    plain = (x.grad, w.grad)
    x, w = chain.inputs()
    torch.manual_seed(SEED)
    out = checkpointing.checkpoint(
        chain,
        x,
        w,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy),
    )
    error: checkpointing.CheckpointError | None = None
    try:
        out.sum().backward()
    except checkpointing.CheckpointError as raised:
        error = raised
    if error is not None:
        assert FIX in str(error)
        return
    assert_tensors_equal((x.grad, w.grad), plain)


# --- Lifetimes and nesting -------------------------------------------------------------------


class _WatchBlanks(TorchDispatchMode):
    """Holds weak references to the blanks made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is aten.empty_strided.default:
            self.refs.append(weakref.ref(out))
        return out


def _ours(obj: object) -> bool:
    if issubclass(type(obj), torch.Tensor):
        return True
    if isinstance(obj, types.FunctionType | types.MethodType):
        return (getattr(obj, "__module__", None) or "").startswith("checkpointing")
    return type(obj).__module__.startswith("checkpointing")


@pytest.mark.usefixtures("gc_disabled")
def test_rule14_nothing_of_the_region_outlives_backward() -> None:
    """After backward the modes, their cache and taint, and every blank are dead without a
    collection, and the step left no reference cycle of ours."""
    model, leaves = decoder()
    key = lin2_key(model, leaves[0])
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    pairs: list[weakref.ref[Any]] = []

    def context_fn() -> Any:
        pair = keyed({key: SKIP_IN_REPLAY})()
        pairs.extend(weakref.ref(mode) for mode in pair)
        return pair

    out = checkpointing.checkpoint(model, leaves[0], use_reentrant=False, context_fn=context_fn)
    watch = _WatchBlanks()
    with watch:
        out.sum().backward()
    del out
    assert len(watch.refs) == 1
    assert [r() for r in [*pairs, *watch.refs] if r() is not None] == []
    assert replay_taint() is None
    gc.collect()
    assert [type(o).__qualname__ for o in gc.garbage if _ours(o)] == []


def test_rule14_skip_inside_a_nested_region() -> None:
    """A skipping selective region inside a plain checkpoint, and a plain checkpoint inside a
    skipping region: both exact, both skip."""
    model, leaves = decoder()
    key = lin2_key(model, leaves[0])
    plain, _ = run(model, leaves, "plain")

    def outer(t: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(
            model, t, use_reentrant=False, context_fn=keyed({key: SKIP_IN_REPLAY})
        )

    def with_inner(t: torch.Tensor) -> torch.Tensor:
        h = checkpointing.checkpoint(lambda u: F.gelu(model.lin1(u)), t, use_reentrant=False)
        return t + F.dropout(model.lin2(h), 0.1, True)

    grads, counts = run(outer, leaves, "plain")
    assert_tensors_equal(grads, plain, "skipping region inside")
    # lin1's, in the inner replay (the outer one stops at the inner region's input); lin2's skipped
    assert counts["aten.addmm.default"] == 1
    assert nth(keys_of(with_inner, leaves[0]), aten.addmm.default, 1) == key
    grads, counts = run(with_inner, leaves, "ours", {key: SKIP_IN_REPLAY})
    _, baseline = run(with_inner, leaves, "ours", {})
    assert_tensors_equal(grads, plain, "plain region inside")
    assert counts["aten.addmm.default"] == baseline["aten.addmm.default"] - 1
