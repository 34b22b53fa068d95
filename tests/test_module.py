"""``checkpoint_module`` and the frame generator, side by side with torch's composable checkpoint.

Every scenario runs three times: without checkpointing, with torch's
``torch.distributed._composable.checkpoint`` and with ours, on identically seeded models. Rules are
NOTE [Module checkpoint hooks] (``_module``) and NOTE [Nestable checkpoint], Rule 8 (``_frame``).
"""

from __future__ import annotations

import copy
import functools
import gc
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from frame_support import assert_tensors_equal, counting_ops
from hypothesis import given
from hypothesis import strategies as st
from strategies import StackSpec, layer_stacks_with_dropout
from torch import nn
from torch.distributed._composable import checkpoint as torch_composable

import checkpointing
from checkpointing import _compat
from checkpointing._frame import Frame, Holder

Apply = Callable[[nn.Module], Any]
APPLY: dict[str, Apply | None] = {
    "plain": None,
    "torch": torch_composable,
    "ours": checkpointing.checkpoint_module,
}
WIDTH = 6


class Block(nn.Module):
    """Linear, dropout, tanh, linear: parameters, random numbers and a saved nonlinearity."""

    def __init__(self, width: int = WIDTH, p: float = 0.25) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.drop = nn.Dropout(p)
        self.outer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.outer(torch.tanh(self.drop(self.inner(x)))) * scale


