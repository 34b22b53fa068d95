"""How a tiled region adds up its gradients (NOTE [Tiled regions], Rule 11; NOTE [Tiled gradient
sums]): parameters' stand-ins under a torch function mode, each chunk's gradient added to the
running sum as it is made (a linear's weight's multiplied straight into it), and the fallback
for a parameter that reaches the graph past the mode. Split inputs' gradients are bitwise the
chunkwise run's; parameters' agree with it to ``PARAM_TOL`` (the sums' rounding order).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from frame_support import assert_tensors_equal
from torch import nn

import checkpointing
from checkpointing import Tiling
from checkpointing._planning.measure.live_bytes import cpu_peak

PARAM_TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}


class _Wide(nn.Module):
    """Two bias-free linears: weights much larger than a few tokens' activations."""

    def __init__(self, hidden: int = 64, inner: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class _MatmulFn(torch.autograd.Function):
    """``x @ w.t()`` as a custom function: its ``apply`` is no torch function, so the mode never
    sees the weight it is given."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)  # type: ignore[attr-defined]  # FunctionCtx
        return x @ w.t()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx
        return grad @ w, (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class _Custom(_Wide):
    """``_Wide`` whose first weight goes through a custom autograd function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(_MatmulFn.apply(x, self.up.weight)))


