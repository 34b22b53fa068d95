"""How reports label and print regions: module paths and classes (NOTE [Region names]), the
per-region summary as the default printout, the per-tensor table on request, bytes in binary
units."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pytest
import torch
from hf_support import tiny_llama
from torch import nn

import checkpointing
from checkpointing import policies, saved_tensors_report
from checkpointing._regions import region_label
from checkpointing._units import format_bytes
from checkpointing.integrations import transformers as hf_checkpointing

LONG_INTEGER = re.compile(r"\d,\d{3}|\d{5,}")  # bytes printed as a long integer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


Run = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Net(nn.Module):
    """Two blocks; ``run(layer, h)`` says how each is called (a checkpoint, or plainly)."""

    def __init__(self, run: Run | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.run: Run = run or (lambda layer, h: layer(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = self.run(layer, h)
        return h


def _net(run: Run | None = None) -> Net:
    torch.manual_seed(0)
    return Net(run)


def _checkpointed(fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    return checkpointing.checkpoint(fn, *args, use_reentrant=False)


ENTRY_POINTS: dict[str, Callable[[], Net]] = {
    "checkpoint(layer, x)": lambda: _net(lambda layer, h: _checkpointed(layer, h)),
    "checkpoint(layer.forward, x)": lambda: _net(lambda layer, h: _checkpointed(layer.forward, h)),
    "checkpoint(Block.forward, layer, x)": lambda: _net(
        lambda layer, h: _checkpointed(Block.forward, layer, h)
    ),
    "checkpoint(partial(Block.forward, layer), x)": lambda: _net(
        lambda layer, h: _checkpointed(functools.partial(Block.forward, layer), h)
    ),
    "checkpoint_module": lambda: _with_each_layer(checkpointing.checkpoint_module),
    "checkpoint_wrapper": lambda: _with_each_layer(checkpointing.checkpoint_wrapper),
}


def _with_each_layer(install: Callable[[nn.Module], nn.Module | None]) -> Net:
    """The plain net with each layer checkpointed by ``install`` (in place, or replaced by what
    it returns)."""
    net = _net()
    for index, layer in enumerate(net.layers):
        installed = install(layer)
        if installed is not None:
            net.layers[index] = installed
    return net


def _both_reports(
    net: nn.Module, x: torch.Tensor, model: nn.Module | None
) -> tuple[checkpointing.SavedTensorsReport, checkpointing.SavedTensorsReport]:
    """(the report of a watched step, the report from the loss of another forward)."""
    with saved_tensors_report(model=model) as watched:
        net(x).sum().backward()
    from_loss = saved_tensors_report(net(x).sum(), model=model)
    return watched, from_loss


def _module_regions(report: checkpointing.SavedTensorsReport) -> list[str]:
    return [name for name in report.regions() if name != "(outside any region)"]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_module_regions_are_labelled_by_path_and_class(entry: str) -> None:
    """With the model given, every way of checkpointing a module labels its region by the
    module's path in the model and its class, in both report forms, rows and summary alike."""
    net = ENTRY_POINTS[entry]()
    x = torch.randn(4, 16, requires_grad=True)
    for report in _both_reports(net, x, net):
        assert _module_regions(report) == ["layers.0 (Block)", "layers.1 (Block)"], entry
        regions = {r.region for r in report.records}
        assert {"inputs of layers.1 (Block)", "layers.0 (Block)"} <= regions, entry
        assert "layers.1 (Block)" in str(report)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_without_a_model_modules_are_numbered_in_forward_order(entry: str) -> None:
    """Without the model, a module's region is labelled by its class and a number that counts
    the regions of that class in forward order, the same in both report forms."""
    net = ENTRY_POINTS[entry]()
    x = torch.randn(4, 16, requires_grad=True)
    watched, from_loss = _both_reports(net, x, None)
    assert _module_regions(watched) == _module_regions(from_loss) == ["Block #1", "Block #2"]
    first = [r for r in watched.records if r.region == "Block #1" and r.decision == "recomputed"]
    assert first[0].shape == (4, 16)  # the first block's input, recomputed in its region


def test_a_module_called_twice_keeps_one_label() -> None:
    """One module checkpointed at two calls is one region of the summary, one label."""
    net = _net()
    shared = net.layers[0]
    x = torch.randn(4, 16, requires_grad=True)
    with saved_tensors_report() as report:
        h = _checkpointed(shared, _checkpointed(shared, x))
        h.sum().backward()
    assert _module_regions(report) == ["Block #1"]
    assert report.regions()["Block #1"].recomputed > 0