def _stack(depth: int = 3, seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(*[Block() for _ in range(depth)]).double()


def _input(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, WIDTH, generator=gen, dtype=torch.float64, requires_grad=True)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [x.grad, *(p.grad for p in model.parameters())]


def _step(model: nn.Module, x: torch.Tensor, seed: int = 7) -> list[torch.Tensor | None]:
    """One forward (RNG seeded) and backward; the input and parameter gradients."""
    torch.manual_seed(seed)
    model(x).sum().backward()
    return _grads(model, x)


def _prepared(variant: str, depth: int = 3, which: Callable[[int], bool] = bool) -> nn.Sequential:
    """A fresh stack whose blocks ``i`` with ``which(i + 1)`` are checkpointed by ``variant``."""
    model = _stack(depth)
    apply = APPLY[variant]
    if apply is not None:
        for i, block in enumerate(model):
            if which(i + 1):
                apply(block)
    return model


def _all_three(
    scenario: Callable[[nn.Sequential], list[torch.Tensor | None]],
    prepare: Callable[[str], nn.Sequential] = _prepared,
) -> None:
    """Run ``scenario`` on the plain, torch and our model; all results bit-identical."""
    results = {name: scenario(prepare(name)) for name in APPLY}
    assert_tensors_equal(results["torch"], results["plain"], "torch vs plain")
    assert_tensors_equal(results["ours"], results["plain"], "ours vs plain")


# -- gradients ---------------------------------------------------------------------------------


def test_gradients_bitwise_with_dropout_as_torch_and_plain() -> None:
    """Every block checkpointed: gradients (dropout on) bit-identical to torch and to plain."""
    _all_three(lambda model: _step(model, _input()))


def test_module_called_several_times_before_backward() -> None:
    """Reusing a checkpointed module three times in one forward gives plain's gradients."""

    def scenario(model: nn.Sequential) -> list[torch.Tensor | None]:
        x = _input()
        torch.manual_seed(3)
        h = x
        for _ in range(3):
            h = model[0](h)
        h.sum().backward()
        return _grads(model, x)

    _all_three(scenario)


def test_keyword_arguments_reach_forward_and_recompute() -> None:
    """Keyword arguments of the call are passed to the forward and to its re-run."""

    def scenario(model: nn.Sequential) -> list[torch.Tensor | None]:
        x = _input()
        torch.manual_seed(3)
        model[1](model[0](x, scale=2.0), scale=0.5).sum().backward()
        return _grads(model, x)

    _all_three(scenario)


def _nested(variant: str) -> nn.Sequential:
    """Parent (the whole stack) and every child block both checkpointed."""
    model = _prepared(variant)
    apply = APPLY[variant]
    if apply is not None:
        apply(model)
    return model


def test_rule3_parent_and_children_both_checkpointed() -> None:
    """Nesting: the stack and its blocks checkpointed at once gives plain's gradients."""
    _all_three(lambda model: _step(model, _input()), prepare=_nested)


def _backward_ops(prepare: Callable[[str], nn.Sequential]) -> dict[str, Counter[str]]:
    """The aten ops each variant runs in backward (recompute included)."""
    counts: dict[str, Counter[str]] = {}
    for variant in APPLY:
        model, x = prepare(variant), _input()
        torch.manual_seed(7)
        loss = model(x).sum()
        with counting_ops() as ops:
            loss.backward()
        counts[variant] = ops
    return counts


def test_nested_recompute_runs_the_same_ops_as_torch() -> None:
    """Nesting: the ops re-run in backward are those torch re-runs."""
    counts = _backward_ops(_nested)
    assert counts["ours"] == counts["torch"]


def test_recompute_op_counts_match_torch() -> None:
    """The ops run in backward (recompute included) are exactly torch's."""
    counts = _backward_ops(_prepared)
    assert counts["ours"] == counts["torch"]
    assert counts["ours"]["aten.tanh.default"] == 3  # each block re-ran its forward once
    assert counts["plain"]["aten.tanh.default"] == 0


@given(spec=layer_stacks_with_dropout(), data=st.data())
def test_random_stacks_random_subsets_give_plain_gradients(spec: StackSpec, data: Any) -> None:
    """Random stacks with ``checkpoint_module`` on a random subset of layers: plain's gradients."""
    chosen = data.draw(st.sets(st.integers(0, spec.depth - 1)), label="checkpointed layers")

    def forward(variant: str) -> Callable[[nn.Sequential, torch.Tensor], torch.Tensor]:
        def run(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
            apply = APPLY[variant]
            if apply is not None:
                for i in chosen:
                    apply(model[i])
            torch.manual_seed(spec.seed)
            return model(x)

        return run

    plain = spec.run(forward("plain"))
    spec.run(forward("ours")).assert_equal(plain)
    spec.run(forward("torch")).assert_equal(plain)


def test_selective_policies_work_through_context_fn() -> None:
    """``context_fn`` with a ``checkpointing.policies`` policy: plain's gradients, matmuls not
    re-run in backward."""
    policy = checkpointing.policies.save_matmuls()
    context_fn = functools.partial(checkpointing.create_selective_checkpoint_contexts, policy)
    model, x = _stack(), _input()
    for block in model:
        checkpointing.checkpoint_module(block, context_fn=context_fn)
    torch.manual_seed(7)
    loss = model(x).sum()
    with counting_ops() as ops:
        loss.backward()
    assert ops["aten.tanh.default"] == 3, "the blocks were not recomputed"
    assert ops["aten.addmm.default"] == 0, "a saved matmul was recomputed"
    assert_tensors_equal(_grads(model, x), _step(_stack(), _input()), "SAC vs plain")


# -- bytes kept --------------------------------------------------------------------------------


@contextmanager
def _saved_bytes(params: set[int]) -> Iterator[list[int]]:
    """Bytes of the unique storages autograd keeps outside checkpointed regions (their inputs),
    parameters left out; an outer hook sees them because frames save inputs through it."""
    seen: dict[int, int] = {}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
    total[0] = sum(seen.values())


def test_saved_bytes_at_most_torchs() -> None:
    """Bytes kept between forward and backward: ours <= torch's < plain's."""
    kept = {}
    for variant in APPLY:
        model, x = _prepared(variant), _input()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with _saved_bytes(params) as total:
            loss = model(x).sum()
        kept[variant] = total[0]
        loss.backward()
    assert kept["ours"] <= kept["torch"] < kept["plain"], kept


# -- hooks of the user ------------------------------------------------------------------------


def test_rule1_user_hooks_called_as_often_as_with_torch() -> None:
    """User pre-hooks and forward hooks, on the module and its children: torch's call counts."""
    counts: dict[str, Counter[str]] = {}
    for variant in ("torch", "ours"):
        model, x = _prepared(variant), _input()
        seen: Counter[str] = Counter()
        for name, module in [("block", model[0]), ("child", model[0].inner)]:
            module.register_forward_pre_hook(lambda *_, n=name, c=seen: c.update([f"{n} pre"]))
            module.register_forward_hook(lambda *_, n=name, c=seen: c.update([f"{n} post"]))
        _step(model, x)
        counts[variant] = seen
    assert counts["ours"] == counts["torch"]
    assert counts["ours"]["block pre"] == 2  # forward, then the re-run in backward


def test_names_types_and_state_dict_unchanged() -> None:
    """No wrapper: class, ``named_modules`` and ``state_dict`` keys are those of the plain model."""
    plain, ours = _stack(), _prepared("ours")
    assert [type(m) for m in ours.modules()] == [type(m) for m in plain.modules()]
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in plain.named_modules()]
    assert list(ours.state_dict()) == list(plain.state_dict())
    ours.load_state_dict(plain.state_dict())


def test_apply_activation_checkpointing_can_use_hooks() -> None:
    """``apply_activation_checkpointing(..., checkpoint_wrapper_fn=checkpoint_module)`` hooks the
    matches in place; applying it twice changes nothing."""
    model = _stack()
    for _ in range(2):
        checkpointing.apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=checkpointing.checkpoint_module,
            check_fn=lambda m: isinstance(m, Block),
        )
    assert list(model.state_dict()) == list(_stack().state_dict())
    assert all(isinstance(m, Block) for m in model)
    assert_tensors_equal(_step(model, _input()), _step(_stack(), _input()), "hooked vs plain")


