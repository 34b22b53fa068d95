"""Modules and torch.distributed: forward hooks, FSDP wrap policies, process groups.

What ``checkpoint_module``, the wrappers and the collectives read of an ``nn.Module`` or of
torch.distributed that torch keeps private. Each name is checked against torch 2.11-2.15.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as checkpoint_wrapper
from torch.nn.modules import module as module_py
from torch.nn.utils.stateless import _reparametrize_module


def forward_pre_hooks(module: torch.nn.Module) -> list[Callable[..., Any]]:
    """The forward pre-hooks registered on ``module`` (2.11-2.15: ``nn.Module._forward_pre_hooks``;
    there is no public accessor)."""
    return list(module._forward_pre_hooks.values())


def forward_hooks(module: torch.nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks registered on ``module`` (2.11-2.15: ``nn.Module._forward_hooks``; there
    is no public accessor)."""
    return list(module._forward_hooks.values())


def has_module_hooks(module: torch.nn.Module) -> bool:
    """Whether a forward or backward hook (or pre-hook) would run when ``module`` is called:
    one of its own, or one registered for every module (2.11-2.15: the ``nn.Module._forward*``
    and ``_backward*`` dicts, and ``torch.nn.modules.module``'s ``_global_*_hooks`` dicts;
    there is no public accessor)."""
    own = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    )
    shared = (
        module_py._global_forward_hooks,
        module_py._global_forward_pre_hooks,
        module_py._global_backward_hooks,
        module_py._global_backward_pre_hooks,
    )
    return any(len(hooks) for hooks in (*own, *shared))


def remove_forward_hooks(
    module: torch.nn.Module, pre_hook: Callable[..., Any], hook: Callable[..., Any]
) -> None:
    """Remove the forward pre-hook ``pre_hook`` and forward hook ``hook`` (compared with ``==``,
    so bound methods of one object match) from ``module``. A ``RemovableHandle`` would do, but
    ``copy.deepcopy`` of a module copies its hooks and not the handles' targets (2.11-2.15: the
    ``nn.Module._forward_*hooks*`` dicts)."""
    for key in [k for k, h in module._forward_pre_hooks.items() if h == pre_hook]:
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in [k for k, h in module._forward_hooks.items() if h == hook]:
        del module._forward_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)


# torch.distributed's wrappers, 2.11-2.15: ``checkpoint_wrapper`` (imported above; ``_wrappers``
# subclasses it).
def wrap_policy_targets(policy: object, root: torch.nn.Module) -> dict[Any, Any] | None:
    """Modules an FSDP policy object picks in ``root``, with kwargs (``_Policy._run_policy``)."""
    run = getattr(policy, "_run_policy", None)
    return None if run is None else dict(run(root, ignored_modules=set(), root_kwargs={}))


def process_group_named(name: str) -> Any:
    """The process group a functional collective's ``group_name`` argument names (2.11-2.15:
    ``torch._C._distributed_c10d._resolve_process_group``)."""
    from torch._C._distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]  # a NewType of str


def default_store() -> Any:
    """The key-value store of the default process group, which every rank reaches (2.11-2.15:
    ``torch.distributed.distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def awaits_first_static_step(replica: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``replica`` (``static_graph=True``) has yet to run the backward of its first
    iteration, the one whose reduction it delays to record the graph (2.11-2.15:
    ``DistributedDataParallel._static_graph_delay_allreduce_enqueued``, set by that backward)."""
    return bool(replica.static_graph) and not replica._static_graph_delay_allreduce_enqueued


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """A context in which ``module``'s parameters and buffers named in ``tensors`` (qualified
    names) are those tensors, tied weights swapped together, the originals back on exit
    (2.11-2.15: ``torch.nn.utils.stateless._reparametrize_module``, what ``functional_call``
    runs in)."""
    return _reparametrize_module(module, tensors, tie_weights=True)
