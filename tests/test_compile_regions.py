"""Under ``torch.compile`` our checkpoints are torch's region (NOTE [Compiled regions]).

Each case builds the same model twice, once checkpointed with torch's API and once with ours, and
compares them side by side in the same test: ``torch._dynamo.explain``'s graph and break counts
equal torch's; compiled gradients equal the eager run (bitwise with "eager" and "aot_eager",
close with "inductor", whose kernels differ); the bytes the compiled forward keeps for backward
are no more than torch's compiled checkpoint keeps.

Every release runs each case on at least one backend, and the backends' own handling of a region
on all three: the plain block stack, SAC's saves and ``checkpoint_sequential`` with torch's cut
(NOTE [Compile cases per release] below says which combinations CI's first stage adds).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from compile_support import BACKENDS, COMPILE_MARKS, backends_once_beyond, fresh_dynamo  # noqa: F401  (a fixture)
from torch import nn

import checkpointing
from checkpointing import _compiled
from checkpointing.policies import (
    MATMUL_OPS,
    as_context_fn,
    both,
    either,
    offload_ops,
    save_everything,
    save_matmuls,
    save_nothing,
    save_only_these_names,
    tag,
)

pytestmark = COMPILE_MARKS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) + x


class Stack(nn.Module):
    """Four blocks; ``run(block, h)`` says how each block is called."""

    def __init__(self, run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.run(block, x) if self.run is not None else block(x)
        return x.pow(2).sum()


def _counts(model: Callable[..., torch.Tensor], *inputs: Any) -> tuple[int, int]:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*inputs)
    return explanation.graph_count, explanation.graph_break_count


def _saved_bytes(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The loss of ``run()`` and the bytes of distinct storages saved for backward meanwhile."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    # With the "eager" backend a SAC region runs eagerly inside these hooks: torch 2.14+ (and
    # we, Rule 13) warn that SAC's saves bypass them; torch's region and ours alike.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "A saved_tensors_hooks context", FutureWarning)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run()
    return loss, sum(storages.values())


def _grads(model: nn.Module, run: Callable[..., torch.Tensor], x: torch.Tensor) -> list[Any]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    run(x).backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad]


def _check_side_by_side(
    ours: nn.Module, theirs: nn.Module, x: torch.Tensor, backend: str, *, plain: nn.Module
) -> None:
    """The three proofs of issue 24 for one model and one backend."""
    assert _counts(ours, x) == _counts(theirs, x)
    want = _grads(plain, plain, x)
    torch._dynamo.reset()
    compiled_ours = torch.compile(ours, backend=backend)
    got = _grads(ours, compiled_ours, x)
    for g, w in zip(got, want, strict=True):
        if backend == "inductor":
            torch.testing.assert_close(g, w)
        else:
            assert torch.equal(g, w)
    compiled_theirs = torch.compile(theirs, backend=backend)
    _, kept_ours = _saved_bytes(lambda: compiled_ours(x.detach().requires_grad_()))
    _, kept_theirs = _saved_bytes(lambda: compiled_theirs(x.detach().requires_grad_()))
    assert kept_ours <= kept_theirs


def _torch_run(**options: Any) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    return lambda block, h: torch_checkpoint.checkpoint(block, h, use_reentrant=False, **options)


def _our_run(**options: Any) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    return lambda block, h: checkpointing.checkpoint(block, h, use_reentrant=False, **options)


X = torch.randn(8, 16)


# NOTE [Compile cases per release]
# A backend receives one kind of region whichever entry point made it: dynamo traces our
# checkpoint to torch's own region (equal graph and break counts, checked on every case). So the
# backends' handling of a region (eager's run, the aot_eager partitioner, inductor's min-cut
# partitioner and kernels) is checked on all three, on every release, by the cases that reach a
# new kind of region: the plain block stack, SAC with saved matmuls, and checkpoint_sequential
# cut as torch cuts it. An entry point (the decorator, reentrant, module hooks, the wrappers, a
# plan's regions, each other sequential strategy, each name-policy combinator) runs on every
# release on one backend; its other backends are marked `once` (CI's first stage only). The
# representative is aot_eager, whose gradients must be bitwise eager's, or inductor where the
# case checks what the min-cut partitioner keeps.


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_stack_with_checkpoint_is_one_graph_as_torchs(backend: str) -> None:
    ours, theirs = Stack(_our_run()), Stack(_torch_run())
    assert _counts(ours, X) == (1, 0)
    _check_side_by_side(ours, theirs, X, backend, plain=Stack())


class DecoratedBlock(Block):
    """A block whose ``forward`` is checkpointed by the decorator form."""

    @checkpointing.checkpoint(use_reentrant=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@checkpointing.checkpoint(use_reentrant=False)
def _decorated_call(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return block(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", backends_once_beyond("aot_eager"))
def test_decorator_form_is_torchs_region(backend: str) -> None:
    """A decorated function and a decorated ``forward`` method."""
    ours, theirs = Stack(lambda block, h: _decorated_call(block, h)), Stack(_torch_run())
    _check_side_by_side(ours, theirs, X, backend, plain=Stack())
    methods = Stack()
    torch.manual_seed(0)
    methods.blocks = nn.ModuleList(DecoratedBlock() for _ in range(4))
    _check_side_by_side(methods, theirs, X, backend, plain=Stack())


@pytest.mark.parametrize("backend", backends_once_beyond("aot_eager"))
def test_reentrant_checkpoint_is_torchs_region_too(backend: str) -> None:
    """torch's checkpoint with ``use_reentrant=True`` is the same region under dynamo."""
    ours = Stack(lambda block, h: checkpointing.checkpoint(block, h, use_reentrant=True))
    theirs = Stack(lambda block, h: torch_checkpoint.checkpoint(block, h, use_reentrant=True))
    _check_side_by_side(ours, theirs, X, backend, plain=Stack())


