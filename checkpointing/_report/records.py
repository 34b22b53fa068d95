"""What a saved-tensor report holds and how it prints, and the bookkeeping both builders share.

Owns ``SavedTensorRecord`` (one row), ``SavedTensorsReport`` (the rows, the totals, the table)
and ``Tally``, which adds rows to a report and counts each storage once in its byte totals. How
rows are found is the builders' business: ``watch`` (hooks around a step) and ``graph`` (a walk
of the autograd graph from a loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._events import Decision

__all__ = [
    "LEAF",
    "OUTSIDE",
    "SavedTensorRecord",
    "SavedTensorsReport",
    "Tally",
    "record_of",
    "storage_key",
]

OUTSIDE = "(outside any region)"
"""The region of a tensor saved by no checkpoint of ours."""
LEAF = "(input or parameter)"
"""The op of a tensor no op made: an input or a parameter (a leaf tensor)."""


@dataclass(frozen=True, slots=True)
class SavedTensorRecord:
    """One tensor autograd needs for backward, and what happens to it until then.

    ``name`` is the name the tensor was given with ``checkpointing.policies.tag(tensor, name)``,
    or None."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    region: str
    decision: Decision
    name: str | None = None


@dataclass
class SavedTensorsReport:
    """What a step saved for backward. ``str(report)`` is a table; the fields are the data."""

    records: list[SavedTensorRecord] = field(default_factory=list)
    recompute_ops: int = 0
    recompute_flops: int = 0
    kept_bytes: int = 0
    """Bytes of the distinct storages kept between forward and backward (device memory)."""
    activation_bytes: int = 0
    """The part of ``kept_bytes`` that is activations: storages that ops made inside the block
    (saved masks included, though they do not require grad), not those of inputs and
    parameters, which stay in memory whether or not anything is checkpointed. A report built
    from a loss sees no block: there, every kept storage but those of leaf tensors that require
    grad is an activation."""
    rng_state_bytes: int = 0
    """The part of ``activation_bytes`` that is RNG states our checkpoints keep for recompute
    (each distinct state once). torch's own checkpoint keeps one per region too, but out of
    sight of this report: subtract this to compare with a step checkpointed by torch."""
    notes: list[str] = field(default_factory=list)
    """What the report saw but could not count, and why (printed under the table)."""
    recompute_counted: bool = True
    """Whether ``recompute_ops`` and ``recompute_flops`` were measured: only a report that
    watched the backward (``with saved_tensors_report():``) counts them."""

    def bytes_by_decision(self) -> dict[Decision, int]:
        """Total tensor bytes per decision (a tensor saved twice counts twice here)."""
        totals: dict[Decision, int] = {"saved": 0, "recomputed": 0, "offloaded": 0}
        for record in self.records:
            totals[record.decision] += record.nbytes
        return totals

    def bytes_by_region(self, decision: Decision = "saved") -> dict[str, int]:
        """Tensor bytes per region for one decision, largest first (a tensor saved twice
        counts twice): which region holds what."""
        totals: dict[str, int] = {}
        for record in self.records:
            if record.decision == decision:
                totals[record.region] = totals.get(record.region, 0) + record.nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def table(self) -> str:
        """A fixed-width table of the records, then the totals."""
        header = (
            f"{'op':<28} {'name':<12} {'shape':<20} {'dtype':<9} {'bytes':>12}  "
            f"{'decision':<10} region"
        )
        lines = [header, "-" * len(header)]
        for r in self.records:
            dtype = str(r.dtype).removeprefix("torch.")
            lines.append(
                f"{r.op[:28]:<28} {(r.name or '')[:12]:<12} {str(list(r.shape))[:20]:<20} "
                f"{dtype:<9} {r.nbytes:>12,}  {r.decision:<10} {r.region}"
            )
        totals = self.bytes_by_decision()
        lines.append("-" * len(header))
        lines.append(
            f"kept for backward: {self.kept_bytes:,} bytes in distinct storages, "
            f"{self.activation_bytes:,} of them activations; "
            + ", ".join(f"{k}: {v:,} bytes" for k, v in totals.items())
        )
        if self.recompute_counted:
            lines.append(
                f"recompute cost: {self.recompute_ops} ops, {self.recompute_flops:,} FLOPs "
                "(FLOPs only for ops torch.utils.flop_counter knows)"
            )
        else:
            lines.append("recompute cost: not counted (no backward ran under the report)")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class Tally:
    """Adds rows to a report and counts each kept storage once in its byte totals."""

    def __init__(self, report: SavedTensorsReport) -> None:
        self.report = report
        self.kept_storages: dict[tuple[int, torch.device], int] = {}
        self.activation_storages: dict[tuple[int, torch.device], int] = {}
        self.rng_storages: dict[tuple[int, torch.device], int] = {}

    def row(
        self,
        op: str,
        tensor: torch.Tensor,
        region: str,
        decision: Decision,
        name: str | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Add a row for ``tensor`` (see ``record_of``)."""
        self.report.records.append(record_of(op, tensor, region, decision, name, nbytes))

    def keep(self, tensor: torch.Tensor, *, activation: bool, rng: bool = False) -> None:
        """Count ``tensor``'s storage once in ``kept_bytes`` (and ``activation_bytes``, and
        ``rng_state_bytes``)."""
        key = storage_key(tensor)
        if key is None:
            return
        nbytes = tensor.untyped_storage().nbytes()
        report = self.report
        self.kept_storages[key] = nbytes
        report.kept_bytes = sum(self.kept_storages.values())
        if activation or rng:
            self.activation_storages[key] = nbytes
            report.activation_bytes = sum(self.activation_storages.values())
        if rng:
            self.rng_storages[key] = nbytes
            report.rng_state_bytes = sum(self.rng_storages.values())

    def note(self, text: str) -> None:
        """Add ``text`` to the report's notes, once."""
        if text not in self.report.notes:
            self.report.notes.append(text)


def record_of(
    op: str,
    tensor: torch.Tensor,
    region: str,
    decision: Decision,
    name: str | None = None,
    nbytes: int | None = None,
) -> SavedTensorRecord:
    """The row for ``tensor`` (``nbytes`` when the row's bytes are not its own: an offloaded
    tensor's host copy stands for the device tensor)."""
    size = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
    return SavedTensorRecord(op, tuple(tensor.shape), tensor.dtype, size, region, decision, name)


def storage_key(tensor: torch.Tensor) -> tuple[int, torch.device] | None:
    """Where ``tensor``'s memory lives; None for tensors without memory (meta, sparse)."""
    if tensor.device.type == "meta" or tensor.is_sparse:
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.device)
