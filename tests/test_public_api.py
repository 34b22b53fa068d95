"""Pins the public surface: every torch.utils.checkpoint name, with compatible signatures, and
nothing public that ``__all__`` does not declare (STYLE.md, rule 4)."""

from __future__ import annotations
import __future__

import enum
import importlib
import importlib.util
import inspect
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import releases
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

import checkpointing

PARITY_NAMES = sorted(torch_checkpoint.__all__)
PARITY_FUNCTIONS = [n for n in PARITY_NAMES if inspect.isfunction(getattr(torch_checkpoint, n))]
PARITY_CLASSES = [n for n in PARITY_NAMES if inspect.isclass(getattr(torch_checkpoint, n))]
# Our own public names beyond torch's (README "Entry points"). Adding a name to __all__ means
# adding it here too, so that every change of the public surface is a deliberate one.
OWN_NAMES = {
    "ActivationPlan",
    "ActivationWrapper",
    "AppliedSpec",
    "CheckpointImpl",
    "CheckpointWrapper",
    "Compress",
    "DeviceCosts",
    "LayerCost",
    "OffloadStats",
    "OffloadWrapper",
    "RecomputeStateHook",
    "SavedTensorRecord",
    "SavedTensorsReport",
    "SequentialSchedule",
    "apply_activation_checkpointing",
    "apply_spec",
    "checkpoint_module",
    "checkpoint_wrapper",
    "gradient_checkpoint_scope",
    "gradient_checkpoint_session",
    "is_recomputing",
    "keep",
    "keeping",
    "load_spec",
    "megatron_spec",
    "offload_wrapper",
    "plan_checkpointing",
    "plan_sweep",
    "remove_checkpoint_module",
    "report_on_oom",
    "saved_tensors_report",
    "sequential_schedule",
    "split_backward",
    "Tiling",
    "tiled",
    "tiled_experts",
    "tiled_lm_head_loss",
    "tiled_mlp",
}
# Our keyword-only option on torch's generator signatures (user state restored for recompute).
STATE_HOOKS = ("recompute_state_hooks", inspect.Parameter.KEYWORD_ONLY, None)
# Public attributes that are deliberately not in __all__: the public submodules (``integrations``
# is a package of one module per outside library, each imported only on demand).
PUBLIC_SUBMODULES = {"integrations", "policies"}
# `from __future__ import annotations` leaves a feature object in the module namespace.
_FUTURE_FEATURE = type(__future__.annotations)


def _comparable_default(value: Any) -> Any:
    """Function defaults (``context_fn=noop_context_fn``) compare by name, not identity."""
    return value.__name__ if callable(value) else value


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter of ``fn``, annotations left out.

    ``*args`` and ``**kwargs`` are nameless here: no caller can spell their names.
    """
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        ("*" if p.kind in variadic else p.name, p.kind, _comparable_default(p.default))
        for p in inspect.signature(fn).parameters.values()
    ]


def _assert_compatible(ours: Callable[..., Any], theirs: Callable[..., Any], what: str) -> None:
    """Every call valid for torch's ``theirs`` is valid for ``ours`` and means the same.

    Positional parameters, ``*args`` and ``**kwargs`` match in name, kind and order, with torch's
    defaults (ours may give a default where torch has none); torch's keyword-only
    parameters exist in ours with the same defaults; ours may add keyword-only parameters that
    have defaults (e.g. ``preserve_rng_state``, which torch reads from ``**kwargs``).
    """
    our_params, their_params = _parameters(ours), _parameters(theirs)
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    our_positional = [p for p in our_params if p[1] != keyword_only]
    their_positional = [p for p in their_params if p[1] != keyword_only]
    assert [p[:2] for p in our_positional] == [p[:2] for p in their_positional], (
        f"{what}: positional parameters differ from torch's"
    )
    for mine, theirs_p in zip(our_positional, their_positional, strict=True):
        # A default where torch has none accepts every call torch accepts (and more).
        if theirs_p[2] != _comparable_default(inspect.Parameter.empty):
            assert mine[2] == theirs_p[2], f"{what}: default of {mine[0]} differs from torch's"
    ours_kw = {p[0]: p for p in our_params if p[1] == keyword_only}
    theirs_kw = {p[0]: p for p in their_params if p[1] == keyword_only}
    missing = {name: p for name, p in theirs_kw.items() if ours_kw.get(name) != p}
    assert not missing, f"{what}: keyword-only parameters missing or different: {missing}"
    signature = inspect.signature(ours)
    extra = sorted(ours_kw.keys() - theirs_kw.keys())
    no_default = [n for n in extra if signature.parameters[n].default is inspect.Parameter.empty]
    assert not no_default, f"{what}: added keyword-only parameters need defaults: {no_default}"


def test_all_torch_parity_names_are_exported() -> None:
    """Every name in ``torch.utils.checkpoint.__all__`` is in ``checkpointing.__all__``."""
    missing = sorted(set(PARITY_NAMES) - set(checkpointing.__all__))
    assert not missing, f"parity names not exported yet: {missing}"


def test_all_is_parity_names_plus_declared_own_names() -> None:
    """Beyond torch's names, ``__all__`` holds exactly the own names this file declares."""
    assert set(checkpointing.__all__) - set(PARITY_NAMES) == OWN_NAMES


