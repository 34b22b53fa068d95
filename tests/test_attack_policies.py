"""Issue 26's attacks on policies and on this wave's new entry points, each kept as a test.

- No garbage from container outputs: an op that returns a tuple or a list, kept or offloaded
  by selective checkpointing, leaves no cyclic object behind (torch's ``tree_map`` left 7 per
  map; a tiny Llama under ``save_matmuls()`` 14 per attention call), so a long training run
  does not fill memory between collections.
- An uncalled policy factory (``save_matmuls`` for ``save_matmuls()``) is refused where it is
  passed, by every API that takes a policy, instead of failing at the first forward inside torch
  ("unsupported operand type(s) for @"); any other callable is still a policy, as in torch.
- This wave's entry points (the decorator form of ``checkpoint``, ``respect_saved_tensors_hooks``
  under the user's saved-tensors hooks, ``_checkpoint_without_reentrant_generator_impl``): each
  soaks 300 steps with ``gc`` disabled leaving no cyclic garbage and nothing of ours alive
  (counted, and by weakrefs), and runs in two threads at once with the plain gradients.

The soaks follow ``tests/test_leaks.py`` (``gc`` disabled, ``DEBUG_SAVEALL``) but assert that
there is no garbage at all, not only none of ours: torch's pytree helpers, called from our hot
paths, leave objects of torch's.
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from garbage_support import gc_disabled  # noqa: F401  (a fixture)
from hf_support import tiny_llama
from thread_support import run_threads
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import checkpointing
from checkpointing import CheckpointPolicy, OffloadStats
from checkpointing._selective import policy_from
from checkpointing._selective.cache import _keep, _save_traced
from checkpointing._selective.policy import _Action
from checkpointing.integrations import transformers as hf_checkpointing
from checkpointing.policies import (
    as_context_fn,
    both,
    either,
    offload_ops,
    offload_these_names,
    recompute_ops,
    save_everything,
    save_matmuls,
    save_nothing,
    save_only_these_names,
    save_ops,
)

aten = torch.ops.aten
SOAK_STEPS = 300
WARMUP = 3
THREADS = 2
THREAD_STEPS = 20


def _garbage_of(step: Callable[[], None], steps: int) -> list[str]:
    """Run ``step`` ``steps`` times (``gc`` is off) and describe the cyclic garbage left."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    for _ in range(steps):
        step()
    gc.collect()
    gc.set_debug(0)
    found = sorted(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    gc.garbage.clear()
    return found


def _is_ours(obj: object) -> bool:
    # type(), not obj.__class__: some objects warn when it is read.
    return str(getattr(type(obj), "__module__", "")).startswith("checkpointing")


def _ours() -> Counter[str]:
    """The live objects whose class is checkpointing's, counted by class."""
    return Counter(type(o).__qualname__ for o in gc.get_objects() if _is_ours(o))


def _weak_ours_made_by(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
    """``run()``'s output and weakrefs to the objects of ours it made that take one."""
    before = {id(o) for o in gc.get_objects() if _is_ours(o)}
    out = run()
    refs = []
    for obj in gc.get_objects():
        if _is_ours(obj) and id(obj) not in before:
            try:
                refs.append(weakref.ref(obj))
            except TypeError:  # a slotted class without a weakref slot: counted by _ours()
                continue
    return out, refs


# --- No garbage from container outputs (Defect 7) --------------------------------------------

# native_layer_norm and max.dim return tuples, split.Tensor a list.
CONTAINER_OPS = (aten.native_layer_norm.default, aten.max.dim, aten.split.Tensor)


def _container_block(t: torch.Tensor) -> torch.Tensor:
    y = nn.functional.layer_norm(t, (8,))
    values, _ = y.max(dim=1)
    a, b = y.split(4, dim=1)
    return (a * b).sum(1) + values.sin()


@pytest.mark.parametrize(
    ("policy", "offloaded_per_step"),
    [(save_ops(*CONTAINER_OPS), 0), (offload_ops(*CONTAINER_OPS), 7)],
    ids=["save", "offload"],
)
@pytest.mark.usefixtures("gc_disabled")
def test_sac_of_ops_returning_containers_leaves_no_cyclic_garbage(
    policy: Any, offloaded_per_step: int
) -> None:
    """Kept tuple and list outputs are mapped without torch's pytree: 100 steps, no garbage
    (offload: the 7 tensors of the three outputs each step)."""
    stats = OffloadStats()
    context_fn = as_context_fn(policy, offload_stats=stats)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(_container_block(x).sum(), x)[0]

    def step() -> None:
        out = checkpointing.checkpoint(
            _container_block, x, use_reentrant=False, context_fn=context_fn
        )
        assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected)

    step()
    assert _garbage_of(step, 100) == []
    assert stats.offloaded_tensors == 101 * offloaded_per_step


@pytest.mark.usefixtures("gc_disabled")
def test_tiny_llama_under_save_matmuls_leaves_no_cyclic_garbage() -> None:
    """``enable(model, policy=save_matmuls())``: fused attention returns a tuple; 10 training
    steps leave no garbage (torch's ``tree_map`` left 14 objects per attention call)."""
    model = tiny_llama()
    hf_checkpointing.enable(model, policy=save_matmuls())
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    assert _garbage_of(step, 10) == []


def test_kept_containers_come_back_with_their_structure() -> None:
    """A nested output (tuples, lists, None, numbers) is cached and handed back as it was:
    same container types, the tensors as aliases, everything else as is."""
    a, b, c = torch.randn(2), torch.randn(3), torch.randn(4)
    out = (a, [b, None, (c, 2)], None)
    stats = OffloadStats()
    for entry in (
        _keep(out, _Action.SAVE, stats),
        _keep(out, _Action.OFFLOAD, stats),
        _save_traced(out),
    ):
        got = entry.take(False, stats)
        assert type(got) is tuple
        assert type(got[1]) is list
        assert type(got[1][2]) is tuple
        assert got[1][1] is None
        assert got[1][2][1] == 2
        assert got[2] is None
        for kept, original in ((got[0], a), (got[1][0], b), (got[1][2][0], c)):
            assert kept is not original
            assert kept.data_ptr() == original.data_ptr()


# --- Uncalled factories (Defect 8) ------------------------------------------------------------

FACTORIES = [
    save_nothing,
    save_everything,
    save_ops,
    save_matmuls,
    recompute_ops,
    offload_ops,
    save_only_these_names,
    offload_these_names,
    either,
    both,
]
# Each API that takes a policy: how to pass it one, and the name its message speaks with.
POLICY_APIS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "either": (lambda p: either(p), "checkpointing.policies.either"),
    "both": (lambda p: both(save_matmuls(), p), "checkpointing.policies.both"),
    "as_context_fn": (as_context_fn, "checkpointing.policies.as_context_fn"),
    "create_selective_checkpoint_contexts": (
        checkpointing.create_selective_checkpoint_contexts,
        "create_selective_checkpoint_contexts",
    ),
    "policy_from": (policy_from, "create_selective_checkpoint_contexts"),
}


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("api", list(POLICY_APIS))
def test_every_policy_api_refuses_an_uncalled_factory(api: str, factory: Any) -> None:
    """``save_matmuls`` where ``save_matmuls()`` was meant is a ``TypeError`` where it is
    passed, naming the API, what it got and how to call the factory."""
    call, speaker = POLICY_APIS[api]
    with pytest.raises(TypeError) as raised:
        call(factory)
    message = str(raised.value)
    name = factory.__name__
    assert message.startswith(speaker)
    assert "expected" in message
    assert f"the factory {name}" in message or f"factory checkpointing.policies.{name}" in message
    assert f"Fix: call the factory, e.g. {name}(" in message


