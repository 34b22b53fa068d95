"""``checkpointing.keep`` under ``torch.compile`` (NOTE [Compiled regions], Rule 6).

A kept span inside a checkpoint becomes the partitioner's "must save": each case builds a block
whose first matmul is kept, compiles it, and compares it side by side with torch's own
``checkpoint`` whose selective policy answers ``MUST_SAVE`` for that same matmul. Graph and break
counts equal torch's; gradients equal eager's (bitwise with "eager" and "aot_eager", close with
"inductor"); the bytes the compiled forward keeps for backward equal torch's selective checkpoint
and exceed a plain compiled checkpoint's (and fall back to it when the tagging is switched off,
so the byte check sees the tagging). Bytes are compared with "aot_eager" and "inductor" only:
with "eager" the region runs eagerly as torch's selective checkpoint, whose saves bypass the
saved-tensors hooks that count them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from compile_support import BACKENDS, COMPILE_MARKS, fresh_dynamo  # noqa: F401  (a fixture)
from mechanism_support import StateCounter
from torch import nn

import checkpointing
from checkpointing import _compiled

pytestmark = COMPILE_MARKS

BYTE_BACKENDS = ["aot_eager", "inductor"]
X = torch.randn(8, 16)

# How a block computes its first matmul ("proj", 8x32): plainly, through ``keep``, through a
# ``@keeping()`` function, through ``keep`` with a keyword argument and a tuple output, or in a
# ``with keeping():`` block.
Proj = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _kept(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return checkpointing.keep(torch.matmul, x, w)  # type: ignore[no-any-return]


@checkpointing.keeping("proj")
def _decorated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _with_keywords(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    def mm(a: torch.Tensor, *, right: torch.Tensor) -> tuple[torch.Tensor, int]:
        return a @ right, 1

    h, one = checkpointing.keep(mm, x, right=w)
    return h * one  # type: ignore[no-any-return]


def _plain_dropping(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return nn.functional.dropout(x @ w, 0.5)


def _kept_dropping(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return checkpointing.keep(_plain_dropping, x, w)  # type: ignore[no-any-return]


def _in_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with checkpointing.keeping():
        h = x @ w
    return h


class Block(nn.Module):
    """``sin(dropout(relu(proj(x, w1))) @ w2)``: two matmuls of different widths."""

    def __init__(self, proj: Proj, p: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 32) / 4)
        self.w2 = nn.Parameter(torch.randn(32, 16) / 4)
        self.proj = proj
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(self.proj(x, self.w1).relu(), self.p, self.training)
        return (h @ self.w2).sin()


Run = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Stack(nn.Module):
    """Two blocks (each called through ``run``) after a dropout on the input."""

    def __init__(self, run: Run | None, proj: Proj = _plain, p: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(proj, p) for _ in range(2))
        self.run = run
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.dropout(x, self.p, self.training)
        for block in self.blocks:
            x = self.run(block, x) if self.run is not None else block(x)
        return x.pow(2).sum()


def _ours(**options: Any) -> Run:
    return lambda block, h: checkpointing.checkpoint(block, h, use_reentrant=False, **options)


def _torch_saves_the_proj(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Torch's policy keeping what ``keep`` keeps here: the 32-wide matmul."""
    if op is torch.ops.aten.mm.default and args[1].shape[-1] == 32:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _torch_sac(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    context_fn = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, _torch_saves_the_proj
    )
    return torch_checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)  # type: ignore[no-any-return]


def _torch_plain(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint.checkpoint(block, h, use_reentrant=False)  # type: ignore[no-any-return]


def _counts(model: Callable[..., torch.Tensor], *inputs: Any) -> tuple[int, int]:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*inputs)
    return explanation.graph_count, explanation.graph_break_count


def _kept_bytes(model: nn.Module, backend: str) -> int:
    """Bytes of the distinct storages the compiled forward of ``model`` saves for backward."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(X.detach().requires_grad_())
    return sum(storages.values())


def _grads(model: nn.Module, run: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = X.detach().requires_grad_()
    torch.manual_seed(1)  # the dropout masks
    run(x).backward()
    assert x.grad is not None
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad]


def _compiled_grads(model: nn.Module, backend: str) -> list[torch.Tensor]:
    torch._dynamo.reset()
    return _grads(model, torch.compile(model, backend=backend))


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], backend: str) -> None:
    assert len(got) == len(want)
    tolerance = None if backend == "inductor" else 0.0  # None: torch's default for the dtype
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rule6_keep_compiles_as_torchs_selective_checkpoint_of_the_same_matmul(
    backend: str,
) -> None:
    """Same graph and break counts as torch's SAC keeping the matmul; eager's gradients; the
    same kept bytes as torch's SAC, more than a plain compiled checkpoint."""
    ours = Stack(_ours(), _kept)
    assert _counts(ours, X) == _counts(Stack(_torch_sac), X) == (1, 0)
    plain = Stack(None)
    _assert_same(_compiled_grads(ours, backend), _grads(plain, plain), backend)
    if backend in BYTE_BACKENDS:
        kept = _kept_bytes(ours, backend)
        assert kept == _kept_bytes(Stack(_torch_sac), backend)
        assert kept > _kept_bytes(Stack(_ours()), backend)


