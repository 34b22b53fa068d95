"""The catalogue of user mistakes: each raises (or warns) clearly, and its key phrases are pinned.

One row per mistake: the call that makes it, the exception type, and phrases the message must
contain (which API speaks, what was expected, the fix). Only key phrases are pinned, not whole
texts, so wording can improve without touching this file. Where torch raises for the same
mistake, the row says so and ``test_same_exception_type_as_torch`` checks the type side by side.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import releases
import torch
import torch.utils.checkpoint as torch_checkpoint
import transformers
from mechanism_support import require

import checkpointing
import checkpointing.policies as policies
from checkpointing import apply_activation_checkpointing, checkpoint_wrapper
from checkpointing._selective import unkept
from checkpointing.integrations import transformers as hf_checkpointing
from checkpointing.policies import save_matmuls


@dataclass(frozen=True)
class Mistake:
    """A user mistake: ``call(module)`` must raise ``error`` with every phrase in ``phrases``."""

    call: Callable[[Any], Any]
    error: type[BaseException]
    phrases: tuple[str, ...]
    torch_too: bool = False  # torch.utils.checkpoint raises the same type for it
    needs: tuple[str, ...] = field(default=())  # names that must exist, else the row skips


def _x() -> torch.Tensor:
    return torch.randn(3, 3, requires_grad=True)


def _seq() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))


def _layered() -> torch.nn.Module:
    """A model whose layers are a ``ModuleList`` (what ``megatron_spec`` looks for)."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(4))
    return model


