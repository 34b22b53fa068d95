"""The two libraries under test, behind one small adapter each.

``Library`` holds the callables a workload needs: ``checkpoint``, ``checkpoint_sequential``, a
``context_fn`` that saves matmuls (selective checkpointing) and, for ``checkpointing`` only,
``gradient_checkpoint_scope``. Both sides are given their natural best form of the same policy:
ours uses ``checkpointing.policies.save_matmuls``; torch gets the equivalent list of aten
overloads (matmuls and fused attention), which ``create_selective_checkpoint_contexts`` turns into
"save these, recompute the rest".
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

# The overloads a "save matmuls" policy keeps: dense matmuls and every overload of each fused
# attention kernel this torch build has (on CPU, scaled_dot_product_attention lands in the
# *_for_cpu flash kernel; flash attention has a ``quantized`` overload besides ``default``).
_ATTENTION_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_attention_math_for_mps",
)
MATMUL_OPS = tuple(
    getattr(torch.ops.aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm")
) + tuple(
    getattr(getattr(torch.ops.aten, name), overload)
    for name in _ATTENTION_NAMES
    if hasattr(torch.ops.aten, name)
    for overload in getattr(torch.ops.aten, name).overloads()
)


@dataclass(frozen=True)
class Library:
    """What one library offers to the workloads; ``None`` marks what it does not have (yet)."""

    name: str
    checkpoint: Callable[..., Any]
    checkpoint_sequential: Callable[..., Any]
    save_matmuls: ContextFn | None
    scope: Callable[[], AbstractContextManager[Any]] | None
    session: Callable[[], AbstractContextManager[Any]] | None = None


def torch_library(name: str = "torch") -> Library:
    """``torch.utils.checkpoint`` with the list form of the save-matmuls policy."""
    context_fn = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, list(MATMUL_OPS)
    )
    return Library(
        name=name,
        checkpoint=torch_checkpoint.checkpoint,
        checkpoint_sequential=torch_checkpoint.checkpoint_sequential,
        save_matmuls=context_fn,
        scope=None,
    )


def ours_library() -> Library | None:
    """``checkpointing``, or ``None`` while its ``checkpoint`` is not importable yet.

    Selective checkpointing uses ``policies.as_context_fn(policies.save_matmuls())`` when the
    policies exist, else the op list above through our ``create_selective_checkpoint_contexts``;
    it and ``gradient_checkpoint_scope`` are optional: their rows print "n/a" while missing.
    """
    ours = importlib.import_module("checkpointing")
    if not hasattr(ours, "checkpoint") or not hasattr(ours, "checkpoint_sequential"):
        return None
    return Library(
        name="ours",
        checkpoint=ours.checkpoint,
        checkpoint_sequential=ours.checkpoint_sequential,
        save_matmuls=_our_save_matmuls(ours),
        scope=getattr(ours, "gradient_checkpoint_scope", None),
        session=getattr(ours, "gradient_checkpoint_session", None),
    )


def _our_policies() -> Any:
    """``checkpointing.policies``, or ``None`` while it does not exist."""
    try:
        return importlib.import_module("checkpointing.policies")
    except ImportError:
        return None


def _our_save_matmuls(ours: Any) -> ContextFn | None:
    """Our save-matmuls ``context_fn`` (see ``ours_library``), or ``None``."""
    policies = _our_policies()
    if policies is not None and hasattr(policies, "as_context_fn"):
        return policies.as_context_fn(policies.save_matmuls())
    make_contexts = getattr(ours, "create_selective_checkpoint_contexts", None)
    if make_contexts is None:
        return None
    return functools.partial(make_contexts, list(MATMUL_OPS))


def policy_source() -> str:
    """Say which save-matmuls policy ``ours_library`` picked, and whether its op set is torch's."""
    policies = _our_policies()
    if policies is None or not hasattr(policies, "as_context_fn"):
        return "the op list of benchmarks/_libs.py (checkpointing.policies missing)"
    same = set(getattr(policies, "MATMUL_OPS", ())) == set(MATMUL_OPS)
    ops = "the same ops as torch's list" if same else "ops DIFFERENT from torch's list"
    return f"checkpointing.policies.save_matmuls() ({ops})"
