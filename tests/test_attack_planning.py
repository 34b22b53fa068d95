"""Issue 26: what an outside attack found in the planner and ``checkpoint_sequential``, and the
bad inputs and untouched state of their entry points.

One test (or more) per defect; then, per public entry point
touched (``plan_checkpointing``, ``ActivationPlan.apply/remove/from_json/to_json``,
``sequential_schedule``, ``checkpoint_sequential``'s strategies), its bad inputs with the state
that must stay as it was; then a 300-step soak with ``gc`` disabled (no cyclic garbage of ours)
and two threads at once (the gradients of a single-threaded run).
"""

from __future__ import annotations

import copy
import gc
import io
import json
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from garbage_support import described, gc_disabled, ours  # noqa: F401  (gc_disabled: a fixture)
from thread_support import run_threads
from torch import nn

import checkpointing
from checkpointing import ActivationPlan, LayerCost, plan_checkpointing
from checkpointing._module import is_module_checkpointed
from checkpointing._planning.apply import installed as installed_module
from checkpointing._schedule import memory_floor

BIG: int = 1 << 40  # an "optimal" budget that holds everything: nothing is checkpointed


# --- models -------------------------------------------------------------------------------------


def blocks(depth: int = 3, width: int = 8) -> nn.Sequential:
    """``depth`` x (Linear + Tanh) blocks: the planner's regions."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)))


def with_batchnorm(depth: int = 3, width: int = 8) -> nn.Sequential:
    """``depth`` x (Linear + BatchNorm1d + Tanh) blocks, in training mode."""
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh())
            for _ in range(depth)
        )
    ).train()


class Counted(nn.Module):
    """A Linear that counts its forward calls."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x))


class Keyworded(nn.Module):
    """Blocks fed by keyword: ``x``, a ``mask`` of another shape, and an optional 0-d ``scale``
    (as Hugging Face's ``num_items_in_batch``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x * mask
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h if scale is None else h / scale


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (BatchNorm statistics, ``num_batches_tracked``), copied."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer of ``model`` equals its ``snapshot``."""
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def hooks_of(model: nn.Module) -> int:
    """How many forward hooks and pre-hooks sit anywhere in ``model``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def checkpointed(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules that ``checkpoint_module`` hooks sit on."""
    return [n for n, m in model.named_modules() if is_module_checkpointed(m)]


def planned(model: nn.Module, budget: float = 1.0) -> ActivationPlan:
    """A plan for ``blocks()``-like models (1.0: at these sizes nothing needs checkpointing)."""
    return plan_checkpointing(model, torch.randn(4, 8, requires_grad=True), budget=budget)


def edited(plan: ActivationPlan, edit: Callable[[dict[str, Any]], Any]) -> str:
    """``plan``'s JSON text after ``edit`` changed its parsed form in place."""
    data = json.loads(plan.to_json())
    edit(data)
    return json.dumps(data)


def checkpoint_all(data: dict[str, Any]) -> None:
    """Edit a parsed plan to checkpoint every region (keeping nothing inside)."""
    for region in data["regions"]:
        region["checkpoint"] = True


