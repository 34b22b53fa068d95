"""Reading autograd's graph without unpacking it, for the saved-tensor report.

Each name is checked against torch 2.11-2.15.
"""

from __future__ import annotations

from typing import Any

import torch

from .autograd import SavedTensor

# Owned by the report (``_report``). A report built from a loss reads what each autograd node saved
# through its raw accessors, which give the packed value and the unpack hook of each save:
# unpacking instead would run a checkpoint's recompute.

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