def _torch_sac() -> Callable[[], Any]:
    """Torch's SAC saving the ops our ``save_matmuls()`` saves."""
    listed = sorted(MATMUL_OPS, key=str)
    return functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, listed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sac_save_matmuls_reaches_the_compiler(backend: str) -> None:
    """Our ``save_matmuls()`` tags the traced matmuls as torch's list policy does: same graph,
    no more kept bytes than torch's SAC keeping the same ops."""
    ours = Stack(_our_run(context_fn=as_context_fn(save_matmuls())))
    theirs = Stack(_torch_run(context_fn=_torch_sac()))
    _check_side_by_side(ours, theirs, X, backend, plain=Stack())
    if backend != "eager":  # the partitioner decides: saving matmuls keeps more than none
        _, sac = _saved_bytes(lambda: torch.compile(ours, backend=backend)(X))
        _, full = _saved_bytes(lambda: torch.compile(Stack(_our_run()), backend=backend)(X))
        assert sac > full


@pytest.mark.parametrize("backend", backends_once_beyond("aot_eager"))
def test_checkpoint_module_hooks_compile_as_torchs_region(backend: str) -> None:
    ours, theirs = Stack(), Stack(_torch_run())
    for block in ours.blocks:
        checkpointing.checkpoint_module(block)
    _check_side_by_side(ours, theirs, X, backend, plain=Stack())


@pytest.mark.parametrize("backend", backends_once_beyond("aot_eager"))
def test_checkpoint_wrapper_on_transformer_layers(backend: str) -> None:
    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            *(
                nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                for _ in range(2)
            )
        )

    plain, ours, theirs = layers(), layers(), layers()
    checkpointing.apply_activation_checkpointing(
        ours, check_fn=lambda m: isinstance(m, nn.TransformerEncoderLayer)
    )
    for i, layer in enumerate(theirs):
        theirs[i] = _TorchWrapped(layer)
    x = torch.randn(2, 5, 16)
    _check_side_by_side(_Loss(ours), _Loss(theirs), x, backend, plain=_Loss(plain))


class _Loss(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).pow(2).sum()  # type: ignore[no-any-return]


class _TorchWrapped(nn.Module):
    """torch's checkpoint around a layer (the side-by-side reference for the wrapper)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(self.layer, x, use_reentrant=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", backends_once_beyond("aot_eager"))
def test_a_plan_applied_to_a_compiled_model(backend: str) -> None:
    """``plan_checkpointing``'s per-region decisions become the compiled regions' policies."""
    model, plain = Stack(), Stack()
    x = torch.randn(64, 16, requires_grad=True)
    plan = checkpointing.plan_checkpointing(model, (x,), budget=0.5)
    plan.apply(model)
    checkpointed = [r for r in plan.regions if r.checkpoint]
    assert checkpointed  # the budget forces checkpoints
    theirs = Stack(_torch_run())
    assert _counts(model, x) == _counts(theirs, x)
    want = _grads(plain, plain, x)
    got = _grads(model, torch.compile(model, backend=backend), x)
    exact = {} if backend == "inductor" else {"rtol": 0, "atol": 0}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **exact)


def test_debug_is_said_once_and_the_region_still_compiles() -> None:
    _compiled._said.discard("debug")  # said once per process
    model = Stack(_our_run(debug=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _counts(model, X) == (1, 0)
        torch._dynamo.reset()
        torch.compile(model, backend="aot_eager")(X).backward()
    said = [
        w for w in caught if "debug=True is not supported under torch.compile" in str(w.message)
    ]
    assert len(said) == 1


def test_eager_behaviour_is_unchanged_outside_compile() -> None:
    """Outside dynamo nothing of torch's region is used: our frame runs (is_recomputing)."""
    seen: list[bool] = []

    def region(h: torch.Tensor) -> torch.Tensor:
        seen.append(checkpointing.is_recomputing())
        return h.sin()

    x = torch.randn(3, requires_grad=True)
    checkpointing.checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen == [False, True]