def test_a_bound_method_other_than_forward_is_named() -> None:
    """``checkpoint(layer.mlp, x)`` is the layer's region, its method named after the class."""
    net = _net(lambda layer, h: h + _checkpointed(layer.mlp, h))
    x = torch.randn(4, 16, requires_grad=True)
    watched, from_loss = _both_reports(net, x, net)
    expected = ["layers.0 (Block.mlp)", "layers.1 (Block.mlp)"]
    assert _module_regions(watched) == _module_regions(from_loss) == expected
    assert _module_regions(_both_reports(net, x, None)[0]) == ["Block.mlp #1", "Block.mlp #2"]


def test_plain_functions_keep_their_qualified_name() -> None:
    """A region that runs a plain function is ``checkpoint(<qualified name>)``, a partial by its
    function's; the model given changes nothing there."""
    net = _net()

    def body(t: torch.Tensor, scale: float) -> torch.Tensor:
        return net.layers[0](t).sin() * scale

    x = torch.randn(4, 16, requires_grad=True)
    with saved_tensors_report(model=net) as report:
        h = _checkpointed(body, x, 2.0)
        h = _checkpointed(functools.partial(body, scale=3.0), h)
        h.sum().backward()
    assert _module_regions(report) == [f"checkpoint({body.__qualname__})"]


def test_a_module_outside_the_model_is_numbered() -> None:
    """A module region whose module the given model does not hold falls back to class and
    number; the model itself is labelled by its class alone."""
    net, other = _net(), Block()
    x = torch.randn(4, 16, requires_grad=True)
    with saved_tensors_report(model=net) as report:
        h = _checkpointed(net, x)
        h = _checkpointed(other, h)
        h.sum().backward()
    assert _module_regions(report) == ["Net", "Block #1"]


def test_outside_a_report_a_module_region_is_its_class() -> None:
    """Messages name a module's region by its class (no report, no path); functions as ever."""
    block = Block()
    assert region_label(block) == "Block"
    assert region_label(block.mlp) == "Block.mlp"
    assert region_label(torch.sin) == f"checkpoint({torch.sin.__qualname__})"


def test_hf_layers_are_labelled_by_path_and_class() -> None:
    """The Hugging Face integration's regions are the decoder layers, by their names in the
    model: ``model.layers.0 (LlamaDecoderLayer)``."""
    torch.manual_seed(0)
    model = tiny_llama(2)
    hf_checkpointing.enable(model)
    ids = torch.randint(0, 64, (2, 8))
    watched, from_loss = _both_reports(lambda t: model(t, labels=t).loss, ids, model)  # type: ignore[arg-type]  # a callable stands for the net
    expected = ["model.layers.0 (LlamaDecoderLayer)", "model.layers.1 (LlamaDecoderLayer)"]
    assert _module_regions(watched) == _module_regions(from_loss) == expected


def test_an_applied_plan_s_regions_are_labelled_as_the_plan_names_them() -> None:
    """The report of a planned model, given the model, labels each checkpointed region as the
    plan names it (its path, then its type)."""
    net = _net()
    x = torch.randn(64, 16, requires_grad=True)
    plan = checkpointing.plan_checkpointing(net, x, budget=0.5)
    planned = [f"{r.name} ({r.type_name})" for r in plan.regions if r.checkpoint]
    assert planned, str(plan)
    plan.apply(net)
    try:
        for report in _both_reports(net, x, net):
            assert _module_regions(report) == planned
    finally:
        plan.remove(net)


def test_selective_rows_are_in_their_region() -> None:
    """What a selective policy saves is listed in the region that saves it (not "sac"), in
    both forms; a selective context under torch's own checkpoint has no region of ours."""
    context_fn = policies.as_context_fn(policies.save_matmuls())
    net = _net(
        lambda layer, h: checkpointing.checkpoint(
            layer, h, use_reentrant=False, context_fn=context_fn
        )
    )
    x = torch.randn(4, 16, requires_grad=True)
    for report in _both_reports(net, x, net):
        saved = {(r.op, r.region) for r in report.records if r.decision == "saved"}
        assert {("addmm", "layers.0 (Block)"), ("addmm", "layers.1 (Block)")} <= saved
    with saved_tensors_report() as report:
        y = torch.utils.checkpoint.checkpoint(
            net.layers[0], x, use_reentrant=False, context_fn=context_fn
        )
        y.sum().backward()
    assert ("addmm", "sac") in {(r.op, r.region) for r in report.records}


