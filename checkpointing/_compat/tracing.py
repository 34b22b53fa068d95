"""Compilers: keeping dynamo out, FX nodes traced by AOTAutograd, inductor's compiled regions.

How our hook-based machinery stays out of dynamo's way, how selective checkpointing reads and marks
the nodes a proxy mode traces, and the compiler's own activation budget (for comparison with the
planner). Each name is checked against torch 2.11-2.15.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _get_eval_frame_callback
from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper as _dynamo_bypassing_wrapper
from torch._higher_order_ops.wrap import inductor_compiled_code as inductor_compiled_code
from torch._subclasses.fake_tensor import DataDependentOutputException as _DataDependent
from torch._subclasses.fake_tensor import DynamicOutputShapeException as _DynamicShape
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode
from torch._subclasses.fake_tensor import UnsupportedOperatorException as _Unsupported
from torch._subclasses.functional_tensor import FunctionalTensor as _FunctionalTensor
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode

_F = TypeVar("_F", bound=Callable[..., Any])


def disable_dynamo(fn: _F) -> _F:
    """Keep dynamo out of ``fn``: hook-based machinery breaks the graph instead of being traced
    (2.11-2.15: ``torch._disable_dynamo``)."""
    disable: Callable[[_F], _F] = torch._disable_dynamo  # type: ignore[attr-defined,assignment]  # private, overloaded
    return disable(fn)


def assume_constant_result(fn: _F) -> _F:
    """Mark ``fn`` so that dynamo calls it at trace time and treats its result as a constant,
    as ``torch.compiler.assume_constant_result`` does, without importing ``torch._dynamo`` (about
    1 s, most of ``import checkpointing``) when nothing compiles (2.11-2.15: that decorator only
    sets ``fn._dynamo_marked_constant``; tests/test_import.py checks the two agree)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]  # the attribute dynamo reads
    return fn


def skip_dynamo_in_code(fn: _F) -> _F:
    """Keep dynamo out of ``fn`` and of every frame it calls, as ``disable_dynamo`` does, but
    recorded once on ``fn``'s code object, so that a call costs nothing (no wrapper frame, no
    eval-frame switch). For hot functions called by torch itself, such as a dispatch mode's
    ``__torch_dispatch__`` (2.11-2.15: ``torch._C._dynamo.eval_frame.set_code_exec_strategy`` with
    SKIP for the frame and its callees, the mechanism behind dynamo's own ``skip_code``)."""
    code = fn.__code__
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return fn


_get_dispatch_mode = torch._C._get_dispatch_mode
_PROXY_MODE_KEY = torch._C._TorchDispatchModeKey.PROXY

proxy_mode: Callable[[], object | None] = functools.partial(_get_dispatch_mode, _PROXY_MODE_KEY)
"""The active proxy mode (tracing) or None, as a C-level call without a Python frame: the cheap
first test before ``proxy_tracing_active``, per op of selective checkpointing (2.11-2.15:
``torch._C._get_dispatch_mode``)."""


# 2.12 added the non-strict tracing flag; 2.11 cannot tell that kind of tracing apart (and
# torch 2.11's own selective checkpoint treats it as compiling too).
_is_non_strict_tracing: Callable[[], bool] = getattr(
    torch.compiler, "_is_non_strict_tracing", lambda: False
)


def proxy_tracing_active() -> bool:
    """True while AOTAutograd or export traces through a dispatch mode (a proxy mode is
    active), false in eager and in non-strict make_fx tracing (2.12-2.15:
    ``torch.compiler._is_non_strict_tracing``; 2.11 has no such flag, so there any proxy mode
    counts). Runs per op of selective checkpointing, hence the names bound once above."""
    if proxy_mode() is None:
        return False
    return not _is_non_strict_tracing()


def is_traced_tensor(tensor: object) -> bool:
    """True for the functional tensors AOTAutograd traces with (every supported release; on
    2.11 such a trace can run with ``torch.compiler.is_compiling()`` false and no proxy mode
    visible to a dispatch mode below the functional one)."""
    return isinstance(tensor, _FunctionalTensor)


def is_fake_tensor(tensor: object) -> bool:
    """True for a fake tensor: shapes, dtype and a device, no memory (``FakeTensorMode``'s;
    2.11-2.15: ``torch._subclasses.fake_tensor.FakeTensor``)."""
    return isinstance(tensor, _FakeTensor)


def fake_mode_of(tensor: object) -> Any:
    """The ``FakeTensorMode`` a fake tensor belongs to, or None for any other object (2.11-2.15:
    ``FakeTensor.fake_mode``)."""
    return tensor.fake_mode if isinstance(tensor, _FakeTensor) else None


