"""Sequence-tiled regions (NOTE [Tiled regions], ``_tiling``), against the untiled run.

The tolerance of Rule 4: gradients of what is not split (parameters, inputs reaching every
chunk) are sums over chunks; against one untiled call they agree to ``rtol=1e-5, atol=1e-6`` in
float32 (``PARAM_TOL``). Split inputs' gradients are bitwise those of the function run chunk by
chunk in plain autograd, and bitwise the untiled run's for elementwise functions.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from frame_support import assert_tensors_equal
from torch import nn

import checkpointing
from checkpointing import CheckpointError, Tiling

PARAM_TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}


class _MLP(nn.Module):
    """A SwiGLU MLP that counts its calls (chunks) and their lengths."""

    def __init__(self, hidden: int = 8, inner: int = 24, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.dropout = nn.Dropout(dropout)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[1])
        return self.down(self.dropout(F.silu(self.gate(x)) * self.up(x)))


def _grads(model: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor | None]:
    return [t.grad for t in inputs] + [p.grad for p in model.parameters()]


def _chunkwise_reference(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, bounds: list[tuple[int, int]]
) -> torch.Tensor:
    """The function run chunk by chunk in plain autograd, outputs side by side."""
    return torch.cat([fn(x.narrow(1, start, size)) for start, size in bounds], dim=1)


@pytest.mark.parametrize("chunks", [1, 3, 8, 40])
@pytest.mark.parametrize("dim", [0, 1, -2])
def test_rule_4_elementwise_input_gradients_are_bitwise_the_untiled_ones(
    chunks: int, dim: int
) -> None:
    """An elementwise region: output and input gradients bit-identical to the untiled run,
    whatever the chunking (one chunk per position included); the broadcast input's gradient
    within the reduction tolerance."""

    def fn(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (x.sin() * scale).tanh() + x.exp()

    x = torch.randn(5, 37, 8, requires_grad=True)
    scale = torch.randn(8, requires_grad=True)
    out = checkpointing.tiled(fn, dim=dim, chunks=chunks)(x, scale)
    out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
    got = (out.detach(), x.grad, scale.grad)
    x.grad = scale.grad = None
    ref = fn(x, scale)
    ref.backward(torch.randn_like(ref, generator=torch.Generator().manual_seed(1)))
    assert_tensors_equal(got[:2], (ref.detach(), x.grad), "output, input gradient")
    torch.testing.assert_close(got[2], scale.grad, **PARAM_TOL)


@pytest.mark.parametrize("chunks", [2, 5])
def test_rule_4_module_input_gradients_are_the_chunkwise_run_bitwise(chunks: int) -> None:
    """``checkpoint_module(tile=)``: the input gradient bitwise that of the chunk-by-chunk
    plain run; parameter gradients (summed in chunk order, the linears' by ``addmm_``) within
    the documented tolerance of it, and of the untiled run (and torch's checkpoint of it,
    side by side)."""
    torch.manual_seed(0)
    mlp = _MLP()
    x = torch.randn(3, 23, 8, requires_grad=True)
    params = list(mlp.parameters())
    reference: list[torch.Tensor] = [torch.zeros_like(x)]
    for start, size in Tiling(dim=1, chunks=chunks).bounds(23):
        part = x.detach().narrow(1, start, size).requires_grad_()
        got_x, *got_params = torch.autograd.grad(mlp(part).square().sum(), [part, *params])
        reference[0].narrow(1, start, size).copy_(got_x)
        if len(reference) == 1:
            reference.extend(got_params)
        else:
            for total, grad in zip(reference[1:], got_params, strict=True):
                total.add_(grad)  # in chunk order
    torch_checkpoint.checkpoint(mlp, x, use_reentrant=False).square().sum().backward()
    untiled = [g.clone() if g is not None else None for g in _grads(mlp, x)]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    checkpointing.checkpoint_module(mlp, tile=Tiling(dim=1, chunks=chunks))
    mlp(x).square().sum().backward()
    got = _grads(mlp, x)
    assert_tensors_equal(got[:1], reference[:1], "tiled vs chunkwise plain autograd")
    for a, b, c in zip(got, untiled, reference, strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)
        torch.testing.assert_close(a, c, **PARAM_TOL)


def test_rule_1_each_chunk_runs_once_in_forward_and_once_in_backward() -> None:
    """Forward runs every chunk once, backward recomputes every chunk once."""
    mlp = checkpointing.checkpoint_module(_MLP(), tile=Tiling(dim=1, chunk_size=4))
    out = mlp(torch.randn(2, 10, 8, requires_grad=True))
    assert mlp.calls == [4, 4, 2]
    out.sum().backward()
    assert mlp.calls == [4, 4, 2] * 2


def test_rule_2_inside_an_outer_checkpoint_no_third_forward() -> None:
    """A tiled MLP in a checkpointed layer runs twice per chunk (forward, its own recompute):
    the layer's recompute stops at the MLP's saved inputs. The input gradient is bitwise that
    of the plain run with the MLP applied chunk by chunk; the others within the tolerance."""
    torch.manual_seed(0)
    mlp, norm = _MLP(), nn.LayerNorm(8)

    def layer(h: torch.Tensor) -> torch.Tensor:
        return h + mlp(norm(h))

    x = torch.randn(2, 12, 8, requires_grad=True)
    bounds = Tiling(dim=1, chunks=4).bounds(12)
    (x + _chunkwise_reference(mlp, norm(x), bounds)).sum().backward()
    expected = _grads(mlp, x) + [p.grad for p in norm.parameters()]
    expected = [g.clone() if g is not None else None for g in expected]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    norm.zero_grad(set_to_none=True)
    checkpointing.checkpoint_module(mlp, tile=Tiling(dim=1, chunks=4))
    mlp.calls.clear()
    out = checkpointing.checkpoint(layer, x, use_reentrant=False)
    out.sum().backward()
    assert mlp.calls == [3] * 8  # 4 chunks forward, 4 recomputed: no third forward
    got = _grads(mlp, x) + [p.grad for p in norm.parameters()]
    assert_tensors_equal(got[:1], expected[:1], "input gradient")
    for a, b in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)


class _PatchedTiledMLP(torch.autograd.Function):
    """The patch-the-model way (a tiled MLP module as the libraries that patch models write
    it): forward by chunks under no_grad saving its input with ``save_for_backward``, backward
    recomputing chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, mlp: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
        ctx.mlp, ctx.chunks = mlp, chunks
        ctx.save_for_backward(x)
        return torch.cat([mlp(part) for part in x.chunk(chunks, dim=1)], dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            parts = zip(x.chunk(ctx.chunks, dim=1), grad.chunk(ctx.chunks, dim=1), strict=True)
            for part, g in parts:
                torch.autograd.backward(ctx.mlp(part), g)
        return None, x.grad, None


def test_rule_2_the_patch_the_model_way_runs_three_forwards() -> None:
    """The comparison the rule makes: a tiled module that saves its input after its forward,
    inside a checkpointed layer, runs each chunk three times."""
    mlp = _MLP()

    def layer(h: torch.Tensor) -> torch.Tensor:
        return h + _PatchedTiledMLP.apply(mlp, h, 4)

    x = torch.randn(2, 12, 8, requires_grad=True)
    out = checkpointing.checkpoint(layer, x, use_reentrant=False)
    out.sum().backward()
    assert mlp.calls == [3] * 12


def test_rule_6_dropout_recompute_draws_what_the_forward_drew() -> None:
    """With dropout, each chunk's recompute restores that chunk's RNG: output and input
    gradient are bitwise those of the chunk-by-chunk plain run from the same seed (masks differ
    from an untiled run's, which draws once for the whole shape)."""
    mlp = _MLP(dropout=0.5)
    x = torch.randn(2, 9, 8, requires_grad=True)
    bounds = Tiling(dim=1, chunks=3).bounds(9)
    torch.manual_seed(7)
    ref_out = _chunkwise_reference(mlp, x, bounds)
    ref_out.sum().backward()
    expected = [g.clone() if g is not None else None for g in _grads(mlp, x)]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    out = checkpointing.tiled(mlp, dim=1, chunks=3)(x)
    torch.randn(100)  # the caller's RNG moves on before backward
    out.sum().backward()
    got = _grads(mlp, x)
    assert_tensors_equal([out.detach(), got[0]], [ref_out.detach(), expected[0]], "out, dx")
    for a, b in zip(got[1:], expected[1:], strict=True):  # autograd sums chunks in any order
        torch.testing.assert_close(a, b, **PARAM_TOL)


def test_rule_6_autocast_is_restored_per_chunk() -> None:
    """Under CPU autocast (bfloat16) with backward outside it, each chunk is recomputed under
    the forward's autocast (else the determinism check would see float32): the input gradient
    matches the untiled autocast run's to bfloat16 rounding."""
    torch.manual_seed(0)
    mlp = _MLP()
    x = torch.randn(2, 8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = mlp(x)
    ref.float().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = checkpointing.tiled(mlp, dim=1, chunks=2)(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    torch.testing.assert_close(x.grad, expected, rtol=1.6e-2, atol=1e-3)


def test_autograd_grad_returns_parameter_gradients_without_touching_grad() -> None:
    """``torch.autograd.grad`` gets the summed parameter gradients; ``.grad`` stays None."""
    mlp = checkpointing.checkpoint_module(_MLP(), tile=Tiling(dim=1, chunks=3))
    x = torch.randn(2, 6, 8, requires_grad=True)
    params = list(mlp.parameters())
    got = torch.autograd.grad(mlp(x).sum(), [x, *params])
    assert all(p.grad is None for p in params)
    checkpointing.remove_checkpoint_module(mlp)
    expected = torch.autograd.grad(mlp(x).sum(), [x, *params])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)


def test_retain_graph_recomputes_again_with_the_same_gradients() -> None:
    """A second backward over a retained graph recomputes and gives the same gradients."""
    x = torch.randn(2, 6, 4, requires_grad=True)
    out = checkpointing.tiled(torch.sinh, dim=1, chunks=2)(x)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    out.sum().backward()
    assert_tensors_equal([x.grad], [first * 2], "twice the gradient")


def test_several_split_inputs_tuple_outputs_and_broadcast_tensors() -> None:
    """Two split inputs, an input every chunk shares (its gradient summed), keyword options
    and a tuple output: all as the untiled run."""

    def fn(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, *, power: int) -> Any:
        return a * w + b**power, (a - b).cos()

    a = torch.randn(3, 11, 5, requires_grad=True)
    b = torch.randn(3, 11, 5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    run = checkpointing.checkpoint(
        fn, a, b, w, power=3, use_reentrant=False, tile=Tiling(dim=1, chunks=4, split=(0, 1))
    )
    assert isinstance(run, tuple)
    (run[0].sum() + run[1].square().sum()).backward()
    got = [a.grad, b.grad, w.grad]
    a.grad = b.grad = w.grad = None
    ref = fn(a, b, w, power=3)
    (ref[0].sum() + ref[1].square().sum()).backward()
    assert_tensors_equal(got[:2], [a.grad, b.grad], "split inputs")
    torch.testing.assert_close(got[2], w.grad, **PARAM_TOL)


def test_decorator_form_and_no_grad() -> None:
    """``@checkpoint(tile=...)`` tiles every call; under ``no_grad`` the forward still runs in
    chunks and keeps nothing."""
    lengths: list[int] = []

    @checkpointing.checkpoint(tile=Tiling(dim=0, chunks=2))
    def fn(x: torch.Tensor) -> torch.Tensor:
        lengths.append(x.shape[0])
        return x.relu()

    with torch.no_grad():
        out = fn(torch.randn(5, 3))
    assert lengths == [3, 2]
    assert out.grad_fn is None
    x = torch.randn(5, 3, requires_grad=True)
    fn(x).sum().backward()
    assert_tensors_equal([x.grad], [(x > 0).float()], "relu gradient")


def test_rule_5_a_parameter_read_from_a_closure_is_refused() -> None:
    """A function reading an undeclared tensor that requires grad is refused in backward."""
    weight = torch.randn(4, 4, requires_grad=True)
    out = checkpointing.tiled(lambda x: x @ weight, dim=0, chunks=2)(
        torch.randn(6, 4, requires_grad=True)
    )
    with pytest.raises(CheckpointError, match="neither an input of the region nor a declared"):
        out.sum().backward()


def test_rule_5_a_module_declares_its_parameters() -> None:
    """A module given to ``tiled`` (or to ``checkpoint``) has its parameters declared."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    x = torch.randn(6, 4, requires_grad=True)
    checkpointing.checkpoint(linear, x, tile=Tiling(dim=0, chunks=3)).sum().backward()
    got = [linear.weight.grad, linear.bias.grad]
    linear.zero_grad(set_to_none=True)
    linear(x).sum().backward()
    for a, b in zip(got, [linear.weight.grad, linear.bias.grad], strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)


@pytest.mark.parametrize(
    "module",
    [
        nn.MultiheadAttention(4, 2, batch_first=True),
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
        nn.Conv1d(4, 4, 3),
        nn.GRU(4, 4),
    ],
    ids=["attention", "batchnorm", "conv", "rnn"],
)
def test_rule_7_modules_that_mix_positions_are_refused(module: nn.Module) -> None:
    """Known position-mixing modules cannot be tiled, by any route."""
    with pytest.raises(ValueError, match="mixes positions"):
        checkpointing.checkpoint_module(module, tile=Tiling(dim=1, chunks=2))
    with pytest.raises(ValueError, match="mixes positions"):
        checkpointing.tiled(module, dim=1, chunks=2)(torch.randn(2, 4, 4))


def test_rule_7_a_module_named_attention_is_refused() -> None:
    """transformers' attention modules (``...Attention``) count as mixing."""

    class SelfAttention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match=r"SelfAttention.*attention"):
        checkpointing.checkpoint_module(nn.Sequential(SelfAttention()), tile=Tiling(chunks=2))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.softmax(dim=1),
        lambda x: x.cumsum(dim=1),
        lambda x: x - x.mean(dim=1, keepdim=True),
        lambda x: x.flip(1),
    ],
    ids=["softmax", "causal-cumsum", "norm-over-positions", "anti-causal"],
)
def test_rule_7_debug_detects_a_function_that_mixes_positions(fn: Callable[..., Any]) -> None:
    """In debug mode (the argument, or ``set_checkpoint_debug_enabled``), mixing is detected."""
    x = torch.randn(2, 12, 4, requires_grad=True)
    with pytest.raises(CheckpointError, match="not position-wise along dim 1"):
        checkpointing.tiled(fn, dim=1, chunks=4, debug=True)(x)
    with (
        checkpointing.set_checkpoint_debug_enabled(True),
        pytest.raises(CheckpointError, match="not position-wise"),
    ):
        checkpointing.checkpoint(fn, x, tile=Tiling(dim=1, chunks=3))


def test_rule_7_debug_passes_a_position_wise_function() -> None:
    """The probe accepts a position-wise MLP, and a function that draws is not probed."""
    x = torch.randn(2, 12, 8, requires_grad=True)
    checkpointing.tiled(_MLP(), dim=1, chunks=4, debug=True)(x).sum().backward()
    checkpointing.tiled(_MLP(dropout=0.5), dim=1, chunks=4, debug=True)(x).sum().backward()


def test_a_reduction_output_is_refused_with_the_head_recipe_named() -> None:
    """An output without the chunk's length (a loss) is refused, pointing at the recipe."""
    with pytest.raises(ValueError, match="tiled_lm_head_loss"):
        checkpointing.tiled(lambda x: x.sum(), dim=0, chunks=2)(torch.randn(4, 2))


def test_rule_8_keyword_tensor_requiring_grad_is_refused() -> None:
    """A keyword tensor that requires grad would lose its gradient: refused."""
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="keyword input 'w' requires grad"):
        checkpointing.tiled(lambda x, w: x * w, dim=0, chunks=2)(torch.randn(4, 3), w=w)


