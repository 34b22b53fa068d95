"""``saved_tensors_report(loss)``: the report from a loss after forward, and tag names in rows.

Each case runs one step twice with the same seed: once watched (``with saved_tensors_report()``)
and once not, then walks the second step's graph from its loss. Both forms must give the same
rows (but for the op of a tensor the graph cannot trace to its producer) and the same kept,
activation and RNG bytes; building the report must recompute nothing, and backward afterwards
must give the gradients of the plain run, bit for bit. See NOTE [Report from a graph].
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from allocator_support import allocator_step
from frame_support import assert_tensors_equal
from garbage_support import gc_disabled  # noqa: F401  (a fixture)

import checkpointing
from checkpointing import _events, policies, saved_tensors_report
from checkpointing._frame import Frame, Holder

Step = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""One forward: (model, input) -> loss."""


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8), torch.nn.Dropout(0.25)
    )


def _plain(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def _checkpointed(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpointing.checkpoint(model, x, use_reentrant=False).sum()


def _tagged(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The first layer's output is tagged "proj"; the rest runs as it is."""
    return model[1:](policies.tag(model[0](x), "proj")).sin().sum()


def _selective(policy: policies.Policy) -> Step:
    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        context_fn = policies.as_context_fn(policy)
        return checkpointing.checkpoint(
            _tagged, model, x, use_reentrant=False, context_fn=context_fn
        )

    return step


def _nested(model: Any, x: torch.Tensor) -> torch.Tensor:
    def outer(t: torch.Tensor) -> torch.Tensor:
        inner = checkpointing.checkpoint(model[:2], t.sin(), use_reentrant=False)
        return model[2:](inner).cos()

    return checkpointing.checkpoint(outer, x, use_reentrant=False).sum()


def _keyword_and_nested_inputs(model: Any, x: torch.Tensor) -> torch.Tensor:
    def fn(pair: tuple[torch.Tensor, torch.Tensor], *, scale: torch.Tensor) -> torch.Tensor:
        return model(pair[0] * scale + pair[1])

    scale = torch.full((8,), 2.0)
    return checkpointing.checkpoint(fn, (x, x.cos()), scale=scale, use_reentrant=False).sum()


CASES: dict[str, Step] = {
    "plain": _plain,
    "checkpointed": _checkpointed,
    "tagged": _tagged,
    "selective-saved": _selective(policies.save_only_these_names("proj")),
    "selective-matmuls": _selective(policies.save_matmuls()),
    "selective-offloaded": _selective(policies.offload_these_names("proj")),
    "nested": _nested,
    "keyword-and-nested-inputs": _keyword_and_nested_inputs,
}


def _nested_plain(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model[2:](model[:2](x.sin())).cos().sum()


def _keyword_plain(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model(x * torch.full((8,), 2.0) + x.cos()).sum()


# Each case's run without checkpoints (the selective cases: ``_tagged``).
PLAIN: dict[str, Step] = {
    "plain": _plain,
    "checkpointed": _plain,
    "nested": _nested_plain,
    "keyword-and-nested-inputs": _keyword_plain,
}


def _rows(report: checkpointing.SavedTensorsReport) -> Counter[tuple[Any, ...]]:
    """Every row but its op (the graph cannot always trace a tensor to its producer)."""
    return Counter((r.shape, r.dtype, r.nbytes, r.region, r.decision) for r in report.records)


def _watched(step: Step) -> checkpointing.SavedTensorsReport:
    model, x = _model(), torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    with saved_tensors_report() as report:
        loss = step(model, x)
    loss.backward()
    return report


def _walked(step: Step) -> tuple[checkpointing.SavedTensorsReport, list[torch.Tensor]]:
    """The report from the loss, then the gradients of backward run after it."""
    model, x = _model(), torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    loss = step(model, x)
    report = saved_tensors_report(loss)
    loss.backward()
    return report, [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("case", CASES)
def test_report_from_loss_equals_watched_report(case: str) -> None:
    """Same rows (op aside) and the same kept, activation and RNG bytes as the watched step."""
    watched = _watched(CASES[case])
    walked, _ = _walked(CASES[case])
    assert _rows(walked) == _rows(watched)
    assert walked.kept_bytes == watched.kept_bytes
    assert walked.activation_bytes == watched.activation_bytes
    assert walked.rng_state_bytes == watched.rng_state_bytes
    assert walked.bytes_by_decision() == watched.bytes_by_decision()
    assert not walked.recompute_counted
    assert walked.recompute_ops == 0


@pytest.mark.parametrize("case", CASES)
def test_backward_after_the_report_gives_the_plain_gradients(case: str) -> None:
    """Gradients after building the report are bit-identical to the run without checkpoints
    (dropout included: the RNG states the report reads are untouched)."""
    _, grads = _walked(CASES[case])
    model, x = _model(), torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    PLAIN.get(case, _tagged)(model, x).backward()
    assert_tensors_equal(grads, [x.grad, *(p.grad for p in model.parameters())], case)


def test_building_the_report_recomputes_nothing() -> None:
    """The walk unpacks nothing: no checkpointed function runs while it builds the report, and
    backward afterwards runs each as often as without a report (nested: the outer re-run makes
    the inner region anew, which recomputes once more)."""

    def counted_step(report: bool) -> Counter[str]:
        calls = Counter[str]()
        lin = torch.nn.Linear(8, 8)

        def inner(t: torch.Tensor) -> torch.Tensor:
            calls["inner"] += 1
            return lin(t).relu()

        def outer(t: torch.Tensor) -> torch.Tensor:
            calls["outer"] += 1
            return checkpointing.checkpoint(inner, t.sin(), use_reentrant=False).cos()

        x = torch.randn(4, 8, requires_grad=True)
        loss = checkpointing.checkpoint(outer, x, use_reentrant=False).sum()
        assert calls == {"outer": 1, "inner": 1}
        if report:
            assert saved_tensors_report([loss]).records
            assert saved_tensors_report(loss).records  # twice: still nothing consumed
            assert calls == {"outer": 1, "inner": 1}
        loss.backward()
        return calls

    assert counted_step(report=True) == counted_step(report=False) == {"outer": 2, "inner": 3}


def test_kept_bytes_from_loss_match_the_allocator() -> None:
    """What the allocator holds after forward (the loss aside) is the report's activation
    bytes, for a plain and a checkpointed chain."""
    layers = [torch.nn.Linear(32, 32) for _ in range(4)]
    x = torch.randn(16, 32, requires_grad=True)
    for use_checkpoint in (False, True):
        reports: list[checkpointing.SavedTensorsReport] = []

        def forward(
            use_checkpoint: bool = use_checkpoint,
            reports: list[checkpointing.SavedTensorsReport] = reports,
        ) -> torch.Tensor:
            h = x
            for layer in layers:
                fn = lambda t, layer=layer: torch.nn.functional.gelu(layer(t))  # noqa: E731
                ckpt = checkpointing.checkpoint
                h = ckpt(fn, h, use_reentrant=False) if use_checkpoint else fn(h)
            loss = h.sum()
            reports.append(saved_tensors_report(loss))
            return loss

        held = allocator_step(forward).held
        assert reports[0].activation_bytes == held, use_checkpoint


def test_frame_inputs_rng_states_and_holders_are_listed_in_forward_order() -> None:
    """Each region lists its input and RNG state first, then its recomputed tensors, with
    shapes from the determinism check's metadata."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 6, requires_grad=True)
    loss = checkpointing.checkpoint(lambda t: (t @ w).relu(), x, use_reentrant=False).sum()
    report = saved_tensors_report(loss)
    rows = [(r.op, r.shape, r.decision) for r in report.records]
    assert rows[:2] == [
        ("(input or parameter)", (4, 8), "saved"),
        ("rng state", (torch.get_rng_state().numel(),), "saved"),
    ]
    assert sorted(rows[2:]) == [
        ("(saved by mm)", (4, 8), "recomputed"),
        ("(saved by mm)", (8, 6), "recomputed"),
        ("relu", (4, 6), "recomputed"),
    ]


def test_rows_without_determinism_metadata_say_so() -> None:
    """With ``determinism_check="none"`` no shapes are recorded: rows say 0 bytes, a note why."""
    x = torch.randn(4, 8, requires_grad=True)
    loss = checkpointing.checkpoint(
        torch.sin, x, use_reentrant=False, determinism_check="none"
    ).sum()
    report = saved_tensors_report(loss)
    recomputed = [r for r in report.records if r.decision == "recomputed"]
    assert [(r.shape, r.nbytes) for r in recomputed] == [((), 0)]
    assert any("determinism_check='none'" in note for note in report.notes)


def test_debug_regions_are_found_through_their_unpack_hook() -> None:
    """With ``debug=True`` the unpack hook is a closure; the walk still finds the region."""

    def sine(t: torch.Tensor) -> torch.Tensor:
        return t.sin()

    x = torch.randn(4, 8, requires_grad=True)
    loss = checkpointing.checkpoint(sine, x, use_reentrant=False, debug=True).sum()
    report = saved_tensors_report(loss)
    recomputed = [(r.region, r.shape) for r in report.records if r.decision == "recomputed"]
    assert recomputed == [(f"checkpoint({sine.__qualname__})", (4, 8))]


def test_kept_span_rows_carry_the_span_region() -> None:
    """A ``keep`` span's tensors are "saved" in its region, the rest of the checkpoint is
    recomputed, as in the watched report."""
    lin = torch.nn.Linear(8, 8)

    def block(t: torch.Tensor) -> torch.Tensor:
        return checkpointing.keep(lambda a: lin(a).relu(), t).sin()

    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(block, x, use_reentrant=False).sum()

    watched, walked = _watched(step), _walked(step)[0]
    assert _rows(walked) == _rows(watched)
    assert walked.kept_bytes == watched.kept_bytes
    spans = {r.region for r in walked.records if r.region.startswith("keep(")}
    assert spans == {f"keep(<lambda>) in checkpoint({block.__qualname__})"}


def test_report_of_a_freed_graph_says_backward_freed_it() -> None:
    """After backward the graph holds nothing: the report is empty and a note says why."""
    x = torch.randn(4, requires_grad=True)
    loss = x.exp().sum()
    loss.backward()
    report = saved_tensors_report(loss)
    assert report.records == []
    assert any("backward already ran" in note for note in report.notes)


def test_reentrant_regions_note_what_they_keep_unseen() -> None:
    """A use_reentrant=True region's inputs are rows; its RNG states are out of sight: a note."""
    x = torch.randn(4, 8, requires_grad=True)
    loss = checkpointing.checkpoint(torch.sin, x, use_reentrant=True).sum()
    report = saved_tensors_report(loss)
    assert [r.shape for r in report.records] == [(4, 8)]
    assert any("use_reentrant=True" in note for note in report.notes)


def test_several_roots_share_nodes_and_storages() -> None:
    """Roots in one graph add nothing twice: two outputs of one forward give the rows of both,
    each node once."""
    x = torch.randn(4, 8, requires_grad=True)
    h = x.sin()
    a, b = h.exp(), h.cos()
    both = saved_tensors_report([a, b])
    assert len(both.records) == len(saved_tensors_report(a).records) + 1  # cos saves h too
    assert both.kept_bytes == x.nbytes + h.nbytes + a.nbytes


@pytest.mark.parametrize(
    ("shape", "bias"), [((4, 8), True), ((2, 3, 8), False)], ids=["addmm", "mm"]
)
def test_linear_keeps_its_input_not_its_weight(shape: tuple[int, ...], bias: bool) -> None:
    """NOTE [Report from a graph], Rule 4, in both forms: the transposed weight ``linear``
    saves is a view of the parameter (its storage), so the activation bytes are the input it
    saved and nothing of the weight; the kept bytes add the weight once."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 16, bias=bias)
    x = torch.randn(*shape, requires_grad=True)

    def loss_of() -> tuple[torch.Tensor, torch.Tensor]:
        h = x.tanh()  # tanh saves h, and so does linear (or a view of it)
        return linear(h).sum(), h

    with saved_tensors_report() as watched:
        loss, h = loss_of()
    loss.backward()
    loss, h = loss_of()
    for report in (watched, saved_tensors_report(loss), saved_tensors_report(loss, model=linear)):
        assert report.activation_bytes == h.nbytes, report.table()
        assert report.kept_bytes == h.nbytes + linear.weight.nbytes, report.table()


class _Rotary(torch.nn.Module):
    """A block that multiplies by a slice of a table it holds as a buffer (RoPE's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(256, 8))
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.table[: x.shape[0]])  # mul saves the slice: a view


def test_model_buffers_are_not_activations_from_a_loss() -> None:
    """NOTE [Report from a graph], Rule 4: with ``model=``, a saved slice of the model's buffer
    is model state, as in the watched report, not an activation counted by its whole storage;
    without ``model``, the walk cannot tell it from a tensor the step made."""
    torch.manual_seed(0)
    model, x = _Rotary(), torch.randn(4, 8, requires_grad=True)
    with saved_tensors_report(model=model) as watched:
        model(x).sum().backward()
    loss = model(x).sum()
    walked = saved_tensors_report(loss, model=model)
    product = 4 * 8 * 4  # x * table[:4], saved by linear
    assert walked.activation_bytes == watched.activation_bytes == product, walked.table()
    assert walked.kept_bytes == watched.kept_bytes
    assert saved_tensors_report(loss).activation_bytes == product + model.table.nbytes


@pytest.mark.parametrize(
    ("outputs", "error", "phrases"),
    [
        (torch.randn(3), ValueError, ("grad_fn=None", "before backward", "position 0")),
        (torch.randn(3, requires_grad=True), ValueError, ("requires_grad=True", "the loss")),
        ([], ValueError, ("at least one tensor", "empty list")),
        (3.0, TypeError, ("3.0 of type float", "saved_tensors_report(loss)")),
        (None, TypeError, ("None of type NoneType", "with saved_tensors_report()")),
        ([torch.randn(3, requires_grad=True).exp(), "x"], TypeError, ("at position 1",)),
    ],
)
def test_bad_outputs_are_refused_with_the_fix(
    outputs: Any, error: type[Exception], phrases: tuple[str, ...]
) -> None:
    """What is not a tensor with a ``grad_fn`` is refused, saying what came and what to pass."""
    with pytest.raises(error) as raised:
        saved_tensors_report(outputs)
    message = str(raised.value)
    assert message.startswith("checkpointing.saved_tensors_report:")
    for phrase in phrases:
        assert phrase in message


@pytest.mark.usefixtures("gc_disabled")
def test_report_holds_nothing_of_the_graph() -> None:
    """Once the loss is dropped, its graph, frames, holders and tensors die, report or not; and
    building the report leaves no cyclic garbage."""
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    h = x.sin()  # kept by the region as its input
    loss = checkpointing.checkpoint(lambda t: lin(t).relu(), h, use_reentrant=False).exp().sum()
    refs = [weakref.ref(o) for o in gc.get_objects() if type(o) in (Frame, Holder)]
    refs.append(weakref.ref(h))
    del h
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    report = saved_tensors_report(loss)
    gc.collect()
    assert gc.garbage == []
    assert len(refs) > 2
    assert len(report.records) > 3
    del loss
    assert [ref for ref in refs if ref() is not None] == []


# --- tag() names ------------------------------------------------------------------------------


def test_watched_rows_show_tag_names() -> None:
    """A tensor named with ``policies.tag`` shows its name in the watched report's rows: a plain
    save, a recomputed one and what a selective policy keeps by that name."""
    report = _watched(_selective(policies.save_only_these_names("proj")))
    named = Counter((r.decision, r.region) for r in report.records if r.name == "proj")
    assert named == {("saved", "checkpoint(_tagged)"): 1, ("recomputed", "checkpoint(_tagged)"): 1}
    plain = _watched(_tagged)
    assert [r.name for r in plain.records if r.op == "addmm"] == ["proj"]
    assert "proj" in plain.table()


def test_rows_from_a_loss_show_names_noted_by_storage() -> None:
    """Names reach a report from a loss through ``_events.note_tag`` (by storage): the tagged
    tensor, the selective cache's alias of it and views of it are named; new memory is not."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = policies.tag(t @ w, "proj")
        _events.note_tag(h, "proj")  # what ``policies.tag`` does when it notes names itself
        return h.relu().sin()

    policy = policies.as_context_fn(policies.save_only_these_names("proj"))
    loss = checkpointing.checkpoint(fn, x, use_reentrant=False, context_fn=policy).sum()
    report = saved_tensors_report(loss)
    assert [(r.op, r.region, r.name) for r in report.records if r.decision == "saved"][-1] == (
        "mm",
        f"checkpoint({fn.__qualname__})",
        "proj",
    )
    assert {r.name for r in report.records if r.decision == "recomputed"} == {None}
    plain_h = (x @ w).exp()
    _events.note_tag(plain_h, "kept")
    assert {r.name for r in saved_tensors_report(plain_h.sum()).records} == {"kept", None}


def test_names_die_with_their_storage() -> None:
    """The name registry holds no memory: an entry goes when its storage does."""
    t = torch.randn(4)
    _events.note_tag(t, "temp")
    assert _events.tag_name(t[1:]) == "temp"
    storage = weakref.ref(t.untyped_storage())
    del t
    assert storage() is None
    assert "temp" not in _events._tag_names.values()


def test_tag_notes_names_for_reports_from_a_loss() -> None:
    """``policies.tag`` itself notes the name, so a report from a loss names tagged tensors."""
    h = torch.randn(4, requires_grad=True).exp()
    policies.tag(h, "probe")
    assert _events.tag_name(h) == "probe"
    report = saved_tensors_report(h.sin().sum())
    assert [r.name for r in report.records] == ["probe", "probe"]  # saved by exp and by sin