def _non_reentrant(m: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return m.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _sac_backward_of(m: Any, policy: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``fn`` of a fresh input, checkpointed under ``policy`` (ours only), then backward."""
    context_fn = policies.as_context_fn(policy)
    m.checkpoint(fn, _x(), use_reentrant=False, context_fn=context_fn).sum().backward()


def _sac_backward(m: Any, policy: Any, **options: Any) -> None:
    context_fn = functools.partial(m.create_selective_checkpoint_contexts, policy, **options)
    x = _x()
    m.checkpoint(torch.mm, x, x, use_reentrant=False, context_fn=context_fn).sum().backward()


def _bad_answer(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return "save"


def _mutate_input_then_backward(m: Any, use_reentrant: bool) -> None:
    a = _x()
    b = a * 1
    y = m.checkpoint(torch.sin, b, use_reentrant=use_reentrant)
    b.add_(1)
    y.sum().backward()


def _backward_twice(m: Any, use_reentrant: bool) -> None:
    y = m.checkpoint(torch.sin, _x(), use_reentrant=use_reentrant)
    y.sum().backward()
    y.sum().backward()


def _sac_backward_twice(m: Any) -> None:
    context_fn = functools.partial(
        m.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    x = _x()
    y = m.checkpoint(
        lambda t: torch.mm(t, t).sin(), x, use_reentrant=False, context_fn=context_fn
    ).sum()
    y.backward(retain_graph=True)
    y.backward()


def _sac_mutated_cache(m: Any) -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        h = torch.mm(t, t)
        h.mul_(2)
        return h.sin()

    context_fn = functools.partial(
        m.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    m.checkpoint(fn, _x(), use_reentrant=False, context_fn=context_fn).sum().backward()


def _reentrant_under_grad(m: Any) -> None:
    x = _x()
    torch.autograd.grad(m.checkpoint(torch.sin, x, use_reentrant=True).sum(), x)


def _nested_groups(m: Any) -> None:
    with m.GraphExecGroup(), m.GraphExecGroup():
        pass


class _UnpackTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        ctx.saved_tensors
        return grad * ctx.saved_tensors[0]


def _unpack_twice(m: Any) -> None:
    _non_reentrant(m, _UnpackTwice.apply, _x()).sum().backward()


def _changing_fn(extra_op_in_forward: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function with one more saving op in forward (or in recompute) than in the other."""
    calls: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        if extra_op_in_forward == (not calls):
            y = y.exp()
        calls.append(True)
        return y

    return fn


def _count_mismatch(m: Any, extra_op_in_forward: bool) -> None:
    fn = _changing_fn(extra_op_in_forward)
    _non_reentrant(m, fn, _x(), early_stop=False).sum().backward()


def _metadata_mismatch(m: Any) -> None:
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x if len(calls) == 1 else x.double()).sin()

    _non_reentrant(m, fn, _x()).sum().backward()


class _Swallow:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> bool:
        return True


def _suppressing_context(m: Any) -> None:
    def fail(x: torch.Tensor) -> torch.Tensor:
        raise KeyError("inside")

    _non_reentrant(m, fail, _x(), context_fn=lambda: (_Swallow(), _Swallow()))


def _scope_exit_twice(m: Any) -> None:
    scope = require("gradient_checkpoint_scope")()
    scope.__enter__()
    scope.__exit__(None, None, None)
    scope.__exit__(None, None, None)


def _in_other_thread(call: Callable[[], object]) -> None:
    """Run ``call`` in a new thread and re-raise here what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _scope_exit_in_other_thread(m: Any) -> None:
    scope = require("gradient_checkpoint_scope")()
    scope.__enter__()
    try:
        _in_other_thread(lambda: scope.__exit__(None, None, None))
    finally:
        scope.__exit__(None, None, None)  # the owner leaves properly


def _scope_entered_twice(m: Any) -> None:
    scope = require("gradient_checkpoint_scope")()
    with scope:
        pass
    with scope:
        pass


def _scope_hook_released_in_other_thread(m: Any) -> None:
    scope = require("gradient_checkpoint_scope")()
    with scope:
        x = torch.randn(2, requires_grad=True).exp()
    try:
        _in_other_thread(scope.exit_saved_tensors_hooks_scope)
    finally:
        del x  # the scope's tensors die: its hook leaves


def _session_exit_in_other_thread(m: Any) -> None:
    session = require("gradient_checkpoint_session")()
    session.__enter__()
    try:
        _in_other_thread(lambda: session.__exit__(None, None, None))
    finally:
        session.__exit__(None, None, None)  # the owner leaves properly


def _session_entered_while_open(m: Any) -> None:
    session = require("gradient_checkpoint_session")()
    with session, session:
        pass


def _session_exit_when_not_open(m: Any) -> None:
    require("gradient_checkpoint_session")().__exit__(None, None, None)


CKPT = "checkpoint"
SAC = "create_selective_checkpoint_contexts"


def _kept_output_changed_in_place(module: Any) -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = module.keep(torch.matmul, x.sin(), w)
        h.mul_(2)
        return h.relu().sum()

    module.checkpoint(block, torch.randn(2, 4, requires_grad=True), use_reentrant=False).backward()


def _replay_reaching_another_span(module: Any) -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        span = torch.mul if module.is_recomputing() else torch.matmul
        return module.keep(span, x.sin(), w).relu().sum()

    module.checkpoint(block, torch.randn(4, 4, requires_grad=True), use_reentrant=False).backward()


def _span_writing_its_argument(module: Any) -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        return module.keep(lambda t: t.relu_() @ w, x.sin()).sum()

    module.checkpoint(block, torch.randn(4, 4, requires_grad=True), use_reentrant=False)


def _keeping_ended_elsewhere(module: Any) -> None:
    block = module.keeping("moved")
    block.__enter__()
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _exit_into(block, errors))
    thread.start()
    thread.join()
    block.__exit__(None, None, None)
    raise errors[0]


def _exit_into(block: Any, errors: list[BaseException]) -> None:
    try:
        block.__exit__(None, None, None)
    except BaseException as error:  # re-raised by the thread that began the block
        errors.append(error)


MISTAKES: dict[str, Mistake] = {
    "function is not callable": Mistake(
        lambda m: m.checkpoint(42, _x(), use_reentrant=False),
        TypeError,
        ("checkpointing.checkpoint", "expected a callable", "got int", "Fix"),
    ),
    "segments is zero": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), 0, _x(), use_reentrant=False),
        ValueError,
        ("checkpoint_sequential", "between 1 and the number of functions (3)", "got 0", "Fix"),
    ),
    "segments is negative": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), -2, _x(), use_reentrant=False),
        ValueError,
        ("checkpoint_sequential", "got -2", "Fix"),
    ),
    "more segments than functions": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), 4, _x(), use_reentrant=False),
        ValueError,
        ("checkpoint_sequential", "(3)", "got 4", "segments=min(segments, 3)"),
    ),
    "segments is not an integer": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), 1.5, _x(), use_reentrant=False),
        ValueError,
        ("checkpoint_sequential", "must be an integer", "got 1.5"),
    ),
    "checkpoint_sequential: unknown strategy": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), 2, _x(), use_reentrant=False, strategy="fast"),
        ValueError,
        ("checkpoint_sequential", "unknown strategy 'fast'", "'balanced'", "Fix"),
    ),
    "checkpoint_sequential: segments with a strategy that chooses them": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), 2, _x(), use_reentrant=False, strategy="log"),
        ValueError,
        ("checkpoint_sequential", "chooses its own segments", "segments=None", "Fix"),
    ),
    "checkpoint_sequential: optimal without budget": Mistake(
        lambda m: m.checkpoint_sequential(
            _seq(), None, _x(), use_reentrant=False, strategy="optimal"
        ),
        ValueError,
        ("checkpoint_sequential", "needs budget=", "Fix: pass budget=<bytes>"),
    ),
    "checkpoint_sequential: budget below the floor": Mistake(
        lambda m: m.checkpoint_sequential(
            _seq(), None, _x(), use_reentrant=False, strategy="optimal", budget=8
        ),
        ValueError,
        ("checkpoint_sequential", "budget=8 bytes is below the floor", "Fix: pass budget >="),
    ),
    "checkpoint_sequential: budget without optimal": Mistake(
        lambda m: m.checkpoint_sequential(
            _seq(), None, _x(), use_reentrant=False, strategy="sqrt", budget=10**6
        ),
        ValueError,
        ("checkpoint_sequential", "only used by strategy='optimal'", "Fix"),
    ),
    "checkpoint_sequential: empty functions": Mistake(
        lambda m: m.checkpoint_sequential([], 1, _x(), use_reentrant=False),
        ValueError,
        ("checkpoint_sequential", "functions is empty", "Fix"),
    ),
    "checkpoint_sequential: debug with reentrant": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), 2, _x(), use_reentrant=True, debug=True),
        ValueError,
        ("checkpoint_sequential", "debug=True", "use_reentrant=False"),
    ),
    "checkpoint_sequential: a second input where use_reentrant goes, with a strategy": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), None, _x(), _x(), strategy="sqrt"),
        TypeError,
        (
            "checkpoint_sequential",
            "use_reentrant must be True or False",
            "got a Tensor of shape (3, 3)",
            "input=(a, b)",
        ),
    ),
    "use_reentrant given as a string": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant="false"),
        TypeError,
        (
            "checkpointing.checkpoint: use_reentrant must be True or False (or omitted)",
            "got 'false' of type str",
            "would run the reentrant variant",
            "Fix: pass the bool, use_reentrant=False",
        ),
    ),
    "checkpoint_wrapper: use_reentrant given as a string": Mistake(
        lambda m: checkpoint_wrapper(torch.nn.Linear(3, 3), use_reentrant="False"),
        TypeError,
        ("checkpointing.checkpoint_wrapper: use_reentrant must be True or False", "Fix"),
    ),
    "context_fn: an unknown policy name": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant=False, context_fn="save_attn"),
        ValueError,
        (
            "checkpointing.checkpoint: unknown policy name 'save_attn'",
            "'save_attention', 'save_everything', 'save_matmuls'",
            "Fix: pass e.g. context_fn='save_attention'",
        ),
    ),
    "context_fn that is not callable": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant=False, context_fn=5),
        TypeError,
        (
            "checkpointing.checkpoint: context_fn must be a function returning two context "
            "managers",
            "got 5 of type int",
            "Fix: pass e.g. context_fn=checkpointing.policies.save_matmuls()",
        ),
        torch_too=True,
    ),
    "as_context_fn: an unknown policy name": Mistake(
        lambda m: policies.as_context_fn("save_attn"),
        ValueError,
        ("policies.as_context_fn: unknown policy name 'save_attn'", "'save_matmuls'", "Fix"),
    ),
    "maxtext: an unknown remat_policy": Mistake(
        lambda m: policies.maxtext("minimall"),
        ValueError,
        ("policies.maxtext: unknown MaxText remat_policy 'minimall'", "'minimal'", "Fix"),
    ),
    "maxtext: per-tensor options without custom": Mistake(
        lambda m: policies.maxtext("minimal", query_proj="offload"),
        TypeError,
        ("'minimal' takes no per-tensor options", "maxtext('custom', query_proj='offload')"),
    ),
    "maxtext: an unknown tensor name": Mistake(
        lambda m: policies.maxtext("custom", q_proj="offload"),
        TypeError,
        ("unknown tensor name(s) q_proj", "query_proj", "Fix"),
    ),
    "maxtext: a placement MaxText has not": Mistake(
        lambda m: policies.maxtext("custom", out_proj="host"),
        ValueError,
        ("out_proj='host'", "expected 'remat', 'device' or 'offload'", "Fix"),
    ),
    "maxtext: the layer input offloaded": Mistake(
        lambda m: policies.maxtext("custom", decoder_layer_input="offload"),
        ValueError,
        ("decoder_layer_input='offload' cannot be honoured", "offload_wrapper", "Fix"),
    ),
    "context_fn: a policy factory passed uncalled": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant=False, context_fn=save_matmuls),
        TypeError,
        ("context_fn got the policy factory", "Fix: call it, context_fn=save_matmuls()"),
    ),
    "unknown kwargs, reentrant": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant=True, scale=2),
        ValueError,
        ("Unexpected keyword arguments: scale", "use_reentrant=False"),
        torch_too=True,
    ),
    "unknown options to the checkpoint decorator": Mistake(
        lambda m: m.checkpoint(use_reentrant=False, scale=2),
        ValueError,
        ("Unexpected keyword arguments: scale", "decorator", "Fix"),
        torch_too=releases.has(releases.DECORATOR),
    ),
    "respect_saved_tensors_hooks with the reentrant variant": Mistake(
        lambda m: m.checkpoint(
            torch.sin, _x(), use_reentrant=True, respect_saved_tensors_hooks=True
        ),
        ValueError,
        ("respect_saved_tensors_hooks", "only supported when use_reentrant=False", "Fix"),
        torch_too=releases.has(releases.RESPECT_HOOKS),
    ),
    "unknown kwargs, non-reentrant (they go to the function)": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant=False, scale=2),
        TypeError,
        ("scale",),
        torch_too=True,
    ),
    "unknown kwargs, checkpoint_sequential": Mistake(
        lambda m: m.checkpoint_sequential(_seq(), 2, _x(), use_reentrant=False, debugs=True),
        ValueError,
        ("Unexpected keyword arguments: debugs", "checkpoint_sequential", "Fix"),
        torch_too=True,
    ),
    "unknown determinism_check": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant=False, determinism_check="strict"),
        ValueError,
        ("determinism_check should be one of", "'strict'", "Fix"),
        torch_too=True,
    ),
    "policy returns something that is not a policy": Mistake(
        lambda m: _sac_backward(m, _bad_answer),
        checkpointing.CheckpointError,
        ("returned 'save'", "expected a CheckpointPolicy member or a bool", "Fix"),
        needs=(SAC,),
    ),
    "policy list holds an OpOverloadPacket": Mistake(
        lambda m: m.create_selective_checkpoint_contexts([torch.ops.aten.mm]),
        ValueError,
        ("to be an OpOverload", "aten.mm.default"),
        torch_too=True,
        needs=(SAC,),
    ),
    "policy list holds a non-op": Mistake(
        lambda m: m.create_selective_checkpoint_contexts([torch.mm]),
        ValueError,
        ("Expected op in `op_list` to be an OpOverload", "torch.ops.aten.mm.default"),
        torch_too=True,
        needs=(SAC,),
    ),
    "policy is neither callable nor a list": Mistake(
        lambda m: m.create_selective_checkpoint_contexts(42),
        TypeError,
        ("either a function or a list of ops", "Fix"),
        needs=(SAC,),
    ),
    "input mutated in place before backward, non-reentrant": Mistake(
        lambda m: _mutate_input_then_backward(m, False),
        RuntimeError,
        ("modified by an inplace operation",),
        torch_too=True,
    ),
    "input mutated in place before backward, reentrant": Mistake(
        lambda m: _mutate_input_then_backward(m, True),
        RuntimeError,
        ("modified by an inplace operation",),
        torch_too=True,
    ),
    "backward twice after the graph was freed, reentrant": Mistake(
        lambda m: _backward_twice(m, True),
        RuntimeError,
        ("backward through the graph a second time",),
        torch_too=True,
    ),
    "backward twice through a SAC region": Mistake(
        _sac_backward_twice,
        RuntimeError,
        ("Trying to backward an extra time", "Fix"),
        # torch 2.13 lets this scenario through; ours raises as the newest release does.
        needs=(SAC,),
    ),
    "SAC cached output mutated in place": Mistake(
        _sac_mutated_cache,
        RuntimeError,
        ("has been mutated", "allow_cache_entry_mutation=True"),
        # torch 2.13 lets this scenario through; ours raises as the newest release does.
        needs=(SAC,),
    ),
    "debug=True with a context_fn": Mistake(
        lambda m: m.checkpoint(
            torch.sin,
            _x(),
            use_reentrant=False,
            debug=True,
            context_fn=m.noop_context_fn
            if m is torch_checkpoint
            else (lambda: (_Swallow(), _Swallow())),
        ),
        ValueError,
        ("debug=True is incompatible with non-default context_fn", "Fix"),
    ),
    "reentrant with a context_fn": Mistake(
        lambda m: m.checkpoint(
            torch.sin, _x(), use_reentrant=True, context_fn=lambda: (_Swallow(), _Swallow())
        ),
        ValueError,
        ("only supported when use_reentrant=False", "context_fn"),
        torch_too=True,
    ),
    "reentrant with debug=True": Mistake(
        lambda m: m.checkpoint(torch.sin, _x(), use_reentrant=True, debug=True),
        ValueError,
        ("only supported when use_reentrant=False", "debug=True"),
        torch_too=True,
    ),
    "torch.autograd.grad with reentrant": Mistake(
        _reentrant_under_grad,
        RuntimeError,
        ("incompatible with .grad()", "use_reentrant=False"),
        torch_too=True,
    ),
    "GraphExecGroup nested": Mistake(
        _nested_groups,
        RuntimeError,
        ("cannot be nested", "Fix"),
        torch_too=True,
    ),
    "saved tensor unpacked twice in one backward": Mistake(
        _unpack_twice,
        CheckpointError := checkpointing.CheckpointError,
        ("already unpacked once", "only once"),
    ),
    "function saves fewer tensors in recompute": Mistake(
        lambda m: _count_mismatch(m, True),
        CheckpointError,
        ("different number of tensors", "forward: 2", "recomputation: 1", "debug=True"),
        torch_too=True,
    ),
    "function saves more tensors in recompute": Mistake(
        lambda m: _count_mismatch(m, False),
        CheckpointError,
        ("more tensors during recomputation", "forward saved 1", "debug=True"),
        torch_too=True,
    ),
    "function recomputes with different metadata": Mistake(
        _metadata_mismatch,
        CheckpointError,
        ("different metadata", "torch.float64", "debug=True"),
    ),
    "function saves fewer tensors in recompute, debug=True": Mistake(
        lambda m: _non_reentrant(m, _changing_fn(True), _x(), debug=True).sum().backward(),
        CheckpointError,
        (
            "Operations executed during recomputation",
            "First divergence at op",
            "Detected non-determinism while running activation checkpointing",
            "You are seeing this error because you passed `debug=True` to checkpoint and",
            "1) Compare the operators ran during original forward and recomputation to",
            "2) Review the stack trace for each operator to locate its invocation source.",
            "Number of tensors saved during forward: 2",
        ),
        torch_too=True,
    ),
    "context_fn suppresses an exception of the forward": Mistake(
        _suppressing_context,
        RuntimeError,
        ("suppressed an exception", "Fix"),
    ),
    "checkpoint_wrapper on something that is not a module": Mistake(
        lambda m: checkpoint_wrapper(torch.sin),  # type: ignore[arg-type]
        TypeError,
        ("checkpointing.checkpoint_wrapper", "expected an nn.Module", "builtin_function", "Fix"),
    ),
    "checkpoint_wrapper with an unknown option": Mistake(
        lambda m: checkpoint_wrapper(torch.nn.Linear(2, 2), early_stopping=False),
        TypeError,
        ("unknown checkpoint option", "'early_stopping'", "'early_stop'", "Fix"),
    ),
    "checkpoint_wrapper with torch's checkpoint_impl": Mistake(
        lambda m: checkpoint_wrapper(torch.nn.Linear(2, 2), checkpoint_impl="REENTRANT"),
        TypeError,
        ("'checkpoint_impl'", "use_reentrant=True"),
    ),
    "apply_activation_checkpointing with a check_fn that is not callable": Mistake(
        lambda m: apply_activation_checkpointing(_seq(), check_fn=42),  # type: ignore[arg-type]
        TypeError,
        ("apply_activation_checkpointing", "check_fn must be a callable"),
    ),
    "scope exited twice": Mistake(
        _scope_exit_twice,
        CheckpointError,
        ("gradient_checkpoint_scope", "not open", "state: closed", "exactly once", "Fix"),
        needs=("gradient_checkpoint_scope",),
    ),
    "scope exited in another thread": Mistake(
        _scope_exit_in_other_thread,
        CheckpointError,
        ("gradient_checkpoint_scope", "__exit__ was called in thread", "entered in thread", "Fix"),
        needs=("gradient_checkpoint_scope",),
    ),
    "scope entered again": Mistake(
        _scope_entered_twice,
        CheckpointError,
        ("gradient_checkpoint_scope", "already entered", "one block", "Fix"),
        needs=("gradient_checkpoint_scope",),
    ),
    "scope's hook released from another thread": Mistake(
        _scope_hook_released_in_other_thread,
        CheckpointError,
        ("exit_saved_tensors_hooks_scope() was called in thread", "per thread", "Fix"),
        needs=("gradient_checkpoint_scope",),
    ),
    "session exited in another thread": Mistake(
        _session_exit_in_other_thread,
        CheckpointError,
        ("gradient_checkpoint_session exit was called in thread", "entered in thread", "Fix"),
        needs=("gradient_checkpoint_session",),
    ),
    "session entered while open": Mistake(
        _session_entered_while_open,
        CheckpointError,
        ("gradient_checkpoint_session", "already open", "Fix"),
        needs=("gradient_checkpoint_session",),
    ),
    "session exited when not open": Mistake(
        _session_exit_when_not_open,
        CheckpointError,
        ("gradient_checkpoint_session", "not open", "exactly once", "Fix"),
        needs=("gradient_checkpoint_session",),
    ),
    "keep of a non-callable": Mistake(
        lambda m: m.keep(3, torch.ones(1)),
        TypeError,
        ("checkpointing.keep", "expected a callable", "got int", "Fix"),
        needs=("keep",),
    ),
    "keeping with a recompute policy": Mistake(
        lambda m: m.keeping(policy=checkpointing.CheckpointPolicy.MUST_RECOMPUTE),
        ValueError,
        ("checkpointing.keeping", "MUST_SAVE", "MUST_RECOMPUTE", "Fix"),
        needs=("keeping",),
    ),
    "keeping with an empty name": Mistake(
        lambda m: m.keeping(""),
        TypeError,
        ("checkpointing.keeping", "non-empty str", "Fix"),
        needs=("keeping",),
    ),
    "recompute_state_hooks without snapshot/restore": Mistake(
        lambda m: m.checkpoint(
            torch.sin,
            torch.ones(1, requires_grad=True),
            use_reentrant=False,
            recompute_state_hooks=[object()],
        ),
        TypeError,
        ("checkpointing.checkpoint", "snapshot() and restore(state)", "got object", "Fix"),
        needs=("keep",),
    ),
    "kept span output changed in place": Mistake(
        _kept_output_changed_in_place,
        CheckpointError,
        ("checkpointing.keep", "modified in place after the span", "version 0 -> 1", "Fix"),
        needs=("keep",),
    ),
    "replay reaching another span": Mistake(
        _replay_reaching_another_span,
        CheckpointError,
        ("checkpointing.keep", "reached the span mul", "was the span matmul", "Fix"),
        needs=("keep",),
    ),
    "kept span writing its argument in place": Mistake(
        _span_writing_its_argument,
        CheckpointError,
        ("checkpointing.keep", "wrote its tensor argument #0", "version 0 -> 1", "Fix"),
        needs=("keep",),
    ),
    "keeping block ended in another thread": Mistake(
        _keeping_ended_elsewhere,
        RuntimeError,
        ("checkpointing.keeping", "'moved'", "must end in the thread", "Fix"),
        needs=("keeping",),
    ),
    "Compress: unknown format": Mistake(
        lambda m: m.Compress("fp4"),
        ValueError,
        ("checkpointing.Compress", "expected a compressed format", "got 'fp4'", "Fix"),
    ),
    "compress_ops naming an exact-value op": Mistake(
        lambda m: policies.compress_ops(torch.ops.aten.amax.default),
        CheckpointError,
        ("policies.compress_ops", "aten.amax.default cannot be kept compressed", "Fix"),
    ),
    "compressed decision for a boolean output": Mistake(
        lambda m: _sac_backward_of(
            m, policies.compress_ops(torch.ops.aten.gt.Scalar), lambda t: (t > 0) * t
        ),
        CheckpointError,
        ("checkpointing.Compress", "aten.gt.Scalar", "torch.bool", "Fix"),
    ),
    "exact-value op kept on a compressed input": Mistake(
        lambda m: _sac_backward_of(
            m,
            policies.either(
                policies.save_ops(torch.ops.aten.amax),
                policies.compress_ops(torch.ops.aten.mm, to="int8"),
            ),
            lambda t: (t @ t).amax(-1),
        ),
        CheckpointError,
        ("keeps the output of aten.amax.default exactly", "kept compressed", "Fix"),
    ),
    "keeping with compress that is not a Compress": Mistake(
        lambda m: m.keeping(compress="bf16"),
        TypeError,
        ("checkpointing.keeping", "compress must be a checkpointing.Compress", "Fix"),
    ),
    "compressing span running amax": Mistake(
        lambda m: m.checkpoint(
            m.keeping("peak", compress=m.Compress("fp8"))(lambda t: t.amax()),
            _x(),
            use_reentrant=False,
        ),
        CheckpointError,
        ("checkpointing.keeping(compress=...)", "'peak' runs aten.amax.default", "Fix"),
    ),
    "spec key selects nothing": Mistake(
        lambda m: m.apply_spec(_seq(), {"lin*": "full"}),
        ValueError,
        ("checkpointing.apply_spec", "'lin*' selects no module", "Nearest module names", "Fix"),
    ),
    "spec keys tie on one module": Mistake(
        lambda m: m.apply_spec(_seq(), {"{0:2}": "full", "{::2}": "offload"}),
        ValueError,
        ("checkpointing.apply_spec", "'0' is selected by", "equal specificity", "Fix"),
    ),
    "spec value unknown": Mistake(
        lambda m: m.apply_spec(_seq(), {"*": "save_matmul"}),
        ValueError,
        ("checkpointing.apply_spec", "unknown value 'save_matmul'", "'save_matmuls'", "Fix"),
    ),
    "spec layer selector malformed": Mistake(
        lambda m: m.apply_spec(_seq(), {"{0-2}": "full"}),
        ValueError,
        ("checkpointing.apply_spec", "{0-2}", "{0:8} (layers 0-7)", "Fix"),
    ),
    "spec layer index past the end": Mistake(
        lambda m: m.apply_spec(_seq(), {"{5}": "full"}),
        IndexError,
        ("checkpointing.apply_spec", "layer index 5 is out of range", "has 3", "Fix"),
    ),
    "spec budget share outside [0, 1]": Mistake(
        lambda m: m.apply_spec(_seq(), {"*": "budget:1.5"}),
        ValueError,
        ("checkpointing.apply_spec", "budget 'budget:1.5'", "from 0", "Fix"),
    ),
    "spec with two budget keys": Mistake(
        lambda m: m.apply_spec(_seq(), {"0": "budget:0.5", "2": "budget:0.2"}),
        ValueError,
        ("checkpointing.apply_spec", "two budget keys, '0'", "'2'", "Fix"),
    ),
    "spec region inside a budget's module": Mistake(
        lambda m: m.apply_spec(
            torch.nn.Sequential(_seq(), _seq()), {"*": "budget:0.5", "0.1": "full"}
        ),
        ValueError,
        ("checkpointing.apply_spec", "'0.1' (full, from '0.1') lies inside '0'", "Fix"),
    ),
    "spec beside check_fn": Mistake(
        lambda m: m.apply_activation_checkpointing(
            _seq(), check_fn=lambda _: True, spec={"*": "full"}
        ),
        ValueError,
        ("checkpointing.apply_activation_checkpointing", "check_fn cannot be given", "Fix"),
    ),
    "load_spec without a format": Mistake(
        lambda m: m.load_spec('"*" = "full"'),
        ValueError,
        ("checkpointing.load_spec", "format must be 'toml' or 'yaml'", "Fix"),
    ),
    "megatron_spec unknown module name": Mistake(
        lambda m: m.megatron_spec(
            _layered(), recompute_granularity="selective", recompute_modules=["attn"]
        ),
        ValueError,
        ("checkpointing.megatron_spec", "'attn'", "known names: 'core_attn'", "Fix"),
    ),
    "megatron_spec uniform over several layers": Mistake(
        lambda m: m.megatron_spec(
            _layered(),
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=2,
        ),
        ValueError,
        ("checkpointing.megatron_spec", "runs of 2 layers", "recompute_num_layers=1", "Fix"),
    ),
}


class _Ours:
    """``checkpointing`` as the rows see it: names still missing from ``__all__`` are found in
    their private module (or the row skips)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # pytest's collector probes dunders
            raise AttributeError(name)
        return require(name)


OURS = _Ours()


def _assert_raises_clearly(name: str, mistake: Mistake, api: Any) -> None:
    """``mistake.call(api)`` raises ``mistake.error`` whose message holds every pinned phrase."""
    with pytest.raises(mistake.error) as info:
        mistake.call(api)
    message = str(info.value)
    missing = [p for p in mistake.phrases if p not in message]
    assert not missing, f"{name}: phrases {missing} not in message:\n{message}"


@pytest.mark.parametrize("name", list(MISTAKES))
def test_mistake_raises_clear_error(name: str) -> None:
    """Each catalogued mistake raises its exception type with the pinned key phrases."""
    mistake = MISTAKES[name]
    for needed in mistake.needs:
        require(needed)
    _assert_raises_clearly(name, mistake, OURS)


@pytest.mark.parametrize("name", [n for n, m in MISTAKES.items() if m.torch_too])
def test_same_exception_type_as_torch(name: str) -> None:
    """Where torch rejects the same mistake, it raises the same exception type (parity)."""
    mistake = MISTAKES[name]
    for needed in mistake.needs:
        require(needed)
    expected = mistake.error
    if expected is checkpointing.CheckpointError:
        expected = torch_checkpoint.CheckpointError  # the same name, torch's class
    with pytest.raises(expected):
        mistake.call(torch_checkpoint)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_under_inference_mode_runs_plainly(use_reentrant: bool) -> None:
    """Under inference mode, checkpoint just runs the function, as torch does (not a mistake)."""
    x = _x()
    results = []
    for module in (checkpointing, torch_checkpoint):
        with torch.inference_mode():
            results.append(module.checkpoint(torch.sin, x, use_reentrant=use_reentrant))
    for out in results:
        assert torch.equal(out, x.detach().sin())
        assert not out.requires_grad
        assert out.is_inference()


@pytest.mark.parametrize("module", [checkpointing, torch_checkpoint], ids=["ours", "torch"])
def test_use_reentrant_omitted_warns(module: Any) -> None:
    """Omitting ``use_reentrant`` warns (checkpoint and checkpoint_sequential), as torch does."""
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        module.checkpoint(torch.sin, _x())
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        module.checkpoint_sequential(_seq(), 2, _x())


@pytest.mark.parametrize("module", [checkpointing, torch_checkpoint], ids=["ours", "torch"])
def test_reentrant_without_grad_inputs_warns(module: Any) -> None:
    """Reentrant checkpoint with no input requiring grad warns that gradients will be None."""
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        module.checkpoint(torch.sin, torch.randn(2), use_reentrant=True)


def test_catalogue_size() -> None:
    """The catalogue covers every mistake listed in issue 7 and more (counted in the report)."""
    assert len(MISTAKES) >= 30


# --- checkpointing.integrations.transformers (issue 13) -----------------------------------------


def _tiny_llama(cls: type[transformers.PreTrainedModel] = transformers.LlamaForCausalLM) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return cls(config)


class _NoCheckpointing(transformers.LlamaForCausalLM):
    supports_gradient_checkpointing = False


class _PreV435Hook(transformers.LlamaForCausalLM):
    def _set_gradient_checkpointing(self, module: Any, value: bool = False) -> None:
        module.gradient_checkpointing = value


class _OtherCheckpointing(transformers.LlamaForCausalLM):
    def _set_gradient_checkpointing(self, enable: bool = True, *args: Any, **kwargs: Any) -> None:
        self.other_checkpointing = enable


class _NoLayers(transformers.PreTrainedModel):
    config_class = transformers.PretrainedConfig
    supports_gradient_checkpointing = True

    def __init__(self, config: transformers.PretrainedConfig) -> None:
        super().__init__(config)
        self.linear = torch.nn.Linear(2, 2)
        self.post_init()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _hf_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(16, (1, 8))
    return {"input_ids": ids, "labels": ids}


def _hf_own_checkpointing() -> Any:
    model = _tiny_llama()
    model.activation_checkpointing_enable()
    return model


def _enable_on_a_plan(hf: Any) -> None:
    model = _tiny_llama()
    # 0.8: on this tiny model the RNG states checkpointing keeps put the floor near 0.7
    hf.enable(model, budget=0.8, example_kwargs=_hf_batch())
    hf.enable(model)


def _hook_ignored(hf: Any) -> None:
    model = _tiny_llama(_OtherCheckpointing)
    try:
        hf.enable(model)
    finally:
        assert not model.other_checkpointing  # left as it was


HF_MISTAKES: dict[str, Mistake] = {
    "transformers: not a PreTrainedModel": Mistake(
        lambda hf: hf.enable(torch.nn.Linear(2, 2)),
        TypeError,
        ("integrations.transformers.enable", "expected a transformers PreTrainedModel", "Linear"),
    ),
    "transformers: disable on a plain module": Mistake(
        lambda hf: hf.disable(torch.nn.Linear(2, 2)),
        TypeError,
        ("integrations.transformers.disable", "PreTrainedModel", "Fix"),
    ),
    "transformers: model without checkpointing": Mistake(
        lambda hf: hf.enable(_tiny_llama(_NoCheckpointing)),
        ValueError,
        ("_NoCheckpointing does not support activation checkpointing", "apply_activation", "Fix"),
    ),
    "transformers: pre-4.35 hook": Mistake(
        lambda hf: hf.enable(_tiny_llama(_PreV435Hook)),
        ValueError,
        ("_PreV435Hook._set_gradient_checkpointing", "transformers < 4.35", "left as it was"),
    ),
    "transformers: hook that checkpoints another way": Mistake(
        _hook_ignored,
        ValueError,
        ("_OtherCheckpointing._set_gradient_checkpointing did not hand", "overridden", "Fix"),
    ),
    "transformers: unknown option": Mistake(
        lambda hf: hf.enable(_tiny_llama(), offload=True),
        TypeError,
        ("unknown checkpoint option(s) ['offload']", "ignores them", "offload_ops", "Fix"),
    ),
    "transformers: policy and context_fn": Mistake(
        lambda hf: hf.enable(_tiny_llama(), policy=save_matmuls(), context_fn=lambda: None),
        ValueError,
        ("got both policy= and context_fn=", "Fix"),
    ),
    "transformers: reentrant with a policy": Mistake(
        lambda hf: hf.enable(_tiny_llama(), policy=save_matmuls(), use_reentrant=True),
        ValueError,
        ("use_reentrant=True cannot run a policy", "Fix"),
    ),
    "transformers: use_reentrant given as a string": Mistake(
        lambda hf: hf.enable(_tiny_llama(), use_reentrant="false"),
        TypeError,
        (
            "integrations.transformers.enable: use_reentrant must be True or False",
            "got 'false' of type str",
            "Fix: pass the bool, use_reentrant=False",
        ),
    ),
    "transformers: every_n_layers of 0": Mistake(
        lambda hf: hf.enable(_tiny_llama(), every_n_layers=0),
        ValueError,
        ("every_n_layers must be a positive int", "got 0", "Fix"),
    ),
    "transformers: unknown policy name": Mistake(
        lambda hf: hf.enable(_tiny_llama(), policy="save_attn"),
        ValueError,
        (
            "integrations.transformers.enable: unknown policy name 'save_attn'",
            "'save_attention'",
            "Fix: pass e.g. policy='save_attention'",
            "a policy with arguments as an object",
        ),
    ),
    "transformers: unknown gradient_checkpointing_kwargs key": Mistake(
        lambda hf: hf.enable(_tiny_llama(), gradient_checkpointing_kwargs={"reentrant": False}),
        TypeError,
        (
            "enable: unknown gradient_checkpointing_kwargs key(s) ['reentrant']",
            "'use_reentrant'",
            "Fix",
        ),
    ),
    "transformers: gradient_checkpointing_kwargs not a dict": Mistake(
        lambda hf: hf.enable(_tiny_llama(), gradient_checkpointing_kwargs=False),
        TypeError,
        ("gradient_checkpointing_kwargs must be a dict", "Fix"),
    ),
    "transformers: an option given twice": Mistake(
        lambda hf: hf.enable(
            _tiny_llama(), debug=True, gradient_checkpointing_kwargs={"debug": False}
        ),
        TypeError,
        ("['debug'] given both in gradient_checkpointing_kwargs and as keyword", "Fix"),
    ),
    "transformers: budget with a policy": Mistake(
        lambda hf: hf.enable(
            _tiny_llama(), budget=0.5, example_kwargs=_hf_batch(), policy=save_matmuls()
        ),
        ValueError,
        ("budget= cannot be combined with policy=", "the plan chooses per layer", "Fix"),
    ),
    "transformers: budget with every_n_layers": Mistake(
        lambda hf: hf.enable(
            _tiny_llama(), budget=0.5, example_kwargs=_hf_batch(), every_n_layers=2
        ),
        ValueError,
        ("budget= cannot be combined with every_n_layers=2", "Fix"),
    ),
    "transformers: budget with use_reentrant=True": Mistake(
        lambda hf: hf.enable(
            _tiny_llama(), budget=0.5, example_kwargs=_hf_batch(), use_reentrant=True
        ),
        ValueError,
        ("budget= cannot be combined with use_reentrant=True", "non-reentrant", "Fix"),
    ),
    "transformers: budget without example inputs": Mistake(
        lambda hf: hf.enable(_tiny_llama(), budget=0.5),
        ValueError,
        (
            "budget= needs example_inputs= or example_kwargs=",
            "example_kwargs={'input_ids': ids, 'labels': ids})",
            "got neither",
            "Fix",
        ),
    ),
    "transformers: example inputs without budget": Mistake(
        lambda hf: hf.enable(_tiny_llama(), example_kwargs=_hf_batch()),
        ValueError,
        ("example_kwargs= only describe the step that budget= plans for", "ignored", "Fix"),
    ),
    "transformers: budget on a model that checkpoints": Mistake(
        lambda hf: hf.enable(_hf_own_checkpointing(), budget=0.5, example_kwargs=_hf_batch()),
        ValueError,
        ("LlamaForCausalLM is already checkpointed", "gradient_checkpointing flags", "disable"),
    ),
    "transformers: enable on a budget plan": Mistake(
        _enable_on_a_plan,
        ValueError,
        ("already checkpointed (by enable(model, budget=...)", "twice", "disable(model) first"),
    ),
    "transformers: budget without layers": Mistake(
        lambda hf: hf.enable(
            _NoLayers(transformers.PretrainedConfig()), budget=0.5, example_inputs=torch.randn(2, 2)
        ),
        ValueError,
        ("_NoLayers has no GradientCheckpointingLayer blocks", "plan_checkpointing", "Fix"),
    ),
}


@pytest.mark.parametrize("name", list(HF_MISTAKES))
def test_transformers_mistake_raises_clear_error(name: str) -> None:
    """Each mistake with ``checkpointing.integrations.transformers`` raises clearly."""
    mistake = HF_MISTAKES[name]
    _assert_raises_clearly(name, mistake, hf_checkpointing)


def _blocks() -> torch.nn.Sequential:
    """Four Linear+Tanh blocks: a model the planner can plan."""
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(4))
    )


