"""Hugging Face ``transformers`` models checkpoint their layers with ``checkpointing``.

The public face of the integration, and nothing more: ``enable(model, ...)`` and
``disable(model)`` (the one-line switch from ``model.activation_checkpointing_enable()`` to
``checkpointing.checkpoint``, with a policy or a memory budget; NOTE [transformers integration]
in ``_hf_enable``, which owns them) and ``CheckpointingCallback`` (the ``Trainer`` route,
``_hf_callback``, loaded on first use of the name). Importing this module without
``transformers`` installed raises an ``ImportError`` that says what to install.

This module and its ``_hf_*`` neighbours are the only ones of the package that import
``transformers``; importing ``checkpointing`` never does. The face imports its neighbours, never
the reverse.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MSG_NO_TRANSFORMERS = (
    "checkpointing.integrations.transformers needs the Hugging Face `transformers` package, "
    "which is not installed (importing `checkpointing` itself never needs it). Fix: "
    "pip install transformers (checked against 5.23.0); in a clone of this repository: "
    "pip install -e . --group hf."
)

try:
    importlib.import_module("transformers.modeling_utils")
except ImportError as error:
    raise ImportError(_MSG_NO_TRANSFORMERS, name="transformers") from error

# After the guard above: without transformers, its message comes first.
from ._hf_enable import disable, enable  # noqa: E402

if TYPE_CHECKING:
    from ._hf_callback import CheckpointingCallback

__all__ = ["CheckpointingCallback", "disable", "enable"]


def __getattr__(name: str) -> Any:
    """``CheckpointingCallback`` needs the ``Trainer``'s modules (``training_args``,
    ``trainer_callback`` and some 300 more): imported on first use, so that ``enable`` alone
    never loads them."""
    if name == "CheckpointingCallback":
        return importlib.import_module("._hf_callback", __package__).CheckpointingCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
