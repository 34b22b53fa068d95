"""``checkpointing.integrations.torchtitan`` against torchtitan's own configurables.

On torchtitan 0.3.0's llama3 ``debugmodel`` and deepseek_v3 ``debugmodel`` (a mixture of
experts with a router gate and shared experts), cut to 2 blocks and built with torchtitan's
eager SDPA attention instead of its compiled FlexAttention (CPU, no compiler): the same blocks
checkpointed by torchtitan's ``FullAC``/``SelectiveAC`` and by ours give bitwise the gradients
of the plain step, and ours keep no more bytes between forward and backward than theirs (NOTE
[torchtitan integration], Rule 3). Bytes are counted as unique storages: what an outer
saved-tensors hook sees autograd save outside the regions, plus the tensors alive after forward
that were not before (what the regions keep), less the output.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import re
from collections.abc import Callable
from typing import Any

import pytest
import releases
import torch
from torch import nn

releases.skip_without_torchtitan_models()

from titan_support import build, ours, theirs  # noqa: E402 (after the skip)

import checkpointing  # noqa: E402

pytestmark = [
    pytest.mark.once,
    # torchtitan's MoE routes under a float32 autocast, which CPU autocast declines, warning
    pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"),
]

FAMILIES = ("llama3", "deepseek_v3")


@pytest.fixture(scope="module", params=FAMILIES)
def base(request: pytest.FixtureRequest) -> nn.Module:
    return build(request.param)


TOKENS = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
LABELS = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(2))


def _loss(model: nn.Module) -> torch.Tensor:
    logits = model(TOKENS)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), LABELS.flatten())


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    # torchtitan's wrapper puts its module under ``_checkpoint_wrapped_module``; ours adds nothing
    return {
        name.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _live() -> dict[int, int]:
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            if storage.data_ptr():
                found[storage.data_ptr()] = storage.nbytes()
    return found


@dataclasses.dataclass
class Step:
    """One training step's kept bytes (module docstring) and gradients."""

    kept: int
    grads: dict[str, torch.Tensor]


def _step(model: nn.Module) -> Step:
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    gc.collect()
    before = _live()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model)
    after = _live()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {loss.data_ptr()}
    kept = {p: n for p, n in after.items() if p not in before} | saved
    loss.backward()
    return Step(sum(n for p, n in kept.items() if p not in skip), _grads(model))


def _applied(base: nn.Module, config: Any) -> nn.Module:
    model = copy.deepcopy(base)
    config.build().apply(model)
    return model


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert want  # a step that made no gradients compares nothing
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


PAIRS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "full": (ours.FullAC.Config, theirs.FullAC.Config),
    "op": (ours.SelectiveAC.Config, theirs.SelectiveAC.Config),
}


@pytest.fixture(scope="module")
def plain(base: nn.Module) -> Step:
    return _step(copy.deepcopy(base))


# Our selective modes warn that their saves bypass the outer hook the byte count installs (as
# torch's do, silently); the census counts those saves.
@pytest.mark.filterwarnings("ignore:A saved_tensors_hooks context:FutureWarning")
@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_matches_torchtitan(base: nn.Module, plain: Step, mode: str) -> None:
    """Rule 3: ours, torchtitan's and the unwrapped step give bitwise the same gradients; ours
    keeps at most what theirs keeps between forward and backward, both less than the plain
    step."""
    mine, titan = PAIRS[mode]
    got, want = _step(_applied(base, mine())), _step(_applied(base, titan()))
    _assert_equal(got.grads, plain.grads)
    _assert_equal(want.grads, plain.grads)
    assert got.kept <= want.kept < plain.kept, (got.kept, want.kept, plain.kept)


def test_names_are_unchanged(base: nn.Module) -> None:
    """Blocks are checkpointed in place: parameter names are the plain model's (torchtitan's
    wrapper inserts ``_checkpoint_wrapped_module``)."""
    model = _applied(base, ours.SelectiveAC.Config())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]


def test_layer_mode_checkpoints_every_kth_block() -> None:
    """Rule 2: ``selective_ac_option="2"`` recomputes the 2nd block whole, leaves the 1st."""
    base = build("llama3")
    model = _applied(base, ours.SelectiveAC.Config(selective_ac_option="2"))
    with checkpointing.saved_tensors_report(model=model) as report:
        _loss(model).backward()
    regions = set(report.regions())
    assert any("layers.1" in r for r in regions), regions
    assert not any("layers.0" in r for r in regions), regions
    _assert_equal(_grads(model), _grads_of(copy.deepcopy(base)))


def test_config_fields_are_torchtitans() -> None:
    """Rule 1: our configs carry torchtitan's fields (and ``selective_ac_option``) and are
    instances of theirs, so torchtitan's trainer takes them where it takes its own."""
    names = lambda c: [f.name for f in dataclasses.fields(c)]  # noqa: E731
    assert names(ours.FullAC.Config) == names(theirs.FullAC.Config)
    assert names(ours.SelectiveAC.Config) == [
        *names(theirs.SelectiveAC.Config),
        "selective_ac_option",
    ]
    assert isinstance(ours.SelectiveAC.Config(), theirs.SelectiveAC.Config)
    assert isinstance(ours.FullAC.Config().build(), theirs.ActivationCheckpointing)
    assert not isinstance(ours.MemoryBudgetAC.Config(), theirs.MemoryBudgetAC.Config)


