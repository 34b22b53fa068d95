"""Hook-based checkpointing of one module: ``checkpoint_module`` and its undo.

Owns the behaviour of torch's composable ``torch.distributed._composable.checkpoint(module)``:
a forward pre-hook starts ``_frame``'s generator (first ``next()``), the module's own forward runs,
an always-called forward hook ends it (second ``next()``). The module object, its class, its
parameter names and its ``state_dict`` keys are untouched, which is what FSDP2 (``fully_shard``)
and optimizers keyed by name need. The frame, holders, recompute and checks all belong to
``_frame``; this module only decides when the generator starts and ends.

NOTE [Module checkpoint hooks]
  Rule 1. The pre-hook runs after the pre-hooks registered before it (it sees the arguments they
          produced, as torch's does) and the forward hook runs first among forward hooks
          (``prepend=True``), so user forward hooks run outside the region, as with torch.
  Rule 2. Open generators are kept per thread on a stack: a module may be re-entered (recursion)
          and run in several threads at once; each forward hook ends the generator its own
          pre-hook started. Nothing of a finished call stays on the module.
  Rule 3. While a module is recomputed its own hooks are off, for that thread only (the region is
          already being recomputed); checkpointed children met during the re-run still checkpoint
          (NOTE [Nestable checkpoint], Rule 3).
  Rule 4. The forward hook is ``always_call=True``: an exception in forward still ends the
          generator, so the hook stack is left as found and the next step works.
  Rule 5. Options are validated when the hooks are installed, not at the first forward.
  Rule 6. Under ``torch.compile`` the region is torch's (NOTE [Compiled regions]): the hooks
          return at once while dynamo traces, and the module's ``forward`` is, while it is
          checkpointed, an instance attribute (``_CheckpointedForward``) that calls the
          module's own forward (the class's, or an instance ``forward`` set before us) and,
          while dynamo traces, hands that call to torch's checkpoint with the same options. It
          holds the module weakly (no cycle); pickling and ``copy.deepcopy`` rebuild it on the
          copy. ``remove_checkpoint_module`` puts back what was there.
  Rule 7. The planner may end a module's region early, at the start of a child it calls last
          (``end_at``: a post-norm block's final norm, NOTE [Planner measure], Rule M13): the
          child's pre-hook ends the generator the module's own pre-hook started in this call,
          and the module's forward hook then finds it ended. The recompute re-runs the module's
          forward and ends before the child (early stop, or the child's pre-hook where early
          stop is off); a call that never reaches the child ends at the module's end as usual.

Rejected: torch's ``_no_hook`` as a ``context_fn`` wrapper around the user's recompute context: it
makes every ``context_fn`` non-default, so ``debug=True`` can never be used (torch raises). We
instead hand the generator a small callable that switches the hooks off around the re-run.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any, Final

import torch
from torch import nn

from . import _compat, _compiled
from ._checkpoint import check_use_reentrant
from ._context_fn import ContextFnOrPolicy, context_fn_from
from ._determinism import metadata_fn_for
from ._errors import internal_error
from ._frame import frame_generator, stop_recompute
from ._options import CheckpointOptions, Tiling, options_of
from ._state import noop_context_fn, state_hooks_from
from ._tiling import TiledForward, check_tile_options, check_tiling, refuse_mixing

__all__ = ["checkpoint_module", "end_at", "is_module_checkpointed", "remove_checkpoint_module"]

_OPTIONS: Final = (
    "preserve_rng_state",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "respect_saved_tensors_hooks",
    "recompute_state_hooks",
    "tile",
)

_MSG_REENTRANT = (
    "use_reentrant=True is not supported in composable checkpoint. Please use "
    "torch.utils.checkpoint.checkpoint instead. (checkpointing.checkpoint_module drives the "
    "non-reentrant frame from module hooks. Fix: drop use_reentrant, or wrap the module with "
    "checkpointing.checkpoint_wrapper(module, use_reentrant=True).)"
)
_MSG_UNEXPECTED = (
    "Unexpected keyword arguments: {names}. (checkpointing.checkpoint_module accepts "
    "{allowed}. Fix: remove the others; arguments of the module's forward are passed when the "
    "module is called, not here.)"
)
_MSG_NOT_MODULE = (
    "checkpointing.{api}: expected an nn.Module, got {type_name}. Fix: pass the module itself, "
    "e.g. checkpoint_module(model.layers[0])."
)
_MSG_APPLIED_TWICE = (
    "checkpointing.checkpoint_module: {type_name} is already checkpointed by checkpoint_module. "
    "Applying it twice would checkpoint the same region inside itself. Fix: call "
    "checkpointing.remove_checkpoint_module(module) first to change its options."
)
_MSG_NOT_APPLIED = (
    "checkpointing.remove_checkpoint_module: {type_name} is not checkpointed by "
    "checkpoint_module, so there is nothing to remove. Fix: only remove what "
    "checkpoint_module(module) installed."
)
_MSG_REMOVE_IN_FORWARD = (
    "checkpointing.remove_checkpoint_module: called while the module's forward is running. "
    "Fix: remove the checkpoint between steps, not from inside the module's forward."
)


class _ModuleCheckpoint:
    """The hooks of one checkpointed module and the generators they have open (Rule 2)."""

    __slots__ = ("open", "options", "recomputing", "traced_options")

    def __init__(self, options: CheckpointOptions) -> None:
        self.options = options
        # Rule 6: what torch's region gets while dynamo traces.
        context_fn = _compiled.traceable_context_fn(options.context_fn)
        self.traced_options = dataclasses.replace(options, context_fn=context_fn)
        # Per thread, the open calls' generators; None where ``end_at`` ended one (Rule 7).
        self.open: dict[int, list[Generator[None, None, None] | None]] = {}
        self.recomputing: dict[int, int] = {}  # thread -> depth of re-runs in progress (Rule 3)

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Start the region: capture state and push the frame's hooks."""
        if _compiled.compiling():
            return  # Rule 6: the forward attribute makes the region torch's
        self._start(module, args, kwargs)

    @_compat.skip_dynamo_in_code  # pushes saved-tensor hooks: never traced
    def _start(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        thread = threading.get_ident()
        if self.recomputing.get(thread):
            return  # Rule 3
        gen = frame_generator(_Rerun(module, self), args, dict(kwargs), self.options)
        next(gen)
        self.open.setdefault(thread, []).append(gen)

    def forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """End the region: pop the frame's hooks and check the forward (Rule 4)."""
        if _compiled.compiling():
            return  # Rule 6
        self._end()

    @_compat.skip_dynamo_in_code
    def _end(self) -> None:
        thread = threading.get_ident()
        if self.recomputing.get(thread):
            return  # Rule 3
        stack = self.open.get(thread)
        if not stack:
            return  # an earlier pre-hook raised before ours ran: nothing was started
        gen = stack.pop()
        if not stack:
            del self.open[thread]  # Rule 2: nothing of a finished call stays
        if gen is not None:  # None: ended at a child's start (Rule 7)
            _finish(gen)

    def end_early(self, *_hook_args: object) -> None:
        """Rule 7: a child's pre-hook: end the region of the module's running call here."""
        if _compiled.compiling():
            return  # Rule 6
        self._end_early()

    @_compat.skip_dynamo_in_code
    def _end_early(self) -> None:
        thread = threading.get_ident()
        if self.recomputing.get(thread):
            stop_recompute()  # Rule 7: the re-run ends where the forward's region ended
        stack = self.open.get(thread)
        if not stack or stack[-1] is None:
            return  # not started, or ended at an earlier call of the child
        gen, stack[-1] = stack[-1], None
        _finish(gen)


def _finish(gen: Generator[None, None, None]) -> None:
    """The generator's second ``next()``: pop the frame's hooks and check the forward."""
    for _ in gen:
        internal_error("the frame generator yielded twice")


class _Rerun:
    """What the frame re-runs in backward: the module, with its own hooks off (Rule 3)."""

    __slots__ = ("module", "state")

    def __init__(self, module: nn.Module, state: _ModuleCheckpoint) -> None:
        self.module = module
        self.state = state

    @property
    def region_module(self) -> nn.Module:
        """The module whose region this is (NOTE [Region names], Rule 1)."""
        return self.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        recomputing = self.state.recomputing
        thread = threading.get_ident()
        recomputing[thread] = recomputing.get(thread, 0) + 1
        try:
            return self.module(*args, **kwargs)
        finally:
            depth = recomputing.pop(thread)
            if depth > 1:
                recomputing[thread] = depth - 1


class _CheckpointedForward:
    """The module's ``forward`` while it is checkpointed (Rule 6): its own forward eagerly (the
    hooks checkpoint it), torch's region around it while dynamo traces."""

    __slots__ = ("__weakref__", "module", "own", "state")

    def __init__(
        self, module: nn.Module, own: Callable[..., Any] | None, state: _ModuleCheckpoint
    ) -> None:
        self.module = weakref.ref(module)
        self.own = own  # an instance ``forward`` that was there before us, else None
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.own
        if forward is None:
            module = self.module()
            if module is None:
                internal_error("a checkpointed forward outlived its module")
            if not _compiled.compiling():
                return type(module).forward(module, *args, **kwargs)
            forward = functools.partial(type(module).forward, module)
        elif not _compiled.compiling():
            return forward(*args, **kwargs)
        return _compiled.torch_region(forward, args, kwargs, self.state.traced_options)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``torch.save(model)``) and deep-copied with the module it belongs to."""
        return (type(self), (self.module(), self.own, self.state))


def _installed(module: nn.Module) -> _ModuleCheckpoint | None:
    """The state whose hooks sit on ``module``, found through the hooks themselves (so a
    ``copy.deepcopy`` of a checkpointed module is found too)."""
    for hook in _compat.forward_pre_hooks(module):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, _ModuleCheckpoint):
            return owner
    return None


def is_module_checkpointed(module: nn.Module) -> bool:
    """Whether ``checkpoint_module`` hooks (or its tiled forward) sit on ``module``."""
    return _installed(module) is not None or isinstance(
        module.__dict__.get("forward"), TiledForward
    )


def checkpoint_module(
    module: nn.Module,
    *,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    context_fn: ContextFnOrPolicy = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    recompute_state_hooks: object = None,
    tile: Tiling | None = None,
    **unexpected: Any,
) -> nn.Module:
    """Checkpoint ``module`` through forward hooks: its activations are recomputed in backward.

    The behaviour of torch's composable ``torch.distributed._composable.checkpoint(module)``,
    on our frame: the module keeps its class, names and ``state_dict`` keys (unlike a wrapper),
    so it composes with FSDP2's ``fully_shard``, with optimizers and with checkpoints on disk.
    The options are those of non-reentrant ``checkpointing.checkpoint``; SAC policies and
    ``checkpointing.policies`` work through ``context_fn``; ``debug=True`` works (torch's
    raises). Undo with ``checkpointing.remove_checkpoint_module(module)``.

    Args:
        module: the module whose every call becomes one checkpointed region.
        use_reentrant: must be ``False``: ``True`` raises ``NotImplementedError`` (as torch).
        preserve_rng_state: as in ``checkpointing.checkpoint(..., use_reentrant=False)``, as
            are ``context_fn``, ``determinism_check``, ``debug``, ``early_stop``,
            ``respect_saved_tensors_hooks`` and ``recompute_state_hooks``.
        tile: a ``checkpointing.Tiling``: the module is position-wise along ``tile.dim`` and
            its calls run, and recompute, chunk by chunk (NOTE [Tiled regions]); its
            parameters are the region's. Its ``forward`` becomes a tiled region instead of
            hooks; modules known to mix positions (attention, batch norm) are refused.

    Returns:
        ``module`` itself.

    Example:
        >>> import torch, checkpointing
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> _ = checkpointing.checkpoint_module(block)
        >>> block(torch.randn(2, 4)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(_MSG_NOT_MODULE.format(api="checkpoint_module", type_name=type(module)))
    check_use_reentrant(use_reentrant, "checkpointing.checkpoint_module")
    if use_reentrant:
        raise NotImplementedError(_MSG_REENTRANT)
    if unexpected:
        raise ValueError(
            _MSG_UNEXPECTED.format(names=",".join(unexpected), allowed=", ".join(_OPTIONS))
        )
    context_fn = context_fn_from(context_fn, "checkpointing.checkpoint_module")
    metadata_fn_for(determinism_check)  # Rule 5: a bad value raises its ValueError now
    if is_module_checkpointed(module):
        raise ValueError(_MSG_APPLIED_TWICE.format(type_name=type(module).__name__))
    options = options_of(
        False,
        preserve_rng_state,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        respect_saved_tensors_hooks,
        recompute_state_hooks,
        tile,
        api="checkpointing.checkpoint_module",
    )
    if tile is not None:
        return _tile(module, tile, options)
    hooks = state_hooks_from(recompute_state_hooks, "checkpointing.checkpoint_module")
    state = _ModuleCheckpoint(dataclasses.replace(options, recompute_state_hooks=hooks))
    module.register_forward_pre_hook(state.pre_hook, with_kwargs=True)
    module.register_forward_hook(state.forward_hook, prepend=True, always_call=True)
    module.forward = _CheckpointedForward(module, module.__dict__.get("forward"), state)  # Rule 6
    return module


def _tile(module: nn.Module, tile: Tiling, options: CheckpointOptions) -> nn.Module:
    """``checkpoint_module(module, tile=...)``: the module's forward becomes a tiled region
    (NOTE [Tiled regions]); no hooks. Options are checked now (Rule 5); ``early_stop`` is not
    read: a tiled region recomputes each chunk whole, there is nothing to stop early."""
    api = "checkpointing.checkpoint_module"
    check_tiling(tile, api)
    check_tile_options(api, options)
    refuse_mixing(module, api)
    module.forward = TiledForward(module, module.__dict__.get("forward"), options)
    return module


def end_at(module: nn.Module, child: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Rule 7: end ``module``'s region (installed by ``checkpoint_module``) at the start of
    ``child``, a module it calls last; the handle removes the hook. For the planner."""
    state = _installed(module)
    if state is None:
        internal_error("end_at on a module that checkpoint_module has not installed")
    return child.register_forward_pre_hook(state.end_early, prepend=True)


def remove_checkpoint_module(module: nn.Module) -> nn.Module:
    """Undo ``checkpoint_module(module)``: remove its hooks; the module runs plainly again.

    Graphs built while it was checkpointed keep working (their frames do not need the hooks).
    Raises ``ValueError`` if ``module`` is not checkpointed by ``checkpoint_module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            _MSG_NOT_MODULE.format(api="remove_checkpoint_module", type_name=type(module))
        )
    tiled = module.__dict__.get("forward")
    if isinstance(tiled, TiledForward):  # tile=: only the forward to put back
        if tiled.own is None:
            del module.forward
        else:
            module.forward = tiled.own
        return module
    state = _installed(module)
    if state is None:
        raise ValueError(_MSG_NOT_APPLIED.format(type_name=type(module).__name__))
    if state.open:
        raise RuntimeError(_MSG_REMOVE_IN_FORWARD)
    _compat.remove_forward_hooks(module, state.pre_hook, state.forward_hook)
    forward = module.__dict__.get("forward")
    if isinstance(forward, _CheckpointedForward):  # Rule 6: put back what was there
        if forward.own is None:
            del module.forward
        else:
            module.forward = forward.own
    return module
