"""Hugging Face's ``gradient_checkpointing_kwargs``, read as transformers reads them.

Owns ``from_hf_kwargs``: the ``checkpointing.checkpoint`` options that a
``gradient_checkpointing_kwargs`` (``activation_checkpointing_kwargs``) dict stands for, for
``enable`` and ``CheckpointingCallback``, which check the options they get (``_hf_enable``).

NOTE [gradient_checkpointing_kwargs]
  Rule 1. transformers 5.23 (``PreTrainedModel._activation_checkpointing_enable``) hands the
          dict to every layer as ``functools.partial(torch.utils.checkpoint.checkpoint,
          **kwargs)``, and reads ``None`` as ``{"use_reentrant": False}``. So do we: ``None``
          adds nothing (``enable``'s default is ``use_reentrant=False`` already), and a dict is
          passed as it is, to our ``checkpoint``, which reads each of torch's options as torch
          does: a dict without ``use_reentrant`` means torch's default, ``None`` (a warning,
          then the reentrant variant), not ours.
  Rule 2. The keys are torch's checkpoint options (``use_reentrant``, ``preserve_rng_state``,
          ``context_fn``, ``determinism_check``, ``debug``, ``early_stop``). Any other key is
          an error naming them: torch's reentrant variant refuses one too, but the non-reentrant
          one hands it to the layer's ``forward``, which transformers' layers accept
          (``**kwargs``) and ignore, so a misspelt option would do nothing in silence.
  Rule 3. An option given both in the dict and as a keyword of ``enable`` is an error: neither
          may silently win.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["HF_KWARGS", "from_hf_kwargs"]

# Rule 2: what transformers may hand to torch.utils.checkpoint.checkpoint (torch 2.11-2.15).
HF_KWARGS: Final = frozenset(
    {
        "context_fn",
        "debug",
        "determinism_check",
        "early_stop",
        "preserve_rng_state",
        "use_reentrant",
    }
)
_MSG_NOT_A_DICT = (
    "{api}: gradient_checkpointing_kwargs must be a dict of torch.utils.checkpoint.checkpoint "
    "options (as transformers' gradient_checkpointing_enable takes it), got {got!r} of type "
    "{type}. Fix: e.g. gradient_checkpointing_kwargs={{'use_reentrant': False}}."
)
_MSG_UNKNOWN_KEY = (
    "{api}: unknown gradient_checkpointing_kwargs key(s) {names}; expected some of {known} "
    "(torch.utils.checkpoint.checkpoint's options, which transformers passes on). Fix: drop or "
    "respell them; transformers would hand them to each layer's forward, which ignores them."
)
_MSG_TWICE = (
    "{api}: {names} given both in gradient_checkpointing_kwargs and as keyword argument(s). "
    "Fix: give each option once, in either place."
)


def from_hf_kwargs(
    api: str, hf_kwargs: object, checkpoint_options: dict[str, Any]
) -> dict[str, Any]:
    """``checkpoint_options`` with the options ``hf_kwargs`` stands for (Rules 1-3)."""
    if hf_kwargs is None:
        return checkpoint_options
    if not isinstance(hf_kwargs, Mapping):
        got = type(hf_kwargs).__name__
        raise TypeError(_MSG_NOT_A_DICT.format(api=api, got=hf_kwargs, type=got))
    unknown = sorted(map(str, hf_kwargs.keys() - HF_KWARGS))
    if unknown:
        raise TypeError(_MSG_UNKNOWN_KEY.format(api=api, names=unknown, known=sorted(HF_KWARGS)))
    twice = sorted(hf_kwargs.keys() & checkpoint_options.keys())
    if twice:
        raise TypeError(_MSG_TWICE.format(api=api, names=twice))
    return {"use_reentrant": None, **hf_kwargs, **checkpoint_options}