def test_all_has_no_duplicates() -> None:
    """``__all__`` lists each name once."""
    assert len(checkpointing.__all__) == len(set(checkpointing.__all__))


@pytest.mark.parametrize("name", checkpointing.__all__)
def test_every_name_in_all_is_importable(name: str) -> None:
    """Each name in ``__all__`` exists on the package and survives ``from checkpointing import``."""
    assert hasattr(checkpointing, name)
    namespace: dict[str, Any] = {}
    exec(f"from checkpointing import {name}", namespace)
    assert namespace[name] is getattr(checkpointing, name)


def test_star_import_gives_exactly_all() -> None:
    """``from checkpointing import *`` brings in ``__all__`` and nothing else."""
    namespace: dict[str, Any] = {}
    exec("from checkpointing import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(checkpointing.__all__)


def test_no_public_attribute_outside_all() -> None:
    """Public attributes are ``__all__`` plus the public submodules; the rest is private."""
    undeclared = []
    for name, value in vars(checkpointing).items():
        if name.startswith("_") or name in checkpointing.__all__ or name in PUBLIC_SUBMODULES:
            continue
        if isinstance(value, _FUTURE_FEATURE):
            continue
        undeclared.append(name)
    assert not undeclared, f"public names missing from __all__ (or make them private): {undeclared}"


def test_public_submodules_are_importable() -> None:
    """The declared public submodules import as modules of the package."""
    for name in PUBLIC_SUBMODULES:
        if importlib.util.find_spec(f"checkpointing.{name}") is None:
            pytest.skip(f"checkpointing.{name} not built yet")
        module = importlib.import_module(f"checkpointing.{name}")
        assert isinstance(module, types.ModuleType)


@pytest.mark.parametrize("name", PARITY_FUNCTIONS)
def test_parity_function_signature_matches_torch(name: str) -> None:
    """Each parity function accepts every call torch's accepts (names, kinds, defaults)."""
    ours = getattr(checkpointing, name, None)
    if ours is None:
        pytest.fail(f"checkpointing.{name} is not exported")
    _assert_compatible(ours, getattr(torch_checkpoint, name), f"checkpointing.{name}")


def _public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """Public callables defined on ``cls`` itself, plus ``__init__``, as bound by ``getattr``."""
    methods = {}
    for attr, raw in vars(cls).items():
        if attr.startswith("_") and attr != "__init__":
            continue
        if isinstance(raw, staticmethod | classmethod | types.FunctionType):
            methods[attr] = getattr(cls, attr)
    return methods


@pytest.mark.parametrize("name", PARITY_CLASSES)
def test_parity_class_matches_torch(name: str) -> None:
    """Each parity class has torch's bases and public methods, with compatible signatures."""
    theirs = getattr(torch_checkpoint, name)
    ours = getattr(checkpointing, name, None)
    if ours is None:
        pytest.fail(f"checkpointing.{name} is not exported")
    assert inspect.isclass(ours)
    for base in theirs.__bases__:
        if base is not object:
            assert issubclass(ours, base), f"checkpointing.{name} should subclass {base}"
    if issubclass(theirs, enum.Enum):
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
        return
    our_methods = _public_methods(ours)
    for method, their_method in _public_methods(theirs).items():
        our_method = our_methods.get(method, getattr(ours, method, None))
        assert our_method is not None, f"checkpointing.{name}.{method} is missing"
        _assert_compatible(our_method, their_method, f"checkpointing.{name}.{method}")


def test_sac_ignored_ops_match_torch() -> None:
    """``SAC_IGNORED_OPS`` holds exactly torch 2.15's ops on every release (they are never
    cached); older releases lack ``prim.layout.default``, which 2.15 added."""
    ours = getattr(checkpointing, "SAC_IGNORED_OPS", None)
    if ours is None:
        pytest.fail("checkpointing.SAC_IGNORED_OPS is not exported")
    theirs = set(torch_checkpoint.SAC_IGNORED_OPS)
    if not releases.has(releases.LAYOUT_IGNORED):
        assert torch.ops.prim.layout.default not in theirs
        theirs.add(torch.ops.prim.layout.default)
    assert set(ours) == theirs


def test_generator_has_torchs_positional_signature() -> None:
    """``_checkpoint_without_reentrant_generator`` takes torch 2.14's arguments in its order:
    torch 2.13's positional form plus a keyword-only ``respect_saved_tensors_hooks``."""
    ours = _parameters(checkpointing._checkpoint_without_reentrant_generator)
    assert ours.pop(-2) == STATE_HOOKS  # ours, before **kwargs: NOTE [Nestable checkpoint], 12
    theirs = _parameters(torch_checkpoint._checkpoint_without_reentrant_generator)
    respect = ("respect_saved_tensors_hooks", inspect.Parameter.KEYWORD_ONLY, None)
    if releases.has(releases.GENERATOR_IMPL):
        assert ours == theirs
    else:
        assert [p for p in ours if p != respect] == theirs
    assert respect in ours


def test_generator_impl_has_torchs_signature() -> None:
    """``_checkpoint_without_reentrant_generator_impl`` (torch 2.14) takes ``fn, args, kwargs``
    then keyword-only options, on every release."""
    ours = _parameters(checkpointing._checkpoint_without_reentrant_generator_impl)
    assert ours.pop() == STATE_HOOKS  # ours, last: NOTE [Nestable checkpoint], Rule 12
    names = [name for name, _, _ in ours]
    assert names == [
        "fn",
        "args",
        "kwargs",
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "respect_saved_tensors_hooks",
    ]
    assert "_checkpoint_without_reentrant_generator_impl" not in checkpointing.__all__
    if releases.has(releases.GENERATOR_IMPL):
        theirs = _parameters(torch_checkpoint._checkpoint_without_reentrant_generator_impl)
        assert ours == theirs
    assert "_checkpoint_without_reentrant_generator" not in checkpointing.__all__


def test_a_torch_below_the_supported_range_is_refused_with_our_message() -> None:
    """Under torch 2.10 (simulated in a fresh interpreter), ``import checkpointing`` fails with
    our ImportError naming the supported range and the fix, before any private torch import."""
    code = (
        "import torch\n"
        "torch.__version__ = '2.10.0+cpu'\n"
        "try:\n"
        "    import checkpointing\n"
        "except ImportError as error:\n"
        "    print('REFUSED', error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("REFUSED checkpointing supports torch 2.11 to 2.15")
    assert "torch 2.10.0+cpu is installed" in done.stdout
    assert "pip install --upgrade 'torch>=2.11'" in done.stdout


# torch.distributed's wrapper API (issue 39): ours under the same names. Ours add keyword-only
# options with defaults (``hooks_during_recompute``) and, to ``apply_activation_checkpointing``,
# ``**checkpoint_options`` for the wrapper.
WRAPPER_FUNCTIONS = ["checkpoint_wrapper", "offload_wrapper", "apply_activation_checkpointing"]
WRAPPER_CLASSES = ["ActivationWrapper", "CheckpointWrapper", "OffloadWrapper"]


@pytest.mark.parametrize("name", WRAPPER_FUNCTIONS)
def test_wrapper_function_signature_matches_torch_distributed(name: str) -> None:
    """Each wrapper function accepts every call torch.distributed's accepts, same defaults."""
    ours = getattr(checkpointing, name)
    theirs = getattr(torch_wrappers, name)
    if name == "apply_activation_checkpointing":
        params = list(inspect.signature(ours).parameters.values())
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD

        def ours(*args: Any, **kwargs: Any) -> None:
            """Stands for our function less its ``**checkpoint_options``."""

        ours.__signature__ = inspect.Signature(params[:-1])  # type: ignore[attr-defined]
    _assert_compatible(ours, theirs, f"checkpointing.{name}")


@pytest.mark.parametrize("name", WRAPPER_CLASSES)
def test_wrapper_class_is_torch_distributed_subclass_with_its_constructor(name: str) -> None:
    """Each wrapper class subclasses torch.distributed's and is built with its arguments."""
    ours, theirs = getattr(checkpointing, name), getattr(torch_wrappers, name)
    assert issubclass(ours, theirs)
    _assert_compatible(ours.__init__, theirs.__init__, f"checkpointing.{name}.__init__")


def test_checkpoint_impl_is_torchs_enum() -> None:
    """``checkpointing.CheckpointImpl`` is torch.distributed's enum object itself."""
    assert checkpointing.CheckpointImpl is torch_wrappers.CheckpointImpl
