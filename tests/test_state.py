"""``_state``: the parity helpers (side by side with torch.utils.checkpoint) and ``ForwardState``.

See NOTE [RNG state shared when identical] in ``checkpointing/_state.py``: each rule has a
test here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import releases
import torch
import torch.utils.checkpoint as tc

import checkpointing
from checkpointing._state import ForwardState, infer_device_type


def _recorded(call: Callable[[], object]) -> list[tuple[type[Warning], str]]:
    """Run ``call`` and return the (category, message) of every warning it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [(w.category, str(w.message)) for w in caught]


def _raised(call: Callable[[], object]) -> tuple[type[BaseException], str]:
    """Run ``call``, which must raise, and return the exception type and message."""
    with pytest.raises(Exception) as info:  # noqa: PT011 - compared with torch by the caller
        call()
    return info.type, str(info.value)


@pytest.fixture
def default_device_type() -> Iterator[None]:
    """Put ``DefaultDeviceType`` (ours and torch's) back as the test found it."""
    ours, theirs = checkpointing.DefaultDeviceType, tc.DefaultDeviceType
    saved = ours._default_device_type, theirs._default_device_type
    yield
    ours._default_device_type, theirs._default_device_type = saved


# --- detach_variable -------------------------------------------------------------------------


# torch 2.12 formats detach_variable's message as one string; torch 2.11 gives RuntimeError a
# tuple of its two parts, so its message reads "('Only tuple ... type: ', 'list')".
_DETACH_MESSAGE_FORMATTED = (2, 12)


@pytest.mark.parametrize(
    "lib",
    [
        pytest.param(checkpointing, id="ours"),
        pytest.param(
            tc,
            id="torch",
            marks=releases.needs_torch(
                _DETACH_MESSAGE_FORMATTED, "detach_variable's one-string message"
            ),
        ),
    ],
)
@pytest.mark.parametrize("bad", [[torch.ones(1)], torch.ones(1), None, {"x": torch.ones(1)}])
def test_detach_variable_rejects_non_tuples_like_torch(lib: Any, bad: object) -> None:
    """A non-tuple argument raises RuntimeError with torch 2.12+'s exact message (its type)."""
    expected = "Only tuple of tensors is supported. Got Unsupported input type: "
    assert _raised(lambda: lib.detach_variable(bad)) == (
        RuntimeError,
        expected + type(bad).__name__,
    )


def test_detach_variable_keeps_requires_grad_and_non_tensors() -> None:
    """Tensors come back detached (same storage, no history), requires_grad kept; others as is."""
    leaf = torch.randn(3, requires_grad=True)
    inputs = (leaf * 2, torch.ones(2), 7, None, "s")
    ours = checkpointing.detach_variable(inputs)
    theirs = tc.detach_variable(inputs)
    assert len(ours) == len(theirs) == len(inputs)
    for mine, ref, original in zip(ours, theirs, inputs, strict=True):
        if isinstance(original, torch.Tensor):
            assert mine.grad_fn is None
            assert mine.is_leaf
            assert mine.requires_grad == ref.requires_grad == original.requires_grad
            assert mine.data_ptr() == original.data_ptr()
            assert mine is not original
        else:
            assert mine is original
            assert ref is original


def test_detach_variable_empty_tuple() -> None:
    """An empty tuple gives an empty tuple, as in torch."""
    assert checkpointing.detach_variable(()) == tc.detach_variable(()) == ()


# --- check_backward_validity -----------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs",
    [
        (torch.ones(1),),
        (torch.ones(1), 3, None),
        (),
        (1, "a"),
        (torch.ones(1, requires_grad=True),),
        (torch.ones(1), torch.ones(1, requires_grad=True), 2),
    ],
    ids=["no-grad", "no-grad-mixed", "empty", "no-tensors", "grad", "one-grad"],
)
def test_check_backward_validity_warns_like_torch(inputs: tuple[Any, ...]) -> None:
    """Warns (same category and message as torch) exactly when no tensor input requires grad."""
    ours = _recorded(lambda: checkpointing.check_backward_validity(inputs))
    theirs = _recorded(lambda: tc.check_backward_validity(inputs))
    assert ours == theirs
    wants_warning = not any(isinstance(a, torch.Tensor) and a.requires_grad for a in inputs)
    assert len(ours) == int(wants_warning)
    if wants_warning:
        assert ours[0][0] is UserWarning
        assert "None of the inputs have requires_grad=True" in ours[0][1]


def test_check_backward_validity_accepts_a_generator() -> None:
    """Any iterable works, not only tuples (torch's annotation says Iterable)."""
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        checkpointing.check_backward_validity(t for t in [torch.ones(1)])


