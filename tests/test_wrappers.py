"""Module wrappers: ``checkpoint_wrapper`` and ``apply_activation_checkpointing``.

Each test names the rule of NOTE [Module wrapper] it pins; gradients are compared with the
unwrapped model (float64, exact) and, for parity, with torch.distributed's wrapper.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from mechanism_support import StateCounter
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

import checkpointing
from checkpointing import CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper


class Block(nn.Module):
    """A small residual block with a norm, a dropout and a keyword argument."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin1 = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)
        self.lin2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        h = self.drop(torch.tanh(self.norm(self.lin1(x))))
        return x + self.lin2(h) * scale


def _model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(Block(), nn.ReLU(), Block(), nn.Linear(6, 2)).double()


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    model(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert x.grad is not None
    return [*grads, x.grad]


def _assert_all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for got, want in zip(a, b, strict=True):
        assert torch.equal(got, want)


def _is_block(module: nn.Module) -> bool:
    return isinstance(module, Block)


X = torch.randn(5, 6, dtype=torch.float64)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_wrapped_model_gradients_equal_unwrapped(use_reentrant: bool) -> None:
    """Gradients (with dropout and batch norm) are bit-identical to the unwrapped model."""
    plain = _model()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, check_fn=_is_block, use_reentrant=use_reentrant)
    assert isinstance(wrapped[0], CheckpointWrapper)
    _assert_all_equal(_grads(wrapped, X), _grads(plain, X))


def test_rule_1_state_dict_keys_unchanged() -> None:
    """NOTE [Module wrapper], Rule 1: wrapping leaves ``state_dict`` keys as they were."""
    plain = _model()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, check_fn=_is_block)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    root = checkpoint_wrapper(Block())
    assert list(root.state_dict()) == list(Block().state_dict())


def test_rule_1_checkpoints_load_both_ways() -> None:
    """Rule 1: unwrapped checkpoints load strictly into wrapped models and vice versa."""
    source = _model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    wrapped = _model()
    apply_activation_checkpointing(wrapped, check_fn=_is_block)
    wrapped.load_state_dict(source.state_dict())
    for (k, v), (k2, v2) in zip(
        wrapped.state_dict().items(), source.state_dict().items(), strict=True
    ):
        assert k == k2
        assert torch.equal(v, v2)
    back = _model()
    back.load_state_dict(wrapped.state_dict())
    _assert_all_equal(list(back.state_dict().values()), list(source.state_dict().values()))


def test_rule_1_nested_wrappers_and_torch_wrapper_checkpoints() -> None:
    """Rule 1: doubly wrapped modules and torch-wrapped checkpoints load with the same keys."""
    inner = checkpoint_wrapper(checkpoint_wrapper(Block()))
    assert list(inner.state_dict()) == list(Block().state_dict())
    theirs = torch_wrappers.checkpoint_wrapper(Block())
    inner.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(inner.state_dict())


def test_rule_1_version_metadata_is_the_wrapped_modules() -> None:
    """Rule 1: the saved version metadata is the wrapped module's, under its unwrapped name."""
    plain = nn.Sequential(nn.BatchNorm1d(3))
    wrapped = nn.Sequential(checkpoint_wrapper(nn.BatchNorm1d(3)))
    assert dict(wrapped.state_dict()._metadata) == dict(plain.state_dict()._metadata)  # type: ignore[attr-defined]


def test_rule_2_named_parameters_on_the_wrapper() -> None:
    """Rule 2: the wrapper's own ``named_parameters``/``named_buffers`` give unwrapped names."""
    block = Block()
    wrapped = checkpoint_wrapper(block)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in block.named_parameters()]
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in block.named_buffers()]


def test_rule_3_use_reentrant_defaults_to_false_without_warning() -> None:
    """Rule 3: the wrapper uses the non-reentrant variant and does not warn about it."""
    wrapped = checkpoint_wrapper(nn.Linear(3, 3))
    assert wrapped.checkpoint_options["use_reentrant"] is False
    wrapped(torch.randn(2, 3, requires_grad=True)).sum().backward()  # a warning would fail


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_rule_3_keyword_arguments_pass_through(use_reentrant: bool) -> None:
    """Rule 3: keyword arguments reach the module, and tensors among them get gradients."""
    torch.manual_seed(0)
    block = Block().double().eval()
    wrapped = checkpoint_wrapper(copy.deepcopy(block), use_reentrant=use_reentrant)
    results = []
    for module in (block, wrapped):
        x = X.clone().requires_grad_()
        scale = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
        module(x, scale=scale).sum().backward()
        results.append((x.grad, scale.grad))
    (gx, gs), (wx, ws) = results
    assert torch.equal(gx, wx)
    assert torch.equal(gs, ws)