def test_remove_restores_the_plain_module() -> None:
    """After ``remove_checkpoint_module`` nothing is recomputed and no hook is left."""
    model, x = _prepared("ours"), _input()
    for block in model:
        assert checkpointing.remove_checkpoint_module(block) is block
        assert not block._forward_pre_hooks
        assert not block._forward_hooks
    loss = model(x).sum()
    with counting_ops() as ops:
        loss.backward()
    assert ops["aten.tanh.default"] == 0
    checkpointing.checkpoint_module(model[0])  # and it can be applied again


def test_deepcopy_of_a_checkpointed_module_is_checkpointed_and_removable() -> None:
    """A deep copy carries its own hooks; removing them leaves the original checkpointed."""
    original = _prepared("ours")
    clone = copy.deepcopy(original)
    checkpointing.remove_checkpoint_module(clone[0])
    assert checkpointing._module.is_module_checkpointed(original[0])
    assert_tensors_equal(_step(clone, _input()), _step(original, _input()), "clone vs original")


def test_debug_works_where_torch_refuses() -> None:
    """``debug=True``: torch's composable checkpoint raises ValueError, ours runs and reports."""
    torch_model, ours = _stack(), _stack()
    torch_composable(torch_model[0], debug=True)
    with pytest.raises(ValueError, match="debug=True is incompatible"):
        torch_model(_input())
    checkpointing.checkpoint_module(ours[0], debug=True)
    assert_tensors_equal(_step(ours, _input()), _step(_stack(), _input()), "debug vs plain")


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "phrase"),
    [
        ({"use_reentrant": True}, NotImplementedError, "use_reentrant=True is not supported"),
        ({"bogus": 1, "other": 2}, ValueError, "Unexpected keyword arguments: bogus,other"),
    ],
)
def test_option_errors_as_torch(
    kwargs: dict[str, Any], error: type[Exception], phrase: str
) -> None:
    """``use_reentrant=True`` and unknown options raise torch's error types and phrases."""
    for apply in (torch_composable, checkpointing.checkpoint_module):
        with pytest.raises(error, match=phrase):
            apply(Block(), **kwargs)


