"""Forward-time global state, captured once and restored for recompute.

Owns ``ForwardState``: the CPU RNG state, the RNG state of each accelerator device the inputs live
on, the autocast state (the inputs' device type and CPU), and the active ``torch.device(...)``
context. Every mechanism (reentrant ``CheckpointFunction``, the non-reentrant frame, the scope)
captures through ``ForwardState.capture`` and re-enters through ``ForwardState.restored``; no other
module reads or sets RNG or autocast state.

It also owns the parity helpers of ``torch.utils.checkpoint`` that are about this state:
``DefaultDeviceType``, ``get_device_states``, ``set_device_states``, ``detach_variable``,
``check_backward_validity`` and ``noop_context_fn``.

NOTE [RNG state shared when identical]
  Rule 1. With ``preserve_rng_state=True`` the CPU RNG state is captured before every region
          runs (we cannot know in advance whether it draws random numbers).
  Rule 2. A capture byte-identical to the previous one shares its tensor: a chain of regions that
          draw no random numbers keeps one ~5 KB state in all, where torch keeps one per call.
          Identity is decided by comparing the bytes, never by guessing whether the region drew
          numbers, so replay always starts from the exact state the forward saw.
  Rule 3. With ``preserve_rng_state=True`` the caller's own RNG stream is put back after a
          recompute, as torch does.
  Rejected: dropping the state when the forward left the stream unchanged: a region that draws
  and then puts the stream back itself (``torch.random.fork_rng``) would replay with other
  numbers, a silent wrong gradient. Also rejected: ``torch.equal`` for the comparison (an aten op
  that user dispatch modes would see, ~4 us); ``bytes`` of the storage cost ~2 us with the capture.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch
import torch.utils.checkpoint as _torch_checkpoint

from ._compat import (
    DeviceContext,
    accelerator_initialized,
    active_device_context,
    storage_bytes,
    tree_leaves,
)

__all__ = [
    "DefaultDeviceType",
    "ForwardState",
    "GeneratorStates",
    "RecomputeStateHook",
    "autocast_disabled",
    "check_backward_validity",
    "default_generator",
    "detach_variable",
    "enter_span",
    "exit_span",
    "get_device_states",
    "infer_device_type",
    "is_noop_context_fn",
    "is_recomputing",
    "leave_spans",
    "marked_as_recompute",
    "noop_context_fn",
    "recompute_depth",
    "set_device_states",
    "shared_cpu_rng_state",
    "span_depth",
    "state_hooks_from",
]

_MSG_MIXED_DEVICE_TYPES = (
    "Tensor arguments, excluding CPU tensors, are detected on at least two types of devices. "
    "Device state will only be saved for devices of a single device type, and the remaining "
    "devices will be ignored. Consequently, if any checkpointed functions involve randomness, "
    "this may result in incorrect gradients. (Note that if CUDA devices are among the devices "
    "detected, it will be prioritized; otherwise, the first device encountered will be "
    "selected.)\nDevice types: {types} first device type: {first}"
)


_recompute_depth: ContextVar[int] = ContextVar("checkpointing_recompute_depth", default=0)


def is_recomputing() -> bool:
    """True while a checkpointed region (any mechanism) is being re-run for backward.

    User code can use it to tell the original forward from recompute, e.g. to skip logging or
    a forward hook's side effect the second time.

    In code that ``torch.compile`` traces it is ``False``: the compiled code is traced once and
    serves forward and the compiler's recompute alike.
    """
    if torch.compiler.is_dynamo_compiling():
        return False
    return _recompute_depth.get() > 0


recompute_depth: Callable[[], int] = _recompute_depth.get
"""How many recomputes are running in this context (0 outside any): ``is_recomputing()`` as one
C-level call, for per-op paths."""


@contextlib.contextmanager
def marked_as_recompute() -> Iterator[None]:
    """Make ``is_recomputing()`` true for the body: the scope's tape replay uses it;
    ``ForwardState.restored()`` sets the same depth inline (its class-based context is the
    checkpoint's per-recompute path and skips a generator frame)."""
    token = _recompute_depth.set(_recompute_depth.get() + 1)
    try:
        yield
    finally:
        _recompute_depth.reset(token)


_span_depth: ContextVar[int] = ContextVar("checkpointing_kept_span_depth", default=0)

span_depth: Callable[[], int] = _span_depth.get
"""How many kept spans (``checkpointing.keep``) are running in this context: selective
checkpointing's modes pass the ops of a span through untouched (NOTE [Kept spans], Rule 6). One
C-level call, for per-op paths."""


def enter_span() -> Token[int]:
    """Mark the start of a kept span's forward or replay (``_keep``); ``exit_span`` ends it."""
    return _span_depth.set(_span_depth.get() + 1)


def leave_spans() -> Token[int]:
    """Run what follows as outside any kept span (a checkpoint inside one); ``exit_span``
    ends it."""
    return _span_depth.set(0)


def exit_span(token: Token[int]) -> None:
    """End what ``enter_span`` or ``leave_spans`` started."""
    _span_depth.reset(token)


def noop_context_fn() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """The default ``context_fn``: run forward and recompute under no extra context."""
    return contextlib.nullcontext(), contextlib.nullcontext()


def is_noop_context_fn(context_fn: object) -> bool:
    """Ours or torch's ``noop_context_fn``: code moving over from torch may pass either."""
    return context_fn is noop_context_fn or context_fn is _torch_checkpoint.noop_context_fn


def detach_variable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detach every tensor of a tuple, keeping its ``requires_grad`` (parity helper)."""
    if not isinstance(inputs, tuple):
        raise RuntimeError(
            "Only tuple of tensors is supported. Got Unsupported input type: "
            f"{type(inputs).__name__}"
        )
    out: list[Any] = []
    for inp in inputs:
        if isinstance(inp, torch.Tensor):
            detached = inp.detach()
            detached.requires_grad = inp.requires_grad
            out.append(detached)
        else:
            out.append(inp)
    return tuple(out)


def check_backward_validity(inputs: Iterable[Any]) -> None:
    """Warn when no tensor input requires grad: the checkpointed part gets no gradient."""
    if not any(inp.requires_grad for inp in inputs if isinstance(inp, torch.Tensor)):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None", stacklevel=2
        )


class DefaultDeviceType:
    """The device type whose RNG and autocast state is captured when no input is on an
    accelerator: the current accelerator if there is one, else ``"cpu"`` (parity class)."""

    _default_device_type: str | None = None

    @staticmethod
    def set_device_type(device: str = "cuda") -> None:
        """Set the default device type for checkpointing."""
        DefaultDeviceType._default_device_type = device

    @staticmethod
    def get_device_type() -> str:
        """The default device type, resolved lazily without initialising an accelerator."""
        if not DefaultDeviceType._default_device_type:
            acc = torch.accelerator.current_accelerator(True)
            DefaultDeviceType._default_device_type = acc.type if acc is not None else "cpu"
        return DefaultDeviceType._default_device_type


def _tensors_in(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors in ``args``, looking inside containers only when there are any."""
    tensors: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif isinstance(a, (tuple, list, dict)):
            return [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    return tensors


def infer_device_type(*args: Any) -> str:
    """The accelerator type of the inputs (CUDA first), else the default device type."""
    device_types = [t.device.type for t in _tensors_in(args) if not t.is_cpu]
    if not device_types:
        return DefaultDeviceType.get_device_type()
    unique = set(device_types)
    if len(unique) > 1:
        warnings.warn(
            _MSG_MIXED_DEVICE_TYPES.format(types=sorted(unique), first=device_types[0]),
            stacklevel=3,
        )
    return "cuda" if "cuda" in unique else device_types[0]


def _device_module(device_type: str) -> Any:
    """``torch.cuda``, ``torch.xpu``, ... for a device type (``meta`` has no RNG)."""
    if device_type == "meta":
        return torch.device("meta")
    return getattr(torch, device_type)


def get_device_states(*args: Any) -> tuple[list[int], list[torch.Tensor]]:
    """The ids of the accelerator devices the inputs live on, and each one's RNG state."""
    device_ids = [t.get_device() for t in _tensors_in(args) if t.device.type not in ("cpu", "meta")]
    module = _device_module(infer_device_type(*args))
    states = []
    for device_id in device_ids:
        with module.device(device_id):
            states.append(module.get_rng_state())
    return device_ids, states


def set_device_states(
    devices: list[int], states: list[torch.Tensor], *, device_type: str | None = None
) -> None:
    """Set the RNG state of each device id (parity helper; ``meta`` is a no-op)."""
    if device_type is None:
        device_type = DefaultDeviceType.get_device_type()
    if device_type == "meta":
        return
    module = _device_module(device_type)
    for device, state in zip(devices, states, strict=False):
        with module.device(device):
            module.set_rng_state(state)


# The last capture, weakly (sharing must never keep a state alive after its regions are gone),
# with its bytes, so that each capture copies out only its own. One tuple, set in one step.
_last_cpu_rng: tuple[weakref.ref[torch.Tensor], bytes] | None = None


def shared_cpu_rng_state() -> torch.Tensor:
    """The CPU RNG state now, as the same tensor as the previous capture when the bytes are
    identical (See NOTE [RNG state shared when identical], Rule 2). Sharing is decided on the
    full bytes, so unequal states are never shared; racing threads can only miss a chance to
    share. (Hashing the 5 KB to pick a candidate costs more than comparing them.)"""
    global _last_cpu_rng
    state = torch.get_rng_state()
    state_bytes = storage_bytes(state)
    last = _last_cpu_rng
    if last is not None and last[1] == state_bytes:
        previous = last[0]()
        if previous is not None:
            return previous
    _last_cpu_rng = (weakref.ref(state), state_bytes)
    return state


# Autocast state of one device type: enabled, dtype, cache enabled. A plain tuple: one is made
# per capture and two per recompute, and a NamedTuple's Python-level constructor costs more.
_Autocast: TypeAlias = tuple[bool, torch.dtype, bool]


def _autocast_now(device_type: str) -> _Autocast:
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


class ForwardState:
    """What a region's forward saw, to be seen again by its recompute.

    See NOTE [RNG state shared when identical].
    """

    __slots__ = (
        "cpu_autocast",
        "cpu_rng",
        "device_autocast",
        "device_ctx",
        "device_ids",
        "device_rng",
        "device_type",
        "had_device",
        "preserve_rng_state",
    )

    def __init__(self, args: tuple[Any, ...], preserve_rng_state: bool) -> None:
        self.device_type = infer_device_type(*args)
        self.device_autocast: _Autocast | None = (
            _autocast_now(self.device_type)
            if self.device_type != "cpu" and torch.amp.is_autocast_available(self.device_type)
            else None
        )
        self.cpu_autocast = _autocast_now("cpu")
        self.device_ctx: DeviceContext | None = active_device_context()
        self.preserve_rng_state = preserve_rng_state
        self.cpu_rng: torch.Tensor | None = None
        self.device_ids: list[int] = []
        self.device_rng: list[torch.Tensor] = []
        # Never initialise an accelerator by accident: only read its RNG if it already runs.
        self.had_device = (
            preserve_rng_state
            and self.device_type != "cpu"
            and accelerator_initialized(_device_module(self.device_type))
        )
        if preserve_rng_state:
            self.cpu_rng = shared_cpu_rng_state()  # See NOTE [RNG state ...], Rules 1 and 2
            if self.had_device:
                self.device_ids, self.device_rng = get_device_states(*args)

    def device_initialized_during(self, preserve_rng_state: bool) -> bool:
        """True when the accelerator was started inside the region (its RNG was not saved)."""
        return (
            preserve_rng_state
            and not self.had_device
            and self.device_type != "cpu"
            and accelerator_initialized(_device_module(self.device_type))
        )

    def restored(self) -> AbstractContextManager[None]:
        """A context that runs its body (a recompute) under the forward's RNG, autocast and
        device context, with ``is_recomputing()`` true; afterwards the caller's RNG streams
        are as they were (See NOTE [RNG state ...], Rule 3)."""
        return _Restored(self)

    def _autocast_contexts(self) -> list[AbstractContextManager[Any]]:
        # Entering autocast costs a few microseconds; skip it when the state already matches.
        wanted: list[tuple[str, _Autocast]] = []
        if self.device_autocast is not None:
            wanted.append((self.device_type, self.device_autocast))
        wanted.append(("cpu", self.cpu_autocast))
        return [
            torch.amp.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
            for device_type, (enabled, dtype, cache) in wanted
            if _autocast_now(device_type) != (enabled, dtype, cache)
        ]


class _Restored:
    """``ForwardState.restored()``: a plain class, not a generator context, because it runs
    once per recompute and the common case (no RNG used, autocast unchanged) must cost little.
    """

    __slots__ = ("exits", "outer_cpu_rng", "state", "token")

    def __init__(self, state: ForwardState) -> None:
        self.state = state
        self.exits: contextlib.ExitStack | None = None
        self.outer_cpu_rng: torch.Tensor | None = None

    def __enter__(self) -> None:
        state = self.state
        if state.cpu_rng is not None:  # See NOTE [RNG state ...], Rule 3
            self.outer_cpu_rng = torch.get_rng_state()
            torch.set_rng_state(state.cpu_rng)
        self.token = _recompute_depth.set(_recompute_depth.get() + 1)
        autocasts = state._autocast_contexts()
        switch_device = (
            state.device_ctx is not None and active_device_context() is not state.device_ctx
        )
        if not (state.device_rng or autocasts or switch_device):
            return  # the common case: nothing else to enter
        self.exits = contextlib.ExitStack()
        try:
            if state.device_rng:
                self.exits.enter_context(
                    torch.random.fork_rng(devices=state.device_ids, device_type=state.device_type)
                )
                set_device_states(state.device_ids, state.device_rng, device_type=state.device_type)
            for ctx in autocasts:
                self.exits.enter_context(ctx)
            if switch_device and state.device_ctx is not None:
                self.exits.enter_context(state.device_ctx)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        _recompute_depth.reset(self.token)
        try:
            if self.exits is not None:
                self.exits.__exit__(*exc)  # type: ignore[arg-type]  # forwards the exc triple
        finally:
            if self.outer_cpu_rng is not None:
                torch.set_rng_state(self.outer_cpu_rng)


ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


@runtime_checkable
class RecomputeStateHook(Protocol):
    """User state (not torch's) that a recompute must see as the forward did, e.g. a counter
    that seeds a custom random kernel: ``checkpoint(..., recompute_state_hooks=[hook])``.

    ``snapshot()`` is called in forward when a region starts and when each kept span ends;
    ``restore(state)`` in the recompute, at its start and after each skipped span. Around the
    recompute the caller's own state is snapshotted and put back, as the RNG is."""

    def snapshot(self) -> Any:
        """The state now, in any form ``restore`` accepts."""

    def restore(self, state: Any) -> None:
        """Put back a state ``snapshot`` returned."""


_MSG_STATE_HOOKS = (
    "{api}: recompute_state_hooks must be objects with snapshot() and restore(state) methods "
    "(or a list of them), got {what}. Fix: e.g. a class with `def snapshot(self): return "
    "self.counter` and `def restore(self, state): self.counter = state`."
)


def state_hooks_from(value: object, api: str) -> tuple[RecomputeStateHook, ...]:
    """``recompute_state_hooks=`` as a tuple (one hook or an iterable of them), or a clear
    ``TypeError``."""
    if value is None:
        return ()
    hooks = (value,) if isinstance(value, RecomputeStateHook) else value
    if isinstance(hooks, str | bytes) or not isinstance(hooks, Iterable):
        raise TypeError(_MSG_STATE_HOOKS.format(api=api, what=type(value).__name__))
    found = tuple(hooks)
    for hook in found:
        if not isinstance(hook, RecomputeStateHook):
            raise TypeError(_MSG_STATE_HOOKS.format(api=api, what=type(hook).__name__))
    return found


def default_generator(device: torch.device) -> torch.Generator | None:
    """The generator a random op on ``device`` draws from when given none (None for ``meta``
    and for device types that expose no default generators)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "meta":
        return None
    module = _device_module(device.type)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    index = device.index if device.index is not None else module.current_device()
    generator: torch.Generator = generators[index]
    return generator


class GeneratorStates:
    """The state of each generator a recorded region drew from, taken just before its first draw.

    Used by the scope API, whose tape sees every random op (and its explicit ``generator=``)
    as it runs and notes, per draw, the state it drew from: replaying a random op from its own
    state reproduces that draw, whichever other draws are replayed.
    """

    __slots__ = ("_states",)

    def __init__(self) -> None:
        self._states: list[tuple[torch.Generator, torch.Tensor]] = []

    def note(self, generator: torch.Generator) -> torch.Tensor:
        """Return ``generator``'s state now, and remember it if this is its first draw."""
        state = generator.get_state()
        if all(known is not generator for known, _ in self._states):
            self._states.append((generator, state))
        return state

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body with every noted generator back at its noted state; afterwards each is
        where the caller had it (See NOTE [RNG state shared when identical], Rule 3)."""
        outer = [(generator, generator.get_state()) for generator, _ in self._states]
        for generator, state in self._states:
            generator.set_state(state)
        try:
            yield
        finally:
            for generator, state in outer:
                generator.set_state(state)


@contextlib.contextmanager
def autocast_disabled(device_types: Iterable[str]) -> Iterator[None]:
    """Turn autocast off for the body on each of ``device_types`` where it is on (replaying ops
    recorded below autocast must not cast them again)."""
    with contextlib.ExitStack() as stack:
        for device_type in device_types:
            if device_type != "meta" and torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.amp.autocast(device_type, enabled=False))
        yield