def test_is_recomputing_is_false_in_traced_code() -> None:
    """Traced once, the region's code serves forward and the compiler's recompute alike."""

    def region(h: torch.Tensor) -> torch.Tensor:
        return h.sin() * (2.0 if checkpointing.is_recomputing() else 1.0)

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(region, x, use_reentrant=False).sum()

    x = torch.randn(3, requires_grad=True)
    assert _counts(step, x) == (1, 0)
    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True)(x).backward()
    assert x.grad is not None
    assert torch.equal(x.grad, x.detach().cos())


# Run in CI's first stage only (the `once` marker): an optional integration on a model zoo's model,
# whose checkpoint regions the tests above already compile on every release.
@pytest.mark.once
@pytest.mark.parametrize("backend", BACKENDS)
def test_transformers_integration_on_a_tiny_llama_compiles_as_transformers_own(
    backend: str,
) -> None:
    """``integrations.transformers.enable`` under ``torch.compile``: the same graphs and breaks
    as transformers' own checkpointing (torch's), gradients equal to it, no more bytes kept."""
    transformers = pytest.importorskip("transformers")
    from checkpointing.integrations import transformers as hf_checkpointing

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )

    def model() -> Any:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train()

    ids = torch.randint(0, 64, (2, 8))

    def loss(m: Any) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

    theirs, ours = model(), model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5: the old method's name
        theirs.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": _torch_sac()}
        )
    hf_checkpointing.enable(ours, policy=save_matmuls())
    assert _counts(loss, ours) == _counts(loss, theirs)
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=backend)
    _, kept_theirs = _saved_bytes(lambda: compiled(theirs).backward())  # type: ignore[func-returns-value]
    _, kept_ours = _saved_bytes(lambda: compiled(ours).backward())  # type: ignore[func-returns-value]
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        if backend == "inductor":
            torch.testing.assert_close(a.grad, b.grad)
        else:
            assert torch.equal(a.grad, b.grad)
    assert kept_ours <= kept_theirs


class TaggedBlock(nn.Module):
    """Two matmuls of different widths; the first one's output is named "proj"."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 32) / 4)
        self.w2 = nn.Parameter(torch.randn(32, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = tag(x @ self.w1, "proj")
        return (h.relu() @ self.w2).sin()


def _tagged_stack(run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None) -> Stack:
    stack = Stack(run)
    torch.manual_seed(0)
    stack.blocks = nn.ModuleList(TaggedBlock() for _ in range(4))
    return stack


def _torch_saves_the_wide_matmul(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Torch's policy for what ``save_only_these_names("proj")`` keeps here: the 32-wide mm."""
    if op is torch.ops.aten.mm.default and args[1].shape[-1] == 32:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


_NAME_POLICIES = {
    "names": save_only_these_names("proj"),
    "either": either(save_nothing(), save_only_these_names("proj")),
    "both": both(save_everything(), save_only_these_names("proj")),
}


@pytest.mark.parametrize(
    ("backend", "policy"),
    [
        pytest.param(
            backend,
            policy,
            id=f"{backend}-{name}",
            # NOTE [Compile cases per release]: the combinators on inductor on every release.
            marks=[pytest.mark.once] if backend == "aot_eager" and name != "names" else [],
        )
        for backend in ["aot_eager", "inductor"]
        for name, policy in _NAME_POLICIES.items()
    ],
)
def test_name_policies_and_combinators_reach_the_compiler(backend: str, policy: Any) -> None:
    """A kept ``tag`` hands its decision to the tensor's producer for the partitioner too
    (``_selective`` Rule 9): the compiled step keeps what torch's SAC keeps for that matmul."""
    ours = _tagged_stack(_our_run(context_fn=as_context_fn(policy)))
    their_ctx = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, _torch_saves_the_wide_matmul
    )
    theirs = _tagged_stack(_torch_run(context_fn=their_ctx))
    _check_side_by_side(ours, theirs, X, backend, plain=_tagged_stack(None))
    _, kept_ours = _saved_bytes(lambda: torch.compile(ours, backend=backend)(X))
    full = _tagged_stack(_our_run())
    _, kept_full = _saved_bytes(lambda: torch.compile(full, backend=backend)(X))
    _, kept_theirs = _saved_bytes(lambda: torch.compile(theirs, backend=backend)(X))
    assert kept_full < kept_ours <= kept_theirs


