"""Compressed saves (NOTE [Compressed saves]): the formats, gradients against the run without
checkpointing, the keep order with compressed answers, offload of the compressed bytes, the
report's column, and the refusals of exact values."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import checkpointing
from checkpointing import CheckpointError, CheckpointPolicy, Compress, _compiled
from checkpointing._compression import pack, unpack
from checkpointing.policies import (
    MATMUL_OPS,
    as_context_fn,
    both,
    compress_ops,
    compress_these_names,
    either,
    offload_ops,
    recompute_ops,
    save_everything,
    save_matmuls,
    save_nothing,
    save_ops,
    tag,
)

aten = torch.ops.aten

FORMATS: dict[str, Compress] = {
    "bf16": Compress("bf16"),
    "fp16": Compress("fp16"),
    "fp8 per tensor": Compress("fp8"),
    "fp8 per row": Compress("fp8", scale="row"),
    "int8 per row": Compress("int8"),
}
# Largest error of a restored value, relative to the largest magnitude of its tensor (or row):
# half a step of the format (fp8: 3 mantissa bits, 1/16), except int8, where a value below half
# a step is moved up to one step (Rule 2: it must not come back zero) rather than down to zero.
VALUE_TOLERANCE = {
    "bf16": 2**-8,
    "fp16": 2**-11,
    "fp8 per tensor": 2**-4,
    "fp8 per row": 2**-4,
    "int8 per row": 1 / 127 + 1e-6,
}
# Relative gradient error (norm of the difference / norm of the exact gradient) allowed on the
# small network below; measured worst cases are a third of these or less.
GRADIENT_TOLERANCE = {
    "bf16": 1e-2,
    "fp16": 2e-3,
    "fp8 per tensor": 1e-1,
    "fp8 per row": 1e-1,
    "int8 per row": 5e-2,
}


def _tensors() -> list[torch.Tensor]:
    """Contiguous, transposed, sliced and expanded floats, with zeros and tiny values."""
    torch.manual_seed(0)
    base = torch.randn(6, 10)
    base[0, :3] = torch.tensor([1e-30, -1e-30, 0.0])
    return [base, base.t(), base[:, ::2], base[1:4], torch.randn(3, 1, 5).expand(3, 4, 5)]


@pytest.mark.parametrize("name", FORMATS)
def test_restored_values_shapes_and_strides(name: str) -> None:
    """Rules 1 and 5: a restored tensor has the original's dtype, shape and dense strides, and
    values within the format's rounding."""
    for tensor in _tensors():
        packed = pack(tensor, FORMATS[name])
        assert packed is not None
        restored = unpack(packed)
        assert restored.dtype == tensor.dtype
        assert restored.shape == tensor.shape
        dense = torch.empty_like(tensor).stride()
        assert restored.stride() == dense
        rows = tensor.reshape(-1, tensor.shape[-1]).abs().amax(-1, keepdim=True)
        largest = rows if FORMATS[name].scale == "row" else tensor.abs().amax()
        error = (restored - tensor).reshape(-1, tensor.shape[-1]).abs() / largest
        assert error.max() <= VALUE_TOLERANCE[name], name


@pytest.mark.parametrize("name", FORMATS)
def test_sign_and_zero_kept_exactly(name: str) -> None:
    """Rule 2: no non-zero value comes back zero, no zero comes back non-zero, no sign flips."""
    torch.manual_seed(1)
    tensor = torch.randn(8, 64) * torch.logspace(-30, 3, 64)
    tensor[:, ::5] = 0.0
    restored = unpack(pack(tensor, FORMATS[name]))  # type: ignore[arg-type]
    assert torch.equal(restored.sign(), tensor.sign())