def test_save_ops_are_torchtitans() -> None:
    """NOTE [Per-region policies], Rule 3: the "op" policy keeps torchtitan's op set."""
    assert set(ours.SelectiveAC.Config().build().get_save_ops()) == set(
        theirs._get_default_save_ops()
    )


def test_budget_mode_fits_its_budget_without_compile() -> None:
    """NOTE [Budget at the first step]: ``MemoryBudgetAC`` plans at the first training step, in
    eager mode; that step and the next give the plain gradients, and the planned step keeps no
    more than torchtitan's reading of the budget: half way from what full checkpointing keeps
    to what the plain step keeps (all three counted alike, the same loss)."""
    base = build("llama3")
    plain = _step(copy.deepcopy(base))
    full = _step(_applied(base, ours.FullAC.Config()))
    model = copy.deepcopy(base)
    ac = ours.MemoryBudgetAC.Config(memory_budget=0.5).build()
    ac.apply(model)
    with torch.no_grad():
        model(TOKENS)  # an evaluation forward plans nothing
    assert ac.plan is None
    _assert_equal(_grads_of(model), plain.grads)
    plan = ac.plan
    assert plan is not None
    assert plan.budget_bytes == plan.floor_bytes + (plan.baseline_bytes - plan.floor_bytes) // 2
    model.zero_grad(set_to_none=True)
    planned = _step(model)
    _assert_equal(planned.grads, plain.grads)
    # No lower bound at full checkpointing's bytes: the plan may chain blocks, which keeps
    # fewer than checkpointing each alone (NOTE [Planner solve], Rule S9).
    assert 0 < planned.kept <= full.kept + (plain.kept - full.kept) // 2, (
        full.kept,
        planned.kept,
        plain.kept,
    )


def _grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    _loss(model).backward()
    return _grads(model)


@pytest.mark.filterwarnings("ignore:A saved_tensors_hooks context:FutureWarning")
def test_keep_spans_inside_blocks_are_honoured() -> None:
    """Code inside a block that says what to keep (``keeping``) is kept under our configurables:
    the plain gradients, and more bytes kept than without the span."""
    base = build("llama3")
    plain = _grads_of(copy.deepcopy(base))
    without = _step(_applied(base, ours.FullAC.Config()))
    model = _applied(base, ours.FullAC.Config())
    for block in model.layers.values():
        ffn = block.feed_forward
        ffn.forward = checkpointing.keeping("ffn")(ffn.forward)  # kept whole, never re-run
    with_span = _step(model)
    _assert_equal(with_span.grads, plain)
    assert with_span.kept > without.kept


def test_spec_mode_delegates_to_apply_spec() -> None:
    """``SpecAC`` checkpoints what its ``apply_spec`` mapping says, by name."""
    base = build("llama3")
    model = _applied(base, ours.SpecAC.Config(spec={"layers.{-1}": "torchtitan:op"}))
    with checkpointing.saved_tensors_report(model=model) as report:
        _loss(model).backward()
    regions = set(report.regions())
    assert any("layers.1" in r for r in regions), regions
    assert not any("layers.0" in r for r in regions), regions
    with pytest.raises(ValueError, match="preserve_rng_state"):
        ours.SpecAC.Config(spec={}, preserve_rng_state=False).build().apply(copy.deepcopy(base))
    budget = ours.SpecAC.Config(spec={"layers.*": "budget:0.5"}).build()
    with pytest.raises(ValueError, match=r"'layers\.\*' has a budget.*Fix: use MemoryBudgetAC"):
        budget.apply(copy.deepcopy(base))


def test_mistakes_raise_clear_errors() -> None:
    """Each mistake names the API, what it got and the fix."""
    model = copy.deepcopy(build("llama3"))
    cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: ours._check_release("0.2.2"), ImportError, "checked against torchtitan 0.3.0"),
        (lambda: ours._check_release(None), ImportError, "pip install --no-deps torchtitan==0.3.0"),
        (
            lambda: ours.SelectiveAC.Config(selective_ac_option="two").build().apply(model),
            ValueError,
            "selective_ac_option must be 'op' or a positive whole number",
        ),
        (
            lambda: (
                ours.SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=["feed_forward"])
                .build()
                .apply(copy.deepcopy(model))
            ),
            ValueError,
            "only nn.Linear modules give a matmul shape",
        ),
        (lambda: ours.FullAC.Config().build().apply(nn.Linear(2, 2)), ValueError, "`layers`"),
        (
            lambda: ours.MemoryBudgetAC.Config(memory_budget=1.5).build().apply(model),
            ValueError,
            "memory_budget must be a number in [0, 1]",
        ),
    ]
    for call, error, phrase in cases:
        with pytest.raises(error, match=re.escape(phrase)):
            call()
