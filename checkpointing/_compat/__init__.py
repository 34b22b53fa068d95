"""The only module that touches private PyTorch APIs.

Each name here wraps one private torch API, with a comment saying what it is for and the releases
it is checked against. The supported range is torch 2.11 to 2.15 (SPEC §12); where a release lacks
an API, the wrapper says so and carries the fallback. Every other module imports from here instead
of reaching into ``torch._C`` or ``torch.utils._*``; when torch moves one of these, this file is
the one place to fix.

The release gate runs before any private import, so that an unsupported torch meets our message
and not an ``ImportError`` from deep inside torch.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
"""The installed torch's (major, minor) release."""
OLDEST_SUPPORTED: tuple[int, int] = (2, 11)
NEWEST_CHECKED: tuple[int, int] = (2, 15)
_MSG_UNSUPPORTED_TORCH = (
    "checkpointing supports torch 2.11 to 2.15, but torch {found} is installed (checkpointing "
    "relies on autograd and dispatch internals that older releases lack or spell differently). "
    "Fix: upgrade PyTorch to 2.11 or newer with the wheel for your accelerator, e.g. "
    "`pip install --upgrade 'torch>=2.11'`."
)
if TORCH_VERSION < OLDEST_SUPPORTED:
    raise ImportError(_MSG_UNSUPPORTED_TORCH.format(found=torch.__version__))

# Every private import sits below the gate (ruff's E402 is off for this file for that reason).
from torch._C._autograd import SavedTensor as SavedTensor
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _get_eval_frame_callback
from torch._higher_order_ops.effects import has_effects as _has_effects
from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper as _dynamo_bypassing_wrapper
from torch._higher_order_ops.wrap import inductor_compiled_code as inductor_compiled_code
from torch._ops import HigherOrderOperator as HigherOrderOperator
from torch._ops import OpOverload as OpOverload
from torch._ops import OpOverloadPacket as OpOverloadPacket
from torch.autograd.graph import _engine_run_backward
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as checkpoint_wrapper
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext as DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves as tree_leaves

_F = TypeVar("_F", bound=Callable[..., Any])

# Pytree helpers (2.11-2.15, ``torch.utils._pytree``): ``tree_leaves`` only. ``tree_flatten`` and
# ``tree_map`` leave a few cyclic objects per call (a self-referencing closure), which a hot path
# must not do (SPEC §6, "No garbage"); where a structure must be rebuilt, walk it by hand
# (``_selective.cache._map_leaves``, ``_scope.ops._flatten``).


# --- Saving a region's inputs (``_frame``, NOTE [Nestable checkpoint], Rule 2) -----------------
# A region's tensor inputs are saved the way autograd saves an op's inputs: through the hooks
# active at the call (a parent checkpoint's, so nesting works), and with the version check that
# turns an in-place change before backward into autograd's usual error.

if hasattr(torch._C._autograd, "_make_saved_tensor"):  # 2.12 and newer
    _make_saved_tensor = torch._C._autograd._make_saved_tensor

    def save_inputs(args: Sequence[Any]) -> list[Any]:
        """``args`` with each tensor replaced by a ``SavedTensor`` (2.12-2.15:
        ``torch._C._autograd._make_saved_tensor(t, is_output=False)``)."""
        return [
            _make_saved_tensor(a, is_output=False) if isinstance(a, torch.Tensor) else a
            for a in args
        ]

    def unpack_inputs(saved: list[Any]) -> list[Any]:
        """The inputs ``save_inputs`` saved, unpacked (the version check runs here)."""
        return [a.unpack() if isinstance(a, SavedTensor) else a for a in saved]

