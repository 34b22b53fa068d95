"""``torch.compile`` around code that calls our ``checkpoint``: eager's gradients, every backend.

While dynamo traces, our ``checkpoint`` hands the region to torch's (NOTE [Compiled regions] in
checkpointing/_compiled.py; the side-by-side proofs are in test_compile_regions.py): the model
compiles to one graph, as with torch's checkpoint. Eager machinery stays out of dynamo: our SAC
modes are never traced when compiled code with graph breaks runs inside an eager region (Rule 11
of the selective cache).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from compile_support import BACKENDS, COMPILE_MARKS, fresh_dynamo  # noqa: F401  (a fixture)
from mechanism_support import StateCounter
from torch._dynamo.utils import counters

import checkpointing
from checkpointing import _compiled, create_selective_checkpoint_contexts
from checkpointing.policies import as_context_fn, save_matmuls

pytestmark = COMPILE_MARKS


class Model(torch.nn.Module):
    """A linear layer, a checkpointed block, and a head: the checkpoint sits mid-graph."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = torch.nn.Linear(4, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.out = torch.nn.Linear(8, 1)
        self.recomputes = 0

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        if checkpointing.is_recomputing():
            self.recomputes += 1
        return self.block(h)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = checkpointing.checkpoint(self._block, h, use_reentrant=self.use_reentrant)
        return self.out(h).sum()  # type: ignore[no-any-return]


def _grads(model: torch.nn.Module, run: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    x = x.clone().requires_grad_()
    run(x).backward()
    assert x.grad is not None
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad]


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_gradients_equal_eager(backend: str, use_reentrant: bool) -> None:
    """The compiled model's gradients equal eager's (where the region re-runs in backward)."""
    torch.manual_seed(0)
    model = Model(use_reentrant)
    x = torch.randn(3, 4)
    want = _grads(model, model, x)
    assert model.recomputes == 1  # eagerly, our frame re-runs the region
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second call runs the cached compiled code
        got = _grads(model, compiled, x)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_is_traced_as_torchs_region(use_reentrant: bool) -> None:
    """Dynamo captures the region in one graph, with no break, as it does torch's checkpoint."""
    model = Model(use_reentrant=use_reentrant)
    explanation = torch._dynamo.explain(model)(torch.randn(3, 4))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)


# --- Selective checkpointing: our dispatch modes stay out of dynamo (NOTE [Selective checkpoint
# cache], Rule 11, in checkpointing/_selective/forward.py) --------------------------------------


def _sac_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Matmuls (kept by ``save_matmuls``) between elementwise ops (recomputed)."""
    return ((x @ w).sin() @ w).cos()


def _breaking(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A function that dynamo splits in two: ``bool()`` of a tensor and a NumPy round trip run
    eagerly between the graphs, as ops that reach whatever dispatch mode is active."""
    h = (x @ w).sin()
    if h.sum() > 0:
        h = h * 2
    h = h + torch.from_numpy(h.detach().numpy().copy())
    return (h @ w).cos()


def _frames_converted(run: Callable[[], object]) -> int:
    """How many Python frames dynamo was handed while ``run`` ran, from a fresh start."""
    torch._dynamo.reset()
    counters.clear()
    run()
    return int(counters["frames"]["total"])


