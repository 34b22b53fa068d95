"""A policy object or a policy name is a valid ``context_fn`` everywhere ours takes one.

Torch wants a function returning two contexts: given ``save_matmuls()`` it fails with "missing 2
required positional arguments: 'ctx' and 'op'", given ``"save_attention"`` with "'str' object is
not callable". Each test pins a rule of NOTE [Context functions]: every form runs the policy (the
forward's matrix products are not run again in backward), with gradients bitwise equal to
``as_context_fn(save_matmuls())`` and to the run without checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import releases
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import checkpointing
from checkpointing import CheckpointPolicy, policies
from checkpointing._compat import TorchDispatchMode
from checkpointing.policies import as_context_fn, save_matmuls

MM = torch.ops.aten.mm.default


class CountingMatmuls(TorchDispatchMode):
    """Counts ``aten.mm`` calls that reach the kernel (a kept output served from the cache does
    not)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is MM:
            self.count += 1
        return func(*args, **(kwargs or {}))


def keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A user's policy function."""
    return CheckpointPolicy.MUST_SAVE if op is MM else CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.w).tanh()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


FORMS: dict[str, Callable[[], object]] = {
    "policy object": save_matmuls,
    "policy name": lambda: "save_matmuls",
    "policy function": lambda: keep_matmuls,
    "combined policy": lambda: policies.either(save_matmuls(), policies.save_only_these_names("a")),
}


def _by_call(model: nn.Sequential, context_fn: object) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for block in model:
            x = checkpointing.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        return x

    return run


def _by_decorator(model: nn.Sequential, context_fn: object) -> Callable[[torch.Tensor], Any]:
    decorate = checkpointing.checkpoint(use_reentrant=False, context_fn=context_fn)
    decorated = [decorate(block) for block in model]

    def run(x: torch.Tensor) -> torch.Tensor:
        for function in decorated:
            x = function(x)
        return x

    return run


def _by_module(model: nn.Sequential, context_fn: object) -> Callable[[torch.Tensor], Any]:
    for block in model:
        checkpointing.checkpoint_module(block, context_fn=context_fn)
    return model


def _by_wrapper(model: nn.Sequential, context_fn: object) -> Callable[[torch.Tensor], Any]:
    for i in range(len(model)):
        model[i] = checkpointing.checkpoint_wrapper(model[i], context_fn=context_fn)
    return model


def _by_wrapper_class(model: nn.Sequential, context_fn: object) -> Callable[[torch.Tensor], Any]:
    for i in range(len(model)):
        model[i] = checkpointing.CheckpointWrapper(model[i], context_fn=context_fn)
    return model


def _by_applying(model: nn.Sequential, context_fn: object) -> Callable[[torch.Tensor], Any]:
    checkpointing.apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, Block), context_fn=context_fn
    )
    return model


def _by_applying_module(model: nn.Sequential, context_fn: object) -> Callable[..., Any]:
    checkpointing.apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=checkpointing.checkpoint_module,
        check_fn=lambda m: isinstance(m, Block),
        context_fn=context_fn,
    )
    return model


def _by_sequential(model: nn.Sequential, context_fn: object) -> Callable[[torch.Tensor], Any]:
    def run(x: torch.Tensor) -> Any:
        return checkpointing.checkpoint_sequential(
            model, 2, x, use_reentrant=False, context_fn=context_fn
        )

    return run


APIS: dict[str, Callable[[nn.Sequential, object], Callable[[torch.Tensor], Any]]] = {
    "checkpoint": _by_call,
    "decorator": _by_decorator,
    "checkpoint_module": _by_module,
    "checkpoint_wrapper": _by_wrapper,
    "CheckpointWrapper": _by_wrapper_class,
    "apply_activation_checkpointing": _by_applying,
    "apply_activation_checkpointing(checkpoint_module)": _by_applying_module,
    "checkpoint_sequential": _by_sequential,
}