def _counting_hook(calls: list[bool]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        calls.append(checkpointing.is_recomputing())

    return hook


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_rule_4_inner_hooks_run_once_per_step(use_reentrant: bool) -> None:
    """Rule 4: the wrapped module's forward hook and pre-hook fire once for forward+backward."""
    block = Block()
    forward_calls: list[bool] = []
    pre_calls: list[bool] = []
    block.register_forward_hook(_counting_hook(forward_calls))
    block.register_forward_pre_hook(lambda m, a: pre_calls.append(checkpointing.is_recomputing()))
    wrapped = checkpoint_wrapper(block, use_reentrant=use_reentrant)
    wrapped(torch.randn(4, 6, requires_grad=True)).sum().backward()
    assert forward_calls == [False]
    assert pre_calls == [False]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_rule_4_hooks_during_recompute_opt_in(use_reentrant: bool) -> None:
    """Rule 4: ``hooks_during_recompute=True`` runs them again, and ``is_recomputing`` says so."""
    block = Block()
    calls: list[bool] = []
    block.register_forward_hook(_counting_hook(calls))
    options: dict[str, Any] = {"use_reentrant": use_reentrant}
    if not use_reentrant:
        options["early_stop"] = False  # else recompute stops before the hook is reached
    wrapped = checkpoint_wrapper(block, hooks_during_recompute=True, **options)
    wrapped(torch.randn(4, 6, requires_grad=True)).sum().backward()
    assert calls == [False, True]


def test_rule_4_wrapper_hooks_run_once_and_inner_submodule_hooks_can_tell() -> None:
    """Rule 4: hooks on the wrapper run once; a submodule's hook sees ``is_recomputing()``."""
    block = Block()
    inner_calls: list[bool] = []
    block.lin1.register_forward_hook(_counting_hook(inner_calls))
    wrapped = checkpoint_wrapper(block, early_stop=False)
    outer_calls: list[bool] = []
    wrapped.register_forward_hook(_counting_hook(outer_calls))
    wrapped(torch.randn(4, 6, requires_grad=True)).sum().backward()
    assert outer_calls == [False]
    assert inner_calls == [False, True]


def test_output_changing_hook_on_wrapper_keeps_gradients() -> None:
    """A hook on the wrapper that rescales the output gives the unwrapped model's gradients."""
    torch.manual_seed(0)
    plain = Block().double().eval()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    for module in (plain, wrapped):
        module.register_forward_hook(lambda m, a, out: out * 3)
    _assert_all_equal(_grads(wrapped, X), _grads(plain, X))


def test_checkpoint_options_pass_through() -> None:
    """``context_fn`` given to the wrapper reaches ``checkpoint`` (entered in forward)."""
    entered: list[str] = []

    class Marker:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            entered.append(self.name)

        def __exit__(self, *args: object) -> None:
            return None

    wrapped = checkpoint_wrapper(
        nn.Linear(3, 3), context_fn=lambda: (Marker("forward"), Marker("recompute"))
    )
    wrapped(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert entered == ["forward", "recompute"]


def test_attribute_access_and_indexing_reach_the_wrapped_module() -> None:
    """``wrapped.weight`` and ``wrapped[0]`` answer as the wrapped module would."""
    linear = nn.Linear(3, 3)
    assert checkpoint_wrapper(linear).weight is linear.weight
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    assert checkpoint_wrapper(seq)[1] is seq[1]
    with pytest.raises(AttributeError):
        checkpoint_wrapper(linear).no_such_attribute


def test_apply_activation_checkpointing_skips_root_and_is_idempotent() -> None:
    """The root is never wrapped; applying twice wraps nothing new."""
    model = _model()
    apply_activation_checkpointing(model)
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["CheckpointWrapper"] * 4
    apply_activation_checkpointing(model)
    assert [type(m).__name__ for m in model] == kinds
    assert not isinstance(model[0]._checkpoint_wrapped_module, CheckpointWrapper)


def test_apply_activation_checkpointing_custom_wrapper_fn() -> None:
    """``checkpoint_wrapper_fn`` receives each matching module and the options."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def wrapper_fn(module: nn.Module, **options: Any) -> nn.Module:
        seen.append((type(module).__name__, options))
        return module

    apply_activation_checkpointing(
        _model(), checkpoint_wrapper_fn=wrapper_fn, check_fn=_is_block, early_stop=False
    )
    assert seen == [("Block", {"early_stop": False})] * 2


def test_parity_with_torch_checkpoint_wrapper() -> None:
    """Side by side with torch.distributed's wrapper: same keys, same gradients."""
    ours, theirs = _model(), _model()
    apply_activation_checkpointing(ours, check_fn=_is_block)
    torch_wrappers.apply_activation_checkpointing(theirs, check_fn=_is_block)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    _assert_all_equal(_grads(ours, X), _grads(theirs, X))


def test_wrapped_model_deepcopies_and_trains_in_eval_mode() -> None:
    """``deepcopy`` and ``eval()`` reach the wrapped module (dropout off, stats frozen)."""
    model = _model()
    apply_activation_checkpointing(model, check_fn=_is_block)
    clone = copy.deepcopy(model).eval()
    assert not clone[0]._checkpoint_wrapped_module.drop.training
    out1 = clone(X)
    out2 = clone(X)
    assert torch.equal(out1, out2)


class _Scaled(nn.Module):
    """Reads and advances the counter: a recompute at the wrong count saves another tanh."""

    def __init__(self, counter: StateCounter) -> None:
        super().__init__()
        self.counter = counter
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter.n += 1
        return torch.tanh(self.lin(x) * self.counter.n)


def _two_steps(model: nn.Module, counter: StateCounter) -> list[torch.Tensor]:
    """Gradients of two steps (the counter runs on), the first step's cleared before the second."""
    grads = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        x = torch.full((3, 4), 0.1 * (step + 1), dtype=torch.float64, requires_grad=True)
        model(x).sum().backward()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return grads


class _Step(nn.Module):
    """``block``'s parameters, run through ``forward`` (the block's own, or decorated)."""

    def __init__(self, block: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.run = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def _generator(counter: StateCounter) -> Any:
    return (hook for hook in [counter])


def test_state_hooks_given_as_a_generator_serve_every_wrapper_call() -> None:
    """NOTE [Module wrapper], Rule 8 (issue 40, item 5): ``recompute_state_hooks`` given as a
    generator to ``checkpoint_wrapper`` and ``apply_activation_checkpointing`` restore the state
    in every call and every block, not only the first: gradients equal the plain model's."""
    plain_counter = StateCounter()
    torch.manual_seed(0)
    plain = nn.Sequential(_Scaled(plain_counter), _Scaled(plain_counter))
    want = _two_steps(plain, plain_counter)
    for build in ("checkpoint_wrapper", "apply_activation_checkpointing"):
        counter = StateCounter()
        torch.manual_seed(0)
        model = nn.Sequential(_Scaled(counter), _Scaled(counter))
        if build == "checkpoint_wrapper":
            wrapped = [
                checkpoint_wrapper(m, recompute_state_hooks=_generator(counter)) for m in model
            ]
            model = nn.Sequential(*wrapped)
        else:
            hooks = _generator(counter)  # one generator for every wrapper
            apply_activation_checkpointing(
                model, check_fn=lambda m: isinstance(m, _Scaled), recompute_state_hooks=hooks
            )
        got = _two_steps(model, counter)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), build


def test_state_hooks_given_as_a_generator_serve_every_decorated_call() -> None:
    """Issue 40, item 5: ``@checkpoint(recompute_state_hooks=<generator>)`` restores the state
    in every call of the decorated function: gradients equal the plain function's."""
    results = []
    for checkpointed in (False, True):
        counter = StateCounter()
        torch.manual_seed(0)
        block = _Scaled(counter)
        forward: Callable[[torch.Tensor], torch.Tensor] = block.forward
        if checkpointed:
            options: dict[str, Any] = {"recompute_state_hooks": _generator(counter)}
            forward = checkpointing.checkpoint(use_reentrant=False, **options)(block.forward)

        results.append(_two_steps(_Step(block, forward), counter))
    plain, ours = results
    assert all(torch.equal(g, w) for g, w in zip(ours, plain, strict=True))


def test_state_hooks_from_a_used_up_generator_are_refused() -> None:
    """Issue 40, item 5: a generator with nothing left (given to another wrapper first) is
    refused where it would silently restore nothing, naming the API and the fix."""
    counter = StateCounter()
    hooks = _generator(counter)
    checkpoint_wrapper(nn.Linear(2, 2), recompute_state_hooks=hooks)
    with pytest.raises(ValueError, match="checkpoint_wrapper: recompute_state_hooks is an iter"):
        checkpoint_wrapper(nn.Linear(2, 2), recompute_state_hooks=hooks)
    with pytest.raises(ValueError, match=r"checkpointing\.checkpoint: .* Fix: pass a list"):
        checkpointing.checkpoint(use_reentrant=False, recompute_state_hooks=iter(()))
    checkpoint_wrapper(nn.Linear(2, 2), recompute_state_hooks=[])  # an empty list is fine
