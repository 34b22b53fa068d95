"""Ground floor: ``CheckpointOptions``, the options of one checkpoint carried as one value, and
``Tiling``, the value of its ``tile=`` option (a record with checks of its own, so it lives with
the record that carries it: the run of a tiled region, ``_tiling``, sits a floor above).

Owns the record that an entry point (``checkpoint`` and its decorator, ``checkpoint_module``,
``tiled``, torch's generator forms) builds from its keyword arguments, and that the layers below
it read: ``_checkpoint.checkpoint_call``, ``_frame``'s generator, ``_compiled.torch_region`` and
``_tiling.run_tiled``. Checking the values belongs to the entry points and to the variants that
use them (their messages name the API that speaks); the record only carries them, but for
Rule 5. It imports nothing of the package but ``_state`` and ``_errors``, so any floor above the
ground may use it.

NOTE [Checkpoint options]
  Rule 1. Public signatures keep their keyword arguments (torch's, for the parity names). An
          entry point builds the record once: per call of ``checkpoint``, once per decorated
          function, per ``checkpoint_module`` install and per ``tiled`` region. Below it the
          options travel as this one value; only ``torch_region`` spreads them back into
          keywords, torch's own.
  Rule 2. A call whose options all sit at their defaults takes a record built at import
          (``DEFAULTS``, keyed by ``use_reentrant``): ``checkpoint(fn, x, use_reentrant=False)``
          builds nothing per call; ``options_of`` makes that choice for every entry point. A
          frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, which
          costs more than the identity tests that avoid it.
  Rule 3. ``recompute_state_hooks`` is carried as the caller gave it (one hook, a sequence, an
          iterator, or None) and read by ``_state.state_hooks_from`` where the variant runs, so
          a bad value is refused at the same point, with the same message, as before the
          record existed. ``checkpoint_module`` and the decorator carry the tuple they read once.
  Rule 4. ``use_reentrant`` is ``None`` only where the caller omitted it and nothing resolved it
          yet: the decorator's record (resolved, with the warning, per call) and a region handed
          to torch while dynamo traces (torch is given what the caller gave).
  Rule 5. A ``context_fn`` that is not callable is refused here, the one place every entry
          point passes (``TypeError``, as torch's call of it raises, but naming the API and the
          fix), when the record is built rather than when a region first runs. Where
          ``use_reentrant`` is True it is left to the reentrant variant, which refuses any
          ``context_fn`` with torch's ``ValueError``. What a callable ``context_fn`` returns is
          checked where it is called (``_frame``).

Rejected: spreading a dict of keyword arguments (``**options``) through every layer, the state
before this module: each signature repeated the nine names, and the decorator and the module
hooks built a dict per call to pass them on.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from ._errors import describe_value
from ._state import ContextFn, noop_context_fn

__all__ = ["DEFAULTS", "CheckpointOptions", "Tiling", "options_of"]

_MSG_BAD_TILING = (
    "checkpointing.Tiling: {what}, got {got}. Fix: e.g. Tiling(dim=1, chunks=8) for inputs of "
    "shape (batch, tokens, hidden), or Tiling(dim=1, chunk_size=2048)."
)

_MSG_CONTEXT_FN_NOT_CALLABLE = (
    "{api}: context_fn must be a function returning two context managers (forward, "
    "recompute), a policy, or a policy's name; got {got}. Fix: pass e.g. "
    "context_fn=checkpointing.policies.save_matmuls(), context_fn='save_matmuls', or "
    "functools.partial(checkpointing.create_selective_checkpoint_contexts, policy); omit "
    "context_fn for plain checkpointing."
)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A checkpointed region declared position-wise along ``dim``, to run in chunks.

    Its forward and its recompute then run chunk by chunk (NOTE [Tiled regions]): what lives
    inside the region at once is about ``1/chunks`` of the untiled region's. Give ``chunks``
    (how many) or ``chunk_size`` (positions per chunk, the last chunk may be shorter).

    Args:
        dim: the dimension of the positions (tokens) in every split input and every output;
            ``1`` for ``(batch, tokens, hidden)``, ``0`` for routed tokens ``(tokens, hidden)``.
        chunks: how many chunks (at most one per position).
        chunk_size: how many positions per chunk, instead of ``chunks``.
        split: the positional inputs sliced along ``dim`` (default: the first); the others
            reach every chunk whole.
    """

    dim: int = 1
    chunks: int | None = None
    chunk_size: int | None = None
    split: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if type(self.dim) is not int:
            raise TypeError(_MSG_BAD_TILING.format(what="dim must be an int", got=self.dim))
        if (self.chunks is None) == (self.chunk_size is None):
            raise ValueError(
                _MSG_BAD_TILING.format(
                    what="give exactly one of chunks and chunk_size",
                    got=f"chunks={self.chunks!r}, chunk_size={self.chunk_size!r}",
                )
            )
        count = self.chunks if self.chunks is not None else self.chunk_size
        if type(count) is not int or count < 1:
            name = "chunks" if self.chunks is not None else "chunk_size"
            raise ValueError(_MSG_BAD_TILING.format(what=f"{name} must be an int >= 1", got=count))
        split = tuple(self.split) if isinstance(self.split, list | tuple) else None
        if (
            not split
            or any(type(i) is not int or i < 0 for i in split)
            or len(set(split)) != len(split)
        ):
            raise ValueError(
                _MSG_BAD_TILING.format(
                    what="split must be distinct positional indices (ints >= 0), at least one",
                    got=self.split,
                )
            )
        object.__setattr__(self, "split", split)

    def bounds(self, length: int) -> list[tuple[int, int]]:
        """``(start, length)`` of each chunk of ``length`` positions; the first chunks take
        one position more when ``chunks`` does not divide it."""
        if length == 0:
            return [(0, 0)]
        if self.chunk_size is not None:
            size = self.chunk_size
            return [(start, min(size, length - start)) for start in range(0, length, size)]
        count = min(self.chunks or 1, length)
        base, extra = divmod(length, count)
        out, start = [], 0
        for k in range(count):
            size = base + (1 if k < extra else 0)
            out.append((start, size))
            start += size
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """The options of one checkpoint, with ``checkpoint``'s defaults (NOTE [Checkpoint
    options]). Built by the entry points; read by the layers below them."""

    use_reentrant: bool | None = None  # Rule 4
    preserve_rng_state: bool = True
    context_fn: ContextFn = noop_context_fn
    determinism_check: str = "default"
    debug: bool = False
    early_stop: bool = True
    respect_saved_tensors_hooks: bool | None = None
    recompute_state_hooks: object = None  # Rule 3: as given
    tile: Tiling | None = None


