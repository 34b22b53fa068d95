"""``apply_activation_checkpointing``: which modules get wrapped, and with which options.

Each test names the rule of NOTE [Applied wrappers] it pins and runs torch.distributed's own
``apply_activation_checkpointing`` side by side: the same module structure built, the same
gradients bitwise (with dropout), and those of the unwrapped model.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers
from torch.distributed.fsdp.wrap import CustomPolicy, size_based_auto_wrap_policy

import checkpointing
from checkpointing import CheckpointImpl


class Block(nn.Module):
    """Two linears of more than 60 parameters each, and a dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(x))))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.ReLU(), Block(), nn.Linear(6, 2)).double()


X = torch.randn(5, 6, dtype=torch.float64)


def _structure(model: nn.Module) -> list[tuple[str, str, object]]:
    """Every module's name, class and (for a checkpoint wrapper) variant."""
    return [
        (name, type(module).__name__, getattr(module, "checkpoint_impl", None))
        for name, module in model.named_modules()
    ]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    x = X.clone().requires_grad_()
    model(x).pow(2).sum().backward()
    assert x.grad is not None
    return [p.grad for p in model.parameters() if p.grad is not None] + [x.grad]


def _assert_same_grads(*models: nn.Module) -> None:
    want = _grads(_model())
    for model in models:
        got = _grads(model)
        assert len(got) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _linear_calls_per_step(model: nn.Module) -> int:
    """How often the linears run in one forward and backward (once, plus each recompute)."""
    calls = [0]

    def count(module: nn.Module, args: object, output: object) -> None:
        calls[0] += 1

    handles = [m.register_forward_hook(count) for m in model.modules() if type(m) is nn.Linear]
    try:
        _grads(model)
    finally:
        for handle in handles:
            handle.remove()
    return calls[0]


def _reentrant_blocks(module: nn.Module) -> object:
    return {"checkpoint_impl": CheckpointImpl.REENTRANT} if isinstance(module, Block) else False


def test_rule_3_a_policys_checkpoint_impl_wins_over_the_calls_defaults() -> None:
    """NOTE [Applied wrappers], Rule 3: a ``CustomPolicy`` giving ``checkpoint_impl=REENTRANT``
    per module builds reentrant wrappers, as torch's function does (the call passed no
    ``use_reentrant``, so none conflicts)."""
    ours, theirs = _model(), _model()
    policy = CustomPolicy(_reentrant_blocks)
    checkpointing.apply_activation_checkpointing(ours, auto_wrap_policy=policy)
    torch_wrappers.apply_activation_checkpointing(theirs, auto_wrap_policy=policy)
    assert _structure(ours) == _structure(theirs)
    assert _structure(ours)[1] == ("0", "CheckpointWrapper", CheckpointImpl.REENTRANT)
    _assert_same_grads(ours, theirs)


def test_rule_3_a_policys_use_reentrant_wins_over_the_calls_options() -> None:
    """NOTE [Applied wrappers], Rule 3: a policy's ``use_reentrant=True`` per module wins over
    the call's own ``use_reentrant=False`` (no duplicate keyword): the blocks run reentrant,
    as torch's ``checkpoint_impl=REENTRANT`` does."""
    ours, theirs = _model(), _model()

    def reentrant(module: nn.Module) -> object:
        return {"use_reentrant": True} if isinstance(module, Block) else False

    checkpointing.apply_activation_checkpointing(
        ours, auto_wrap_policy=CustomPolicy(reentrant), use_reentrant=False
    )
    torch_wrappers.apply_activation_checkpointing(
        theirs, auto_wrap_policy=CustomPolicy(_reentrant_blocks)
    )
    assert [(n, kind) for n, kind, _ in _structure(ours)] == [
        (n, kind) for n, kind, _ in _structure(theirs)
    ]
    assert ours[0].checkpoint_options["use_reentrant"] is True
    _assert_same_grads(ours, theirs)


def test_rule_2_applying_a_size_based_policy_twice_wraps_nothing_new() -> None:
    """NOTE [Applied wrappers], Rule 2: the parameters of already-checkpointed children count
    as wrapped, so a second ``size_based_auto_wrap_policy`` pass leaves the blocks alone (each
    linear is recomputed once per backward, not twice); torch's single pass builds the same."""
    policy = partial(size_based_auto_wrap_policy, min_num_params=60)
    ours, theirs = _model(), _model()
    for _ in range(2):
        checkpointing.apply_activation_checkpointing(ours, auto_wrap_policy=policy)
    torch_wrappers.apply_activation_checkpointing(theirs, auto_wrap_policy=policy)
    assert _structure(ours) == _structure(theirs)
    assert type(ours[0]) is Block
    assert _linear_calls_per_step(ours) == _linear_calls_per_step(theirs)
    _assert_same_grads(ours, theirs)


@pytest.mark.parametrize("wrap", ["checkpoint_wrapper", "checkpoint_module"])
def test_rule_2_applying_a_check_fn_twice_wraps_nothing_new(wrap: str) -> None:
    """NOTE [Applied wrappers], Rule 2, for both wrapper functions: a second pass of the same
    ``check_fn`` changes nothing."""
    once, twice = _model(), _model()
    wrapper_fn = getattr(checkpointing, wrap)
    for model, passes in ((once, 1), (twice, 2)):
        for _ in range(passes):
            checkpointing.apply_activation_checkpointing(
                model, checkpoint_wrapper_fn=wrapper_fn, check_fn=lambda m: isinstance(m, Block)
            )
    assert _structure(twice) == _structure(once)
    assert _linear_calls_per_step(twice) == _linear_calls_per_step(once)
    _assert_same_grads(once, twice)