def test_transformers_enable_refuses_an_uncalled_factory_at_enable_time() -> None:
    """``enable(model, policy=save_matmuls)`` raises at once and leaves the model plain; with
    the factory called it checkpoints."""
    model = tiny_llama()
    with pytest.raises(TypeError, match=r"the factory save_matmuls itself.*save_matmuls\(\)"):
        hf_checkpointing.enable(model, policy=save_matmuls)  # type: ignore[call-overload]  # the mistake under test
    assert not model.is_activation_checkpointing
    hf_checkpointing.enable(model, policy=save_matmuls())
    assert model.is_activation_checkpointing
    ids = torch.randint(64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()


def _by_varargs(*args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _CallableSaver:
    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is aten.mm.default


@functools.wraps(save_matmuls)
def _named_like_a_factory(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return op is aten.mm.default


@pytest.mark.parametrize(
    "policy",
    [_by_varargs, _CallableSaver(), _named_like_a_factory, lambda ctx, op, *a, **k: False],
    ids=["varargs", "instance", "wraps-a-factory", "lambda"],
)
@pytest.mark.parametrize("api", list(POLICY_APIS))
def test_any_other_callable_is_still_a_policy(api: str, policy: Any) -> None:
    """Only our factories themselves are refused: a user's callable, even one wrapping a
    factory's name and docstring, is accepted (torch accepts any callable) and runs."""
    call, _ = POLICY_APIS[api]
    call(policy)
    x = torch.randn(3, 3, requires_grad=True)
    out = checkpointing.checkpoint(
        lambda t: (t @ t).sin(), x, use_reentrant=False, context_fn=as_context_fn(policy)
    )
    out.sum().backward()
    assert x.grad is not None


# --- This wave's entry points: 300-step soaks and two threads -----------------------------------


def _block(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A small region: two matmuls and pointwise ops."""
    return torch.tanh(t @ w).sin() @ w


def _leaves(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    w = torch.randn(5, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    return x, w


class _Recording:
    """A user's saved-tensors hook pair recording which thread packed and unpacked."""

    def __init__(self) -> None:
        self.packed: list[int] = []
        self.unpacked: list[int] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed.append(threading.get_ident())
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.unpacked.append(threading.get_ident())
        return t


@dataclass
class Runner:
    """One entry point made ready: ``run(x, w)`` is the region's output; ``hooks`` the user's
    saved-tensors hooks it runs under, if any."""

    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    hooks: _Recording | None = None


class _DecoratedBlock(nn.Module):
    @checkpointing.checkpoint(use_reentrant=False)
    def forward(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _block(t, w)


def _decorator(use_reentrant: bool) -> Runner:
    return Runner(checkpointing.checkpoint(use_reentrant=use_reentrant)(_block))


def _method_decorator() -> Runner:
    return Runner(_DecoratedBlock())


def _respecting_hooks() -> Runner:
    """Selective checkpointing saving mm, under the user's hooks with
    ``respect_saved_tensors_hooks=True``; backward runs outside the hooks."""
    hooks = _Recording()
    context_fn = as_context_fn(save_matmuls())

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with saved_tensors_hooks(hooks.pack, hooks.unpack):
            return checkpointing.checkpoint(
                _block,
                x,
                w,
                use_reentrant=False,
                context_fn=context_fn,
                respect_saved_tensors_hooks=True,
            )

    return Runner(run, hooks)


def _generator_impl() -> Runner:
    """``_checkpoint_without_reentrant_generator_impl`` driven by hand around the call."""

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gen = checkpointing._checkpoint_without_reentrant_generator_impl(_block, (x, w), {})
        next(gen)
        out = _block(x, w)
        for _ in gen:  # the second next() ends it
            raise AssertionError("the generator yielded twice")
        return out

    return Runner(run)


ENTRY_POINTS: dict[str, Callable[[], Runner]] = {
    "decorator": functools.partial(_decorator, False),
    "decorator-reentrant": functools.partial(_decorator, True),
    "method-decorator": _method_decorator,
    "respect-saved-tensors-hooks": _respecting_hooks,
    "generator-impl": _generator_impl,
}


def _backward(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``out.pow(2).sum()`` for ``x`` and ``w``, taken off them (by
    ``backward()``: the reentrant checkpoint refuses ``autograd.grad``)."""
    out.pow(2).sum().backward()
    x_grad, w_grad = x.grad, w.grad
    x.grad = w.grad = None
    assert x_grad is not None
    assert w_grad is not None
    return [x_grad, w_grad]


def _plain_grads(seed: int) -> list[torch.Tensor]:
    x, w = _leaves(seed)
    return _backward(_block(x, w), x, w)


def _grads(runner: Runner, seed: int) -> list[torch.Tensor]:
    x, w = _leaves(seed)
    return _backward(runner.run(x, w), x, w)


def _soak(entry: str) -> list[weakref.ref[Any]]:
    """Soak one entry point (``gc`` is off); weakrefs to its runner and the user's hooks."""
    runner = ENTRY_POINTS[entry]()
    x, w = _leaves(0)
    expected = _plain_grads(0)

    def step() -> None:
        grads = _backward(runner.run(x, w), x, w)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))

    for _ in range(WARMUP):
        step()
    gc.collect()
    ours_before = _ours()
    assert _garbage_of(step, SOAK_STEPS) == []
    assert _ours() == ours_before
    out, refs = _weak_ours_made_by(lambda: runner.run(x, w))
    if entry != "decorator-reentrant":  # reentrant keeps only a slotted state (counted above)
        assert refs, "the step made nothing of ours to watch: the test would prove nothing"
    _backward(out, x, w)
    del out
    assert [r() for r in refs if r() is not None] == []
    assert _ours() == ours_before
    hooks = [runner.hooks] if runner.hooks is not None else []
    return [weakref.ref(runner.run), *map(weakref.ref, hooks)]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.usefixtures("gc_disabled")
def test_entry_point_soaks_300_steps_leaving_no_garbage_and_nothing_of_ours(entry: str) -> None:
    """300 steps with ``gc`` off: no cyclic garbage, as many objects of ours as before, and the
    last step's objects and the runner itself die by reference counting alone."""
    runner_refs = _soak(entry)
    assert [r() for r in runner_refs if r() is not None] == []


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_entry_point_in_two_threads_gives_the_plain_gradients(entry: str) -> None:
    """One runner shared by two threads, 20 steps each at once: every step's gradients are
    the plain run's, bit for bit; user hooks see their own thread's saves only."""
    reference = {step: _plain_grads(step) for step in range(THREAD_STEPS)}
    alone = ENTRY_POINTS[entry]()
    _grads(alone, 0)
    runner = ENTRY_POINTS[entry]()

    def train(index: int) -> int:
        for step in range(THREAD_STEPS):
            got = _grads(runner, step)
            assert all(torch.equal(g, r) for g, r in zip(got, reference[step], strict=True))
        return threading.get_ident()

    idents = run_threads(train, THREADS)
    if runner.hooks is not None and alone.hooks is not None:
        packed, unpacked = Counter(runner.hooks.packed), Counter(runner.hooks.unpacked)
        for ident in idents:
            assert packed[ident] == THREAD_STEPS * len(alone.hooks.packed)
            assert unpacked[ident] == THREAD_STEPS * len(alone.hooks.unpacked)
        assert sum(packed.values()) == THREADS * THREAD_STEPS * len(alone.hooks.packed)
