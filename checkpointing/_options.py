"""Ground floor: ``CheckpointOptions``, the options of one checkpoint carried as one value.

Owns the record that an entry point (``checkpoint`` and its decorator, ``checkpoint_module``,
``tiled``, torch's generator forms) builds from its keyword arguments, and that the layers below
it read: ``_checkpoint.checkpoint_call``, ``_frame``'s generator, ``_compiled.torch_region`` and
``_tiling.run_tiled``. Checking the values belongs to the entry points and to the variants that
use them (their messages name the API that speaks); the record only carries them. It imports
nothing of the package but ``_state``, so any floor may use it.

NOTE [Checkpoint options]
  Rule 1. Public signatures keep their keyword arguments (torch's, for the parity names). An
          entry point builds the record once: per call of ``checkpoint``, once per decorated
          function, per ``checkpoint_module`` install and per ``tiled`` region. Below it the
          options travel as this one value; only ``torch_region`` spreads them back into
          keywords, torch's own.
  Rule 2. A call whose options all sit at their defaults takes a record built at import
          (``DEFAULTS``, keyed by ``use_reentrant``): ``checkpoint(fn, x, use_reentrant=False)``
          builds nothing per call. A frozen dataclass's ``__init__`` sets each field through
          ``object.__setattr__``, which costs more than the identity tests that avoid it.
  Rule 3. ``recompute_state_hooks`` is carried as the caller gave it (one hook, a sequence, an
          iterator, or None) and read by ``_state.state_hooks_from`` where the variant runs, so
          a bad value is refused at the same point, with the same message, as before the
          record existed. ``checkpoint_module`` and the decorator carry the tuple they read once.
  Rule 4. ``use_reentrant`` is ``None`` only where the caller omitted it and nothing resolved it
          yet: the decorator's record (resolved, with the warning, per call) and a region handed
          to torch while dynamo traces (torch is given what the caller gave).

Rejected: spreading a dict of keyword arguments (``**options``) through every layer, the state
before this module: each signature repeated the nine names, and the decorator and the module
hooks built a dict per call to pass them on.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Final

from ._state import ContextFn, noop_context_fn

if TYPE_CHECKING:  # annotations only: _tiling builds records of its own (TiledFunction)
    from ._tiling import Tiling

__all__ = ["DEFAULTS", "CheckpointOptions"]


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