def test_determinism_check_catches_a_recompute_of_another_shape() -> None:
    """A region whose recompute makes another shape fails loudly (``"default"``)."""
    state = {"wide": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=1) if state["wide"] else x * 2

    out = checkpointing.tiled(fn, dim=0, chunks=2)(torch.randn(4, 3, requires_grad=True))
    state["wide"] = True
    with pytest.raises(CheckpointError, match="recomputed as"):
        out.sum().backward()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"use_reentrant": True}, "use_reentrant cannot be combined with tile"),
        (
            {
                "context_fn": functools.partial(
                    checkpointing.create_selective_checkpoint_contexts,
                    checkpointing.policies.save_matmuls(),
                )
            },
            "context_fn cannot be combined with tile",
        ),
    ],
)
def test_checkpoint_options_without_meaning_are_refused(
    options: dict[str, Any], match: str
) -> None:
    """Options a tiled region cannot honour are refused, naming the option."""
    kwargs = {"use_reentrant": False, **options}
    with pytest.raises(ValueError, match=match):
        checkpointing.checkpoint(torch.sin, torch.randn(4, 2), tile=Tiling(chunks=2), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of chunks and chunk_size"),
        ({"chunks": 2, "chunk_size": 3}, "exactly one of chunks and chunk_size"),
        ({"chunks": 0}, "chunks must be an int >= 1"),
        ({"chunks": 2, "split": ()}, "split must be distinct"),
        ({"chunks": 2, "split": (0, 0)}, "split must be distinct"),
    ],
)
def test_tiling_validates_its_fields(kwargs: dict[str, Any], match: str) -> None:
    """``Tiling`` refuses a bad declaration when made, naming the field."""
    with pytest.raises(ValueError, match=match):
        Tiling(**kwargs)


