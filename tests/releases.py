"""Which torch release the suite runs on, and what each release added (torch 2.11 to 2.15).

Parity tests compare with the installed ``torch.utils.checkpoint`` wherever it has the behaviour.
Where the installed release predates it, the test checks the newest behaviour on ours alone
(against the values below, read from torch 2.15's ``torch/utils/checkpoint.py``), and the part
that needs torch is skipped with a reason naming the release that added it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from checkpointing import _compat

TORCH: tuple[int, int] = _compat.TORCH_VERSION

# What each release added to torch.utils.checkpoint that we offer on every release.
DECORATOR = (2, 14)  # checkpoint(**options) returns a decorator; ``function`` defaults to None
PRESERVE_RNG_PARAMETER = (2, 14)  # preserve_rng_state is a named parameter
RESPECT_HOOKS = (2, 14)  # respect_saved_tensors_hooks, the FutureWarning, internal-hook marks
GENERATOR_IMPL = (2, 14)  # _checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, ...)
REWORDED_WARNING = (2, 15)  # "In a future release, ..." instead of "Starting in PyTorch 2.9, ..."
ORDERED_EFFECTS_KEPT = (2, 15)  # SAC keeps ops with an ordered side effect (MUST_SAVE)
LAYOUT_IGNORED = (2, 15)  # prim.layout.default in SAC_IGNORED_OPS
OP_OUTPUT = (2, 12)  # SelectiveCheckpointContext.op_output
TORCHTITAN_MODELS = (2, 13)  # torchtitan 0.3.0's model code imports (DataParallelMeshDims)
FORWARD_ONLY_POLICY = (2, 13)  # the SAC policy is asked in forward only, never at recompute
CALL_INDEXED_CACHE = (2, 13)  # SAC's cache indexed per op call: a diverging recompute raises
# checkpoint throws fn's exception into its generator (its hooks are popped at once)
THROWS_INTO_GENERATOR = (2, 13)

# torch 2.15's parameters of ``checkpoint``, in order: (name, kind, default).
_P = Any
CHECKPOINT_PARAMETERS: tuple[tuple[str, str, _P], ...] = (
    ("function", "POSITIONAL_OR_KEYWORD", None),
    ("args", "VAR_POSITIONAL", "<empty>"),
    ("use_reentrant", "KEYWORD_ONLY", None),
    ("preserve_rng_state", "KEYWORD_ONLY", True),
    ("context_fn", "KEYWORD_ONLY", "<noop>"),
    ("determinism_check", "KEYWORD_ONLY", "default"),
    ("debug", "KEYWORD_ONLY", False),
    ("early_stop", "KEYWORD_ONLY", True),
    ("respect_saved_tensors_hooks", "KEYWORD_ONLY", None),
    ("kwargs", "VAR_KEYWORD", "<empty>"),
)

USE_REENTRANT_WARNING = (
    "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly. In a "
    "future release, calling checkpoint without use_reentrant will raise an exception. "
    "use_reentrant=False is recommended, but if you need to preserve the current default "
    "behavior, you can pass use_reentrant=True. Refer to docs for more details on the "
    "differences between the two variants."
)
SEQUENTIAL_USE_REENTRANT_WARNING = (
    "torch.utils.checkpoint.checkpoint_sequential: the use_reentrant parameter should be "
    "passed explicitly. In a future release, we will raise an exception if use_reentrant is not "
    "passed. use_reentrant=False is recommended, but if you need to preserve the current "
    "default behavior, you can pass use_reentrant=True. Refer to docs for more details on the "
    "differences between the two variants."
)
REENTRANT_ONLY_DEFAULTS = (
    "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported when "
    "use_reentrant=False."
)


def has(release: tuple[int, int]) -> bool:
    """Whether the installed torch is ``release`` or newer."""
    return release <= TORCH


def name(release: tuple[int, int]) -> str:
    """``(2, 14)`` as ``"2.14"``."""
    return f"{release[0]}.{release[1]}"


def predates(release: tuple[int, int], what: str) -> str:
    """The reason for skipping the torch side of a parity test on an older release."""
    return (
        f"torch {name(release)} added {what}; the installed torch {torch.__version__} predates "
        "it, so only ours is checked (against torch 2.15's behaviour)"
    )


def needs_torch(release: tuple[int, int], what: str) -> pytest.MarkDecorator:
    """Skip a test (or a parameter) that needs torch's own ``what``, added in ``release``."""
    return pytest.mark.skipif(not has(release), reason=predates(release, what))


def skip_without_torchtitan_models() -> None:
    """Skip the calling test module unless torchtitan 0.3.0's model code can run here: torchtitan
    and triton installed (its model code imports triton, for its MoE kernels), torch 2.13 or
    later. Call at module level, before importing ``titan_support``."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")
    if not has(TORCHTITAN_MODELS):
        pytest.skip(
            "torchtitan 0.3.0's model code needs torch 2.13 or later (it imports "
            "DataParallelMeshDims from torch.distributed.fsdp)",
            allow_module_level=True,
        )


def newest_sac_ignored_ops(torch_set: set[Any]) -> set[Any]:
    """torch 2.15's ``SAC_IGNORED_OPS`` as the installed torch would have it: its own set, plus
    ``prim.layout.default`` where it predates 2.15."""
    expected = set(torch_set)
    if not has(LAYOUT_IGNORED):
        expected.add(torch.ops.prim.layout.default)
    return expected