def _sac_grads(fn: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
    fn().sum().backward()
    grads = [t.grad.clone() for t in inputs if t.grad is not None]
    for t in inputs:
        t.grad = None
    return grads


@pytest.mark.parametrize("backend", BACKENDS)
def test_rule11_compiled_code_with_graph_breaks_inside_sac_never_traces_our_modes(
    backend: str,
) -> None:
    """A compiled function that breaks its graph, run inside our SAC region: gradients equal
    eager's and dynamo is handed exactly the frames it gets outside SAC (our modes'
    ``__torch_dispatch__`` and the policy are kept out, as torch's wrapper would)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    want = _sac_grads(lambda: _breaking(x, w), x, w)
    compiled = torch.compile(_breaking, backend=backend)
    context_fn = as_context_fn(save_matmuls())
    got: list[list[torch.Tensor]] = []

    def inside_sac() -> None:
        got.append(
            _sac_grads(
                lambda: checkpointing.checkpoint(
                    compiled, x, w, use_reentrant=False, context_fn=context_fn
                ),
                x,
                w,
            )
        )

    outside = _frames_converted(lambda: _sac_grads(lambda: compiled(x, w), x, w))
    inside = _frames_converted(inside_sac)
    assert outside >= 2  # the graph break really happened
    assert inside == outside
    for g, e in zip(got[0], want, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rule11_our_sac_contexts_in_torch_checkpoint_inside_torch_compile(backend: str) -> None:
    """Our contexts handed to torch's own checkpoint inside a compiled function (where torch
    traces them, Rule 9): every backend gives eager's gradients from one frame, one graph."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    want = _sac_grads(lambda: _sac_block(x, w), x, w)
    context_fn = as_context_fn(save_matmuls())

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(
            _sac_block, x, w, use_reentrant=False, context_fn=context_fn
        )

    compiled = torch.compile(step, backend=backend)
    got: list[list[torch.Tensor]] = []
    assert _frames_converted(lambda: got.append(_sac_grads(lambda: compiled(x, w), x, w))) == 1
    assert counters["stats"]["unique_graphs"] == 1
    for g, e in zip(got[0], want, strict=True):
        torch.testing.assert_close(g, e)


def test_rule11_our_modes_opt_out_of_torchs_per_op_wrapper() -> None:
    """Our modes' ``__torch_dispatch__`` is the plain function (no ``torch._disable_dynamo``
    wrapper, which would show as ``__wrapped__``); torch's own SAC mode keeps the wrapper."""
    forward, recompute = create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
    for mode in (forward, recompute):
        assert not hasattr(type(mode).__torch_dispatch__, "__wrapped__")
    theirs, _ = torch_checkpoint.create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
    assert hasattr(type(theirs).__torch_dispatch__, "__wrapped__")


def _broken_region(counter: StateCounter, seen: list[bool], x: torch.Tensor) -> torch.Tensor:
    """Advances the counter, breaks dynamo's graph, and notes ``is_recomputing()``."""
    counter.n += 1
    h = torch.tanh(x * counter.n)
    torch._dynamo.graph_break()
    seen.append(checkpointing.is_recomputing())
    return h.sin()


def _step_with_a_broken_region(
    compiled: bool, use_reentrant: bool
) -> tuple[torch.Tensor, list[bool], int]:
    """The input's gradient, what the region saw of ``is_recomputing()``, the final count."""
    counter, seen = StateCounter(), []
    x = torch.linspace(-1, 1, 6, requires_grad=True)

    def step(t: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(
            _broken_region,
            counter,
            seen,
            t,
            use_reentrant=use_reentrant,
            recompute_state_hooks=[counter],
        )

    run = torch.compile(step, backend="eager") if compiled else step
    run(x).sum().backward()
    assert x.grad is not None
    return x.grad, seen, counter.n


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_rule7_graph_break_in_a_region_restores_state_hooks_and_is_recomputing(
    use_reentrant: bool,
) -> None:
    """NOTE [Compiled regions], Rule 7 (issue 40, item 4): a graph break inside a region makes
    torch's eager checkpoint run it; its recompute sees the forward's user state (gradients
    equal the plain run's) and ``is_recomputing()`` is true there; the once-only message says
    so instead of claiming that no Python re-runs."""
    want, eager_seen, eager_n = _step_with_a_broken_region(False, use_reentrant)
    _compiled._said.discard("state hooks")  # said once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, compiled_seen, compiled_n = _step_with_a_broken_region(True, use_reentrant)
    said = [str(w.message) for w in caught if "recompute_state_hooks" in str(w.message)]
    assert len(said) == 1
    assert "a region with a graph break inside runs eagerly, and there they are restored" in said[0]
    assert torch.equal(got, want)
    assert compiled_seen == eager_seen == [False, True]
    assert compiled_n == eager_n == 1