def grads_of(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of a step, by ``autograd.grad`` (no ``.grad`` touched)."""
    return list(torch.autograd.grad(model(x).pow(2).sum(), [x, *model.parameters()]))


# --- the defects --------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["optimal", "log", "sqrt"])
def test_sequential_schedule_leaves_batchnorm_statistics_untouched(
    strategy: str,
) -> None:
    """issue 26 defect 1: the measuring pass of ``sequential_schedule`` leaves BatchNorm's
    running statistics and ``num_batches_tracked``, ``.grad`` and the RNG as they were."""
    model, x = with_batchnorm(), torch.randn(4, 8, requires_grad=True)
    before, rng = snapshot(model), torch.get_rng_state()
    budget = BIG if strategy == "optimal" else None
    schedule = checkpointing.sequential_schedule(
        model,
        None,
        x,
        strategy=strategy,  # type: ignore[arg-type]
        budget=budget,
    )
    assert schedule.costs is not None
    assert_same_state(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert x.grad is None


def test_optimal_updates_batchnorm_once_per_step() -> None:
    """issue 26 defect 2: ``checkpoint_sequential(strategy="optimal")`` measuring its costs
    updates BatchNorm once per step, as the plain run does (nothing checkpointed here)."""
    model, x = with_batchnorm(), torch.randn(4, 8, dtype=torch.float32, requires_grad=True)
    reference = copy.deepcopy(model)
    for _ in range(3):
        checkpointing.checkpoint_sequential(
            model, input=x, use_reentrant=False, strategy="optimal", budget=BIG
        ).sum().backward()
        reference(x).sum().backward()
    for (name, mine), theirs in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    assert int(model[0][1].num_batches_tracked) == 3


def test_optimal_measures_once_per_chain_and_input_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 26 defect 2: without ``costs=``, a chain is measured once per input signature
    (shape, training mode), not on every call; a new list of the same functions hits too."""
    from checkpointing import _sequential

    calls: list[int] = []
    measure = _sequential.measure_costs

    def counted(*args: Any) -> Any:
        calls.append(1)
        return measure(*args)

    monkeypatch.setattr(_sequential, "measure_costs", counted)
    model = blocks()

    def step(batch: int, functions: Any = model) -> None:
        x = torch.randn(batch, 8, requires_grad=True)
        checkpointing.checkpoint_sequential(
            functions, input=x, use_reentrant=False, strategy="optimal", budget=BIG
        ).sum().backward()

    for _ in range(3):
        step(4)
    assert len(calls) == 1
    step(2)  # the last, smaller batch of an epoch
    step(4)
    step(2)
    step(4, list(model))
    assert len(calls) == 2
    model.eval()
    step(4)
    assert len(calls) == 3


@pytest.mark.usefixtures("gc_disabled")
def test_measured_costs_do_not_keep_the_chain_alive() -> None:
    """issue 26 defect 2: what ``checkpoint_sequential`` remembers of a chain dies with it (no
    cycle needed: with ``gc`` disabled, reference counts free it)."""
    model = blocks()
    x = torch.randn(4, 8, requires_grad=True)
    checkpointing.checkpoint_sequential(
        model, input=x, use_reentrant=False, strategy="optimal", budget=BIG
    ).sum().backward()
    modules = [weakref.ref(m) for m in model.modules()]
    del model
    assert [m() for m in modules] == [None] * len(modules)


def test_region_named_twice_is_rejected_by_from_json() -> None:
    """issue 26 defect 3: a plan JSON naming a region twice is refused when read."""
    text = edited(planned(blocks()), lambda d: d["regions"].append(d["regions"][0]))
    with pytest.raises(ValueError, match=r"region '0' appears twice \(regions\[0\] and regions"):
        ActivationPlan.from_json(text)


def test_apply_of_a_region_twice_installs_nothing() -> None:
    """issue 26 defect 3: ``apply`` of a plan naming one module twice raises before installing
    anything; the plan stays unapplied, and applies once corrected."""
    model = blocks()
    plan = ActivationPlan.from_json(edited(planned(model), checkpoint_all))
    regions = plan.regions
    plan.regions = (*regions, regions[1])
    with pytest.raises(ValueError, match=r"same Sequential module.*Nothing was installed"):
        plan.apply(model)
    assert checkpointed(model) == []
    assert hooks_of(model) == 0
    with pytest.raises(ValueError, match="not applied"):
        plan.remove(model)
    plan.regions = regions
    plan.apply(model)
    assert checkpointed(model) == ["0", "1", "2"]
    plan.remove(model)
    assert hooks_of(model) == 0


def test_apply_rolls_back_when_installing_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 26 defect 3: an error while installing removes what was installed: all or
    nothing, and a later ``apply`` works."""
    model = blocks()
    plan = ActivationPlan.from_json(edited(planned(model), checkpoint_all))
    install = installed_module.checkpoint_module
    installed: list[nn.Module] = []

    def fails_on_the_second(module: nn.Module, **options: Any) -> nn.Module:
        if installed:
            raise RuntimeError("injected")
        installed.append(module)
        return install(module, **options)

    monkeypatch.setattr(installed_module, "checkpoint_module", fails_on_the_second)
    with pytest.raises(RuntimeError, match="injected"):
        plan.apply(model)
    assert checkpointed(model) == []
    assert hooks_of(model) == 0
    monkeypatch.setattr(installed_module, "checkpoint_module", install)
    plan.apply(model)
    assert checkpointed(model) == ["0", "1", "2"]
    plan.remove(model)


def test_checkpoint_false_as_a_string_is_refused() -> None:
    """issue 26 defect 4: ``"checkpoint": "false"`` is not read as True: the error names the
    API, the field, what was expected and what came."""

    def quoted(data: dict[str, Any]) -> None:
        data["regions"][1]["checkpoint"] = "false"

    with pytest.raises(ValueError, match="from_json") as info:
        ActivationPlan.from_json(edited(planned(blocks()), quoted))
    message = str(info.value)
    for phrase in (
        "ActivationPlan.from_json",
        "regions[1].checkpoint",
        "true or false",
        "'false' of type str",
        "Fix:",
    ):
        assert phrase in message, message


def test_a_parsed_plan_is_accepted() -> None:
    """issue 26 defect 4: ``from_json`` takes the dict ``json.loads`` makes of the text (and
    bytes) as well as the text."""
    text = planned(blocks()).to_json()
    assert ActivationPlan.from_json(json.loads(text)).to_json() == text
    assert ActivationPlan.from_json(text.encode()).to_json() == text


@pytest.mark.parametrize("source", ["{", b"\xff\xfe{", "[1, 2]", '{"format": "other"}'])
def test_text_that_is_no_plan_is_a_value_error(source: str | bytes) -> None:
    """issue 26 defect 4: text that is not JSON (or not UTF-8), or JSON that is not a plan, is a
    ValueError naming ``from_json``."""
    with pytest.raises(ValueError, match=r"ActivationPlan\.from_json: not (JSON|a plan)"):
        ActivationPlan.from_json(source)


@pytest.mark.parametrize("source", [3, None, ["a plan"], object()])
def test_other_sources_are_a_clear_type_error(source: object) -> None:
    """issue 26 defect 4: neither text nor a dict: a TypeError naming ``from_json`` and what
    to pass, not json's bare TypeError."""
    with pytest.raises(TypeError, match=r"ActivationPlan\.from_json: expected the JSON text.*Fix"):
        ActivationPlan.from_json(source)  # type: ignore[arg-type]


def _set(path: tuple[Any, ...], value: object) -> Callable[[dict[str, Any]], None]:
    """An edit setting (or, with ``_DELETE``, removing) the field at ``path``."""

    def edit(data: dict[str, Any]) -> None:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return edit


_DELETE = object()
MALFORMED = {
    "budget_bytes as a string": (("budget_bytes",), "12", "budget_bytes", "non-negative integer"),
    "budget_bytes as a bool": (("budget_bytes",), True, "budget_bytes", "non-negative integer"),
    "negative bytes": (("kept_bytes",), -1, "kept_bytes", "non-negative integer"),
    "a float count": (("floor_bytes",), 1.5, "floor_bytes", "non-negative integer"),
    "time as a string": (("step_ms",), "1.0", "step_ms", "non-negative number"),
    "checkpoint as 1": (("regions", 0, "checkpoint"), 1, "regions[0].checkpoint", "true or false"),
    "name as a number": (("regions", 0, "name"), 0, "regions[0].name", "a string"),
    "save as a string": (("regions", 0, "save"), "mm", "regions[0].save", "a list"),
    "a save key without occurrence": (
        ("regions", 0, "save"),
        [["aten.mm.default"]],
        "regions[0].save[0]",
        "an [op name, occurrence] pair",
    ),
    "a negative occurrence": (
        ("regions", 0, "offload"),
        [["aten.mm.default", -1]],
        "regions[0].offload[0][1]",
        "non-negative integer",
    ),
    "a shape of strings": (("input_shapes",), [["4", 8]], "input_shapes[0][0]", "integer"),
    "a frontier point": (("frontier",), [[1]], "frontier[0]", "a [bytes, ms] pair"),
    "regions as an object": (("regions",), {}, "regions", "a list"),
    "a region as a list": (("regions", 0), [], "regions[0]", "a JSON object"),
    "a missing field": (("regions", 0, "ops"), _DELETE, "regions[0].ops is missing", "Fix"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_fields_are_named(case: str) -> None:
    """issue 26 defect 4: each malformed or missing field is a ValueError naming
    ``ActivationPlan.from_json`` and the field, never a coercion."""
    path, value, field, expected = MALFORMED[case]
    text = edited(planned(blocks()), _set(path, value))
    with pytest.raises(ValueError, match=r"ActivationPlan\.from_json") as info:
        ActivationPlan.from_json(text)
    message = str(info.value)
    assert field in message, message
    assert expected in message, message


def test_keywords_in_another_order_and_scalars_do_not_warn() -> None:
    """issue 26 defect 5: the profiled keyword tensors given in another order, and a 0-d tensor
    that changes, comes or goes, never warn "re-plan"; a real change of shape still does."""
    model = Keyworded()
    x, mask = torch.randn(4, 8, requires_grad=True), torch.rand(4, 1)
    plan = plan_checkpointing(
        model, (), example_kwargs={"x": x, "mask": mask, "scale": torch.tensor(2.0)}, budget=1.0
    )
    plan.apply(model)
    model(mask=mask, x=x, scale=torch.tensor(3.0)).sum().backward()  # a warning fails the test
    model(scale=torch.tensor(5), mask=mask, x=x).sum().backward()
    model(mask=mask, x=x).sum().backward()
    with pytest.warns(UserWarning, match="re-plan"):
        model(mask=mask[:2], x=x[:2]).sum().backward()
    plan.remove(model)


def test_zero_dim_shapes_of_an_older_plan_do_not_warn() -> None:
    """issue 26 defect 5: a plan whose JSON lists a 0-d input shape (``[]``) does not warn when
    that scalar is missing or another 0-d tensor."""
    model = blocks()
    text = edited(planned(model), lambda d: d["input_shapes"].append([]))
    plan = ActivationPlan.from_json(text)
    plan.apply(model)
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    plan.remove(model)


def _live_tensors() -> int:
    """Tensors alive after a full collection."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_optimal_keeps_no_cost_table_alive() -> None:
    """issue 26 defect 6: after ``"optimal"`` schedules on ever different (measured-like)
    costs, no tensor of the dynamic program's tables stays referenced."""
    functions = list(range(24))
    x = torch.randn(25)

    def costs(seed: int) -> tuple[LayerCost, ...]:
        return tuple(LayerCost(time=1.0 + seed + i / 7, output_bytes=100) for i in range(24))

    floor = memory_floor(costs(0), 100)
    checkpointing.sequential_schedule(
        functions, None, x, strategy="optimal", budget=2 * floor, costs=costs(0)
    )
    before = _live_tensors()
    for seed in range(1, 4):
        schedule = checkpointing.sequential_schedule(
            functions, None, x, strategy="optimal", budget=2 * floor, costs=costs(seed)
        )
        assert schedule.peak_bytes is not None
        assert schedule.peak_bytes <= 2 * floor
    assert _live_tensors() == before


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_plan_under_no_grad_profiles_with_grad(
    mode: Callable[[], Any],
) -> None:
    """issue 26 defect 9: ``plan_checkpointing`` under ``torch.no_grad()`` (or
    ``inference_mode``) plans as outside it (its profiled steps enable grad) and leaves the
    caller's mode as it was."""
    model, x = blocks(), torch.randn(4, 8, requires_grad=True)
    reference = plan_checkpointing(model, x, budget=1.0)
    with mode():
        plan = plan_checkpointing(model, x, budget=1.0)
        assert not torch.is_grad_enabled()
    assert plan.baseline_bytes == reference.baseline_bytes
    assert plan.floor_bytes == reference.floor_bytes
    assert [r.name for r in plan.regions] == [r.name for r in reference.regions]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_sequential_schedule_measures_the_same_under_no_grad(mode: Callable[[], Any]) -> None:
    """``sequential_schedule`` measures what a step keeps also when called under ``no_grad``
    or ``inference_mode`` (the bytes; times vary)."""
    model, x = blocks(), torch.randn(4, 8, requires_grad=True)

    def measured() -> list[tuple[int, int, bool, bool]]:
        costs = checkpointing.sequential_schedule(model, None, x, strategy="log").costs
        assert costs is not None
        return [(c.output_bytes, c.saved_bytes, c.keeps_input, c.keeps_output) for c in costs]

    reference = measured()
    with mode():
        assert measured() == reference


BAD_PLAN_ARGUMENTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "model not a module": (
        {"model": lambda x: x},
        ("model must be an nn.Module", "of type function", "wrap a plain function"),
    ),
    "example_kwargs a tensor": (
        {"example_kwargs": torch.randn(2)},
        ("example_kwargs must be None or a dict", "a Tensor of shape (2,)"),
    ),
    "example_kwargs a list": (
        {"example_kwargs": [torch.randn(2)]},
        ("example_kwargs must be None or a dict", "of type list"),
    ),
    "example_kwargs with a non-string key": (
        {"example_kwargs": {0: torch.randn(2)}},
        ("example_kwargs must be None or a dict", "{0: "),
    ),
    "loss_fn a number": ({"loss_fn": 3}, ("loss_fn must be None or a callable", "3 of type int")),
    "regions a number": ({"regions": 3}, ("regions must be None or a predicate", "got 3")),
    "host_budget a string": (
        {"host_budget": "8GB"},
        ("host_budget must be None or an int", "'8GB' of type str"),
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLAN_ARGUMENTS))
def test_bad_plan_arguments_fail_before_anything_runs(case: str) -> None:
    """issue 26 defect 10: a non-module model, example_kwargs that is no dict, a loss_fn or
    host_budget of the wrong type: a TypeError naming ``plan_checkpointing``, what came and the
    fix, raised before the model runs."""
    model = nn.Sequential(Counted(8), Counted(8))
    arguments: dict[str, Any] = {"model": model, "budget": 0.5, **BAD_PLAN_ARGUMENTS[case][0]}
    with pytest.raises(TypeError) as info:
        plan_checkpointing(
            arguments.pop("model"), torch.randn(2, 8, requires_grad=True), **arguments
        )
    message = str(info.value)
    for phrase in ("checkpointing.plan_checkpointing:", *BAD_PLAN_ARGUMENTS[case][1], "Fix:"):
        assert phrase in message, message
    assert [m.calls for m in model] == [0, 0]


def test_negative_host_budget_is_a_value_error() -> None:
    """issue 26 defect 10: a host budget of the right type but below 0 is a ValueError."""
    with pytest.raises(ValueError, match=r"host_budget must be None or an int >= 0.*got -1"):
        plan_checkpointing(blocks(), torch.randn(2, 8), budget=0.5, host_budget=-1)


STRATEGIES = [("torch", 2, None), ("sqrt", None, None), ("optimal", None, BIG)]


@pytest.mark.parametrize(("strategy", "segments", "budget"), STRATEGIES)
def test_a_non_callable_entry_fails_before_any_layer_runs(
    strategy: str, segments: int | None, budget: int | None
) -> None:
    """issue 26 defect 11: a non-callable entry is a TypeError naming ``checkpoint_sequential``
    and its index, raised before any layer ran (torch too raises a TypeError)."""
    layers = [Counted(), Counted(), Counted()]
    functions: list[Any] = [layers[0], 3, *layers[1:]]
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError) as info:
        checkpointing.checkpoint_sequential(
            functions,
            segments,
            x,
            use_reentrant=False,
            strategy=strategy,  # type: ignore[arg-type]
            budget=budget,
        )
    message = str(info.value)
    for phrase in ("checkpoint_sequential", "functions[1] must be callable", "3 of type int"):
        assert phrase in message, message
    assert "Nothing ran" in message
    assert "Fix:" in message
    assert [layer.calls for layer in layers] == [0, 0, 0]
    with pytest.raises(TypeError):
        tc.checkpoint_sequential(functions, 2, x, use_reentrant=False)


@pytest.mark.parametrize("functions", [nn.Linear(4, 4), torch.tanh, "ab"])
def test_a_single_function_is_a_clear_type_error(functions: Any) -> None:
    """issue 26 defect 11: a single module or function as the chain: a TypeError saying to wrap
    it in a list or an nn.Sequential (torch raises a TypeError too)."""
    x = torch.randn(2, 4, requires_grad=True)
    for call in (
        lambda: checkpointing.checkpoint_sequential(functions, 1, x, use_reentrant=False),
        lambda: checkpointing.sequential_schedule(functions, None, x, strategy="log"),
    ):
        with pytest.raises(TypeError, match=r"functions must be an nn\.Sequential or a sequence"):
            call()
    with pytest.raises(TypeError):
        tc.checkpoint_sequential(functions, 1, x, use_reentrant=False)


def test_placeholders_still_plan_without_input() -> None:
    """issue 26 defect 11: ``sequential_schedule`` without measuring runs nothing, so it still
    takes placeholders (``range(n)``); measuring them is the clear TypeError."""
    assert checkpointing.sequential_schedule(range(8), strategy="log").n_layers == 8
    with pytest.raises(TypeError, match=r"sequential_schedule: functions\[0\] must be callable"):
        checkpointing.sequential_schedule(range(8), None, torch.randn(2), strategy="log")


def _saved_round_trip(model: nn.Module) -> nn.Module:
    """``model`` through ``torch.save`` and ``torch.load`` (a whole pickled model)."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


def test_an_applied_model_pickles_and_still_works() -> None:
    """issue 26 defect 12: ``torch.save`` of a model with a plan applied (a region saving
    outputs under a selective policy, the others whole) round-trips through ``torch.load``:
    the regions stay checkpointed and give the original's gradients."""
    model = blocks().double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)

    def save_one_matmul(data: dict[str, Any]) -> None:
        checkpoint_all(data)
        data["regions"][0]["save"] = [["aten.addmm.default", 0]]

    ActivationPlan.from_json(edited(planned(blocks()), save_one_matmul)).apply(model)
    loaded = _saved_round_trip(model)
    assert checkpointed(loaded) == ["0", "1", "2"]
    for mine, theirs in zip(grads_of(loaded, x), grads_of(model, x), strict=True):
        assert torch.equal(mine, theirs)
    twice = _saved_round_trip(loaded)
    assert checkpointed(twice) == ["0", "1", "2"]