def _step(api: str, context_fn: object) -> tuple[int, list[torch.Tensor]]:
    """Matmuls run in one forward and backward, and the gradients (the same model and input
    every time)."""
    model = _model()
    run = APIS[api](model, context_fn)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with CountingMatmuls() as counting:
        run(x).sum().backward()
    assert x.grad is not None
    return counting.count, [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


def _plain_grads() -> list[torch.Tensor]:
    model = _model()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None
    return [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("api", APIS)
def test_rules_2_and_3_every_api_runs_a_policy_or_its_name(api: str, form: str) -> None:
    """NOTE [Context functions], Rules 2 and 3: the policy runs (the matmuls are served from
    the forward's outputs, not run again), as ``as_context_fn(save_matmuls())`` does; the
    gradients are bitwise those of the plain run."""
    plain_count, _ = _step(api, checkpointing.noop_context_fn)
    explicit_count, explicit_grads = _step(api, as_context_fn(save_matmuls()))
    count, grads = _step(api, FORMS[form]())
    # One matmul less per checkpointed block (checkpoint_sequential runs its last plainly).
    assert count == explicit_count == plain_count - (1 if api == "checkpoint_sequential" else 2)
    for got, explicit, plain in zip(grads, explicit_grads, _plain_grads(), strict=True):
        assert torch.equal(got, explicit)
        assert torch.equal(got, plain)


def test_torch_fails_on_each_form_ours_accepts() -> None:
    """Why: torch calls ``context_fn()`` as it is, and a policy or a name cannot be called so."""
    x = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(TypeError, match="missing 2 required positional arguments"):
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False, context_fn=save_matmuls())
    with pytest.raises(TypeError, match="'str' object is not callable"):
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False, context_fn="save_matmuls")  # type: ignore[arg-type]


def test_rule_2_as_context_fn_takes_the_names_enable_takes() -> None:
    """NOTE [Context functions], Rule 2: one table of names; ``as_context_fn`` takes each name
    ``integrations.transformers.enable(policy=...)`` takes, and its function keeps what the
    named policy keeps."""
    names = sorted(policies._NAMED)
    # the factories of checkpointing.policies by their names, then the presets of other
    # libraries as "<library>:<name>"
    assert [name for name in names if ":" not in name] == [
        "save_attention",
        "save_everything",
        "save_matmuls",
        "save_nothing",
        "save_routing",
    ]
    assert {name.split(":")[0] for name in names if ":" in name} == {"maxtext", "torchtitan"}
    for name in names:
        context_fn = as_context_fn(name)
        x = torch.randn(2, 2, requires_grad=True)
        y = checkpointing.checkpoint(
            lambda t: (t @ t).tanh(), x, use_reentrant=False, context_fn=context_fn
        )
        y.sum().backward()
    named = _step("checkpoint", as_context_fn("save_matmuls"))
    explicit = _step("checkpoint", as_context_fn(save_matmuls()))
    assert named[0] == explicit[0]


@pytest.mark.parametrize(
    "call",
    [
        lambda: as_context_fn("save_matmul"),
        lambda: checkpointing.checkpoint(
            torch.sin, torch.randn(2), use_reentrant=False, context_fn="save_matmul"
        ),
        lambda: checkpointing.checkpoint_module(nn.Linear(2, 2), context_fn="save_matmul"),
        lambda: checkpointing.checkpoint_wrapper(nn.Linear(2, 2), context_fn="save_matmul"),
    ],
    ids=["as_context_fn", "checkpoint", "checkpoint_module", "checkpoint_wrapper"],
)
def test_rule_2_an_unknown_name_lists_the_names(call: Callable[[], object]) -> None:
    """NOTE [Context functions], Rule 2: an unknown name is a ValueError listing the names."""
    with pytest.raises(ValueError, match="unknown policy name 'save_matmul'") as info:
        call()
    assert "'save_attention', 'save_everything', 'save_matmuls'" in str(info.value)


def test_rule_3_an_uncalled_factory_names_the_call() -> None:
    """NOTE [Context functions], Rule 3: ``context_fn=save_matmuls`` (the factory) is refused,
    naming both fixes."""
    with pytest.raises(TypeError, match=r"context_fn=save_matmuls\(\), or pass its name"):
        checkpointing.checkpoint(
            torch.sin, torch.randn(2), use_reentrant=False, context_fn=save_matmuls
        )


def test_rule_1_a_context_function_is_used_as_it_is() -> None:
    """NOTE [Context functions], Rule 1: torch's contract is untouched: a function taking no
    arguments (or only defaulted ones) is called for the two contexts."""
    calls: list[int] = []

    def contexts(extra: int = 1) -> Any:
        calls.append(extra)
        return torch_checkpoint.noop_context_fn()

    x = torch.randn(2, requires_grad=True)
    checkpointing.checkpoint(
        torch.sin, x, use_reentrant=False, context_fn=contexts
    ).sum().backward()
    assert calls == [1]