@pytest.mark.parametrize("backend", BYTE_BACKENDS)
def test_rule6_the_kept_bytes_come_from_the_tagging(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``_saving_nodes`` running the span untouched, the compiled step keeps what a plain
    compiled checkpoint keeps: the byte check above sees the tagging, nothing else."""

    def untouched(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    monkeypatch.setattr(_compiled, "_saving_nodes", untouched)
    assert _kept_bytes(Stack(_ours(), _kept), backend) == _kept_bytes(Stack(_ours()), backend)


@pytest.mark.parametrize(
    ("kept", "plain"),
    [(_kept, _plain), (_kept_dropping, _plain_dropping)],
    ids=["after-the-span", "in-the-span-too"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rule6_keep_with_dropout_gives_the_gradients_of_torchs_region(
    backend: str, kept: Proj, plain: Proj
) -> None:
    """Dropout before the checkpoint and in the block after the span (and in the span): bitwise
    eager's gradients with "aot_eager"; with every backend those of torch's own compiled region
    (the random draws are the backend's: with "eager" torch's region does not preserve the RNG
    state for its recompute, and inductor draws its own numbers)."""
    got = _compiled_grads(Stack(_ours(), kept, p=0.5), backend)
    _assert_same(got, _compiled_grads(Stack(_torch_plain, plain, p=0.5), backend), backend)
    if backend == "aot_eager":
        eager = Stack(None, plain, p=0.5)
        _assert_same(got, _grads(eager, eager), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rule6_keep_outside_a_checkpoint_is_the_plain_function(backend: str) -> None:
    """Outside any checkpoint the span's nodes are left alone: the graph, gradients and kept
    bytes of the same model without ``keep``."""
    ours, plain = Stack(None, _kept), Stack(None)
    assert _counts(ours, X) == _counts(plain, X) == (1, 0)
    _assert_same(_compiled_grads(ours, backend), _grads(plain, plain), backend)
    if backend in BYTE_BACKENDS:
        assert _kept_bytes(ours, backend) == _kept_bytes(plain, backend)


@pytest.mark.parametrize("proj", [_decorated, _with_keywords], ids=["decorator", "keywords"])
def test_rule6_every_function_form_of_a_span_is_kept(proj: Proj) -> None:
    """``@keeping()`` and ``keep`` with keyword arguments and a non-tensor output: one graph,
    eager's gradients, the bytes of torch's SAC keeping the matmul."""
    ours = Stack(_ours(), proj)
    assert _counts(ours, X) == (1, 0)
    plain = Stack(None)
    _assert_same(_compiled_grads(ours, "aot_eager"), _grads(plain, plain), "aot_eager")
    assert _kept_bytes(ours, "aot_eager") == _kept_bytes(Stack(_torch_sac), "aot_eager")


@pytest.mark.parametrize("backend", BYTE_BACKENDS)
def test_a_with_keeping_block_compiles_as_a_plain_checkpoint(backend: str) -> None:
    """``with keeping():`` is not translated (its body is not a function to hand over): the
    region compiles to one graph with eager's gradients and keeps what a plain compiled
    checkpoint keeps."""
    ours = Stack(_ours(), _in_block)
    assert _counts(ours, X) == (1, 0)
    plain = Stack(None)
    _assert_same(_compiled_grads(ours, backend), _grads(plain, plain), backend)
    assert _kept_bytes(ours, backend) == _kept_bytes(Stack(_ours()), backend)


def _breaking(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return x @ w


def _kept_breaking(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return checkpointing.keep(_breaking, x, w)  # type: ignore[no-any-return]


def test_a_graph_break_in_a_span_breaks_as_in_torchs_region() -> None:
    """A span dynamo cannot trace whole: the graph and break counts of torch's region with the
    same break, and eager's gradients (the region then runs eagerly, as torch's does)."""
    blocks = []
    for proj in (_kept_breaking, _breaking):
        torch.manual_seed(0)
        blocks.append(Block(proj, 0.0))
    block, torch_block = blocks

    def ours(x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(block, x.cos(), use_reentrant=False).sum()  # type: ignore[no-any-return]

    def theirs(x: torch.Tensor) -> torch.Tensor:
        return _torch_plain(torch_block, x.cos()).sum()

    def plain(x: torch.Tensor) -> torch.Tensor:
        return torch_block(x.cos()).sum()  # type: ignore[no-any-return]

    assert _counts(ours, X) == _counts(theirs, X) == (2, 1)
    torch._dynamo.reset()
    got = _grads(block, torch.compile(ours, backend="aot_eager"))
    _assert_same(got, _grads(torch_block, plain), "aot_eager")


def test_rule6_recompute_state_hooks_are_said_once_and_the_region_compiles() -> None:
    """Nothing to restore in a compiled region: said once per process, even when compiled
    twice; one graph; eager's gradients."""
    _compiled._said.discard("state hooks")  # said once per process
    ours = Stack(_ours(recompute_state_hooks=StateCounter()), _kept)
    plain = Stack(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _counts(ours, X) == (1, 0)
        _assert_same(_compiled_grads(ours, "aot_eager"), _grads(plain, plain), "aot_eager")
    said = [w for w in caught if "recompute_state_hooks are not used" in str(w.message)]
    assert len(said) == 1