# --- device states on a CPU-only machine -----------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        (),
        (torch.ones(2),),
        (torch.ones(2), 3, "x", None),
        ([torch.ones(1), {"k": torch.ones(1)}], (torch.ones(1),)),
        (torch.empty(2, device="meta"),),
    ],
    ids=["none", "cpu", "cpu-mixed", "nested", "meta"],
)
def test_get_device_states_on_cpu_is_empty_like_torch(args: tuple[Any, ...]) -> None:
    """CPU and meta tensors have no device RNG state: both lists are empty, as in torch."""
    assert checkpointing.get_device_states(*args) == tc.get_device_states(*args) == ([], [])


@pytest.mark.parametrize("device_type", [None, "cpu", "meta"])
def test_set_device_states_with_nothing_is_a_noop(device_type: str | None) -> None:
    """Setting no device states changes nothing (CPU RNG included) and raises nothing."""
    before = torch.get_rng_state()
    checkpointing.set_device_states([], [], device_type=device_type)
    assert torch.equal(torch.get_rng_state(), before)


def test_set_device_states_meta_ignores_states() -> None:
    """For ``meta`` the states are ignored whatever they are, as in torch."""
    checkpointing.set_device_states([0], [torch.ones(1)], device_type="meta")
    tc.set_device_states([0], [torch.ones(1)], device_type="meta")


# --- DefaultDeviceType -----------------------------------------------------------------------


@pytest.mark.usefixtures("default_device_type")
def test_default_device_type_resolves_like_torch() -> None:
    """Unset, the default device type resolves as torch's does (``cpu`` without accelerator)."""
    checkpointing.DefaultDeviceType._default_device_type = None
    tc.DefaultDeviceType._default_device_type = None
    ours = checkpointing.DefaultDeviceType.get_device_type()
    assert ours == tc.DefaultDeviceType.get_device_type()
    if torch.accelerator.current_accelerator() is None:
        assert ours == "cpu"


@pytest.mark.usefixtures("default_device_type")
def test_default_device_type_set_and_get() -> None:
    """``set_device_type`` is read back by ``get_device_type``; its default argument is cuda."""
    checkpointing.DefaultDeviceType.set_device_type("meta")
    assert checkpointing.DefaultDeviceType.get_device_type() == "meta"
    assert infer_device_type(torch.ones(1)) == "meta"
    checkpointing.DefaultDeviceType.set_device_type()
    assert checkpointing.DefaultDeviceType.get_device_type() == "cuda"


@pytest.mark.usefixtures("default_device_type")
def test_set_device_states_uses_default_device_type() -> None:
    """With no ``device_type``, ``set_device_states`` uses the default one (meta: a no-op)."""
    checkpointing.DefaultDeviceType.set_device_type("meta")
    checkpointing.set_device_states([0], [torch.ones(1)])


def test_infer_device_type_prefers_non_cpu_tensors() -> None:
    """A non-CPU tensor anywhere in the arguments decides the device type."""
    meta = torch.empty(1, device="meta")
    assert infer_device_type(torch.ones(1), [3, {"m": meta}]) == "meta"
    assert infer_device_type(torch.ones(1), 2) == checkpointing.DefaultDeviceType.get_device_type()


# --- noop_context_fn -------------------------------------------------------------------------


def test_noop_context_fn_gives_two_usable_contexts() -> None:
    """It returns two fresh context managers that enter to None and change nothing."""
    first, second = checkpointing.noop_context_fn()
    assert len(checkpointing.noop_context_fn()) == len(tc.noop_context_fn()) == 2
    with first as a, second as b:
        assert a is None
        assert b is None
        assert torch.is_grad_enabled()
    third, _ = checkpointing.noop_context_fn()
    assert third is not first


# --- ForwardState: NOTE [RNG state shared when identical] ------------------------------------


def test_rule1_cpu_rng_captured_before_the_region() -> None:
    """Rule 1: with preserve on, the CPU state is captured at construction, equal to the current."""
    now = torch.get_rng_state()
    state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    assert state.cpu_rng is not None
    assert torch.equal(state.cpu_rng, now)


def test_no_rng_captured_without_preserve() -> None:
    """With preserve off nothing is captured and a restore leaves the caller's stream running."""
    state = ForwardState((torch.ones(1),), preserve_rng_state=False)
    assert state.cpu_rng is None
    assert state.device_rng == []
    torch.rand(3)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with state.restored():
        inside = torch.rand(4)
    assert torch.equal(inside, expected)


def test_rule2_identical_states_are_shared() -> None:
    """Rule 2: two captures with no draw in between share one state tensor."""
    first = ForwardState((torch.ones(1),), preserve_rng_state=True)
    torch.ones(3) * 2  # deterministic work only
    second = ForwardState((torch.ones(1),), preserve_rng_state=True)
    assert first.cpu_rng is not None
    assert second.cpu_rng is first.cpu_rng


