"""Ground floor: the tensors of a tree, and where a tensor's memory lives.

Owns ``tensors`` (the tensors among a pytree's leaves) and ``storage_key`` / ``storage_nbytes``
(a hashable name for the storage behind a tensor, and its size), the spellings the planner's
profile, ``checkpoint_sequential``'s measuring pass and the saved-tensors report share. It
imports nothing of the package but ``_compat``, so any floor may use it.

NOTE [Storage keys]

Rule 1. Two tensors have the same key exactly when they share memory now: the key is the
        storage's device and data pointer, so views of one storage share it. A key names memory,
        not an object: once a storage is freed its pointer may be reused, so a key outlives
        nothing; callers compare keys of tensors alive at the same time.
Rule 2. A tensor without memory of its own has no key (None), never a made-up one and never an
        error: meta and sparse tensors, a storage whose pointer is 0 (empty), and a wrapper
        subclass or python storage that refuses to give a pointer (FSDP2 parameters and other
        ``DTensor``s raise "Attempted to access the data pointer on an invalid python storage").
        A caller that counts bytes counts such a tensor as none; one that tells storages apart
        treats it as unknown.
Rule 3. A wrapper subclass that wraps exactly one inner tensor (``DTensor``: its local shard,
        per ``__tensor_flatten__``) has its inner tensor's key and size: that is the memory this
        process holds for it. One that wraps several, or none, has no key (Rule 2).
Rule 4. A step of shapes (the planner's, on fake tensors: NOTE [Planning without memory]) has
        no memory to name, yet must tell storages apart as a real step would: there
        ``shape_storage_key`` names a storage by its storage object (the same for every view of
        it while it lives, a new one once freed: Rule 1's contract, object for pointer) and
        ``shape_storage_nbytes`` gives the bytes it would take. Only that step's recorder and
        live-byte count use them: every other caller keeps Rule 2 (no memory, no key).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ._compat import storage_identity, tree_leaves

__all__ = [
    "StorageKey",
    "shape_storage_key",
    "shape_storage_nbytes",
    "storage_key",
    "storage_nbytes",
    "storage_of",
    "tensors",
]

StorageKey = tuple[torch.device, int]
"""A storage's device and data pointer (NOTE [Storage keys])."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors among the leaves of a pytree (tuples, lists, dicts and registered nodes
    opened; a tensor subclass is one leaf)."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def _memory(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose storage holds ``tensor``'s memory in this process (Rule 3), or None."""
    if type(tensor) in _PLAIN:
        return tensor
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor
    names, _ = flatten()
    inner = [v for v in (getattr(tensor, n) for n in names) if isinstance(v, torch.Tensor)]
    return _memory(inner[0]) if len(inner) == 1 else None


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``tensor`` with a nonzero pointer, or None (Rules 2 and 3)."""
    if tensor.device.type == "meta" or tensor.layout is not torch.strided:
        return None
    held = _memory(tensor)
    if held is None:
        return None
    try:
        storage = held.untyped_storage()
        pointer = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # an invalid python storage
        return None
    return storage if pointer != 0 else None


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``tensor``, a ``DTensor``'s local shard's included, or None where it
    has no key (NOTE [Storage keys], Rules 2 and 3): for callers that watch it being freed."""
    return _storage(tensor)


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Where ``tensor``'s memory lives, or None if it has none of its own (NOTE [Storage keys])."""
    if type(tensor) in _PLAIN and tensor.layout is _STRIDED:  # the common case, inline
        device = tensor.device
        if device.type == "meta":
            return None
        try:
            pointer = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # an invalid python storage
            return None
        return None if pointer == 0 else (device, pointer)
    storage = _storage(tensor)
    return None if storage is None else (storage.device, storage.data_ptr())


def storage_nbytes(tensor: torch.Tensor) -> int:
    """The bytes of the storage behind ``tensor`` (views count their whole storage), 0 where it
    has no key (NOTE [Storage keys], Rule 2)."""
    storage = _storage(tensor)
    return 0 if storage is None else storage.nbytes()


def _shape_storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage object behind a dense ``tensor``, memory or not (Rule 4), or None."""
    if tensor.layout is not torch.strided:
        return None
    held = _memory(tensor)
    if held is None:
        return None
    try:
        return held.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # an invalid python storage
        return None


def shape_storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Rule 4: the storage behind ``tensor`` in a step of shapes, by its storage object."""
    storage = _shape_storage(tensor)
    return None if storage is None else (tensor.device, storage_identity(storage))


def shape_storage_nbytes(tensor: torch.Tensor) -> int:
    """Rule 4: the bytes the storage behind ``tensor`` takes in a step of shapes."""
    storage = _shape_storage(tensor)
    return 0 if storage is None else storage.nbytes()
