"""A plan installed on a model, and taken off again: off the model ``apply`` was given, or off a
copy of it (``copy.deepcopy``, ``torch.save``/``torch.load``), which carries every hook.

Owns ``Installed`` (what ``apply`` put on the model it was given), ``ShapeCheck`` (the model's
pre-hook that warns on other input shapes, NOTE [Planner apply], Rule A2), ``DrawGuard`` (the
checkpoint of a region planned without draws, its hooks and contexts, which raise where its
recompute draws, Rule A3), ``carries`` and
``take_off`` (a plan's hooks found on any model through the hooks themselves). Choosing what to
install belongs to ``plan``, the spans' hooks to ``spans``.

NOTE [Installed plan]
  Rule 1. Every hook ``apply`` installs can be found on the model through the hooks themselves:
          the shape check and the span recorder carry the plan's mark (a string: equal in every
          copy and pickle of the plan and of the model), a region's checkpoint is
          ``checkpoint_module``'s (or a chain's, for joined regions: NOTE [Checkpoint chains],
          Rule 9), and a trail's end hook is bound to its region's checkpoint.
          So ``remove`` takes a plan off a copy of the planned model as completely as off the
          model: afterwards no hook of the plan is left on any module.
          A region planned without draws carries a ``DrawGuard`` (NOTE [Planner apply], Rule A3),
          marked the same way.
  Rule 2. ``plan_checkpointing`` refuses a model that carries a plan's hooks: profiling it
          would record that plan's spans and end its trails' frames, and measure another step
          than the fresh model's.
"""

from __future__ import annotations

import threading
import uuid
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn

from ... import _compat, _compiled
from ..._chain import ChainHandle, checkpoint_chain, end_chain_at, is_module_chained, unchain_found
from ..._determinism import debug_enabled
from ..._errors import CheckpointError
from ..._frame import NULL_CONTEXT
from ..._kv_caches import drop_caches
from ..._module import checkpoint_module, end_at, is_module_checkpointed, remove_checkpoint_module
from ..._state import (
    ContextFn,
    get_device_states,
    is_noop_context_fn,
    is_recomputing,
    noop_context_fn,
)
from ..._trees import tensors
from ..measure.steps import input_shapes
from .draws import DrawCall, guarded_replay
from .joins import Run
from .span_hooks import SpanHooks, span_hook_mark, take_off_spans

__all__ = [
    "DrawGuard",
    "Installed",
    "ShapeCheck",
    "carries",
    "install",
    "new_mark",
    "take_off",
    "take_off_found",
]

_MSG_RESHAPED = (
    "checkpointing.ActivationPlan: the model was called with input shapes {observed}, but the "
    "plan was profiled with {expected}; its bytes and times do not describe these inputs, so "
    "the budget may not hold. Fix: re-plan with plan_checkpointing(model, inputs_of_this_shape, "
    "budget=...). (Warned once per apply.)"
)


def new_mark() -> str:
    """A plan's mark (Rule 1): unique, and a string, so that copies keep it equal."""
    return uuid.uuid4().hex