else:  # 2.11: no way to make a SavedTensor from Python

    class _KeepInputs(torch.autograd.Function):
        """Saves its tensor arguments for a backward that never runs: autograd then holds
        them as saved inputs (hooks and version check included), as torch 2.11's own
        checkpoint does. The first argument is an anchor that requires grad, so that a node
        exists to hold them. It runs below the dispatch modes (``save_inputs``): as on newer
        releases, a mode sees only the region's own ops (torch 2.11's checkpoint shows it two
        ``aten.empty`` per region)."""

        @staticmethod
        def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(*tensors)
            return torch.empty((0,))

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> Any:
            raise RuntimeError("checkpointing: the node that keeps a region's inputs ran")

    class _InputSlot:
        """Where a saved input sits: the node's output that keeps it alive, and its index."""

        __slots__ = ("index", "keeper")

        def __init__(self, keeper: torch.Tensor, index: int) -> None:
            self.keeper = keeper
            self.index = index

    def save_inputs(args: Sequence[Any]) -> list[Any]:
        """``args`` with each tensor replaced by its slot in one node that saved them all
        (2.11: a no-op ``autograd.Function``; the caller has grad mode on)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            return list(args)
        with _disable_current_modes():
            anchor = torch.empty((0,), requires_grad=True)
            keeper = _KeepInputs.apply(anchor, *tensors)  # type: ignore[no-untyped-call]  # untyped
        saved: list[Any] = []
        count = 0
        for a in args:
            if isinstance(a, torch.Tensor):
                saved.append(_InputSlot(keeper, count))
                count += 1
            else:
                saved.append(a)
        return saved

    def unpack_inputs(saved: list[Any]) -> list[Any]:
        """The inputs ``save_inputs`` saved: the node's saved tensors are unpacked once, all
        together (a parent checkpoint hands each one out once per backward)."""
        values: tuple[torch.Tensor, ...] | None = None
        out: list[Any] = []
        for a in saved:
            if type(a) is _InputSlot:
                if values is None:
                    values = a.keeper.grad_fn.saved_tensors  # type: ignore[union-attr]
                out.append(values[a.index])
            else:
                out.append(a)
        return out


def storage_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of a CPU tensor's storage as ``bytes``, invisible to dispatch and function modes
    (no aten op runs; the torch-function guard is entered only when a mode is active; 2.11-2.15:
    ``torch._C._is_torch_function_mode_enabled``)."""
    if torch._C._is_torch_function_mode_enabled():
        with torch._C.DisableTorchFunction():
            storage = tensor.untyped_storage()
    else:
        storage = tensor.untyped_storage()
    return ctypes.string_at(storage.data_ptr(), storage.nbytes())


# Direct aliases, not wrappers: both run on every unpack of a saved tensor.
current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""Id of the backward graph task running on this thread, -1 outside backward (2.11-2.15)."""

get_graph_exec_group: Callable[[], object | None] = torch._C._get_graph_exec_group
"""The active ``GraphExecGroup`` (a thread-local kept by autograd's C++ side, 2.11-2.15)."""


def set_graph_exec_group(group: object | None) -> None:
    """Set or clear the active ``GraphExecGroup`` (2.11-2.15)."""
    # The stub names torch's own GraphExecGroup; the C++ side stores any object.
    torch._C._set_graph_exec_group(group)  # type: ignore[arg-type]


def is_checkpoint_valid() -> bool:
    """False inside ``torch.autograd.grad`` / ``backward(inputs=...)``, where reentrant
    checkpoint cannot work (2.11-2.15: ``torch.autograd._is_checkpoint_valid``)."""
    return bool(torch.autograd._is_checkpoint_valid())  # type: ignore[no-untyped-call]


def run_backward(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads)`` for the reentrant checkpoint's inner backward,
    where ``grads`` come from autograd itself, straight into the engine through torch's own
    helper (2.11-2.15: ``torch.autograd.graph._engine_run_backward``), skipping the argument
    processing that ``backward`` repeats in Python for every call. Anything that processing
    would act on goes through ``torch.autograd.backward`` itself: functorch transforms,
    ``__torch_function__`` tensors, and a grad whose shape is not its output's (its error)."""
    if (
        torch._C._are_functorch_transforms_active()
        or torch.overrides.has_torch_function(outputs)
        or any(out.shape != grad.shape for out, grad in zip(outputs, grads, strict=True))
    ):
        torch.autograd.backward(outputs, grads)
        return
    _engine_run_backward(
        tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


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


def active_device_context() -> DeviceContext | None:
    """The innermost ``with torch.device(...)`` mode on the function-mode stack, if any (2.11-2.15:
    ``torch.overrides._get_current_function_mode_stack`` and ``torch.utils._device``)."""
    if not torch._C._len_torch_function_stack():
        return None  # the common case, per checkpoint call: no function mode at all
    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]  # untyped in torch
    for mode in reversed(stack):
        if isinstance(mode, DeviceContext):
            return mode
    return None


def accelerator_initialized(device_module: Any) -> bool:
    """Whether an accelerator's runtime is already initialised, without initialising it (each
    device module keeps a private ``_initialized`` flag in 2.11-2.15; ``torch.cpu`` has none)."""
    return bool(getattr(device_module, "_initialized", False))


HookPair = tuple[Callable[..., Any], Callable[..., Any]]

top_saved_tensors_hooks: Callable[[], HookPair | None] = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False
)
"""The innermost default saved-tensors hook pair on this thread, or None (2.11-2.15). A C-level
call without a Python frame: it runs per checkpoint call (``user_saved_tensors_hooks``)."""


