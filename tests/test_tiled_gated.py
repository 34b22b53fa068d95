"""A gated MLP's hand-written tiled backward (NOTE [Tiled gated MLP]) against the chunkwise plain
run: the input's gradient bitwise, the parameters' within ``PARAM_TOL`` (their sums' rounding
order, NOTE [Tiled gradient sums], Rule 3); and every module it does not recognise taking the
generic path.
"""

from __future__ import annotations

import pytest
import torch
from frame_support import assert_tensors_equal, counting_ops
from torch import nn

import checkpointing
from checkpointing import CheckpointError, Tiling
from checkpointing._planning.measure.live_bytes import cpu_peak

PARAM_TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}


class _Gated(nn.Module):
    """Llama's MLP, written as transformers writes it."""

    def __init__(
        self, hidden: int = 8, inner: int = 24, bias: bool = False, act: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class _Added(_Gated):
    """The same attributes, another body: the branches added, not multiplied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


class _Scaled(nn.Module):
    """An activation that reads a tensor requiring grad from a closure."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.scale = [scale]  # not a parameter: undeclared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * self.scale[0]


def _chunkwise(
    module: nn.Module, x: torch.Tensor, w: torch.Tensor, chunks: int
) -> list[torch.Tensor]:
    """Gradients of ``(module(x) * w).sum()`` run chunk by chunk in plain autograd."""
    params = list(module.parameters())
    rows = torch.zeros_like(x)
    sums: list[torch.Tensor] = []
    for start, size in Tiling(dim=1, chunks=chunks).bounds(x.shape[1]):
        part = x.detach().narrow(1, start, size).requires_grad_()
        loss = (module(part) * w.narrow(1, start, size)).sum()
        got_x, *got = torch.autograd.grad(loss, [part, *params])
        rows.narrow(1, start, size).copy_(got_x)
        sums = list(got) if not sums else [s.add_(g) for s, g in zip(sums, got, strict=True)]
    return [rows, *sums]


def _tiled(
    module: nn.Module, x: torch.Tensor, w: torch.Tensor, chunks: int
) -> tuple[list[torch.Tensor], int]:
    """Gradients through ``tiled_mlp`` (undone after), and the matmuls its backward ran."""
    params = list(module.parameters())
    checkpointing.tiled_mlp(module, chunks=chunks)
    try:
        out = module(x)
        with counting_ops() as counts:
            grads = torch.autograd.grad((out * w).sum(), [x, *params])
    finally:
        checkpointing.remove_checkpoint_module(module)
    matmuls = sum(n for op, n in counts.items() if op.split(".")[1] in ("mm", "addmm", "addmm_"))
    return list(grads), matmuls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("act", [nn.SiLU, lambda: nn.GELU(approximate="tanh")])
def test_rules_3_and_5_a_gated_mlp_is_differentiated_by_hand(
    bias: bool, batch: int, act: type[nn.Module]
) -> None:
    """Recognised: each chunk's recompute makes two matmuls, not three (its output is not
    remade); the input's gradient is the chunkwise run's, bitwise; the parameters' within the
    tolerance."""
    torch.manual_seed(0)
    module = _Gated(bias=bias, act=act())
    x = torch.randn(batch, 13, 8, requires_grad=True)
    w = torch.randn(batch, 13, 8)
    got, matmuls = _tiled(module, x, w, 3)
    assert matmuls == 3 * 8  # per chunk: 2 recomputed, 3 weight gradients, 3 input gradients
    expected = _chunkwise(module, x, w, 3)
    assert_tensors_equal(got[:1], expected[:1], "input gradient")
    for a, b in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)


def test_rule_1_another_body_or_a_hook_takes_the_generic_path() -> None:
    """The same attributes with another body, or a hook on a projection (which then runs in
    every chunk's recompute): the generic path (three matmuls recomputed per chunk), with the
    same gradients as the chunkwise run."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 8, requires_grad=True)
    w = torch.randn(2, 13, 8)
    added = _Added()
    got, matmuls = _tiled(added, x, w, 3)
    assert matmuls == 3 * 9
    assert_tensors_equal(got[:1], _chunkwise(added, x, w, 3)[:1], "another body")
    hooked = _Gated()
    calls: list[int] = []
    hooked.up_proj.register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[1]))
    got, matmuls = _tiled(hooked, x, w, 3)
    assert matmuls == 3 * 9
    assert calls == [5, 4, 4, 5, 4, 4]  # forward, then each chunk's recompute
    calls.clear()
    expected = _chunkwise(hooked, x, w, 3)
    assert_tensors_equal(got[:1], expected[:1], "hooked")
    for a, b in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)


def test_rule_6_an_activation_reading_a_closure_is_refused_as_undeclared() -> None:
    """Chunk 0 finds the closure's tensor before summing anything; the generic path then
    refuses it (NOTE [Tiled regions], Rule 5)."""
    scale = torch.tensor(2.0, requires_grad=True)
    module = _Gated(act=_Scaled(scale))
    checkpointing.tiled_mlp(module, chunks=3)
    out = module(torch.randn(1, 9, 8, requires_grad=True))
    with pytest.raises(CheckpointError, match="neither an input of the region nor a declared"):
        out.sum().backward()


def test_rule_4_the_hand_written_backward_holds_less_than_autograds() -> None:
    """With intermediates far wider than the weights, the step's peak is at least two chunk
    intermediate-wide tensors (64 KiB each here) below the generic path's (the same module with
    a no-op hook on its activation): four held at once instead of six."""
    torch.manual_seed(0)
    module = _Gated(hidden=8, inner=256)
    x = torch.randn(1, 256, 8, requires_grad=True)
    checkpointing.tiled_mlp(module, chunks=4)

    def step() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()

    step()
    by_hand = cpu_peak(step)
    handle = module.act_fn.register_forward_hook(lambda *_: None)
    step()
    generic = cpu_peak(step)
    handle.remove()
    one = 64 * 256 * 4
    assert by_hand <= generic - 2 * one, (by_hand, generic)


def test_tiled_mlp_on_llamas_mlp_with_biases_by_hand() -> None:
    """transformers' ``LlamaMLP`` (``mlp_bias=True``) is recognised: two matmuls recomputed
    per chunk; the input's gradient bitwise the chunkwise run's, the parameters' within the
    tolerance."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=2,
        mlp_bias=True,
    )
    torch.manual_seed(0)
    mlp = LlamaMLP(config)
    x = torch.randn(2, 20, 16, requires_grad=True)
    w = torch.randn(2, 20, 16)
    got, matmuls = _tiled(mlp, x, w, 4)
    assert matmuls == 4 * 8
    expected = _chunkwise(mlp, x, w, 4)
    assert_tensors_equal(got[:1], expected[:1], "input gradient")
    for a, b in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)


def test_an_outer_saved_tensors_hook_sees_only_the_saved_input() -> None:
    """The hand-written backward's activation graph saves under the region's own hooks (NOTE
    [Tiled regions], Rule 12): an outer hook around the step sees the region's input only."""
    torch.manual_seed(0)
    module = _Gated()
    x = torch.randn(2, 12, 8, requires_grad=True)
    w = torch.randn(2, 12, 8)
    packed: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got, matmuls = _tiled(module, x, w, 3)
    assert matmuls == 3 * 8
    assert packed == [(2, 12, 8), (2, 12, 8)]  # the region's input; w, saved by `out * w`
    assert_tensors_equal(got[:1], _chunkwise(module, x, w, 3)[:1], "under an outer hook")