def test_rule5_misuse_errors_name_the_fix() -> None:
    """Twice, removing what is not there, a bad check or a non-module: clear errors at once."""
    block = checkpointing.checkpoint_module(Block())
    with pytest.raises(ValueError, match="remove_checkpoint_module"):
        checkpointing.checkpoint_module(block)
    with pytest.raises(ValueError, match="nothing to remove"):
        checkpointing.remove_checkpoint_module(Block())
    with pytest.raises(ValueError, match="determinism_check"):
        checkpointing.checkpoint_module(Block(), determinism_check="strict")
    with pytest.raises(TypeError, match=r"expected an nn\.Module"):
        checkpointing.checkpoint_module(lambda x: x)  # type: ignore[arg-type]  # the mistake


class _Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.lin = nn.Linear(WIDTH, WIDTH).double()
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.fail:
            raise KeyError("boom")
        return h


@pytest.mark.parametrize("variant", ["torch", "ours"])
def test_rule4_exception_in_forward_then_a_normal_step(variant: str) -> None:
    """An exception inside the module's forward leaves the hook stack as found; the next step
    gives plain's gradients."""
    module = _Failing()
    apply = APPLY[variant]
    assert apply is not None
    apply(module)
    before = _compat.top_saved_tensors_hooks()
    with pytest.raises(KeyError, match="boom"):
        module(_input())
    assert _compat.top_saved_tensors_hooks() == before
    module.fail = False
    x = _input()
    module(x).sum().backward()
    reference = _Failing()
    reference.fail = False
    y = _input()
    reference(y).sum().backward()
    assert_tensors_equal(_grads(module, x), _grads(reference, y), "after the exception")


# -- the generator, driven by hand -------------------------------------------------------------


def _by_hand(generator_fn: Callable[..., Any], fn: Callable[..., Any], *args: Any) -> Any:
    """The unsloth pattern: start the generator, run ``fn`` ourselves, finish the generator."""
    gen = generator_fn(fn, True, torch_checkpoint.noop_context_fn, "default", False, True, *args)
    next(gen)
    out = fn(*args)
    with pytest.raises(StopIteration):
        next(gen)
    return out


@pytest.mark.parametrize(
    "generator_fn",
    [
        torch_checkpoint._checkpoint_without_reentrant_generator,
        checkpointing._checkpoint_without_reentrant_generator,
    ],
    ids=["torch", "ours"],
)
def test_generator_driven_by_hand(generator_fn: Callable[..., Any]) -> None:
    """The generator driven by hand gives plain's gradients and re-runs the region once."""
    block, x = _stack(1)[0], _input()
    torch.manual_seed(7)
    out = _by_hand(generator_fn, block, x)
    with counting_ops() as ops:
        out.sum().backward()
    assert ops["aten.tanh.default"] == 1
    assert_tensors_equal(_grads(block, x), _step(_stack(1), _input()), "by hand vs plain")