@pytest.mark.parametrize("length", [0, 1, 7, 64, 65])
@pytest.mark.parametrize("tiling", [Tiling(chunks=1), Tiling(chunks=8), Tiling(chunk_size=5)])
def test_bounds_cover_every_position_once_in_order(length: int, tiling: Tiling) -> None:
    """The chunks cover ``[0, length)`` in order, none empty but for length 0."""
    bounds = tiling.bounds(length)
    assert bounds[0][0] == 0
    assert sum(size for _, size in bounds) == length
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(bounds))
    assert length == 0 or all(size > 0 for _, size in bounds)


def test_split_input_errors_name_the_input() -> None:
    """A split index past the inputs, or split inputs of unequal lengths, are refused."""
    run = checkpointing.tiled(lambda a, b: a + b, dim=0, chunks=2, split=(0, 1))
    with pytest.raises(ValueError, match="differ in length along dim 0"):
        run(torch.randn(4, 2), torch.randn(5, 2))
    with pytest.raises(ValueError, match="names positional input 1"):
        checkpointing.tiled(torch.sin, dim=0, chunks=2, split=(1,))(torch.randn(4))


def test_remove_checkpoint_module_puts_the_forward_back() -> None:
    """``remove_checkpoint_module`` undoes ``tile=``: the module runs plainly again."""
    mlp = checkpointing.checkpoint_module(_MLP(), tile=Tiling(dim=1, chunks=2))
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpointing.checkpoint_module(mlp)
    checkpointing.remove_checkpoint_module(mlp)
    assert "forward" not in mlp.__dict__
    mlp(torch.randn(1, 4, 8))
    assert mlp.calls == [4]


