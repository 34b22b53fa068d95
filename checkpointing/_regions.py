"""How reports and messages name a checkpointed region.

Owns ``region_label`` (the name of one region, from the function a checkpoint runs and its
arguments), ``RegionNames`` (one report's naming: module paths from the model it was given, and
numbers that tell apart modules of one class where no path is known) and ``naming``, the
``ContextVar`` through which a report lends its naming to the mechanisms that announce regions.
It imports nothing of ours: the frame, the selective cache and the report all use it. What a
report does with the labels (rows, a summary per region) belongs to ``_report``.

NOTE [Region names]
  Rule 1. A region is a module's when the function it runs is the module; a bound method of one
          (``block.forward``); a method of the module's class called with the module as first
          argument (``Block.forward(block, x)``; Hugging Face's layers pass
          ``partial(forward, layer)``); a ``functools.partial`` of any of these; an object
          whose ``region_module`` is the module (``checkpoint_module``'s re-run); or a plain
          function whose first argument is a checkpoint wrapper (``checkpoint_wrapper``'s,
          which holds the module as ``_checkpoint_wrapped_module``, as torch's does): the
          region is the wrapped module's. Any other function is a plain function's region,
          labelled ``checkpoint(<qualified name>)`` (a partial by its function's).
  Rule 2. A module's region is labelled ``<path> (<Class>)``, ``path`` being the module's name
          in the model given to the report, as ``model.named_modules()`` and ``state_dict``
          keys spell it, less the segments of wrappers that ``state_dict`` leaves out too
          (``_checkpoint_wrapped_module``, ``_orig_mod``, ``_fsdp_wrapped_module``). A bound
          method other than the module's call adds its name: ``<path> (<Class>.<method>)``.
          The model itself has no path: it is labelled by its class.
  Rule 3. Where a report knows no path (no model given, or the module is not in it), it labels
          ``<Class> #<k>``: ``k`` counts the modules of that class the report met, from 1, in
          the order it met them, so that every layer is a region of its own. Outside any
          report (error messages) a module's region is labelled ``<Class>``.
  Rule 4. A report lends its naming (``naming``) only while it watches a step or walks a graph;
          labels are made where a mechanism announces a tensor or the walk meets a region, and
          one module keeps one label for the whole report. The path table is made at the first
          label and dropped with the naming: nothing of the model outlives the report.

Rejected: finding the model without being told. A module does not know its parents; a scan of
the garbage collector's referrers is slow and finds containers that are not the model; global
module hooks would see every thread's modules, not only the watched step's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Final

from torch import nn

__all__ = ["RegionNames", "naming", "region_label", "region_module"]

_WRAPPER_SEGMENTS: Final = frozenset(
    {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}
)
_CALLS: Final = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl"})
_WRAPPED: Final = "_checkpoint_wrapped_module"


class RegionNames:
    """One report's naming (Rules 2 and 3): paths in ``model`` when given, else numbers."""

    __slots__ = ("_labels", "_model", "_numbers", "_paths")

    def __init__(self, model: nn.Module | None = None) -> None:
        self._model = model
        self._paths: dict[int, str] | None = None
        # id -> (module, path, number): the module is held so that its id stays its own
        self._labels: dict[int, tuple[nn.Module, str | None, int]] = {}
        self._numbers: dict[str, int] = {}

    def label(self, module: nn.Module, method: str | None) -> str:
        """The label of ``module``'s region (``method``: a bound method's name, Rule 2)."""
        found = self._labels.get(id(module))
        if found is None:
            path = self._path_of(module)
            found = (module, path, self._number(module) if path is None else 0)
            self._labels[id(module)] = found
        _, path, number = found
        name = type(module).__name__ if method is None else f"{type(module).__name__}.{method}"
        if path is None:
            return f"{name} #{number}"
        return f"{path} ({name})" if path else name

    def _number(self, module: nn.Module) -> int:
        """Rule 3: how many modules of this class the report met, this one included."""
        name = type(module).__name__
        self._numbers[name] = self._numbers.get(name, 0) + 1
        return self._numbers[name]

    def _path_of(self, module: nn.Module) -> str | None:
        if self._model is None:
            return None
        if self._paths is None:
            self._paths = {}
            for path, sub in self._model.named_modules(remove_duplicate=False):
                self._paths.setdefault(id(sub), _state_dict_path(path))
        return self._paths.get(id(module))


naming: ContextVar[RegionNames | None] = ContextVar("checkpointing_region_names", default=None)
"""The naming of the report watching or walking now (Rule 4); None outside any report."""


def region_label(fn: Callable[..., Any], args: Sequence[Any] = ()) -> str:
    """How reports and messages name the region that runs ``fn(*args)`` (Rules 1-3)."""
    owner = region_module(fn, args)
    if owner is None:
        while isinstance(fn, functools.partial):
            fn = fn.func
        name = getattr(fn, "__qualname__", None)
        return f"checkpoint({name or type(fn).__name__})"
    module, method = owner
    names = naming.get()
    if names is not None:
        return names.label(module, method)
    name = type(module).__name__
    return name if method is None else f"{name}.{method}"


def region_module(
    fn: Callable[..., Any], args: Sequence[Any] = ()
) -> tuple[nn.Module, str | None] | None:
    """Rule 1: the module whose region runs ``fn(*args)``, and the name of the bound method it
    runs when that is not the module's call; None for a plain function's region."""
    while isinstance(fn, functools.partial):
        args = (*fn.args, *args)
        fn = fn.func
    if isinstance(fn, nn.Module):
        return fn, None
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        name = getattr(fn, "__name__", None)
        return owner, None if name in _CALLS else name
    module = getattr(fn, "region_module", None)
    if isinstance(module, nn.Module):
        return module, None
    first = args[0] if args else None
    if isinstance(first, nn.Module):
        inner = first._modules.get(_WRAPPED)
        if inner is not None:
            return inner, None
        owner_name, _, name = str(getattr(fn, "__qualname__", "")).rpartition(".")
        if any(cls.__qualname__ == owner_name for cls in type(first).__mro__):
            return first, None if name in _CALLS else name
    return None


def _state_dict_path(path: str) -> str:
    """``path`` without the segments of wrappers (Rule 2)."""
    return ".".join(part for part in path.split(".") if part not in _WRAPPER_SEGMENTS)
