"""Integrations with libraries where users already switch activation checkpointing on.

One module per outside library, each importing that library itself, so that importing
``checkpointing`` (or this package) never imports any of them:

- ``checkpointing.integrations.transformers``: Hugging Face ``transformers`` models checkpoint
  their layers with ``checkpointing.checkpoint``, policies and budget plans included.
- ``checkpointing.integrations.torchtitan``: torchtitan's activation-checkpointing configurables
  (``FullAC``, ``SelectiveAC``, an eager ``MemoryBudgetAC``, ``SpecAC``) on ``checkpointing``;
  the budget's first-step planning in ``_titan_budget``.
"""

from __future__ import annotations

__all__: list[str] = []