def test_summary_is_the_default_printout_one_line_per_region() -> None:
    """``str(report)`` is the summary: a headline, one line per region (its inputs and spans
    counted in it) with tensors and bytes per decision, the totals; the per-tensor table is
    ``table()``/``detail()``, one line per row."""
    net = ENTRY_POINTS["checkpoint(layer, x)"]()
    x = torch.randn(64, 16, requires_grad=True)
    with saved_tensors_report(model=net) as report:
        net(torch.sin(x)).sum().backward()
    text = str(report)
    assert text == report.summary()
    lines = text.splitlines()
    assert lines[0].startswith(f"saved-tensor report: {len(report.records)} tensors in 3 regions")
    assert lines[1].split() == ["region", "tensors", "saved", "recomputed", "offloaded"]
    block = next(line for line in lines if line.startswith("layers.1 (Block)"))
    totals = report.regions()["layers.1 (Block)"]
    rows = [r for r in report.records if r.region.endswith("layers.1 (Block)")]
    assert totals.tensors == len(rows)
    assert totals.saved == sum(r.nbytes for r in rows if r.decision == "saved")
    assert block.split()[2:] == [
        str(totals.tensors),
        *format_bytes(totals.saved).split(),
        *format_bytes(totals.recomputed).split(),
        *format_bytes(totals.offloaded).split(),
    ]
    kept = [line for line in lines if line.startswith(("  kept: ", "  offloaded: "))]
    assert kept  # the checkpointed layers say what they kept (nothing, here)
    assert len(lines) == 3 + len(report.regions()) + len(kept) + 1 + 2 + 1  # no notes here
    detail = report.table()
    assert report.detail() == detail
    assert len(detail.splitlines()) == 3 + len(report.records) + 1 + 2
    assert all(r.region in detail for r in report.records)


@pytest.mark.parametrize("form", ["summary", "table"])
def test_printouts_show_bytes_in_binary_units(form: str) -> None:
    """No printout shows bytes as a long integer: sizes read as B, KiB, MiB."""
    net = ENTRY_POINTS["checkpoint_module"]()
    x = torch.randn(512, 16, requires_grad=True)
    with saved_tensors_report(model=net) as report:
        net(x).sum().backward()
    text = getattr(report, form)()
    printed = text.split("\nrecompute cost")[0]  # FLOPs are counts, not bytes
    assert not LONG_INTEGER.search(printed), printed
    assert format_bytes(report.activation_bytes) in text
    assert "KiB" in text


def test_plan_printout_shows_binary_units_and_names_its_kept_bytes() -> None:
    """A plan prints sizes in binary units and calls its kept bytes "activations kept", as the
    report of the applied plan calls the same number (its ``activation_bytes``)."""
    net = _net()
    x = torch.randn(64, 16, requires_grad=True)
    plan = checkpointing.plan_checkpointing(net, x, budget=0.5)
    for text in (str(plan), repr(plan)):
        assert not LONG_INTEGER.search(text), text
        assert f"{format_bytes(plan.kept_bytes)} of activations kept" in text
    assert "activations kept" in str(plan).splitlines()[1]  # the column's header
    plan.apply(net)
    try:
        torch.manual_seed(0)
        with saved_tensors_report(model=net) as report:
            net(x).sum().backward()
    finally:
        plan.remove(net)
    assert report.activation_bytes == plan.kept_bytes
    assert f"activations kept: {format_bytes(plan.kept_bytes)}" in str(report)


def test_sequential_schedule_prints_binary_units() -> None:
    """``SequentialSchedule`` prints its budget, kept and peak bytes with the same units."""
    layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    x = torch.randn(64, 16, requires_grad=True)
    schedule = checkpointing.sequential_schedule(layers, None, x, strategy="optimal", budget=30_000)
    text = str(schedule)
    assert format_bytes(30_000) in text
    assert not LONG_INTEGER.search(text), text


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (1024**2 - 1, "1.0 MiB"),  # not "1024.0 KiB"
        (5 * 1024**2 + 1024**2 // 10, "5.1 MiB"),
        (3 * 1024**3, "3.0 GiB"),
        (2 * 1024**4, "2.0 TiB"),
        (4096 * 1024**4, "4096.0 TiB"),
        (-1536, "-1.5 KiB"),
    ],
)
def test_format_bytes(size: int, text: str) -> None:
    """Exact below 1 KiB, then one decimal in the largest unit whose value is at least 1."""
    assert format_bytes(size) == text