def _plan(model: torch.nn.Module, budget: float = 1.0) -> checkpointing.ActivationPlan:
    # 1.0: on these 2x4 inputs a region's RNG state outweighs what checkpointing it saves
    x = torch.randn(2, 4, requires_grad=True)
    return checkpointing.plan_checkpointing(model, x, budget=budget)


def _fake_input() -> torch.Tensor:
    """A (2, 4) input made under ``FakeTensorMode``: a shape without memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.randn(2, 4)


class _Routed(torch.nn.Module):
    """Keeps the rows whose first output is positive: ``nonzero`` reads values."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h[torch.nonzero(h[:, 0] > 0).flatten()].sum(0, keepdim=True) + h


def _routed_on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(_Routed(), _Routed())


def _apply_twice(_: object) -> None:
    model = _blocks()
    plan = _plan(model)
    plan.apply(model)
    try:
        plan.apply(model)
    finally:
        plan.remove(model)


PLANNER_MISTAKES: dict[str, Mistake] = {
    "planner: budget below the floor": Mistake(
        lambda _: checkpointing.plan_checkpointing(_blocks(), torch.randn(2, 4), budget=1),
        ValueError,
        ("plan_checkpointing", "below the smallest reachable", "bytes", "Fix"),
    ),
    "planner: budget of the wrong type": Mistake(
        lambda _: checkpointing.plan_checkpointing(_blocks(), torch.randn(2, 4), budget="half"),
        TypeError,
        ("budget must be a float in (0, 1]", "or an int (bytes)", "got 'half'", "Fix"),
    ),
    "planner: a value-dependent op while planning by shapes": Mistake(
        lambda _: checkpointing.plan_checkpointing(_routed_on_meta(), _fake_input(), budget=0.5),
        ValueError,
        ("runs aten.nonzero", "depends on tensor values", "plan on real tensors", "Fix"),
    ),
    "planner: an unknown device class": Mistake(
        lambda _: checkpointing.plan_checkpointing(
            _blocks(), torch.randn(2, 4), budget=0.5, device="h100"
        ),
        ValueError,
        ("device must be None", "'h100-80gb'", "got 'h100'", "Fix"),
    ),
    "planner: no regions": Mistake(
        lambda _: checkpointing.plan_checkpointing(
            torch.nn.Linear(4, 4), torch.randn(2, 4), budget=0.5
        ),
        ValueError,
        ("found no regions in Linear", "regions=lambda module", "Fix"),
    ),
    "planner: nothing requires grad": Mistake(
        lambda _: checkpointing.plan_checkpointing(
            _blocks().requires_grad_(False), torch.randn(2, 4), budget=0.5
        ),
        ValueError,
        ("no floating-point tensor that requires grad", "loss_fn", "Fix"),
    ),
    "planner: sweep budgets not a list": Mistake(
        lambda _: checkpointing.plan_sweep(_blocks(), torch.randn(2, 4), budgets=0.5),
        TypeError,
        ("plan_sweep", "non-empty list or tuple", "got 0.5", "Fix"),
    ),
    "planner: sweep budget of the wrong type": Mistake(
        lambda _: checkpointing.plan_sweep(_blocks(), torch.randn(2, 4), budgets=[0.5, "half"]),
        TypeError,
        ("plan_sweep: budget must be a float in (0, 1]", "got 'half'", "Fix"),
    ),
    "planner: sweep budget below the floor": Mistake(
        lambda _: checkpointing.plan_sweep(_blocks(), torch.randn(2, 4), budgets=[1.0, 1]),
        ValueError,
        ("plan_sweep", "below the smallest reachable", "bytes", "Fix"),
    ),
    "planner: apply twice": Mistake(
        _apply_twice, ValueError, ("ActivationPlan.apply", "already applied", "plan.remove", "Fix")
    ),
    "planner: apply to another model": Mistake(
        lambda _: _plan(_blocks()).apply(_blocks()),
        ValueError,
        ("profiled on another model", "from_json(plan.to_json())", "Fix"),
    ),
    "planner: remove what is not applied": Mistake(
        lambda _: _plan(model := _blocks()).remove(model),
        ValueError,
        ("ActivationPlan.remove", "not applied", "Fix"),
    ),
    "planner: JSON that is not a plan": Mistake(
        lambda _: checkpointing.ActivationPlan.from_json("[1, 2]"),
        ValueError,
        ("ActivationPlan.from_json", "not a plan", "Fix"),
    ),
}