# Rule 2: the records of calls that set no option but ``use_reentrant``.
DEFAULTS: Final[dict[bool | None, CheckpointOptions]] = {
    None: CheckpointOptions(),
    False: CheckpointOptions(use_reentrant=False),
    True: CheckpointOptions(use_reentrant=True),
}


def options_of(
    use_reentrant: bool | None,
    preserve_rng_state: bool,
    context_fn: ContextFn,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    respect_saved_tensors_hooks: bool | None,
    recompute_state_hooks: object,
    tile: Tiling | None = None,
    *,
    api: str,
) -> CheckpointOptions:
    """The record of these options, in ``CheckpointOptions``' field order: the one built at
    import where every option but ``use_reentrant`` sits at its default (Rule 2), else a new
    one. Every entry point builds its record here; ``api`` names it in errors (Rule 5)."""
    if (
        preserve_rng_state is True
        and context_fn is noop_context_fn
        and type(determinism_check) is str  # no other type's __eq__ runs here
        and determinism_check == "default"
        and debug is False
        and early_stop is True
        and respect_saved_tensors_hooks is None
        and recompute_state_hooks is None
        and tile is None
        and (use_reentrant is None or type(use_reentrant) is bool)
    ):
        return DEFAULTS[use_reentrant]
    given: object = context_fn  # typed as torch's contract, but whatever the caller passed
    if not callable(given) and use_reentrant is not True:  # Rule 5
        got = describe_value(given)
        raise TypeError(_MSG_CONTEXT_FN_NOT_CALLABLE.format(api=api, got=got))
    return CheckpointOptions(
        use_reentrant,
        preserve_rng_state,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        respect_saved_tensors_hooks,
        recompute_state_hooks,
        tile,
    )