def test_bytes_kept() -> None:
    """The payload and scale bytes of each format, for a float32 tensor of 64 rows of 256."""
    tensor = torch.randn(64, 256)
    kept = {name: pack(tensor, how).nbytes for name, how in FORMATS.items()}  # type: ignore[union-attr]
    assert kept == {
        "bf16": 64 * 256 * 2,
        "fp16": 64 * 256 * 2 + 4,
        "fp8 per tensor": 64 * 256 + 4,
        "fp8 per row": 64 * 256 + 64 * 4,
        "int8 per row": 64 * 256 + 64 * 4,
    }


def test_fp16_does_not_overflow() -> None:
    """Rule 1: fp16 divides by a power of two where the tensor exceeds its range."""
    tensor = torch.tensor([1e6, -3e5, 1.0])
    restored = unpack(pack(tensor, Compress("fp16")))  # type: ignore[arg-type]
    assert torch.isfinite(restored).all()
    assert torch.allclose(restored, tensor, rtol=1e-3)


# --- Gradients ------------------------------------------------------------------------------


def _net() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    w1 = (torch.randn(16, 32) / 4).requires_grad_()
    w2 = (torch.randn(32, 8) / 6).requires_grad_()
    x = torch.randn(12, 16)

    def block(x: torch.Tensor) -> torch.Tensor:
        return ((x @ w1).relu() @ w2).tanh()

    return block, [w1, w2], x