@pytest.mark.parametrize("name", list(PLANNER_MISTAKES))
def test_planner_mistake_raises_clear_error(name: str) -> None:
    """Each mistake with ``plan_checkpointing`` / ``ActivationPlan`` raises clearly."""
    mistake = PLANNER_MISTAKES[name]
    _assert_raises_clearly(name, mistake, None)


def test_planner_reshaped_inputs_warning_says_re_plan() -> None:
    """Inputs of other shapes than the profiled ones warn, naming both and saying re-plan."""
    model = _blocks()
    plan = _plan(model)
    plan.apply(model)
    with pytest.warns(UserWarning, match="re-plan") as record:
        model(torch.randn(3, 4))
    plan.remove(model)
    message = str(record[0].message)
    for phrase in ("ActivationPlan", "[[3, 4]]", "[[2, 4]]", "re-plan", "Fix"):
        assert phrase in message


# --- Warnings: a policy that names something to keep and keeps none of it -----------------------

aten = torch.ops.aten


def _checkpointed_backward(fn: Callable[[torch.Tensor], torch.Tensor], policy: Any) -> None:
    context_fn = policies.as_context_fn(policy)
    checkpointing.checkpoint(fn, _x(), use_reentrant=False, context_fn=context_fn).sum().backward()


def _tagged_layer_norm(x: torch.Tensor) -> torch.Tensor:
    return policies.tag(torch.nn.functional.layer_norm(x, (3,)), "normed").sin()


