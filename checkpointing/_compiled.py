"""Checkpoints under ``torch.compile``: while dynamo traces, our regions become torch's.

Owns what every checkpoint entry point does when dynamo is tracing it: hand the region to torch's
public ``torch.utils.checkpoint.checkpoint``, which dynamo captures as its activation-checkpoint
higher-order op (the compiler then plans the recompute inside one graph), with our options
translated. Eager checkpointing belongs to ``_checkpoint`` and ``_frame``; module hooks to
``_module``.

NOTE [Compiled regions]
  Rule 1. The test is ``torch.compiler.is_dynamo_compiling()``: a constant ``True`` while dynamo
          traces (it then inlines our entry point and takes this branch), a plain ``False``
          otherwise (about 50 ns per eager call). Nothing here runs eagerly.
  Rule 2. Torch is handed the options the caller gave, as the caller's own call of torch's
          checkpoint would: an option at torch's default (``use_reentrant=None``,
          ``preserve_rng_state=True``, ``determinism_check="default"``, ``early_stop=True``,
          ``respect_saved_tensors_hooks=None``, no ``context_fn``) is left out, so dynamo's
          graph is the one torch's own call gives (the HOP's keyword arguments appear in its
          text). The compiled region is non-reentrant, RNG-functionalized and never stops early,
          whatever they say, as for torch's own. A ``context_fn`` of ours
          (``create_selective_checkpoint_contexts``, ``checkpointing.policies``, a plan's keep
          lists) goes over as is: under AOTAutograd our modes tag the traced nodes with torch's
          policy members (``_selective`` Rule 9), which is what the partitioner reads. A plan's
          draw guard (NOTE [Planner apply], Rule A3) goes over as what its ``stand_in()``
          gives: the region's own contexts, or none.
          ``respect_saved_tensors_hooks`` goes over only where torch has it (2.14+).
  Rule 3. What the compiler cannot honour is said once per process, at trace time, never
          silently dropped: ``debug=True`` (the region compiles without it) and a policy's
          offload answer (the partitioner keeps that output on the device, as for torch's own
          SAC; ``_selective`` Rule 9 says it while AOTAutograd traces). In dynamo's trace the
          message comes from a function dynamo runs at trace time and treats as constant
          (``torch.compiler.assume_constant_result``), so the graph does not break for it. The
          scope (``gradient_checkpoint_scope``) is not translated: dynamo cannot enter its block,
          so the frame that opens it runs eagerly with the scope in effect (README).
  Rule 4. ``is_recomputing()`` is ``False`` in traced code: the compiled code is traced once and
          serves forward and the compiler's recompute alike.
  Rule 5. ``checkpoint_sequential``'s schedules are plain Python on constants and are traced
          (every strategy gives torch's graph and break counts), except what needs the running
          machine: an input's bytes come from its shape (not its storage), and
          ``strategy="optimal"`` without ``costs=`` cannot measure the chain, so it checkpoints
          every function on its own (the least memory) and says so once.
  Rule 6. A kept span (``checkpointing.keep``, NOTE [Kept spans]) becomes the partitioner's
          "must save" for its nodes: dynamo inlines the span, and when AOTAutograd traces it a
          wrapper marks every node the span added that sits in a checkpointed region (it
          carries torch's ``recompute`` tag) ``MUST_SAVE``. Outside a region the nodes are left
          as they are, as eager ``keep`` is a plain call there. The span's arguments are made
          before it, so they stay the partitioner's to recompute (NOTE [Kept spans], Rule 2):
          the compiled step keeps what torch's selective checkpoint answering ``MUST_SAVE`` for
          the span's ops keeps ("aot_eager" and "inductor"; tests/test_keep_compile.py). With
          the "eager" backend nothing is traced by AOTAutograd: torch's region runs eagerly and
          recomputes the span with the rest of the region. A ``with keeping():`` block is not
          a function to hand over, so it is traced as part of the plain region.
          ``recompute_state_hooks`` have nothing to restore in a compiled region (no Python
          re-runs) and are said once.
  Rule 7. A graph break inside the region makes dynamo run torch's eager checkpoint on the
          function instead (dynamo off inside it): the function then runs as Python, once in
          forward and again in each recompute. Torch is handed the function wrapped
          (``_EagerFallback``): traced, the wrapper only calls it (the graph is unchanged); run
          eagerly, its first call is the forward (it snapshots the ``recompute_state_hooks``)
          and every later one is torch's recompute, run with ``is_recomputing()`` true and the
          hooks restored to the forward's state, the caller's put back afterwards, as our eager
          checkpoint does (NOTE [Nestable checkpoint], Rule 12).
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any, Final

import torch
import torch.utils.checkpoint as _torch_checkpoint

from . import _compat
from ._options import CheckpointOptions
from ._state import (
    ContextFn,
    RecomputeStateHook,
    is_noop_context_fn,
    marked_as_recompute,
    state_hooks_from,
)

__all__ = ["compiling", "kept_region", "say_once", "torch_region", "traceable_context_fn"]

compiling: Final = torch.compiler.is_dynamo_compiling

# Torch 2.14 added the option; earlier releases' checkpoint would pass it to the function.
_TORCH_HAS_RESPECT: Final = (
    "respect_saved_tensors_hooks" in inspect.signature(_torch_checkpoint.checkpoint).parameters
)

_MSG_DEBUG = (
    "checkpointing: debug=True is not supported under torch.compile; the checkpointed region "
    "compiles without it (this is said once). Fix: to debug a nondeterministic recompute, run "
    "the model eagerly with debug=True, or drop debug=True from the compiled model."
)

_MSG_OFFLOAD = (
    "checkpointing: a selective-checkpoint policy answered an offload policy "
    "(MUST_CPU_OFFLOAD/PREFER_CPU_OFFLOAD) under torch.compile; the compiler does not offload on "
    "a policy's answer and keeps that output on the device, as with torch's own selective "
    "checkpoint (this is said once). Fix: to offload to host memory, run the checkpointed "
    "region eagerly (wrap the call in torch.compiler.disable), or answer MUST_SAVE to keep it."
)
_MSG_OPTIMAL = (
    "checkpointing.checkpoint_sequential: strategy='optimal' measures the chain, which cannot "
    "run while torch.compile traces; the compiled chain checkpoints every function on its own "
    "(the least memory, more recompute than the optimal schedule; this is said once). Fix: "
    "measure once eagerly and pass the result: schedule = checkpointing.sequential_schedule("
    "functions, None, x, strategy='optimal', budget=...), then strategy=schedule (or "
    "costs=schedule.costs)."
)
_MSG_STATE_HOOKS = (
    "checkpointing: recompute_state_hooks are not used where torch.compile captures a "
    "checkpointed region whole: its recompute is compiled code that runs no Python, so there is "
    "no user state to restore; a region with a graph break inside runs eagerly, and there they "
    "are restored as in eager mode (this is said once). Fix: nothing, if the state only feeds "
    "Python code; a custom random kernel whose seed comes from such state should draw through "
    "torch's generators under compile."
)
_MSG_KEPT_OFFLOAD = (
    "checkpointing.keeping: an offload policy (MUST_CPU_OFFLOAD/PREFER_CPU_OFFLOAD) on a kept "
    "span under torch.compile; the compiler does not offload, so the span's tensors are kept on "
    "the device (this is said once). Fix: to offload to host memory, run the checkpointed region "
    "eagerly (wrap the call in torch.compiler.disable), or keep the span with the default policy."
)
_MSG_COMPRESS = (
    "checkpointing: a Compress decision (a policy's answer, or keeping(compress=...)) under "
    "torch.compile; the compiler does not compress, and keeps those tensors on the device "
    "uncompressed (this is said once). Fix: to keep them compressed, run the checkpointed "
    "region eagerly (wrap the call in torch.compiler.disable), or keep them exactly."
)
_MESSAGES: Final = {
    "debug": _MSG_DEBUG,
    "offload": _MSG_OFFLOAD,
    "compress": _MSG_COMPRESS,
    "optimal": _MSG_OPTIMAL,
    "state hooks": _MSG_STATE_HOOKS,
    "kept offload": _MSG_KEPT_OFFLOAD,
}
_said: set[str] = set()


@_compat.assume_constant_result
def say_once(what: str) -> bool:
    """Rule 3: warn about ``what`` once per process; dynamo runs this while tracing."""
    if what not in _said:
        _said.add(what)
        warnings.warn(_MESSAGES[what], UserWarning, stacklevel=2)
    return True


def _call(context_fn: ContextFn) -> Any:
    return context_fn()


def traceable_context_fn(context_fn: ContextFn) -> ContextFn:
    """``context_fn`` in a form dynamo hands to torch's region (Rule 2): a function or a
    ``functools.partial`` as it is, another callable (a plan's per-region contexts) bound into
    a partial. Made before tracing, where the hooks are installed: one built while dynamo
    traces would not be accepted. A callable with a ``stand_in()`` method (a planned region's
    draw guard, whose work the partitioner does) gives the ``context_fn`` torch gets."""
    stand_in = getattr(context_fn, "stand_in", None)
    if stand_in is not None:
        context_fn = stand_in()
        if is_noop_context_fn(context_fn):
            return context_fn
    if isinstance(context_fn, types.FunctionType | functools.partial):
        return context_fn
    return functools.partial(_call, context_fn)


def torch_region(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: CheckpointOptions,
) -> Any:
    """One checkpointed call as torch's region (Rule 2); only reached while dynamo traces.
    ``options.tile`` is not read: the compiled region is untiled (NOTE [Tiled regions], 9)."""
    if options.debug:
        say_once("debug")
    hooks = state_hooks_from(options.recompute_state_hooks, "checkpointing.checkpoint")
    if hooks:
        say_once("state hooks")
    given: dict[str, Any] = {}
    if options.use_reentrant is not None:
        given["use_reentrant"] = options.use_reentrant
    if not options.preserve_rng_state:
        given["preserve_rng_state"] = False
    if options.determinism_check != "default":
        given["determinism_check"] = options.determinism_check
    if not options.early_stop:
        given["early_stop"] = False
    if not is_noop_context_fn(options.context_fn):
        given["context_fn"] = options.context_fn
    if options.respect_saved_tensors_hooks is not None and _TORCH_HAS_RESPECT:
        given["respect_saved_tensors_hooks"] = options.respect_saved_tensors_hooks
    region = _EagerFallback(function, hooks)  # Rule 7
    return _torch_checkpoint.checkpoint(region, *args, **given, **kwargs)


class _EagerFallback:
    """The function handed to torch's checkpoint (Rule 7): traced, a plain call; run by torch's
    eager checkpoint after a graph break, the first call is the forward and every later call
    a recompute, with ``is_recomputing()`` true and the state hooks at the forward's state."""

    __slots__ = ("entry", "function", "hooks")

    def __init__(self, function: Callable[..., Any], hooks: tuple[RecomputeStateHook, ...]):
        self.function = function
        self.hooks = hooks
        self.entry: tuple[Any, ...] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if compiling():
            return self.function(*args, **kwargs)
        if self.entry is None:  # torch's eager forward
            self.entry = tuple(hook.snapshot() for hook in self.hooks)
            return self.function(*args, **kwargs)
        outer = tuple(hook.snapshot() for hook in self.hooks)
        for hook, snapshot in zip(self.hooks, self.entry, strict=True):
            hook.restore(snapshot)
        try:
            with marked_as_recompute():
                return self.function(*args, **kwargs)
        finally:
            for hook, snapshot in zip(self.hooks, outer, strict=True):
                hook.restore(snapshot)


def kept_region(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A kept span while dynamo traces (Rule 6)."""
    return _compat.run_when_traced(_saving_nodes, fn, *args, **kwargs)


def _saving_nodes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run at AOTAutograd trace time: the span's checkpointed nodes become ``MUST_SAVE``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        count_before = _compat.traced_node_count()
        out = fn(*args, **kwargs)
        for node in _compat.traced_nodes_since(count_before):
            meta = _compat.traced_node_meta(node)
            if node.op == "call_function" and "recompute" in meta:
                meta["recompute"] = _torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return out

    return run