# Checkpoint-internal hooks (torch 2.14's protocol, which we follow on every release): a pack hook
# of checkpoint machinery says so with ``_checkpoint_internal = True`` and, while it is on the
# stack, names in ``_user_hooks`` the user's pair that was visible when it was pushed (or None).
# Selective checkpointing asks for the user's hooks through that chain: torch's own (2.14+) and
# ours, so neither mistakes the other's frame for a user hook. Torch 2.11-2.13 mark nothing; their
# checkpoint's hooks are recognised by their module, and what sits below them is unknown there.


def is_torch_checkpoint_hook(pack: object) -> bool:
    """Whether ``pack`` is a pack hook of ``torch.utils.checkpoint``'s own frames (its pack
    hooks are closures defined in that module, 2.11-2.15)."""
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint"


def resolve_user_hooks(hooks: HookPair | None) -> HookPair | None:
    """The user's pair behind ``hooks``: follow internal hooks down to the first user pair."""
    while hooks is not None:
        pack = hooks[0]
        if getattr(pack, "_checkpoint_internal", False):
            hooks = pack._user_hooks  # type: ignore[attr-defined]  # the protocol's mark
        elif is_torch_checkpoint_hook(pack):
            return None  # torch 2.11-2.13's checkpoint: no record of what is below it
        else:
            return hooks
    return None


def user_saved_tensors_hooks() -> HookPair | None:
    """The user's saved-tensors hook pair a tensor saved now would meet if checkpoint
    machinery were not in the way, or None. Runs per checkpoint call: the empty stack, the
    common case, costs one C call."""
    hooks = top_saved_tensors_hooks()
    if hooks is None:
        return None
    return resolve_user_hooks(hooks)


dispatch_mode_depth: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""How many Python dispatch modes are active in this thread, infra modes included (2.11-2.15)."""

has_torch_function_unary: Callable[[object], bool] = torch._C._has_torch_function_unary
"""Whether a call on this object would reach ``__torch_function__``: a subclass that overrides
it, or an active torch-function mode (2.11-2.15)."""

detach_below_modes: Callable[[torch.Tensor], torch.Tensor] = functools.partial(
    torch.Tensor._make_subclass, torch.Tensor
)
"""``tensor.detach()`` that no dispatch mode sees: the same alias (version counter shared,
``requires_grad`` off) as a mode that passes ``detach`` through unchanged would give, without
the ~2 us of a round trip into Python, and no Python frame of its own. Callers make sure that
is the only mode, no torch-function override or mode could see the call, and ``tensor`` is a
plain ``torch.Tensor`` (2.11-2.15: ``Tensor._make_subclass`` stashes the dispatch-mode stack and
turns the Python dispatcher off around its detach)."""


def push_saved_tensors_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
    """Push a default saved-tensors hook pair without a context manager (2.11-2.15)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    """Pop the innermost default saved-tensors hook pair (2.11-2.15)."""
    torch._C._autograd._pop_saved_tensors_default_hooks()


# --- Selective checkpointing (``_selective``): op types, aliases below autograd, tracing ---------
# All checked against torch 2.11-2.15 (the release gate above).


