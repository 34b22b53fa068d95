"""The saved-tensor report: what autograd keeps for backward, and what recompute costs.

Owns ``saved_tensors_report`` in its two forms, ``report_on_oom`` and the report's data
(``SavedTensorsReport``, ``SavedTensorRecord``). JAX's ``print_saved_residuals`` is the model:
one row per tensor, with the op that produced it, the name ``policies.tag`` gave it, shape,
dtype, bytes, the region it belongs to and what happens to it (saved, recomputed, offloaded);
printed by default as one line per region (``_regions`` labels them: NOTE [Region names]).

One concept per module; each imports only from the ones listed before it:

- ``records``: the rows, the totals, the table, and ``Tally`` (each storage counted once).
- ``watch``: ``with saved_tensors_report() as report:``, hooks and a dispatch mode around a step
  (its docstring: "How it watches").
- ``graph``: ``saved_tensors_report(loss)``, a walk of the graph after forward that unpacks
  nothing (NOTE [Report from a graph]).
- ``oom``: ``report_on_oom``, the walk from every live graph when memory runs out (NOTE
  [Out-of-memory report]).

The two forms agree on one step: the same rows (but for the op of a tensor the graph cannot
trace to its producer, and names of recomputed tensors) and the same kept bytes; activation
bytes differ only for tensors made before the step without grad (``graph``, Rule 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Final, overload

import torch
from torch import nn

from .graph import report_from_graph, roots_of
from .oom import report_on_oom
from .records import RegionTotals, SavedTensorRecord, SavedTensorsReport
from .watch import watch_step

__all__ = [
    "RegionTotals",
    "SavedTensorRecord",
    "SavedTensorsReport",
    "report_on_oom",
    "saved_tensors_report",
]


class _Watch:
    """The default of ``saved_tensors_report``'s argument: no outputs, watch the block."""

    def __repr__(self) -> str:
        return "<watch the block>"


_WATCH: Final = _Watch()


@overload
def saved_tensors_report(
    *, model: nn.Module | None = None
) -> AbstractContextManager[SavedTensorsReport]: ...


@overload
def saved_tensors_report(
    outputs: torch.Tensor | Sequence[torch.Tensor], *, model: nn.Module | None = None
) -> SavedTensorsReport: ...


def saved_tensors_report(
    outputs: torch.Tensor | Sequence[torch.Tensor] | _Watch = _WATCH,
    *,
    model: nn.Module | None = None,
) -> AbstractContextManager[SavedTensorsReport] | SavedTensorsReport:
    """Report every tensor kept for backward: by watching a step, or from its loss.

    ``with saved_tensors_report() as report:`` watches the block: run forward inside it, and
    backward too to count recompute ops and FLOPs; the report is complete when the block exits.

    ``saved_tensors_report(loss)`` (a tensor, or a sequence of them) returns the report at once,
    after a forward that nothing watched: it walks the autograd graph from ``loss`` and reads
    what each node saved without unpacking it, so no checkpointed region is recomputed and
    backward runs afterwards as usual. It sees what the graph and our checkpoints hold
    (recomputed, saved and offloaded tensors, RNG states, selective caches, kept spans), not
    recompute cost.

    ``print(report)`` shows one line per region (tensors, bytes saved, recomputed and
    offloaded) and the totals; ``print(report.table())`` one row per tensor. A region that runs
    a module (``checkpoint(layer, x)``, ``checkpoint_module``, ``checkpoint_wrapper``, a plan,
    the Hugging Face integration) is labelled by the module's path in ``model`` and its class,
    ``model.layers.3 (LlamaDecoderLayer)``, as ``model.named_modules()`` names it; without
    ``model``, by its class and a number, ``LlamaDecoderLayer #4`` (the fourth met). A region
    that runs a plain function is labelled ``checkpoint(<its qualified name>)``.

    ``activation_bytes`` is what an ``ActivationPlan`` calls ``kept_bytes``; the report's own
    ``kept_bytes`` also counts the inputs and parameters that backward needs. From a loss,
    give ``model=`` so that the model's buffers are not counted as activations (what each form
    counts: ``SavedTensorsReport.activation_bytes``).

    Example:
        >>> import torch, checkpointing
        >>> lin = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> with checkpointing.saved_tensors_report() as report:
        ...     y = checkpointing.checkpoint(lambda t: lin(t).relu(), x, use_reentrant=False)
        ...     y.sum().backward()
        >>> report.recompute_ops > 0
        True
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> loss = checkpointing.checkpoint(model[0], x, use_reentrant=False).relu().sum()
        >>> report = checkpointing.saved_tensors_report(loss, model=model)
        >>> list(report.regions())
        ['0 (Linear)', '(outside any region)']
        >>> sorted({r.decision for r in report.records})
        ['recomputed', 'saved']
    """
    if isinstance(outputs, _Watch):
        return watch_step(model)
    return report_from_graph(roots_of(outputs), model)