def _native_dropout(x: torch.Tensor) -> torch.Tensor:
    return torch.native_dropout(x.sin(), 0.5, True)[0]


POLICY_WARNINGS: dict[str, tuple[Callable[[], object], tuple[str, ...]]] = {
    "save_ops of the composite attention op": (
        lambda: policies.save_ops(aten.scaled_dot_product_attention),
        (
            "checkpointing.policies.save_ops: aten.scaled_dot_product_attention never reaches "
            "a policy",
            "composite op",
            "Fix: name the attention kernels it runs",
            "save_ops(*checkpointing.policies.ATTENTION_OPS), which save_attention() is",
        ),
    ),
    "offload_ops of another composite op": (
        lambda: policies.offload_ops(aten.linear.default),
        (
            "never reaches a policy, so this policy never offloads it",
            "Fix: name the ops it runs instead",
            "checkpointing.saved_tensors_report() lists them",
            "aten.linear runs aten.addmm or aten.mm",
        ),
    ),
    "a tag whose maker returns several tensors": (
        lambda: _checkpointed_backward(
            _tagged_layer_norm, policies.save_only_these_names("normed")
        ),
        (
            "names 'normed' to keep",
            "kept no tensor tagged 'normed'",
            "aten.native_layer_norm.default returns several tensors",
            "Fix: keep what makes x with checkpointing.keep(fn, *args)",
            "either(<this policy>, save_ops(torch.ops.aten.native_layer_norm.default))",
        ),
    ),
    "a named op that draws random numbers": (
        lambda: _checkpointed_backward(
            _native_dropout, policies.save_ops(aten.native_dropout.default)
        ),
        (
            "names aten.native_dropout.default to keep",
            "kept none of its outputs",
            "an op that draws is always recomputed",
            "Fix: run it without dropout (dropout_p=0",
            "checkpointing.keep(fn, *args)",
        ),
    ),
}


@pytest.mark.parametrize("name", list(POLICY_WARNINGS))
def test_policy_keeping_nothing_it_names_warns_clearly(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each warning of a policy that keeps none of what it names holds the pinned phrases."""
    monkeypatch.setattr(unkept, "_said", set())  # the warnings are once per process
    call, phrases = POLICY_WARNINGS[name]
    with pytest.warns(UserWarning, match=re.escape(phrases[0])) as said:
        call()
    message = str(said[0].message)
    missing = [p for p in phrases if p not in message]
    assert not missing, f"{name}: phrases {missing} not in message:\n{message}"