def _chunkwise(module: nn.Module, x: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """Input and parameter gradients of ``module`` run chunk by chunk in plain autograd, the
    parameters' summed in chunk order."""
    params = list(module.parameters())
    rows = torch.zeros_like(x)
    sums: list[torch.Tensor] = []
    for start, size in Tiling(dim=1, chunks=chunks).bounds(x.shape[1]):
        part = x.detach().narrow(1, start, size).requires_grad_()
        got_x, *got = torch.autograd.grad(module(part).sum(), [part, *params])
        rows.narrow(1, start, size).copy_(got_x)
        sums = got if not sums else [s.add_(g) for s, g in zip(sums, got, strict=True)]
    return [rows, *sums]


def _assert_chunkwise(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    """The input's gradient (first) bitwise, the parameters' within the sums' tolerance."""
    assert_tensors_equal(got[:1], expected[:1], what)
    for a, b in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a, b, **PARAM_TOL)


def _addmm_sums(module: _Wide, x: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """The two weights' gradients as NOTE [Tiled gradient sums] makes them: per chunk, plain
    autograd's gradient at each linear's output times that linear's input, chunk 0's by ``mm``
    and each later one's by ``addmm_`` into the sum."""
    sums: list[torch.Tensor] = []
    for start, size in Tiling(dim=1, chunks=chunks).bounds(x.shape[1]):
        part = x.detach().narrow(1, start, size)
        inner = module.up(part)
        hidden = torch.tanh(inner)
        out = module.down(hidden)
        g_out = torch.ones_like(out)
        g_inner = torch.autograd.grad(out, inner, g_out)[0]
        for k, (grad, seen) in enumerate(((g_inner, part), (g_out, hidden))):
            rows = grad.reshape(-1, grad.shape[-1])
            flat = seen.detach().reshape(-1, seen.shape[-1])
            if len(sums) <= k:
                sums.append(rows.t().mm(flat))
            else:
                sums[k].addmm_(rows.t(), flat)
    return sums


def _tiled_grads(module: nn.Module, x: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    params = list(module.parameters())
    out = checkpointing.tiled(module, dim=1, chunks=chunks)(x)
    return list(torch.autograd.grad(out.sum(), [x, *params]))


def test_rule_11_backward_holds_the_sums_and_no_chunk_gradient() -> None:
    """With weights far larger than the activations, the step's peak stays under the summed
    gradients plus the small activations: no weight's chunk gradient exists beside the sums
    (NOTE [Tiled gradient sums], Rule 1); adding one before summing it would hold one more
    weight's bytes, capturing every one twice the weights'."""
    torch.manual_seed(0)
    module = _Wide()
    x = torch.randn(1, 8, 64, requires_grad=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    run = checkpointing.tiled(module, dim=1, chunks=4)

    def step() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)
        run(x).sum().backward()

    step()
    peak = cpu_peak(step)
    one_weight = module.up.weight.numel() * module.up.weight.element_size()
    assert one_weight > 32 * 1024
    assert weight_bytes < peak < weight_bytes + 16 * 1024, (peak, weight_bytes)


def test_rule_11_gradients_are_the_chunkwise_run_and_the_addmm_sums() -> None:
    """The input's gradient is the chunkwise plain run's, bitwise; the weights' are the
    chunk-ordered ``mm``/``addmm_`` sums of NOTE [Tiled gradient sums], bitwise, and the
    chunkwise autograd sums within the tolerance; the module's parameters' ``.grad`` stays
    untouched by ``autograd.grad``."""
    torch.manual_seed(0)
    module = _Wide(8, 24)
    x = torch.randn(2, 13, 8, requires_grad=True)
    got = _tiled_grads(module, x, 5)
    assert all(p.grad is None for p in module.parameters())
    _assert_chunkwise(got, _chunkwise(module, x, 5), "stand-ins vs chunkwise autograd")
    assert_tensors_equal(got[1:], _addmm_sums(module, x, 5), "the addmm sums")


class _Tied(_Wide):
    """``_Wide`` whose first weight is also read outside its linear (every position adds the
    weight's sum): its gradient is the linear's sum plus what autograd gives the rest."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) + self.up.weight.square().sum()


class _Transposed(_Wide):
    """``_Wide`` whose first linear reads its input stored transposed (column-major rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stored = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        return self.down(torch.tanh(self.up(stored)))


class _Autocast(_Wide):
    """``_Wide`` run under CPU autocast (bfloat16): autograd's own linear, not the sums."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.down(torch.tanh(self.up(x))).float()


@pytest.mark.parametrize(
    ("module_type", "batch"), [(_Tied, 2), (_Transposed, 1), (_Transposed, 2), (_Autocast, 2)]
)
def test_rule_4_of_the_sums_other_uses_of_a_weight_keep_their_gradients(
    module_type: type[_Wide], batch: int
) -> None:
    """NOTE [Tiled gradient sums], Rules 2 and 4: a weight read outside its linear too, an
    input stored transposed, and autocast's cast copies: the input's gradient is the chunkwise
    plain run's, bitwise, the parameters' within the tolerance."""
    torch.manual_seed(0)
    module = module_type(8, 24)
    x = torch.randn(batch, 13, 8, requires_grad=True)
    _assert_chunkwise(_tiled_grads(module, x, 3), _chunkwise(module, x, 3), module_type.__name__)


def test_rule_11_a_parameter_past_the_mode_falls_back_to_captured_gradients() -> None:
    """A weight handed to a custom autograd function reaches the graph itself: the backward
    starts over with the parameters as targets, and every gradient is still the chunkwise
    run's, bitwise; chunk 0 is recomputed twice, the others once."""
    torch.manual_seed(0)
    module = _Custom(8, 24)
    x = torch.randn(2, 13, 8, requires_grad=True)
    calls: list[int] = []
    module.register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[1]))
    got = _tiled_grads(module, x, 3)
    assert calls == [5, 4, 4, 5, 5, 4, 4]  # forward; chunk 0 under the stand-ins; again
    calls.clear()
    assert_tensors_equal(got, _chunkwise(module, x, 3), "fallback vs chunkwise autograd")


class _Calling(_Wide):
    """``_Wide`` that runs ``during()`` (once) in the middle of its forward."""

    during: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.up(x))
        during, self.during = self.during, None
        if during is not None:
            during()
        return self.down(hidden)


def test_rule_11_another_thread_using_the_module_meanwhile_keeps_its_gradients() -> None:
    """The stand-ins are a per-thread mode: another thread's plain forward and backward of the
    module, run while a chunk is recomputed under the mode, reads the parameters themselves
    and gets their gradients (stand-ins swapped into the module would have been read)."""
    torch.manual_seed(0)
    module = _Calling(8, 24)
    x = torch.randn(2, 12, 8, requires_grad=True)
    other = torch.randn(2, 12, 8)
    params = list(module.parameters())
    expected = torch.autograd.grad(module(other).sum(), params)
    seen: list[tuple[torch.Tensor, ...]] = []

    def plain() -> None:
        with torch.enable_grad():
            seen.append(torch.autograd.grad(module(other).sum(), params))

    def in_thread() -> None:
        thread = threading.Thread(target=plain)
        thread.start()
        thread.join()

    out = checkpointing.tiled(module, dim=1, chunks=3)(x)
    module.during = in_thread  # runs in the first chunk's recompute
    out.sum().backward()
    assert len(seen) == 1
    assert_tensors_equal(list(seen[0]), list(expected), "the other thread's gradients")


def test_rule_12_outer_hooks_and_reports_do_not_see_a_chunks_saves() -> None:
    """An outer saved-tensors hook sees only the region's saved inputs, not what each chunk's
    recompute saves inside backward; a report does not call the tiled recompute a reentrant
    checkpoint's re-run. Gradients stay the chunkwise run's."""
    torch.manual_seed(0)
    module = _Wide(8, 24)
    x = torch.randn(2, 12, 8, requires_grad=True)
    packed: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _tiled_grads(module, x, 3)
    assert packed == [(2, 12, 8)]  # the saved input only
    _assert_chunkwise(got, _chunkwise(module, x, 3), "under an outer hook")
    with checkpointing.saved_tensors_report() as report:
        layer = checkpointing.tiled(module, dim=1, chunks=3)
        checkpointing.checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert not any("use_reentrant=True" in note for note in report.notes), report.notes


def test_rule_2_an_outer_reentrant_checkpoint_reruns_the_region_correctly() -> None:
    """The limit NOTE [Tiled regions], Rule 2 names: a use_reentrant=True checkpoint re-runs
    its whole function, the tiled region included (no early stop), so each chunk runs three
    times; the gradients are still the untiled run's within the tolerance."""
    torch.manual_seed(0)
    module = _Wide(8, 24)
    x = torch.randn(2, 12, 8, requires_grad=True)
    params = list(module.parameters())
    expected = torch.autograd.grad((x + module(x)).sum(), [x, *params])
    calls: list[int] = []
    module.register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[1]))
    layer = checkpointing.tiled(module, dim=1, chunks=3)
    out = checkpointing.checkpoint(lambda h: h + layer(h), x, use_reentrant=True)
    out.sum().backward()  # a reentrant checkpoint needs .backward()
    got = [x.grad, *(p.grad for p in params)]
    assert calls == [4] * 9  # forward, the outer re-run, the region's own recompute
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
