"""Profiling a training step for the planner: what each op of each region costs and keeps.

Owns ``profile_step`` (one forward to warm the model up, one recorded step, one step for the
peak: the model runs three times, Rule M8) and ``tail_regions`` (the modules after the blocks,
Rule M10, found by the warm-up forward); the result, ``StepProfile``, is plain data in the
solver's terms (``step_profile``). Recording belongs to ``recorder``, the prices to ``costs``,
deciding to ``solve.solver``, the search to ``search``. See NOTE [Planner measure] in
``checkpointing._planning.measure`` for the rules it follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..._kv_caches import dropping_caches
from ..._trees import shape_storage_key, storage_key, tensors
from ..._untouched import untouched
from .costs import DeviceCosts, costs_for
from .live_bytes import step_peaks
from .recorder import _Step, record_step
from .step_profile import OpCall, RegionProfile, StepProfile, Trail, structure
from .steps import default_loss, input_shapes, plain_step, step_setting

__all__ = [
    "OpCall",
    "RegionProfile",
    "StepProfile",
    "Trail",
    "default_loss",
    "input_shapes",
    "plain_step",
    "profile_step",
    "step_setting",
    "structure",
    "tail_regions",
]


def tail_regions(
    model: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    shapes: bool = False,
) -> list[tuple[str, nn.Module]]:
    """Rule M10: the modules the model calls after its last block (a Llama's final norm and LM
    head), outermost first in call order: every call of one starts after the blocks' last call
    ended, so it is none of the blocks, inside none, and encloses none. Found by one forward
    with grad enabled (the graph dropped), the model left as found (Rule M7)."""
    starts: dict[int, int] = {}  # a module's first call, by the count of calls before it
    ends = [-1]
    count = [0]
    block_ids = {id(m) for _name, m in blocks}

    def enter(module: nn.Module, _args: Any) -> None:
        starts.setdefault(id(module), count[0])
        count[0] += 1

    def leave(module: nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in block_ids:
            ends[0] = count[0]

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    inputs = list(tensors((args, kwargs)))
    try:
        # NOTE [Key/value caches], Rule 2: the blocks run as the profile and the plan run them.
        with (
            untouched([model], inputs, values=not shapes),
            torch.enable_grad(),
            torch.inference_mode(False),
            dropping_caches(m for _, m in blocks),
        ):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    after = [
        (starts[id(m)], name, m)
        for name, m in model.named_modules()
        if name and starts.get(id(m), -1) >= ends[0] >= 0 and id(m) not in block_ids
    ]
    found: list[tuple[str, nn.Module]] = []
    for _start, name, module in sorted(after, key=lambda c: c[0]):
        if not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def profile_step(
    model: nn.Module,
    regions: Sequence[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    tail: int = 0,
    warmed: bool = False,
    costs: DeviceCosts | None = None,
    shapes: bool = False,
) -> StepProfile:
    """Record one step (after one forward that warms the model up, unless ``warmed``: the
    caller ran one, ``tail_regions``) and run one more for the peak (Rule S6): the model runs
    three times. Op prices are the cost model's (Rule M8): ``costs``, else the model's device
    class's. ``shapes``: the tensors are fake (NOTE [Planning without memory]). The model is
    left as found (Rule M7)."""
    inputs = list(tensors((args, kwargs)))
    key = shape_storage_key if shapes else storage_key
    leaves = {found for t in (*model.parameters(), *model.buffers(), *inputs) if (found := key(t))}
    wrt, device, _synchronize = step_setting(model, inputs)
    costs = costs_for(str(device)) if costs is None else costs
    # Rule M7: the profiled steps train, so grad is on whatever the caller's mode (restored after).
    # NOTE [Key/value caches], Rule 2: every region runs without the caches it is handed.
    with (
        untouched([model], inputs, values=not shapes),
        torch.enable_grad(),
        torch.inference_mode(False),
        dropping_caches(m for _, m in regions),
    ):
        if not warmed:  # first calls may build what later ones reuse (a rotary table)
            model(*args, **kwargs)
        step = record_step(model, regions, args, kwargs, loss_fn, leaves, wrt, costs, tail, shapes)
        profile = _combine(step, input_shapes(args, kwargs), str(device), costs)
        for region, (_name, module) in zip(profile.regions, regions, strict=True):
            region.grad_bytes = sum(p.nbytes for p in module.parameters() if p.requires_grad)
        peaks = step_peaks(  # Rule S6
            lambda: plain_step(model, args, kwargs, loss_fn, wrt),
            device,
            [m for _, m in regions],
            shapes,
        )
        profile.peak_bytes = peaks.step
        for region, peak in zip(profile.regions, peaks.regions, strict=False):
            region.backward_peak = peak
    return profile


_MSG_CALLS_DIFFER = (
    "checkpointing.plan_checkpointing: region {name!r} ran different op sequences in its {calls} "
    "calls of one step (call 0: {first} ops, call {index}: {other} ops), so one selective "
    "policy cannot describe it. Fix: choose regions that run the same ops on every call "
    "(regions=...)."
)


def _combine(step: _Step, shapes: list[list[int]], device: str, costs: DeviceCosts) -> StepProfile:
    """The recorded step as a ``StepProfile``: the calls of a region summed op by op."""
    for index, profile in enumerate(step.profiles):
        calls = [ops for ops, _stop, _trail in step.calls.get(index, [])]
        profile.calls = len(calls)
        if not calls:
            continue
        _check_calls_agree(profile.name, calls)
        profile.stop = max(stop for _ops, stop, _trail in step.calls[index])
        if len(calls) == 1:  # Rule M13: one call, one place to end the frame
            profile.trail = step.calls[index][0][2]
            profile.follows = step.follows.get(index) == [True]  # Rule S9
        profile.ops = [
            OpCall(
                first.op,
                first.index,
                sum(c.seconds for c in column),
                sum(c.flops for c in column),
                first.kind,
                tuple(s for c in column for s in c.storages),
                tuple(s for c in column for s in c.inputs),
                all(c.skippable for c in column),
            )
            for first, column in zip(calls[0], zip(*calls, strict=True), strict=True)
        ]
    return StepProfile(
        regions=step.profiles,
        storage_bytes=step.storage_bytes,
        outside=step.outside,
        input_shapes=shapes,
        device=device,
        step_seconds=3 * step.forward_seconds,
        policy_seconds_per_op=costs.policy_seconds_per_op,
        spans=[step.head, step.tail],
        late=step.late,
    )


def _check_calls_agree(name: str, calls: list[list[OpCall]]) -> None:
    for number, ops in enumerate(calls[1:], start=1):
        if [(c.op, c.index) for c in ops] != [(c.op, c.index) for c in calls[0]]:
            raise ValueError(
                _MSG_CALLS_DIFFER.format(
                    name=name, calls=len(calls), first=len(calls[0]), index=number, other=len(ops)
                )
            )