def detach_sharing_version(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``tensor`` that shares its version counter even when called below
    autograd, inside ``__torch_dispatch__`` (2.11-2.15: re-include the ADInplaceOrView key)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


def op_mutates_inputs(op: OpOverload | HigherOrderOperator) -> bool:
    """Whether ``op`` writes to any of its arguments (in-place and ``out=`` ops); higher-order
    operators are assumed to (2.11-2.15: ``OpOverload._schema.is_mutable``)."""
    if isinstance(op, OpOverload):
        return bool(op._schema.is_mutable)
    return True


def argument_index(op: OpOverload, name: str) -> int | None:
    """Position of the argument called ``name`` in ``op``'s schema, None if it has none
    (2.11-2.15: ``OpOverload._schema.arguments``)."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            return index
    return None


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


def has_ordered_effect(op: object) -> bool:
    """Whether ``op`` is registered with a side effect that must not run twice (printing, a
    torchbind call, ...), outside the ``c10d`` namespace, whose launches return a work handle
    that cannot stand in for running them (2.11-2.15: ``torch._higher_order_ops.effects``).
    Each release registers its own set of ops."""
    if getattr(op, "namespace", None) == "c10d":
        return False
    return bool(_has_effects(op))


# --- Scope API (``_scope``): tensor versions and view bases, op schemas --------------------------
# All checked against torch 2.11-2.15 (the release gate above).


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter, bumped by every in-place write (2.11-2.15:
    ``Tensor._version``)."""
    return int(tensor._version)


def op_runner(op: OpOverload) -> Callable[..., Any]:
    """What ``op(...)`` calls: same arguments and result, one Python frame fewer per call, for
    the scope's tape, which runs every op of a scope and replays it, and for selective
    checkpointing's two modes, which run every op of a region (2.11-2.15: ``OpOverload._op``)."""
    runner: Callable[..., Any] = op._op
    return runner


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor an autograd view was taken from (always a non-view), else None
    (2.11-2.15: ``Tensor._base``)."""
    return tensor._base


def written_arguments(op: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``op``'s schema marks as written, e.g. ``self`` of an
    in-place op or ``out`` (2.11-2.15: ``OpOverload._schema``)."""
    return tuple(
        (index, argument.name)
        for index, argument in enumerate(op._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def returns_alias(op: OpOverload) -> bool:
    """Whether ``op``'s schema lets an output alias an argument (``Tensor(a)``): a view, or the
    argument itself, as ``lift_fresh`` and in-place ops return (2.11-2.15:
    ``OpOverload._schema``)."""
    return any(result.alias_info is not None for result in op._schema.returns)


def forward_pre_hooks(module: torch.nn.Module) -> list[Callable[..., Any]]:
    """The forward pre-hooks registered on ``module`` (2.11-2.15: ``nn.Module._forward_pre_hooks``;
    there is no public accessor)."""
    return list(module._forward_pre_hooks.values())


def remove_forward_hooks(
    module: torch.nn.Module, pre_hook: Callable[..., Any], hook: Callable[..., Any]
) -> None:
    """Remove the forward pre-hook ``pre_hook`` and forward hook ``hook`` (compared with ``==``,
    so bound methods of one object match) from ``module``. A ``RemovableHandle`` would do, but
    ``copy.deepcopy`` of a module copies its hooks and not the handles' targets (2.11-2.15: the
    ``nn.Module._forward_*hooks*`` dicts)."""
    for key in [k for k, h in module._forward_pre_hooks.items() if h == pre_hook]:
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in [k for k, h in module._forward_hooks.items() if h == hook]:
        del module._forward_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)


# torch.distributed's wrappers, 2.11-2.15: ``checkpoint_wrapper`` above (``_wrappers`` subclasses).
def wrap_policy_targets(policy: object, root: torch.nn.Module) -> dict[Any, Any] | None:
    """Modules an FSDP policy object picks in ``root``, with kwargs (``_Policy._run_policy``)."""
    run = getattr(policy, "_run_policy", None)
    return None if run is None else dict(run(root, ignored_modules=set(), root_kwargs={}))


def process_group_named(name: str) -> Any:
    """The process group a functional collective's ``group_name`` argument names (2.11-2.15:
    ``torch._C._distributed_c10d._resolve_process_group``)."""
    from torch._C._distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]  # a NewType of str


def default_store() -> Any:
    """The key-value store of the default process group, which every rank reaches (2.11-2.15:
    ``torch.distributed.distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


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


# === Saved-tensor report (``_report``): reading the graph without unpacking it ===================
# Owned by the report; other parts of this file belong to other modules. A report built from a loss
# reads what each autograd node saved through its raw accessors, which give the packed value and the
# unpack hook of each save: unpacking instead would run a checkpoint's recompute.

_RAW_PREFIX = "_raw_saved_"
_raw_attributes: dict[type, tuple[str, ...]] = {}


def raw_saves(node: Any) -> list[tuple[str, Any, Any]]:
    """(what, packed value, unpack hook) of each tensor ``node`` saved, never unpacked; the
    packed value is None once backward has freed it (2.11-2.15: the ``_raw_saved_<name>``
    accessors of built-in nodes, ``_raw_saved_tensors`` of a custom ``autograd.Function``'s,
    each a ``SavedTensor`` with ``.data`` and ``.unpack_hook``)."""
    kind = type(node)
    names = _raw_attributes.get(kind)
    if names is None:
        names = _raw_attributes[kind] = tuple(n for n in dir(node) if n.startswith(_RAW_PREFIX))
    saves: list[tuple[str, Any, Any]] = []
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # a custom Function's saves, freed by backward: nothing to read
            continue
        what = name.removeprefix(_RAW_PREFIX)
        if isinstance(value, SavedTensor):
            saves.append((what, *_packed(value)))
        elif isinstance(value, (tuple, list)):  # a list of tensors, or a custom Function's
            saves.extend(
                (f"{what}[{i}]", *_packed(v))
                for i, v in enumerate(value)
                if isinstance(v, SavedTensor)
            )
    return saves


def _packed(saved: SavedTensor) -> tuple[Any, Any]:
    """(packed value, unpack hook) of one ``SavedTensor`` (torch's stubs omit both)."""
    return saved.data, saved.unpack_hook  # type: ignore[attr-defined]  # missing from the stubs


def raw_saved_input(entry: object) -> tuple[Any, Any] | None:
    """(packed value, unpack hook) of a region input that ``save_inputs`` saved, never
    unpacked; None for an argument that is not a saved tensor (2.12-2.15: a ``SavedTensor``;
    2.11: a slot of the no-op node that saved the inputs, read through its node's raw saves)."""
    if isinstance(entry, SavedTensor):
        return _packed(entry)
    keeper = getattr(entry, "keeper", None)
    index = getattr(entry, "index", None)
    if isinstance(keeper, torch.Tensor) and isinstance(index, int) and keeper.grad_fn is not None:
        saves = raw_saves(keeper.grad_fn)
        if index < len(saves):
            return saves[index][1], saves[index][2]
    return None


def node_sequence_number(node: Any) -> int:
    """The order in which autograd made ``node`` during forward (2.11-2.15:
    ``Node._sequence_nr()``), so that a graph walk can list rows in forward order."""
    return int(node._sequence_nr())


def attach_cuda_oom_observer(observer: Callable[[int, int, int, int], None]) -> bool:
    """Have CUDA's caching allocator call ``observer(device, requested, allocated, free)`` just
    before it raises an out-of-memory error; False where there is no CUDA (a CPU build, or no
    device). torch offers no way to detach one (2.11-2.15:
    ``torch._C._cuda_attach_out_of_memory_observer``): attach once and dispatch from there."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
        return False
    attach(observer)
    return True


# --- Host copies off the critical path (``_offload``'s CUDA backend) ------------------------------
# The stream, event and pinned-memory calls of offload, each in one place (2.11-2.15). All are
# public ``torch.cuda`` APIs except the end-of-backward callback; they live here so that
# ``_offload`` names no CUDA call itself and its tests can swap the whole set for a fake.


def cuda_current_stream(device: torch.device) -> Any:
    """The stream work on ``device`` is queued on now (``torch.cuda.current_stream``)."""
    return torch.cuda.current_stream(device)


def cuda_new_stream(device: torch.device) -> Any:
    """A side stream of ``device`` (``torch.cuda.Stream``), for copies off the compute stream."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch's stub is untyped


def cuda_record_event(stream: Any, timing: bool = False) -> Any:
    """An event recorded on ``stream`` now; ``timing`` makes it usable by ``cuda_elapsed``."""
    event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]  # untyped
    event.record(stream)
    return event


def cuda_wait_event(stream: Any, event: Any) -> None:
    """Work queued on ``stream`` from now on starts after ``event`` (never blocks the host)."""
    stream.wait_event(event)


def cuda_event_done(event: Any) -> bool:
    """Whether the device has passed ``event`` (a query: never blocks)."""
    return bool(event.query())


def cuda_elapsed_seconds(start: Any, end: Any) -> float:
    """Seconds between two timing events, waiting for ``end`` on the host (read after a step)."""
    end.synchronize()
    return float(start.elapsed_time(end)) / 1000.0


def cuda_pinned_bytes(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer of ``nbytes`` bytes (uint8), for non-blocking copies."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def cuda_copy_to_host(host: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
    """Queue ``host.copy_(source)`` on ``stream`` without blocking the host."""
    with torch.cuda.stream(stream):
        host.copy_(source, non_blocking=True)


def cuda_copy_to_device(host: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
    """A new ``device`` tensor with ``host``'s strides, allocated for ``stream`` and filled on it
    by a non-blocking copy (the caller makes other streams wait and records their use)."""
    with torch.cuda.stream(stream):
        restored = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        restored.copy_(host, non_blocking=True)
    return restored


def cuda_record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator ``stream`` uses ``tensor``: its block is not reused before the
    work queued on ``stream`` at the time it is freed has run (``Tensor.record_stream``)."""
    tensor.record_stream(stream)


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward running in this thread ends; False outside a backward
    (2.11-2.15: ``Variable._execution_engine.queue_callback``, as FSDP uses it)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True
