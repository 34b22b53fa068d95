"""The planner on every model family (issue 43 point 1): plan, apply, three training steps.

Per family of ``hf_support.ZOO`` (tiny configs, random weights, transformers' defaults:
``use_cache`` stays True) and per budget: the planned model's gradients equal the plain run's
bitwise (dropout on, the same seeds: the plan preserves the RNG), the allocator holds no more
than the budget between forward and backward, and two calls give one plan. Then the key/value
cache rules (NOTE [Key/value caches]) one by one.

The plain run the planned one is compared with is the model with ``config.use_cache = False``:
a planned region runs its layer without the empty cache it is handed (Rule 2), as transformers'
``gradient_checkpointing_enable`` does, so its layers see the inputs of that run. The default
run's layers write their keys into the cache and read them back, and that path rounds otherwise
on some CPUs (an AMD EPYC: 73 of 84 GPT-2 gradients 1e-8 off); comparing with it was right only
where the two paths happen to round alike. Each comparison checks that both runs hand their
regions the same inputs (caches, ``use_cache``, tensors' shapes, dtypes and strides).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import pytest
import torch
import transformers
from allocator_support import allocator_step
from garbage_support import gc_disabled  # noqa: F401  (a fixture)
from hf_support import ZOO, ZooMember, tiny_llama, zoo_member
from torch import nn

import checkpointing
from checkpointing import plan_checkpointing
from checkpointing._kv_caches import drop_caches, dropping_caches, is_cache

pytestmark = pytest.mark.once

BUDGETS = (0.3, 0.5, 0.7)
STEPS = 3


def train(
    member: ZooMember,
    model: nn.Module,
    steps: int = STEPS,
    regions: list[str] | None = None,
) -> tuple[list[list[torch.Tensor | None]], list[Any]]:
    """``steps`` SGD steps of ``model`` on the member's inputs, each seeded alike; per step,
    every parameter's gradient; and what each call of a module named in ``regions`` was handed
    in the steps' forwards (``handed``; a recompute in backward is not recorded)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    seen: list[Any] = []
    forward = [False]
    modules = dict(model.named_modules())

    def note(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if forward[0]:
            seen.append((name, handed(args, kwargs)))

    handles = [
        modules[name].register_forward_pre_hook(
            lambda _m, a, k, name=name: note(name, a, k), with_kwargs=True
        )
        for name in regions or []
    ]
    try:
        for step in range(steps):
            torch.manual_seed(100 + step)
            optimizer.zero_grad(set_to_none=True)
            forward[0] = True
            loss = member.loss_fn(model(*member.args, **member.kwargs))
            forward[0] = False
            loss.backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    return grads, seen


def handed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """A region call's arguments as the comparison sees them: a cache as "cache", a tensor by
    shape, dtype and strides, None and plain values as they are; ``use_cache`` as False where
    no cache is handed (BART's encoder layers get ``use_cache`` and no cache to write)."""

    def shown(value: Any) -> Any:
        if is_cache(value):
            return "cache"
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.stride())
        if value is None or isinstance(value, bool | int | float | str):
            return value
        return type(value).__name__

    if not any(is_cache(value) for value in (*args, *kwargs.values())):
        kwargs = {**kwargs, "use_cache": False} if "use_cache" in kwargs else kwargs
    return [(str(i), shown(v)) for i, v in enumerate(args)] + [
        (name, shown(kwargs[name])) for name in sorted(kwargs)
    ]