def test_rule_10_an_outer_selective_policy_keeps_no_chunk_output() -> None:
    """Inside a layer checkpointed with ``save_matmuls()``, the tiled MLP's chunk matmuls are
    not cached by the policy (the layer keeps what it keeps without the MLP's ops), the MLP
    is not re-run by the layer's recompute, and gradients match the plain run."""
    torch.manual_seed(0)
    mlp, norm = _MLP(), nn.LayerNorm(8)

    def layer(h: torch.Tensor) -> torch.Tensor:
        return h + mlp(norm(h))

    x = torch.randn(2, 12, 8, requires_grad=True)
    layer(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    checkpointing.checkpoint_module(mlp, tile=Tiling(dim=1, chunks=4))
    mlp.calls.clear()
    policy = functools.partial(
        checkpointing.create_selective_checkpoint_contexts, checkpointing.policies.save_matmuls()
    )
    with checkpointing.saved_tensors_report() as report:
        out = checkpointing.checkpoint(layer, x, use_reentrant=False, context_fn=policy)
    # x, the norm's inputs and statistics, the MLP's saved input: no (2, 3, 24) matmul output
    assert all(record.shape[-1] != 24 for record in report.records), report.table()
    out.sum().backward()
    assert mlp.calls == [3] * 8
    torch.testing.assert_close(x.grad, expected, **PARAM_TOL)


def test_a_watching_report_counts_the_rng_states_chunks_keep() -> None:
    """Each chunk's RNG state, kept by plain reference, is told to a watching report."""
    mlp = _MLP(dropout=0.5)
    x = torch.randn(2, 8, 8, requires_grad=True)
    with checkpointing.saved_tensors_report() as report:
        checkpointing.tiled(mlp, dim=1, chunks=4)(x).sum().backward()
    assert report.rng_state_bytes > 0


def test_rule_5_a_parameter_with_gradient_hooks_is_refused() -> None:
    """A parameter hook would run on each chunk's share and on the sum: refused at the call."""
    linear = nn.Linear(4, 4)
    linear.weight.register_hook(lambda grad: grad * 2)
    checkpointing.checkpoint_module(linear, tile=Tiling(dim=0, chunks=2))
    with pytest.raises(ValueError, match="has gradient hooks"):
        linear(torch.randn(4, 4, requires_grad=True))