def _grads(context_fn: Any = None, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    _, params, x = _net()
    params = [p.detach().to(dtype).requires_grad_() for p in params]
    w1, w2 = params

    def run(x: torch.Tensor) -> torch.Tensor:
        return ((x @ w1).relu() @ w2).tanh()

    x = x.to(dtype)
    if context_fn is None:
        out = run(x)
    else:
        out = checkpointing.checkpoint(run, x, use_reentrant=False, context_fn=context_fn)
    out.square().sum().backward()
    return [p.grad for p in params]  # type: ignore[misc]


@pytest.mark.parametrize("name", FORMATS)
def test_gradients_close_to_the_run_without_checkpointing(name: str) -> None:
    """Every format, matmul outputs kept compressed: gradients within the documented tolerance
    of the plain run, and not equal to it (the compression really happened)."""
    how = FORMATS[name]
    exact = _grads()
    policy = compress_ops(*MATMUL_OPS, to=how.format, scale=how.scale)
    got = _grads(as_context_fn(policy))
    for g, e in zip(got, exact, strict=True):
        error = ((g - e).norm() / e.norm()).item()
        assert error <= GRADIENT_TOLERANCE[name], (name, error)
        assert not torch.equal(g, e)


def test_relu_mask_is_the_forward_s() -> None:
    """Rule 2: relu's backward reads its (recomputed) output as a mask; from an int8 matmul
    output the mask is exactly the plain run's."""
    _, (w1, _), x = _net()
    h = x @ w1
    policy = compress_ops(aten.mm, to="int8")
    plain = torch.autograd.grad(h.relu().sum(), w1)[0]
    kept = checkpointing.checkpoint(
        lambda t: (t @ w1).relu().sum(), x, use_reentrant=False, context_fn=as_context_fn(policy)
    )
    got = torch.autograd.grad(kept, w1)[0]
    assert torch.equal(got, plain)  # the gradient is the mask, summed: exact


def test_compressing_to_the_own_dtype_is_bitwise() -> None:
    """Rule 3: bf16 tensors compressed to bf16 give the very gradients of keeping them, and of
    the plain run."""
    policy = compress_ops(*MATMUL_OPS, to=torch.bfloat16)
    got = _grads(as_context_fn(policy), torch.bfloat16)
    kept = _grads(as_context_fn(save_matmuls()), torch.bfloat16)
    plain = _grads(None, torch.bfloat16)
    for g, k, p in zip(got, kept, plain, strict=True):
        assert torch.equal(g, k)
        assert torch.equal(g, p)


def test_tag_names_a_compressed_tensor() -> None:
    """``compress_these_names``: the tagged tensor's producer keeps it compressed (the report
    shows it), and gradients are close to the plain run's."""
    _, (w1, w2), x = _net()

    def tagged(x: torch.Tensor) -> torch.Tensor:
        return (tag(x @ w1, "h").relu() @ w2).tanh()

    exact = torch.autograd.grad(tagged(x).square().sum(), (w1, w2))
    context_fn = as_context_fn(compress_these_names("h", to="bf16"))
    with checkpointing.saved_tensors_report() as report:
        out = checkpointing.checkpoint(tagged, x, use_reentrant=False, context_fn=context_fn)
        got = torch.autograd.grad(out.square().sum(), (w1, w2))
    assert report.bytes_by_decision()["compressed"] == 12 * 32 * 2
    for g, e in zip(got, exact, strict=True):
        assert ((g - e).norm() / e.norm()).item() <= GRADIENT_TOLERANCE["bf16"]


# --- Offload and the report --------------------------------------------------------------------


# The two mm outputs of ``_grads`` (12 x 32 and 12 x 8, 1,920 float32 bytes): the packed bytes
# each format moves, payload plus float32 scales (one per tensor, or one per row: 24 rows).
_ON_HOST = {
    ("bf16", None): 960,
    ("fp16", None): 960 + 2 * 4,
    ("fp8", None): 480 + 2 * 4,
    ("fp8", "row"): 480 + 24 * 4,
    ("int8", None): 480 + 24 * 4,
}


@pytest.mark.parametrize(("to", "scale"), list(_ON_HOST))
def test_offload_moves_the_packed_bytes_scales_included(to: str, scale: str | None) -> None:
    """Rule 6: compress, then offload: the host receives the payload (half or a quarter of the
    float32 bytes offload_ops moves) and the scales; OffloadStats and the report count the same
    bytes, and gradients match compressing on the device bit for bit."""
    plain, compressed = checkpointing.OffloadStats(), checkpointing.OffloadStats()
    _grads(as_context_fn(offload_ops(*MATMUL_OPS), offload_stats=plain))
    policy = compress_ops(*MATMUL_OPS, to=to, scale=scale, offload=True)
    with checkpointing.saved_tensors_report() as report:
        on_host = _grads(as_context_fn(policy, offload_stats=compressed))
    on_device = _grads(as_context_fn(compress_ops(*MATMUL_OPS, to=to, scale=scale)))
    assert plain.offloaded_bytes == 1920
    assert compressed.offloaded_bytes == _ON_HOST[(to, scale)]
    assert report.bytes_by_decision()["offloaded"] == compressed.offloaded_bytes
    assert compressed.restored_bytes == compressed.offloaded_bytes
    for a, b in zip(on_host, on_device, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("to", "scale"), list(_ON_HOST))
@pytest.mark.parametrize("shape", [(), (5,), (3, 7), (2, 3, 4)])
def test_a_joined_buffer_restores_what_the_device_copy_restores(
    to: str, scale: str | None, shape: tuple[int, ...]
) -> None:
    """Rule 6: the one buffer offload moves (scale, then payload) holds exactly the packed
    bytes and restores bit for bit what the packed tensor kept on the device restores,
    whatever the shape (a scalar, transposed strides) and at fp16's range limit."""
    torch.manual_seed(0)
    tensor = torch.randn(shape) * 1e5
    if tensor.dim() > 1:
        tensor = tensor.transpose(0, -1)
    on_device = pack(tensor, Compress(to, scale=scale))  # type: ignore[arg-type]
    joined = pack(tensor, Compress(to, scale=scale, offload=True))  # type: ignore[arg-type]
    assert on_device is not None
    assert joined is not None
    assert joined.payload is not None
    assert joined.nbytes == on_device.nbytes == joined.payload.nbytes
    assert joined.payload.dtype == (torch.bfloat16 if to == "bf16" else torch.uint8)
    buffer = joined.payload.clone()
    joined.payload = None
    restored = unpack(joined, buffer)
    assert torch.equal(restored, unpack(on_device))
    assert restored.stride() == unpack(on_device).stride()


def test_report_has_a_compressed_column() -> None:
    """The report counts compressed bytes apart: the packed size, and in the summary."""
    block, _, x = _net()
    context_fn = as_context_fn(compress_ops(aten.mm, to="fp8", scale="row"))
    with checkpointing.saved_tensors_report() as report:
        checkpointing.checkpoint(
            block, x, use_reentrant=False, context_fn=context_fn
        ).sum().backward()
    packed = (12 * 32 + 12 * 4) + (12 * 8 + 12 * 4)  # two mm outputs: payload and row scales
    assert report.bytes_by_decision()["compressed"] == packed
    (totals,) = report.regions().values()
    assert totals.compressed == packed
    assert totals.compressed_ops == {"mm": (2, packed)}
    assert "  compressed: mm x2" in report.summary()
    assert report.summary().splitlines()[1].split()[-1] == "compressed"
    plain = checkpointing.SavedTensorsReport()
    assert "compressed" not in plain.summary()  # the column only where something was
    assert sum(r.decision == "compressed" for r in report.records) == 2


# --- The keep order ----------------------------------------------------------------------------

_POLICIES: dict[str, Any] = {
    "nothing": save_nothing(),
    "everything": save_everything(),
    "matmuls": save_matmuls(),
    "offload mm": offload_ops(aten.mm),
    "recompute mm": recompute_ops(aten.mm),
    "bf16 mm": compress_ops(aten.mm, to="bf16"),
    "fp8 mm": compress_ops(aten.mm, aten.addmm, to="fp8"),
    "int8 offloaded": compress_ops(aten.mm, to="int8", offload=True),
}
_OPS = (aten.mm.default, aten.addmm.default, aten.relu.default)


def _answers(policy: Any) -> tuple[Any, ...]:
    return tuple(policy(None, op) for op in _OPS)


def test_lattice_laws_with_compressed_answers() -> None:
    """``either`` and ``both`` stay commutative, associative, idempotent and absorbing with
    compressed answers, whose place in the keep order is between the exact levels."""
    policies = list(_POLICIES.values())
    for p in policies:
        assert _answers(either(p, p)) == _answers(p) == _answers(both(p, p))
        for q in policies:
            assert _answers(either(p, q)) == _answers(either(q, p))
            assert _answers(both(p, q)) == _answers(both(q, p))
            assert _answers(either(p, both(p, q))) == _answers(p)
            assert _answers(both(p, either(p, q))) == _answers(p)
            for r in policies[:4]:
                assert _answers(either(p, either(q, r))) == _answers(either(either(p, q), r))
                assert _answers(both(p, both(q, r))) == _answers(both(both(p, q), r))


def test_keep_order_places_compressed_answers() -> None:
    """Exact keep beats compressed, compressed on the device beats offload, compressed on the
    host beats recompute, and a finer format beats a coarser one."""
    mm = aten.mm.default
    assert either(save_ops(aten.mm), compress_ops(aten.mm))(None, mm) is CheckpointPolicy.MUST_SAVE
    assert either(offload_ops(aten.mm), compress_ops(aten.mm))(None, mm) == Compress("bf16")
    offloaded = compress_ops(aten.mm, offload=True)
    assert both(offload_ops(aten.mm), offloaded)(None, mm) == Compress("bf16", offload=True)
    assert either(recompute_ops(aten.mm), offloaded)(None, mm) == Compress("bf16", offload=True)
    finer = either(compress_ops(aten.mm, to="fp8"), compress_ops(aten.mm, to="int8"))
    assert finer(None, mm) == Compress("int8")


# --- Refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [aten.max, aten.amax.default, aten.topk, aten.native_dropout])
def test_exact_value_ops_are_refused_when_named(op: Any) -> None:
    """Rule 4: naming an op whose backward needs its outputs' exact values is an error."""
    with pytest.raises(CheckpointError, match=r"cannot be kept compressed.*Fix"):
        compress_ops(op)


def _answering(answer: Any, op: Any) -> Any:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        return answer if func == op else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def test_exact_value_op_is_refused_at_forward() -> None:
    """Rule 4: a policy of one's own answering Compress for ``amax`` fails at that op."""
    x = torch.randn(4, 4, requires_grad=True)
    policy = _answering(Compress("bf16"), aten.amax.default)
    context_fn = functools.partial(checkpointing.create_selective_checkpoint_contexts, policy)
    with pytest.raises(CheckpointError, match=r"aten\.amax\.default cannot be kept compressed"):
        checkpointing.checkpoint(
            lambda t: t.sin().amax(0).sum(), x, use_reentrant=False, context_fn=context_fn
        )


@pytest.mark.parametrize("view", [False, True])
def test_exact_value_op_kept_on_a_compressed_input_is_refused(view: bool) -> None:
    """Rule 4: ``amax`` kept exactly on a compressed matmul output (or a view of one) would
    compare the restored input with the forward's result in backward (a lost gradient, NaN
    here): refused at forward; recomputing ``amax`` instead gives close gradients."""
    _, (w1, _), x = _net()

    def peak(t: torch.Tensor) -> torch.Tensor:
        h = t @ w1
        return (h.view(-1) if view else h).amax(-1).sum()

    kept = either(save_ops(aten.amax), compress_ops(aten.mm, to="int8"))
    with pytest.raises(CheckpointError, match=r"keeps the output of aten\.amax\.default.*Fix"):
        checkpointing.checkpoint(peak, x, use_reentrant=False, context_fn=as_context_fn(kept))
    exact = torch.autograd.grad(peak(x), w1)[0]
    context_fn = as_context_fn(compress_ops(aten.mm, to="bf16"))
    out = checkpointing.checkpoint(peak, x, use_reentrant=False, context_fn=context_fn)
    got = torch.autograd.grad(out, w1)[0]
    assert ((got - exact).norm() / exact.norm()).item() <= GRADIENT_TOLERANCE["bf16"]


def test_integer_and_boolean_outputs_are_refused() -> None:
    """Rule 4: an integer or boolean output reaching a compressed decision is an error naming
    the op and the dtype."""
    x = torch.randn(4, 4, requires_grad=True)
    for op, fn in [
        (aten.gt.Scalar, lambda t: torch.where(t > 0, t, 0.0).sum()),
        (aten.cumsum.default, lambda t: t.sum() + torch.arange(3).cumsum(0).sum()),
    ]:
        context_fn = as_context_fn(compress_ops(op))
        with pytest.raises(CheckpointError, match=rf"{op}.*torch\.(bool|int64).*Fix"):
            checkpointing.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)