# --- bad inputs of the entry points, and the state they leave -----------------------------------


def test_plan_below_the_floor_leaves_the_model_untouched() -> None:
    """``plan_checkpointing`` refusing a budget below the floor leaves the model (BatchNorm
    statistics, ``.grad``, hooks), the input and the RNG as they were."""
    model, x = with_batchnorm(), torch.randn(4, 8, requires_grad=True)
    before, rng = snapshot(model), torch.get_rng_state()
    with pytest.raises(ValueError, match="below the smallest reachable"):
        plan_checkpointing(model, x, budget=1)
    assert_same_state(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert hooks_of(model) == 0
    assert x.grad is None
    assert all(p.grad is None for p in model.parameters())


def test_apply_to_a_model_missing_a_region_installs_nothing() -> None:
    """``apply`` to a model lacking a region raises with nothing installed; the plan applies to
    the right model afterwards."""
    plan = ActivationPlan.from_json(edited(planned(blocks()), checkpoint_all))
    small = blocks(depth=2)
    with pytest.raises(ValueError, match="has no Sequential named '2'"):
        plan.apply(small)
    assert checkpointed(small) == []
    assert hooks_of(small) == 0
    model = blocks()
    plan.apply(model)
    plan.remove(model)


def test_apply_with_a_region_taken_installs_nothing() -> None:
    """``apply`` where a later region is checkpointed already raises with none of the earlier
    regions installed."""
    model = blocks()
    plan = ActivationPlan.from_json(edited(planned(model), checkpoint_all))
    checkpointing.checkpoint_module(model[2])
    with pytest.raises(ValueError, match="region '2' is already checkpointed"):
        plan.apply(model)
    assert checkpointed(model) == ["2"]
    checkpointing.remove_checkpoint_module(model[2])
    assert hooks_of(model) == 0


def test_apply_and_remove_reject_what_is_not_their_model() -> None:
    """``apply`` of something that is not a module is a TypeError; ``remove`` from another
    model leaves the plan applied to its own."""
    model = blocks()
    plan = ActivationPlan.from_json(edited(planned(model), checkpoint_all))
    with pytest.raises(TypeError, match=r"ActivationPlan\.apply: model must be an nn\.Module"):
        plan.apply([model])  # type: ignore[arg-type]
    plan.apply(model)
    with pytest.raises(ValueError, match="not applied"):
        plan.remove(blocks())
    assert checkpointed(model) == ["0", "1", "2"]
    plan.remove(model)
    assert hooks_of(model) == 0


def test_remove_during_forward_can_be_finished_later() -> None:
    """``remove`` called from inside a checkpointed region raises; the regions it did not
    remove stay under the plan, and a later ``remove`` finishes."""
    model = blocks()
    plan = ActivationPlan.from_json(edited(planned(model), checkpoint_all))
    errors: list[BaseException] = []

    def remove_inside(_module: nn.Module, _args: Any) -> None:
        handle.remove()  # once: not again when backward re-runs the region
        try:
            plan.remove(model)
        except RuntimeError as error:
            errors.append(error)

    handle = model[0][0].register_forward_pre_hook(remove_inside)
    plan.apply(model)
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert len(errors) == 1
    assert "while the module's forward is running" in str(errors[0])
    assert checkpointed(model) == ["0"]
    plan.remove(model)
    assert hooks_of(model) == 0


def test_to_json_round_trips_through_from_json_unchanged() -> None:
    """``to_json`` writes what ``from_json`` reads back to the same text (and the strict reader
    accepts every field ``to_json`` writes)."""
    model = blocks()
    text = ActivationPlan.from_json(edited(planned(model), checkpoint_all)).to_json()
    assert ActivationPlan.from_json(text).to_json() == text


@pytest.mark.parametrize(
    ("arguments", "error", "phrase"),
    [
        ({"strategy": "fast"}, ValueError, "unknown strategy"),
        ({"strategy": "optimal"}, ValueError, "needs budget="),
        ({"strategy": "optimal", "budget": "1MB"}, TypeError, "budget must be an int"),
        ({"strategy": "optimal", "budget": 8}, ValueError, "below the floor"),
        ({"strategy": "sqrt", "budget": 8}, ValueError, "only used by strategy='optimal'"),
        ({"strategy": "optimal", "budget": BIG, "costs": [1, 2]}, ValueError, "one LayerCost"),
    ],
)
def test_bad_sequential_arguments_leave_the_chain_as_it_was(
    arguments: dict[str, Any], error: type[Exception], phrase: str
) -> None:
    """Each bad ``checkpoint_sequential`` argument raises clearly with the chain's modules
    (BatchNorm statistics), ``.grad`` and the RNG as they were (a measuring pass may have run
    for a budget below the floor; it leaves no trace)."""
    model, x = with_batchnorm(), torch.randn(4, 8, requires_grad=True)
    before, rng = snapshot(model), torch.get_rng_state()
    with pytest.raises(error, match=phrase):
        checkpointing.checkpoint_sequential(model, input=x, use_reentrant=False, **arguments)
    assert_same_state(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert x.grad is None


def test_sequential_schedule_below_the_floor_leaves_the_chain_as_it_was() -> None:
    """``sequential_schedule`` refusing a budget below the floor leaves BatchNorm as it was."""
    model, x = with_batchnorm(), torch.randn(4, 8, requires_grad=True)
    before = snapshot(model)
    with pytest.raises(ValueError, match="below the floor"):
        checkpointing.sequential_schedule(model, None, x, strategy="optimal", budget=8)
    assert_same_state(model, before)


# --- soak and threads ---------------------------------------------------------------------------

SOAK_STEPS = 300


def _soak(step: Callable[[], None]) -> list[str]:
    """The garbage of ours that ``SOAK_STEPS`` steps leave with ``gc`` disabled."""
    step()  # warm-up: the first step measures, resolves ops, fills caches
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    for _ in range(SOAK_STEPS):
        step()
    gc.collect()
    return described([o for o in gc.garbage if ours(o)])


def _soak_steps() -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, one training step) for each soaked entry point, on tiny float64 models."""
    model = blocks().double()
    plan = ActivationPlan.from_json(edited(planned(blocks()), checkpoint_all))

    def save_one_matmul(data: dict[str, Any]) -> None:
        checkpoint_all(data)
        data["regions"][1]["save"] = [["aten.addmm.default", 0]]

    selective = ActivationPlan.from_json(edited(planned(blocks()), save_one_matmul))
    selective_model = blocks().double()
    selective.apply(selective_model)
    plan.apply(model)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    chain = blocks(depth=6).double()
    costs = checkpointing.sequential_schedule(chain, None, x, strategy="log").costs
    assert costs is not None
    floor = memory_floor(costs, x.numel() * 8)

    def applied_plan() -> None:
        model(x).sum().backward()

    def selective_plan() -> None:
        selective_model(x).sum().backward()

    def optimal(given: bool) -> Callable[[], None]:
        def step() -> None:
            checkpointing.checkpoint_sequential(
                chain,
                input=x,
                use_reentrant=False,
                strategy="optimal",
                budget=floor,
                costs=costs if given else None,
            ).sum().backward()

        return step

    yield "applied plan", applied_plan
    yield "applied plan with a selective region", selective_plan
    yield "optimal with costs given", optimal(True)
    yield "optimal with measured costs", optimal(False)


@pytest.mark.usefixtures("gc_disabled")
def test_soak_300_steps_leave_no_cyclic_garbage() -> None:
    """300 steps each of applied plans and of ``"optimal"`` (costs given, or measured once)
    with ``gc`` disabled leave no reference cycle of ours behind."""
    for name, step in _soak_steps():
        garbage = _soak(step)
        assert not garbage, f"{name}: reference cycles of ours: {garbage}"
        gc.set_debug(0)
        gc.garbage.clear()


def test_two_threads_get_single_threaded_gradients() -> None:
    """Two threads at once, one running ``checkpoint_sequential(strategy="optimal")`` (measuring
    its chain the first time) and one a plan-applied model, both on shared modules, 10 steps
    each: bit for bit the gradients of the plain run."""
    chain = blocks(depth=6).double()
    model = blocks().double()
    plan = ActivationPlan.from_json(edited(planned(blocks()), checkpoint_all))
    plan.apply(model)
    inputs = [torch.randn(4, 8, dtype=torch.float64, requires_grad=True) for _ in range(10)]
    floor_run = checkpointing.sequential_schedule(chain, None, inputs[0], strategy="log")
    assert floor_run.costs is not None
    budget = memory_floor(floor_run.costs, inputs[0].numel() * 8)

    def optimal(x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint_sequential(
            chain, input=x, use_reentrant=False, strategy="optimal", budget=budget
        )

    def grads(forward: Callable[[torch.Tensor], torch.Tensor], owner: nn.Module) -> list[Any]:
        out = []
        for x in inputs:
            out.append(torch.autograd.grad(forward(x).pow(2).sum(), [x, *owner.parameters()]))
        return out

    plan.remove(model)
    reference = [grads(chain, chain), grads(model, model)]
    plan.apply(model)
    results = run_threads(
        lambda index: grads(optimal, chain) if index == 0 else grads(model, model), 2
    )
    for mine, theirs in zip(results, reference, strict=True):
        for step_mine, step_theirs in zip(mine, theirs, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(step_mine, step_theirs, strict=True))
    plan.remove(model)