def without_cache(model: nn.Module) -> nn.Module:
    """``model``'s twin whose layers run as a planned model's run theirs: ``use_cache`` off in
    every config it holds (T5's decoder stack has its own; a model without the setting is
    copied as it is)."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is not None:
            config.use_cache = False  # type: ignore[union-attr]
    return twin


def assert_same_handed(plain: list[Any], planned: list[Any]) -> None:
    """Both runs handed their regions the same inputs, call by call (the regions' caches and
    ``use_cache``: Rule 2's like with like)."""
    assert plain, "no region call recorded"
    assert [name for name, _ in plain] == [name for name, _ in planned]
    for (name, want), (_, got) in zip(plain, planned, strict=True):
        assert got == want, f"{name}: planned {got}, plain {want}"


def plan_of(member: ZooMember, budget: float) -> checkpointing.ActivationPlan:
    """The planner's default plan of ``member`` at ``budget``."""
    return plan_checkpointing(
        member.model,
        member.args,
        budget=budget,
        regions=member.regions,
        example_kwargs=member.kwargs,
        loss_fn=member.loss_fn,
    )


def held_bytes(member: ZooMember, model: nn.Module) -> int:
    """What the allocator holds between ``model``'s forward and backward (the loss aside)."""
    torch.manual_seed(99)
    return allocator_step(lambda: member.loss_fn(model(*member.args, **member.kwargs))).held


def unsaved_bytes(member: ZooMember, model: nn.Module) -> int:
    """The slack: what the allocator holds after a plain forward beyond every storage autograd
    saves (each once; parameters and inputs are not the step's). A few bytes per model held
    outside the saved tensors (GPT-2 and Phi 24 per block, BART and OPT 16, T5 8; 0 on the
    Llamas): held alike with and without a plan, invisible to a profile that counts saves."""
    leaves = [*model.parameters(), *model.buffers(), *member.args, *member.kwargs.values()]
    outside = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in outside:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def forward() -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return member.loss_fn(model(*member.args, **member.kwargs))

    torch.manual_seed(99)
    held = allocator_step(forward).held
    return held - sum(saved.values())


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", sorted(ZOO))
def test_zoo_plan_trains_as_the_plain_run_within_its_budget(
    family: str, budget: float, subtests: Any
) -> None:
    """Planned and applied with transformers' defaults (use_cache on): three steps' gradients
    bitwise the plain run's (use_cache off, its regions handed the same inputs), the
    allocator's held bytes within the plan's budget, and a second call gives the same plan
    (each checked on its own)."""
    member = zoo_member(family)
    twin = without_cache(member.model)
    slack = unsaved_bytes(member, twin)
    plan = plan_of(member, budget)
    again = plan_of(member, budget)
    regions = [region.name for region in plan.regions]
    plain, plain_handed = train(member, twin, regions=regions)
    plan.apply(member.model)
    try:
        held = held_bytes(member, member.model)
        planned, planned_handed = train(member, member.model, regions=regions)
    finally:
        plan.remove(member.model)
    print(
        f"ZOO {family} {budget} held={held} budget={plan.budget_bytes} kept={plan.kept_bytes} "
        f"slack={slack}"
    )
    with subtests.test("gradients"):
        assert_same_handed(plain_handed, planned_handed)
        names = [name for name, _ in member.model.named_parameters()]
        for step, (expected, got) in enumerate(zip(plain, planned, strict=True)):
            for name, a, b in zip(names, expected, got, strict=True):
                assert (a is None) == (b is None), f"step {step}, {name}\n{plan}"
                assert a is None or b is None or torch.equal(a, b), f"step {step}, {name}\n{plan}"
    with subtests.test("bytes"):
        assert 0 <= slack <= 64 * len(plan.regions), slack
        assert held <= plan.budget_bytes + slack, f"held {held}, budget {plan.budget_bytes}\n{plan}"
    # Two calls, one plan: issue 43 point 2 (helper H1's deterministic plans); this check alone
    # fails while measured times still decide the plan.
    with subtests.test("two calls give one plan"):
        assert plan.to_json() == again.to_json(), f"{plan}\n{again}"


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("family", sorted(ZOO))
def test_zoo_fewest_flops_plan_with_saves_skips_and_spans_trains_as_the_plain_run(
    family: str,
) -> None:
    """``objective="flops"`` at 0.3 (plans that keep op outputs, skip ops in replay and record
    spans where the default prefers whole regions): one step's gradients bitwise the plain
    run's, the bytes within the budget and the slack."""
    member = zoo_member(family)
    twin = without_cache(member.model)
    slack = unsaved_bytes(member, twin)
    plan = plan_checkpointing(
        member.model,
        member.args,
        budget=0.3,
        regions=member.regions,
        example_kwargs=member.kwargs,
        loss_fn=member.loss_fn,
        objective="flops",
    )
    assert any("save" in r.describe() or "skips" in r.describe() for r in plan.regions), str(plan)
    regions = [region.name for region in plan.regions]
    plain, plain_handed = train(member, twin, 1, regions)
    plan.apply(member.model)
    try:
        held = held_bytes(member, member.model)
        planned, planned_handed = train(member, member.model, 1, regions)
    finally:
        plan.remove(member.model)
    assert_same_handed(plain_handed, planned_handed)
    for expected, got in zip(plain[0], planned[0], strict=True):
        assert expected is None or got is None or torch.equal(expected, got), str(plan)
    assert held <= plan.budget_bytes + slack, f"held {held}\n{plan}"


# -- NOTE [Key/value caches] ---------------------------------------------------------------------


def test_rule5_a_cache_is_told_by_its_class_without_importing_transformers() -> None:
    """Rule 5: transformers' caches (a decoder's and an encoder-decoder's) are caches; a tensor,
    None and a class of another package that is also named Cache are not."""

    class Cache:  # a look-alike outside transformers
        pass

    assert is_cache(transformers.DynamicCache())
    assert is_cache(
        transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
    )
    assert not is_cache(Cache())
    assert not is_cache(torch.zeros(1))
    assert not is_cache(None)


def test_rule2_drop_caches_drops_positional_and_keyword_caches_while_grad_records() -> None:
    """Rule 2: with grad enabled, an empty cache handed by position (GPT-2's blocks) or by
    keyword becomes None and use_cache False; other arguments pass as they are; under no_grad
    nothing changes."""
    layer, cache, x = nn.Linear(2, 2), transformers.DynamicCache(), torch.zeros(1)
    args, kwargs = drop_caches(layer, (x, cache), {"past_key_values": cache, "use_cache": True})
    assert args[0] is x
    assert args[1] is None
    assert kwargs == {"past_key_values": None, "use_cache": False}
    assert drop_caches(layer, (x,), {"use_cache": True}) is None  # no cache: nothing to drop
    with torch.no_grad():
        assert drop_caches(layer, (x, cache), {"use_cache": True}) is None


def test_rule4_a_layer_that_only_reads_its_cache_keeps_it() -> None:
    """Rule 4: a layer declaring ``_can_checkpoint_with_cache`` keeps its cache, as under
    transformers' own checkpointing."""
    layer = nn.Linear(2, 2)
    layer._can_checkpoint_with_cache = True  # type: ignore[assignment]  # transformers' flag
    assert drop_caches(layer, (transformers.DynamicCache(),), {}) is None


def filled_cache() -> transformers.DynamicCache:
    """A cache holding three positions of one layer's keys and values."""
    cache = transformers.DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    return cache


def test_rule3_a_filled_cache_is_refused_with_the_fix() -> None:
    """Rule 3: a cache that holds positions is neither dropped (the output would change) nor
    kept (the recompute would update it twice): the region refuses it, naming the fix."""
    with pytest.raises(ValueError, match="already holds 3 positions") as raised:
        drop_caches(nn.Linear(2, 2), (), {"past_key_values": filled_cache()})
    assert "use_cache=False" in str(raised.value)
    assert "torch.no_grad()" in str(raised.value)
    with torch.no_grad():  # generation: nothing recorded, the cache passes
        assert drop_caches(nn.Linear(2, 2), (), {"past_key_values": filled_cache()}) is None


def planned_llama(budget: float = 0.3) -> tuple[transformers.PreTrainedModel, torch.Tensor, Any]:
    """A tiny Llama with use_cache on, planned at ``budget`` (untimed) and applied."""
    model = tiny_llama()
    model.config.use_cache = True
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = plan_checkpointing(model, ids, budget=budget, timing_steps=0)
    assert any(region.checkpoint for region in plan.regions), str(plan)
    plan.apply(model)
    return model, ids, plan


@pytest.mark.usefixtures("gc_disabled")
def test_rule1_a_planned_region_keeps_no_cache_alive_until_backward() -> None:
    """Rule 1: after a planned model's forward, with only the loss held, the cache the model
    made is gone (no checkpointed layer's frame keeps it), and it holds nothing: no layer wrote
    into it, so no recompute can write into it again."""
    model, ids, plan = planned_llama()
    try:
        output = model(ids)
        cache = output.past_key_values
        assert is_cache(cache)
        assert cache.get_seq_length() == 0
        loss = output.logits.square().mean()
        gone = weakref.ref(cache)
        del output, cache
        assert gone() is None
        loss.backward()
    finally:
        plan.remove(model)


def test_rule2_apply_and_remove_put_the_hook_on_every_region_and_take_it_off() -> None:
    """Rule 2: ``apply`` puts ``drop_caches`` first on every region, checkpointed or not;
    ``remove`` takes it off the model and off a deep copy of the applied model."""
    model, _ids, plan = planned_llama(0.7)
    regions = [dict(model.named_modules())[r.name] for r in plan.regions]

    def hooked(module: nn.Module) -> list[bool]:
        return [h is drop_caches for h in module._forward_pre_hooks.values()]

    assert all(hooked(m)[:1] == [True] for m in regions)
    copied = copy.deepcopy(model)
    plan.remove(model)
    assert not any(any(hooked(m)) for m in model.modules())
    plan.remove(copied)
    assert not any(any(hooked(m)) for m in copied.modules())


@pytest.mark.filterwarnings("ignore:checkpointing.ActivationPlan. the model was called with")
def test_rule3_a_planned_model_refuses_a_filled_cache_while_training() -> None:
    """Rule 3, from the installed plan: a prefix cache handed to a training step raises before
    any layer runs; under no_grad (generation) the same call runs."""
    model, ids, plan = planned_llama()
    try:
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(ids[:, :4], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="already holds 4 positions"):
            model(ids[:, 4:], past_key_values=cache, use_cache=True)
        with torch.no_grad():
            model(ids[:, 4:], past_key_values=cache, use_cache=True)
    finally:
        plan.remove(model)


def test_rule2_the_profile_runs_the_regions_without_their_caches() -> None:
    """Rule 2 while planning: ``dropping_caches`` is in force around the profiled steps, so the
    plan describes the layers without cache updates (a profiled region's ops are the installed
    region's ops), and it is off again after."""
    model = tiny_llama()
    model.config.use_cache = True
    seen: list[object] = []
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(
        lambda _m, _a, k: seen.append(k.get("past_key_values")), with_kwargs=True
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plan_checkpointing(model, ids, budget=0.5, timing_steps=0)
    assert seen
    assert all(value is None for value in seen)
    assert not any(h is drop_caches for h in layer._forward_pre_hooks.values())
    with dropping_caches([layer]):
        assert any(h is drop_caches for h in layer._forward_pre_hooks.values())
    model(ids)
    assert is_cache(seen[-1])