def test_a_name_with_the_reentrant_variant_is_refused_as_any_context_fn() -> None:
    """The reentrant variant runs no context: a name is refused there as any ``context_fn``."""
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        checkpointing.checkpoint(
            torch.sin,
            torch.randn(2, requires_grad=True),
            use_reentrant=True,
            context_fn="save_matmuls",
        )


def _not_callable_at(api: str, module: Any) -> Callable[[], object]:
    """The call of ``api`` (of ``module``: ours or torch's) with ``context_fn=5``."""
    x = torch.randn(2, requires_grad=True)
    if api == "checkpoint":
        return lambda: module.checkpoint(torch.sin, x, use_reentrant=False, context_fn=5)
    if api == "decorator":
        return lambda: module.checkpoint(use_reentrant=False, context_fn=5)(torch.sin)(x)
    if api == "checkpoint_module":
        return lambda: module.checkpoint_module(nn.Linear(2, 2), context_fn=5)
    if api == "_checkpoint_without_reentrant_generator":
        return lambda: next(
            module._checkpoint_without_reentrant_generator(torch.sin, True, 5, "default")
        )
    return lambda: next(
        module._checkpoint_without_reentrant_generator_impl(torch.sin, (x,), {}, context_fn=5)
    )


@pytest.mark.parametrize(
    "api",
    [
        "checkpoint",
        "decorator",
        "checkpoint_module",
        "_checkpoint_without_reentrant_generator",
        "_checkpoint_without_reentrant_generator_impl",
    ],
)
def test_options_rule_5_a_context_fn_not_callable_is_a_clear_type_error(api: str) -> None:
    """NOTE [Checkpoint options], Rule 5: ``context_fn=5`` is refused when each entry point
    builds its options, with torch's exception type (where torch has the API, side by side)
    and a message naming the API, what was expected and the fix, not "'int' object is not
    callable"."""
    with pytest.raises(TypeError) as info:
        _not_callable_at(api, checkpointing)()
    message = str(info.value)
    name = "checkpoint" if api == "decorator" else api
    assert message.startswith(f"checkpointing.{name}: context_fn must be a function returning")
    assert "got 5 of type int" in message
    assert "Fix: pass e.g. context_fn=checkpointing.policies.save_matmuls()" in message
    torch_has = (
        releases.has(releases.DECORATOR) if api == "decorator" else hasattr(torch_checkpoint, api)
    )
    if torch_has:
        with pytest.raises(TypeError, match="'int' object is not callable"):
            _not_callable_at(api, torch_checkpoint)()


def test_options_rule_5_reentrant_leaves_context_fn_to_torchs_value_error() -> None:
    """NOTE [Checkpoint options], Rule 5: with ``use_reentrant=True`` a ``context_fn`` that is
    not callable is refused as any ``context_fn`` there, a ``ValueError``, as torch's."""
    x = torch.randn(2, requires_grad=True)
    for module in (checkpointing, torch_checkpoint):
        with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
            module.checkpoint(torch.sin, x, use_reentrant=True, context_fn=5)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_rule_4_a_name_compiles_into_one_graph_as_torchs_list_form() -> None:
    """NOTE [Context functions], Rule 4: under ``torch.compile(fullgraph=True)`` a name works
    (its function was made at import), with the gradients of torch's own selective checkpoint
    keeping ``aten.mm`` on the same backend."""
    w = torch.randn(4, 4, requires_grad=True)

    def step(run: Callable[..., torch.Tensor], context_fn: object) -> list[torch.Tensor]:
        torch._dynamo.reset()
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        compiled = torch.compile(
            lambda t: run(
                lambda u: (u @ w).tanh() @ w, t, use_reentrant=False, context_fn=context_fn
            ),
            backend="aot_eager",
            fullgraph=True,
        )
        w.grad = None
        compiled(x).sum().backward()
        assert x.grad is not None
        assert w.grad is not None
        return [x.grad, w.grad]

    torchs = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, [MM])
    try:
        ours = step(checkpointing.checkpoint, "save_matmuls")
        theirs = step(torch_checkpoint.checkpoint, torchs)
    finally:
        torch._dynamo.reset()
    for got, want in zip(ours, theirs, strict=True):
        assert torch.equal(got, want)