@pytest.mark.parametrize(
    ("kwargs", "error", "phrase"),
    [
        ({"to": "fp4"}, ValueError, "expected a compressed format"),
        ({"to": torch.float32}, ValueError, "expected a compressed format"),
        ({"to": "bf16", "scale": "row"}, ValueError, "takes scale none"),
        ({"to": "int8", "scale": "tensor"}, ValueError, "'row' only"),
        ({"to": "fp8", "scale": "block"}, ValueError, "'tensor' or 'row'"),
        ({"to": "fp8", "offload": 1}, TypeError, "offload to be a bool"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], phrase: str) -> None:
    """Bad formats, scales and offload flags name the API, what was expected and the fix."""
    to = kwargs.pop("to")
    with pytest.raises(error, match=rf"checkpointing\.Compress: .*{phrase}.*Fix"):
        Compress(to, **kwargs)
    with pytest.raises(error, match=r"checkpointing\.policies\.compress_ops"):
        compress_ops(aten.mm, to=to, **kwargs)


# --- Kept spans (NOTE [Compressed spans]) ------------------------------------------------------


def _span_grads(keeper: Any) -> tuple[list[torch.Tensor], checkpointing.SavedTensorsReport]:
    """Gradients of a region whose first layer is a span kept by ``keeper`` (None: no
    checkpoint at all), and the report of that step."""
    _, (w1, w2), x = _net()

    def layer(x: torch.Tensor) -> torch.Tensor:
        return (x @ w1).relu() @ w2

    def region(x: torch.Tensor) -> torch.Tensor:
        return (layer(x) if keeper is None else keeper(layer)(x)).tanh()

    with checkpointing.saved_tensors_report() as report:
        if keeper is None:
            out = region(x)
        else:
            out = checkpointing.checkpoint(region, x, use_reentrant=False)
        got = torch.autograd.grad(out.square().sum(), (w1, w2))
    return list(got), report


@pytest.mark.parametrize("name", FORMATS)
def test_span_keeps_its_tensors_compressed(name: str) -> None:
    """``keeping(compress=...)``: the span's saved floats are kept compressed (the report's
    column), gradients close to the plain run's, and the same as compressing those ops by
    policy would give within the format's tolerance."""
    how = FORMATS[name]
    exact, _ = _span_grads(None)
    got, report = _span_grads(checkpointing.keeping(compress=how))
    assert report.bytes_by_decision()["compressed"] > 0
    for g, e in zip(got, exact, strict=True):
        assert ((g - e).norm() / e.norm()).item() <= GRADIENT_TOLERANCE[name]


def test_span_compressed_to_its_own_dtype_is_bitwise() -> None:
    """A span of float32 tensors ``Compress``-ed to ... float32 is not a format; a bf16 span
    compressed to bf16 keeps its tensors as they are: gradients bitwise those of keeping."""
    _, (w1, w2), x = _net()
    w1, w2, x = (t.detach().bfloat16().requires_grad_(t.requires_grad) for t in (w1, w2, x))

    def run(keeper: Any) -> list[torch.Tensor]:
        layer = keeper(lambda t: (t @ w1).relu() @ w2)
        out = checkpointing.checkpoint(lambda t: layer(t).tanh(), x, use_reentrant=False)
        return list(torch.autograd.grad(out.square().sum(), (w1, w2)))

    compressed = run(checkpointing.keeping(compress=Compress("bf16")))
    kept = run(checkpointing.keeping())
    for a, b in zip(compressed, kept, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("to", ["bf16", "fp8"])
def test_span_offloads_the_compressed_bytes(to: str) -> None:
    """``Compress(..., offload=True)`` on a span: the host receives the compressed bytes (half
    for bf16; a quarter and the scales for fp8), as many as the report calls offloaded."""
    plain, compressed = checkpointing.OffloadStats(), checkpointing.OffloadStats()
    offloading = checkpointing.keeping(
        policy=CheckpointPolicy.MUST_CPU_OFFLOAD, offload_stats=plain
    )
    _span_grads(offloading)
    how = Compress(to, offload=True)  # type: ignore[arg-type]
    _, report = _span_grads(checkpointing.keeping(compress=how, offload_stats=compressed))
    assert report.bytes_by_decision()["offloaded"] == compressed.offloaded_bytes > 0
    if to == "bf16":
        assert compressed.offloaded_bytes * 2 == plain.offloaded_bytes
    else:  # fp8 per tensor: a quarter, and one 4-byte scale per kept tensor
        kept = sum(r.decision == "offloaded" for r in report.records)
        assert compressed.offloaded_bytes == plain.offloaded_bytes // 4 + 4 * kept


def test_span_refuses_an_op_that_compares_its_result() -> None:
    """Rule 2 of NOTE [Compressed spans]: amax inside a compressing span is refused, naming it."""
    x = torch.randn(4, 4, requires_grad=True)
    span = checkpointing.keeping("peak", compress=Compress("fp8"))(lambda t: t.sin().amax())
    with pytest.raises(CheckpointError, match=r"'peak' runs aten\.amax\.default.*Fix"):
        checkpointing.checkpoint(span, x, use_reentrant=False)


def test_span_keeps_masks_exactly() -> None:
    """Rule 1 of NOTE [Compressed spans]: a dropout mask a compressing span saves stays exact;
    gradients with the RNG preserved are close to the plain run's (same draws)."""
    _, (w1, _), x = _net()

    def layer(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(t @ w1, 0.5, training=True)

    torch.manual_seed(5)
    plain = torch.autograd.grad(layer(x).square().sum(), w1)[0]
    torch.manual_seed(5)
    span = checkpointing.keeping(compress=Compress("bf16"))(layer)
    out = checkpointing.checkpoint(span, x, use_reentrant=False)
    got = torch.autograd.grad(out.square().sum(), w1)[0]
    assert torch.equal(got == 0, plain == 0)
    assert ((got - plain).norm() / plain.norm()).item() <= GRADIENT_TOLERANCE["bf16"]


@pytest.mark.parametrize(
    ("kwargs", "error", "phrase"),
    [
        ({"compress": "bf16"}, TypeError, "compress must be a checkpointing.Compress"),
        (
            {"compress": Compress("bf16"), "policy": CheckpointPolicy.MUST_CPU_OFFLOAD},
            ValueError,
            "offload=True",
        ),
    ],
)
def test_span_bad_compress(kwargs: dict[str, Any], error: type[Exception], phrase: str) -> None:
    """``keeping``'s compress option refuses what is not a ``Compress``, and says how to
    compress and offload both."""
    with pytest.raises(error, match=re.escape(phrase)):
        checkpointing.keeping(**kwargs)


@pytest.mark.parametrize("offload", [False, True])
def test_report_from_the_loss_sees_what_the_watch_sees(offload: bool) -> None:
    """A report built from the loss finds the compressed entries of the selective cache and of
    a kept span: the same bytes per decision and kept bytes as the watched step."""
    _, (w1, w2), x = _net()
    context_fn = as_context_fn(compress_ops(aten.mm, to="int8", offload=offload))
    span = checkpointing.keeping("second", compress=Compress("fp8", offload=offload))

    def region(t: torch.Tensor) -> torch.Tensor:
        return span(lambda h: (h @ w2).tanh())((t @ w1).relu())

    def step() -> torch.Tensor:
        return checkpointing.checkpoint(region, x, use_reentrant=False, context_fn=context_fn)

    with checkpointing.saved_tensors_report() as watched:
        step().sum().backward()
    loss = step().sum()
    walked = checkpointing.saved_tensors_report(loss)
    loss.backward()
    assert walked.bytes_by_decision() == watched.bytes_by_decision()
    assert walked.bytes_by_decision()["offloaded" if offload else "compressed"] > 0
    assert walked.kept_bytes == watched.kept_bytes


def test_under_compile_outputs_are_kept_uncompressed() -> None:
    """Rule 7: under ``torch.compile`` a compressed answer is kept as a save by the compiler's
    partitioner, said once; gradients are the plain run's."""
    _, (w1, _), x = _net()
    context_fn = as_context_fn(compress_ops(aten.mm, to="int8"))

    def region(t: torch.Tensor) -> torch.Tensor:
        def body(u: torch.Tensor) -> torch.Tensor:
            return (u @ w1).relu().sum()

        return checkpointing.checkpoint(body, t, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()
    _compiled._said.discard("compress")  # said once per process
    with pytest.warns(UserWarning, match=r"Compress decision .* under torch\.compile"):
        out = torch.compile(region, backend="aot_eager")(x)
    got = torch.autograd.grad(out, w1)[0]
    plain = torch.autograd.grad((x @ w1).relu().sum(), w1)[0]
    assert torch.equal(got, plain)