def test_offload_answers_are_said_once_under_compile() -> None:
    _compiled._said.discard("offload")
    model = Stack(_our_run(context_fn=as_context_fn(offload_ops(torch.ops.aten.addmm))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(X).backward()
        torch._dynamo.reset()
        torch.compile(model, backend="aot_eager")(X).backward()
    said = [w for w in caught if "the compiler does not offload" in str(w.message)]
    assert len(said) == 1


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)))


_SEQUENTIAL = {
    "torch": {"segments": 4},
    "balanced": {"segments": 4},
    "sqrt": {},
    "log": {},
    "optimal": {"budget": 3000},
}


@pytest.mark.parametrize(
    ("strategy", "backend"),
    [
        pytest.param(
            strategy,
            backend,
            id=f"{strategy}-{backend}",
            # NOTE [Compile cases per release]: torch's cut on every backend, the others on
            # aot_eager, on every release.
            marks=[] if strategy == "torch" or backend == "aot_eager" else [pytest.mark.once],
        )
        for backend in BACKENDS
        for strategy in _SEQUENTIAL
    ],
)
def test_checkpoint_sequential_every_strategy_is_torchs_regions(
    strategy: str, backend: str
) -> None:
    """Non-reentrant ``checkpoint_sequential``: every strategy traces to one graph, as torch's
    ``checkpoint_sequential`` does; "optimal" with costs measured eagerly beforehand."""
    chain, plain = _chain(), _chain()
    x = torch.randn(4, 16, requires_grad=True)
    options: dict[str, Any] = dict(_SEQUENTIAL[strategy])
    if strategy == "optimal":
        schedule = checkpointing.sequential_schedule(chain, None, x, strategy="optimal", **options)
        options["costs"] = schedule.costs

    def ours(h: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint_sequential(  # type: ignore[no-any-return]
            chain, input=h, use_reentrant=False, strategy=strategy, **options
        ).sum()

    def theirs(h: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint_sequential(chain, 4, h, use_reentrant=False).sum()  # type: ignore[no-any-return]

    assert _counts(ours, x) == _counts(theirs, x) == (1, 0)
    want = _grads(plain, lambda h: plain(h).sum(), x)
    torch._dynamo.reset()
    got = _grads(chain, torch.compile(ours, backend=backend), x)
    exact = {} if backend == "inductor" else {"rtol": 0, "atol": 0}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **exact)
    if strategy == "torch":  # the same cut written with torch's checkpoint per segment
        _, kept_ours = _saved_bytes(lambda: torch.compile(ours, backend=backend)(x))
        _, kept_theirs = _saved_bytes(lambda: torch.compile(_torch_cut(chain), backend=backend)(x))
        assert kept_ours <= kept_theirs


def _torch_cut(chain: nn.Sequential) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's cut of 8 functions in 4 segments, as torch's ``checkpoint`` regions: three
    checkpointed pairs, then the last pair plainly. (Torch's ``checkpoint_sequential`` itself
    is not traced by dynamo: it runs eagerly inside an empty graph, so its compiled bytes are
    eager checkpointing's.)"""

    def run(h: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            h = torch_checkpoint.checkpoint(chain[2 * i : 2 * i + 2], h, use_reentrant=False)
        return chain[6:](h).sum()  # type: ignore[no-any-return]

    return run


def test_checkpoint_sequential_optimal_unmeasured_says_so_once_and_compiles() -> None:
    """ "optimal" without ``costs=`` cannot measure in a trace: every function is checkpointed
    on its own (the least memory), said once; still one graph, eager's gradients."""
    _compiled._said.discard("optimal")  # said once per process
    chain, plain = _chain(), _chain()
    x = torch.randn(4, 16, requires_grad=True)

    def ours(h: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint_sequential(  # type: ignore[no-any-return]
            chain, input=h, use_reentrant=False, strategy="optimal", budget=3000
        ).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _counts(ours, x) == (1, 0)
        torch._dynamo.reset()
        got = _grads(chain, torch.compile(ours, backend="aot_eager"), x)
    said = [w for w in caught if "strategy='optimal' measures the chain" in str(w.message)]
    assert len(said) == 1
    for g, w in zip(got, _grads(plain, lambda h: plain(h).sum(), x), strict=True):
        assert torch.equal(g, w)
