"""``torch.compile`` around code that calls our ``checkpoint``: eager's gradients, every backend.

Our ``checkpoint`` is hook-based and wrapped in ``_compat.disable_dynamo``: dynamo does not trace
into it but breaks the graph around it, compiles what comes before and after, and the
checkpointed region runs eagerly with our hooks (README, "torch.compile"). Graph breaks are
therefore expected; the tests check that gradients equal the uncompiled run and that the region
is really checkpointed (it re-runs in backward).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import checkpointing

BACKENDS = ["eager", "aot_eager", "inductor"]
# After the graph break, dynamo reads ``.grad`` of the checkpoint's (non-leaf) output while it
# wraps the inputs of the resumed graph. It means to hide the resulting warning (torch 2.13,
# ``safe_grad_filter``), but the suite's "error" filter turns it into an exception first.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
    ),
    # Importing inductor (torch 2.13) reaches a torch.jit.script_method decorator inside torch.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and leaves no compiled code behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
    """The compiled model's gradients equal eager's, and the region re-runs in backward."""
    torch.manual_seed(0)
    model = Model(use_reentrant)
    x = torch.randn(3, 4)
    want = _grads(model, model, x)
    model.recomputes = 0
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second call runs the cached compiled code
        got = _grads(model, compiled, x)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert model.recomputes == 2


def test_checkpoint_breaks_the_graph_instead_of_being_traced() -> None:
    """Dynamo reports graph breaks around ``checkpoint`` rather than tracing our hooks."""
    model = Model(use_reentrant=False)
    explanation = torch._dynamo.explain(model)(torch.randn(3, 4))
    assert explanation.graph_break_count >= 1
    assert explanation.graph_count >= 2