def new_fake_mode() -> Any:
    """A ``FakeTensorMode`` that never runs a real kernel: an op without a shape rule raises
    (``allow_fallback_kernels=False``; the default runs the real kernel on zeros, allocating),
    and a real tensor met in it becomes a fake one (``allow_non_fake_inputs=True``: the RNG
    state, a table a model builds from a Python constant)."""
    return _FakeTensorMode(allow_fallback_kernels=False, allow_non_fake_inputs=True)


def storage_identity(storage: torch.UntypedStorage) -> int:
    """The address of the storage object behind a Python ``UntypedStorage`` (its ``_cdata``):
    the same for every view of one storage while it lives, also where the storage has no
    memory (meta, fake), whose data pointer is 0 (2.11-2.15)."""
    return int(storage._cdata)


SHAPE_ONLY_ERRORS: tuple[type[Exception], ...] = (_DataDependent, _DynamicShape, _Unsupported)
"""What a fake tensor's op raises where shapes do not tell the answer: a value read on the host
(``.item()``, ``bool(tensor)``), an output shape that depends on values (``nonzero``, boolean
indexing), or an op with no shape rule and no real kernel allowed (2.11-2.15; each carries the
op as ``.func``)."""


def set_traced_node_meta(key: str, value: object) -> None:
    """Set ``key`` on the metadata of every FX node traced from now on
    (2.11-2.15: ``torch.fx.traceback.current_meta``)."""
    fx_traceback.current_meta[key] = value


def traced_node_count() -> int:
    """Number of nodes in the graph the active proxy mode is tracing, 0 when none (2.11-2.15:
    ``torch.fx.experimental.proxy_tensor.get_proxy_mode``)."""
    mode = get_proxy_mode()
    return 0 if mode is None else len(mode.tracer.graph.nodes)


def traced_nodes_since(count_before: int) -> list[Any]:
    """The FX nodes traced since the graph had ``count_before`` nodes, newest first (2.11-2.15:
    the proxy mode's tracer graph); none when no proxy mode is active."""
    mode = get_proxy_mode()
    if mode is None:
        return []
    nodes = mode.tracer.graph.nodes
    return list(itertools.islice(reversed(nodes), len(nodes) - count_before))


def run_when_traced(
    wrapper: Callable[[Callable[..., Any]], Callable[..., Any]],
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` from code dynamo traces, so that ``wrapper(fn)`` runs it when
    AOTAutograd traces the graph (where the traced FX nodes can be read), while dynamo inlines
    ``fn`` into the graph as usual (2.11-2.15: the ``dynamo_bypassing_wrapper`` higher-order
    op)."""
    return _dynamo_bypassing_wrapper(wrapper, fn, *args, **kwargs)


def traced_node_meta(node: Any) -> dict[str, Any]:
    """An FX node's metadata dict (2.11-2.15: ``node.meta``)."""
    meta: dict[str, Any] = node.meta
    return meta


# ``inductor_compiled_code`` (imported above): the higher-order op that runs an inductor-compiled
# region; selective checkpointing keys its calls per region.


# 2.12 added the side table of compiled regions; 2.11 keys every compiled region by the op alone
# (as torch 2.11's selective checkpoint does).
_resolve_inductor_callable: Callable[[Any], Any] | None = getattr(
    torch._higher_order_ops.wrap, "_resolve_inductor_callable", None
)


def inductor_region_key(op: object, args: tuple[Any, ...]) -> object:
    """Cache key of an ``inductor_compiled_code`` call: the op and the compiled region's id, so
    two compiled regions do not share one call counter (2.12-2.15:
    ``_resolve_inductor_callable``; on 2.11 the op alone)."""
    if not args or _resolve_inductor_callable is None:
        return op
    return (op, _resolve_inductor_callable(args[0]).idx)


def dynamo_eval_frame_active() -> bool:
    """Whether dynamo's frame-evaluation callback is set in this thread, i.e. new Python frames
    may be compiled (2.11-2.15: ``torch._C._dynamo.eval_frame.get_eval_frame_callback``). When it is
    not, a ``disable_dynamo`` wrapper would only set it to ``None`` again: calling the function
    directly is the same and skips that wrapper's cost."""
    return _get_eval_frame_callback() not in (None, False)


def compile_activation_memory_budget(fraction: float) -> Any:
    """A context manager: inside it, ``torch.compile``'s partitioner keeps at most ``fraction``
    of its default activation memory (2.11-2.15: ``torch._functorch.config``'s
    ``activation_memory_budget``); ``benchmarks/planner.py`` compares the planner with it."""
    from torch._functorch import config

    return config.patch(activation_memory_budget=fraction)