@pytest.mark.parametrize("how", ["close", "throw"])
def test_rule8_closing_the_generator_early_restores_the_hook_stack(how: str) -> None:
    """NOTE [Nestable checkpoint], Rule 8: ``close()``/``throw()`` at the pause pops the hooks."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        before = _compat.top_saved_tensors_hooks()
        gen = checkpointing._checkpoint_without_reentrant_generator(torch.sin, True)
        next(gen)
        assert _compat.top_saved_tensors_hooks() != before
        if how == "close":
            gen.close()
        else:
            with pytest.raises(KeyError):
                gen.throw(KeyError("from the caller"))
        assert _compat.top_saved_tensors_hooks() == before


def test_checkpoint_pops_the_hook_before_the_exception_leaves() -> None:
    """An exception in the checkpointed function finds the hook stack already restored."""
    stacks = []

    def failing(x: torch.Tensor) -> torch.Tensor:
        raise KeyError(torch.sin(x))

    try:
        checkpointing.checkpoint(failing, _input(), use_reentrant=False)
    except KeyError:
        stacks.append(_compat.top_saved_tensors_hooks())
    assert stacks == [None]


# -- reliability -------------------------------------------------------------------------------


def test_rule2_soak_1000_steps_no_garbage_no_growth() -> None:
    """1,000 steps of one hooked module with gc disabled: no cyclic garbage of ours, no growth of
    objects or tensors, and no frame, holder or generator left on the module."""
    model, x = _prepared("ours", depth=2), _input()
    params = list(model.parameters())

    def step() -> None:
        model(x).sum().backward()
        for p in params:
            p.grad = None
        x.grad = None

    for _ in range(20):
        step()
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for _ in range(1000):
            step()
        after = len(gc.get_objects())
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = [o for o in gc.garbage if type(o).__module__.startswith("checkpointing")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert garbage == []
    assert after - before <= 50, (before, after)
    assert not [o for o in gc.get_objects() if type(o) in (Frame, Holder)]
    for block in model:
        state = checkpointing._module._installed(block)
        assert state is not None
        assert not state.open
        assert not state.recomputing


def test_frame_module_and_input_die_with_the_graph() -> None:
    """Once backward ran and the loss is gone, nothing of the step is kept alive by the hooks."""
    model, x = _prepared("ours", depth=1), _input()
    loss = model(x * 2).sum()
    refs = [weakref.ref(o) for o in gc.get_objects() if type(o) in (Frame, Holder)]
    assert refs
    loss.backward()
    del loss
    assert [r() for r in refs if r() is not None] == []


def test_rule2_threads_share_one_hooked_module() -> None:
    """Four threads run one checkpointed module at once: each gets plain's gradients."""
    model = _prepared("ours")
    for p in model.parameters():
        p.requires_grad_(False)  # threads must not race on .grad; input gradients are compared
    model.eval()  # no dropout: threads share the global RNG
    expected = []
    reference = _stack().eval()
    for seed in range(4):
        x = _input(seed)
        reference(x).sum().backward()
        expected.append(x.grad)
    results: dict[int, torch.Tensor | None] = {}
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for _ in range(20):
                x = _input(seed)
                model(x).sum().backward()
            results[seed] = x.grad
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert_tensors_equal([results[s] for s in range(4)], expected, "threads vs plain")


def _compiled_outcome(variant: str, backend: str) -> list[torch.Tensor | None] | str:
    """Gradients of a compiled model whose blocks 1 and 3 are hooked, or the error's type."""
    torch._dynamo.reset()
    model = _prepared(variant, which=lambda i: i != 2).eval()  # eager and compiled dropout differ
    x = _input()
    try:
        torch.compile(model, backend=backend)(x).sum().backward()
    except checkpointing.CheckpointError:
        return "CheckpointError"
    except torch_checkpoint.CheckpointError:
        return "CheckpointError"
    return _grads(model, x)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
# Importing inductor (torch 2.13) reaches a torch.jit.script_method decorator inside torch.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_model_with_hooked_blocks_gives_eager_gradients(backend: str) -> None:
    """``torch.compile`` of a model with hooked blocks: while dynamo traces, each hooked block is
    torch's checkpoint region (Rule 6), so every backend gives the plain run's gradients. Torch's
    composable checkpoint compiles the block's forward between its hooks and re-runs it eagerly:
    the saved tensors differ and its determinism check raises with graph-compiling backends."""
    got = _compiled_outcome("ours", backend)
    assert not isinstance(got, str)
    reference, y = _stack().eval(), _input()
    reference(y).sum().backward()
    for a, b in zip(got, _grads(reference, y), strict=True):
        assert a is not None
        assert b is not None
        torch.testing.assert_close(a, b)
    if backend != "eager":
        assert _compiled_outcome("torch", backend) == "CheckpointError"