def test_rule2_different_states_are_not_shared() -> None:
    """Rule 2: a draw between two captures gives each its own state."""
    first = ForwardState((torch.ones(1),), preserve_rng_state=True)
    torch.rand(1)
    second = ForwardState((torch.ones(1),), preserve_rng_state=True)
    assert first.cpu_rng is not None
    assert second.cpu_rng is not None
    assert second.cpu_rng is not first.cpu_rng
    assert not torch.equal(second.cpu_rng, first.cpu_rng)


def test_rule2_region_that_puts_the_stream_back_still_replays_its_draws() -> None:
    """Rule 2: a region that draws inside fork_rng leaves the stream unchanged, yet replays
    exactly (the state is kept, not guessed away)."""
    state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    with torch.random.fork_rng(devices=[]):
        drawn = torch.rand(4)
    torch.rand(50)  # the caller moves on before backward
    with state.restored(), torch.random.fork_rng(devices=[]):
        assert torch.equal(torch.rand(4), drawn)


def test_rule3_used_rng_kept_and_restored_bit_identically() -> None:
    """Rule 3: a region that drew keeps its state; a restore replays the same numbers."""
    state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    first = torch.rand(5)
    noise = torch.nn.functional.dropout(torch.ones(16), 0.5)
    assert state.cpu_rng is not None
    torch.rand(100)  # the caller moves on
    with state.restored():
        assert torch.equal(torch.rand(5), first)
        assert torch.equal(torch.nn.functional.dropout(torch.ones(16), 0.5), noise)


def test_rule3_callers_stream_untouched_by_restore() -> None:
    """Rule 3: after a restore the caller's RNG stream continues exactly where it was."""
    state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    torch.rand(5)
    torch.rand(7)
    before = torch.get_rng_state()
    with state.restored():
        torch.rand(1000)
    assert torch.equal(torch.get_rng_state(), before)


def test_rule3_callers_stream_untouched_when_only_the_recompute_draws() -> None:
    """Rule 3: a recompute that draws although its forward did not leaves the caller's stream."""
    state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    torch.rand(7)
    before = torch.get_rng_state()
    with state.restored():
        torch.rand(10)
    assert torch.equal(torch.get_rng_state(), before)


def test_restore_twice_replays_twice() -> None:
    """A state can be restored more than once (a retained graph recomputes again)."""
    state = ForwardState((), preserve_rng_state=True)
    drawn = torch.randn(3)
    for _ in range(2):
        with state.restored():
            assert torch.equal(torch.randn(3), drawn)


def test_restore_puts_caller_stream_back_after_an_exception() -> None:
    """An exception inside a restore still gives the caller's RNG stream back."""
    state = ForwardState((), preserve_rng_state=True)
    torch.rand(2)
    before = torch.get_rng_state()

    def draw_then_fail() -> None:
        with state.restored():
            torch.rand(3)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        draw_then_fail()
    assert torch.equal(torch.get_rng_state(), before)


def test_cpu_has_no_device_rng() -> None:
    """On CPU inputs no device state is captured and no accelerator starts during the region."""
    state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    assert state.device_ids == []
    assert state.device_rng == []
    assert not state.device_initialized_during(True)
    assert not state.device_initialized_during(False)


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_autocast_restored_when_captured_inside(cache_enabled: bool) -> None:
    """Autocast captured inside a CPU bfloat16 region is active again in a restore outside it."""
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
        state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    assert not torch.is_autocast_enabled("cpu")
    with state.restored():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_cache_enabled() == cache_enabled
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert torch.is_autocast_cache_enabled()


def test_autocast_disabled_in_restore_when_captured_outside() -> None:
    """Autocast captured off is off in a restore entered inside an autocast region."""
    state = ForwardState((torch.ones(1),), preserve_rng_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with state.restored():
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")


def test_autocast_dtype_restored() -> None:
    """The autocast dtype of the forward wins over the one active at restore time."""
    with torch.autocast("cpu", dtype=torch.float16):
        state = ForwardState((torch.ones(1),), preserve_rng_state=False)
    with torch.autocast("cpu", dtype=torch.bfloat16), state.restored():
        assert torch.get_autocast_dtype("cpu") == torch.float16


def test_device_context_restored() -> None:
    """A ``with torch.device(...)`` active at capture is active again in the restore."""
    with torch.device("meta"):
        state = ForwardState((), preserve_rng_state=False)
    assert torch.empty(1).device.type == "cpu"
    with state.restored():
        assert torch.empty(1).device.type == "meta"
    assert torch.empty(1).device.type == "cpu"