class ShapeCheck:
    """The forward pre-hook ``apply`` installs on the model: Rule A2's warning, once per apply
    (not under ``no_grad``: evaluation and generation keep nothing, whatever the shapes). A
    plain object holding only the shapes and the plan's mark, so that an applied model pickles
    (``torch.save``)."""

    __slots__ = ("expected", "mark", "warned")

    def __init__(self, expected: list[list[int]], mark: str) -> None:
        self.expected = [shape for shape in expected if shape]  # 0-d ones: Rule A2
        self.mark = mark
        self.warned = False

    def __call__(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.warned or not torch.is_grad_enabled():
            return
        observed = input_shapes(args, kwargs)
        if observed != self.expected:
            self.warned = True
            warnings.warn(
                _MSG_RESHAPED.format(observed=observed, expected=self.expected),
                UserWarning,
                stacklevel=2,
            )


class DrawGuard:
    """NOTE [Planner apply], Rule A3: what watches a checkpointed region whose plan says it
    draws nothing (so its frame keeps no RNG state). It is the region's ``context_fn`` (around
    the region's selective contexts, if any): each call gets a ``DrawCall`` and a recompute
    context that raises at a random op where the call is suspect (``draws.guarded_replay``).
    Its hooks make a call suspect: they compare the CPU generator's state, and each
    accelerator's among the region's inputs, before and after each forward under grad, as
    bytes (no op runs); a generator that did not move proves that the call drew nothing (but
    inside ``torch.random.fork_rng``, which the profile sees as draws all the same), one that
    moved may be another thread's, so only the recompute's own ops decide. A plain object
    holding the region's name, the plan's mark and the region's own contexts, so that an
    applied model pickles; what it holds per thread (the running calls) is a
    ``threading.local``, gone with the thread."""

    __slots__ = ("inner", "local", "mark", "name")

    def __init__(self, name: str, mark: str, inner: ContextFn | None = None) -> None:
        self.name = name
        self.mark = mark
        self.inner = inner
        # Per thread: the call ``__call__`` made last (its forward starts next), and per running
        # call, its ``DrawCall`` and the generators' states at its start (None: unchecked).
        self.local = threading.local()

    def __reduce__(self) -> tuple[Any, ...]:
        return DrawGuard, (self.name, self.mark, self.inner)

    def install(self, module: nn.Module) -> None:
        """The hooks on ``module``, checkpointed with the guard as its ``context_fn`` and no RNG
        state; after the checkpoint's, whose pre-hook calls the guard for the call's contexts
        first."""
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)

    def remove(self, module: nn.Module) -> None:
        _compat.remove_forward_hooks(module, self.before, self.after)

    def stand_in(self) -> ContextFn:
        """What stands for the guard where its contexts cannot run: torch's compiled region
        (NOTE [Compiled regions], Rule 2; the partitioner keeps random ops' outputs itself) and
        the debug report, whose op loggers are the contexts (the hooks then check the forward
        itself, ``after``): the region's own contexts."""
        return noop_context_fn if self.inner is None else self.inner

    def __call__(self) -> tuple[Any, Any]:
        forward, replay = (NULL_CONTEXT, None) if self.inner is None else self.inner()
        call = DrawCall()
        self.local.made = call
        return forward, guarded_replay(call, replay, self.name)

    def before(self, _module: nn.Module, args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        if _compiled.compiling():
            return  # a compiled region is torch's: its partitioner keeps random ops' outputs
        local = self.local
        call: DrawCall | None = getattr(local, "made", None)
        local.made = None
        if call is None and debug_enabled(False) and not is_recomputing():
            call = _DEBUGGED  # the debug report's loggers run instead of our contexts
        checked = call is not None and torch.is_grad_enabled()
        states = _generator_states(args) if checked else None
        running: list[tuple[DrawCall | None, list[bytes] | None]] | None
        running = getattr(local, "running", None)
        if running is None:
            running = local.running = []
        running.append((call, states))

    def after(self, _module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
        if _compiled.compiling():
            return  # as ``before``: nothing was entered
        running = getattr(self.local, "running", None)
        call, states = running.pop() if running else (None, None)
        if call is None or states is None:
            return
        now = _generator_states(args, devices=len(states) > 1)
        if now == states:
            return
        if call is _DEBUGGED:  # no recompute alarm: the forward's move decides, as it can
            raise CheckpointError(_MSG_DREW_DEBUG.format(name=self.name))
        call.suspect = True  # the recompute's own ops decide (``draws.guarded_replay``)


# The call of a region under the debug report (no ``DrawCall`` made: the loggers are its
# contexts), checked by its forward alone.
_DEBUGGED: Final = DrawCall()

_MSG_DREW_DEBUG = (
    "checkpointing.ActivationPlan: region {name!r} moved the random number generator in forward "
    "under debug mode, but the plan was profiled with the region drawing none, so it keeps no "
    "RNG state and its recompute would draw other numbers (a wrong gradient). Under debug mode "
    "the region's forward is checked instead of its recompute, so another thread drawing at the "
    "same time raises this too. Typically: the model was planned in eval mode (dropout off) and "
    "trains in train mode. Fix: plan_checkpointing in the mode you train in (model.train()), "
    "then apply that plan; or debug with other threads' draws paused."
)


def _generator_states(args: tuple[Any, ...], devices: bool | None = None) -> list[bytes]:
    """The CPU generator's state, then (where ``devices``; None: where any input is on an
    accelerator) those of the accelerators the inputs live on, as bytes: no op runs, so no
    dispatch mode of the caller's sees the guard."""
    states = [_compat.storage_bytes(torch.get_rng_state())]
    if devices is None:
        devices = _on_accelerator(args)
    if devices:
        states.extend(_compat.storage_bytes(s) for s in get_device_states(*args)[1])
    return states


def _on_accelerator(args: tuple[Any, ...]) -> bool:
    """Whether a tensor among the positional inputs is on an accelerator; the containers'
    tensors are looked for only where there are containers (the common call has none)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if not arg.is_cpu and not arg.is_meta:
                return True
        elif isinstance(arg, (tuple, list, dict)):
            return any(not t.is_cpu and not t.is_meta for t in tensors(args))
    return False


@dataclass
class Installed:
    """Where a plan is installed: the model, its checkpointed regions, the shape-check hook."""

    model: weakref.ref[nn.Module]
    modules: list[nn.Module]
    hook: torch.utils.hooks.RemovableHandle
    spans: SpanHooks
    ends: list[torch.utils.hooks.RemovableHandle]
    """Rule M13: the hooks that end a region's frame at its trail."""
    caches: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    """NOTE [Key/value caches], Rule 2: every region's ``drop_caches`` pre-hook."""
    guards: list[tuple[nn.Module, DrawGuard]] = field(default_factory=list)
    """NOTE [Planner apply], Rule A3: the regions planned without draws, and their guards."""
    chains: list[ChainHandle] = field(default_factory=list)
    """NOTE [Planner apply], Rule A4: the runs of joined regions, one chain each."""

    def remove(self) -> None:
        """Every hook off; a region whose removal raises (during the model's forward) stays
        listed, so that a later call finishes."""
        while self.ends:
            self.ends.pop().remove()
        while self.caches:
            self.caches.pop().remove()
        while self.guards:
            module, guard = self.guards.pop()
            guard.remove(module)
        while self.modules:
            remove_checkpoint_module(self.modules[-1])
            self.modules.pop()
        while self.chains:
            self.chains[-1].remove()
            self.chains.pop()
        self.hook.remove()
        self.spans.remove()


def install(
    model: nn.Module,
    runs: list[Run],
    trails: list[tuple[nn.Module, nn.Module]],
    spans: tuple[nn.Module | None, tuple[nn.Module, nn.Module] | None],
    regions: list[nn.Module],
    input_shapes: list[list[int]],
    mark: str,
) -> Installed:
    """What ``ActivationPlan.apply`` installs, all or nothing (what was installed goes again if
    a later step raises): each run's checkpoint (a region alone: ``checkpoint_module``, under a
    ``DrawGuard`` where it draws nothing, Rule A3; joined regions: one chain, Rule A4), the
    trails' ends (Rule M13), every region's cache dropper (NOTE [Key/value caches], Rule 2), the
    shape check (Rule A2) and the spans' hooks (Rule M11; ``spans``: the head's end, the tail)."""
    installed: list[nn.Module] = []
    chains: list[ChainHandle] = []
    guards: list[tuple[nn.Module, DrawGuard]] = []
    ends: list[torch.utils.hooks.RemovableHandle] = []
    caches = [
        region.register_forward_pre_hook(drop_caches, with_kwargs=True, prepend=True)
        for region in regions
    ]
    try:
        for run in runs:
            if len(run) > 1:  # Rule A4: one frame for the run, its RNG state kept
                members = [module for module, _, _ in run]
                chains.append(checkpoint_chain(members, model, context_fn=run[0][1]))
                continue
            module, context_fn, decision = run[0]
            if getattr(decision, "draws", True):  # a decision pickled before the field
                checkpoint_module(module, context_fn=context_fn)
                installed.append(module)
                continue
            # Rule A3: it keeps no RNG state, so its recompute must draw nothing
            inner = None if is_noop_context_fn(context_fn) else context_fn
            guard = DrawGuard(decision.name, mark, inner)
            checkpoint_module(module, context_fn=guard, preserve_rng_state=False)
            installed.append(module)
            guard.install(module)
            guards.append((module, guard))
        for region, child in trails:  # Rule M13: before the trail's scope starts
            if is_module_checkpointed(region):
                ends.append(end_at(region, child))
            elif is_module_chained(region):  # Rule A4: the last of its run
                ends.append(end_chain_at(region, child))
        hook = model.register_forward_pre_hook(ShapeCheck(input_shapes, mark), with_kwargs=True)
        recorded = SpanHooks(model, *spans, [child for _, child in trails], mark)
    except BaseException:
        for handle in [*ends, *caches]:
            handle.remove()
        for module, guard in guards:
            guard.remove(module)
        for module in installed:
            remove_checkpoint_module(module)
        for chain in chains:
            chain.remove()
        raise
    return Installed(weakref.ref(model), installed, hook, recorded, ends, caches, guards, chains)


def _mark_of(hook: object) -> str | None:
    """The mark of the plan whose shape check or span hook ``hook`` is (None: neither)."""
    if isinstance(hook, ShapeCheck):  # one pickled before marks existed has none: ""
        return str(getattr(hook, "mark", ""))
    return span_hook_mark(hook)


def carries(model: nn.Module, mark: str | None = None) -> str | None:
    """Rule 1: the name of a module of ``model`` on which a hook of the plan marked ``mark``
    (of any plan, where None) sits ("" for the model itself); None where there is none."""
    for name, module in model.named_modules():
        for hook in _compat.forward_pre_hooks(module):
            found = _mark_of(hook)
            if found is not None and (mark is None or found == mark):
                return str(name)
    return None


def take_off(
    model: nn.Module, mark: str, regions: Iterable[str], trails: Iterable[tuple[str, str]]
) -> None:
    """Rule 1: the plan marked ``mark`` off ``model`` (a copy of the model it was applied to):
    each trail's end hook (bound to its region's checkpoint, so taken first), each checkpointed
    region's checkpoint, the shape check and the span hooks."""
    modules = dict(model.named_modules())
    for region_name, child_name in trails:
        region, child = modules.get(region_name), modules.get(child_name)
        if region is None or child is None:
            continue
        owners = [getattr(hook, "__self__", None) for hook in _compat.forward_pre_hooks(region)]
        for hook in _compat.forward_pre_hooks(child):
            if any(getattr(hook, "__self__", None) is o for o in owners if o is not None):
                _compat.remove_forward_hooks(child, hook, hook)
    for name in regions:
        module = modules.get(name)
        if module is not None and is_module_checkpointed(module):
            remove_checkpoint_module(module)
    unchain_found([modules[name] for name in regions if name in modules], model)  # Rule A4
    for hook in _compat.forward_pre_hooks(model):
        if isinstance(hook, ShapeCheck) and hook.mark == mark:
            _compat.remove_forward_hooks(model, hook, hook)
    take_off_spans(model, mark)
    for module in modules.values():  # NOTE [Key/value caches], Rule 2: on every region
        _compat.remove_forward_hooks(module, drop_caches, drop_caches)
        for hook in _compat.forward_pre_hooks(module):  # NOTE [Planner apply], Rule A3
            guard = getattr(hook, "__self__", None)
            if isinstance(guard, DrawGuard) and guard.mark == mark:
                guard.remove(module)


def take_off_found(model: nn.Module, regions: Iterable[str]) -> None:
    """Rule 1 where the plan itself is not at hand (a copy the Hugging Face integration
    ``disable``s): the hooks of every plan found on ``model`` off it, its checkpointed
    ``regions`` (module names) included, each trail's end hook before its region's checkpoint."""
    modules = dict(model.named_modules())
    marks = {
        mark
        for module in modules.values()
        for hook in _compat.forward_pre_hooks(module)
        if (mark := _mark_of(hook)) is not None
    }
    names = [name for name in regions if name in modules]
    trails = [
        (region, child)
        for region in names
        for child, module in modules.items()
        if child.startswith(f"{region}.") and _ends_frame_of(modules[region], module)
    ]
    for mark in marks or {""}:
        take_off(model, mark, names, trails)


def _ends_frame_of(region: nn.Module, child: nn.Module) -> bool:
    """Whether a pre-hook of ``child`` is bound to what checkpoints ``region`` (a trail's end)."""
    owners = [getattr(hook, "__self__", None) for hook in _compat.forward_pre_hooks(region)]
    return any(
        getattr(hook, "__self__", None) is owner
        for hook in _compat.forward_pre_hooks(child)
        for owner in owners
        if owner is not None
    )
