"""What a saved-tensor report holds and how it prints, and the bookkeeping both builders share.

Owns ``SavedTensorRecord`` (one row), ``SavedTensorsReport`` (the rows, the totals, and its two
printouts: a summary with one line per region, the default, and the table of rows, on request)
and ``Tally``, which adds rows to a report and counts each storage once in its byte totals. How
rows are found is the builders' business: ``watch`` (hooks around a step) and ``graph`` (a walk
of the autograd graph from a loss); how regions are labelled, ``_regions``'.

Two byte totals, named apart on purpose: ``activation_bytes`` is what an ``ActivationPlan``
calls ``kept_bytes`` (the activations kept between forward and backward, each storage once: a
plan's prediction is checked against it); the report's own ``kept_bytes`` adds the inputs and
parameters that backward also needs, which stay in memory whatever is checkpointed. Printouts
say "activations kept" for the first and "with inputs and parameters" for the second.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .._events import Decision
from .._trees import StorageKey, storage_key, storage_nbytes
from .._units import format_bytes

__all__ = [
    "LEAF",
    "OUTSIDE",
    "RNG_STATE",
    "SELECTIVE",
    "RegionTotals",
    "SavedTensorRecord",
    "SavedTensorsReport",
    "Tally",
    "record_of",
]

OUTSIDE = "(outside any region)"
"""The region of a tensor saved by no checkpoint of ours."""
LEAF = "(input or parameter)"
"""The op of a tensor no op made: an input or a parameter (a leaf tensor)."""
RNG_STATE = "rng state"
"""The op of a row that is an RNG state a checkpoint keeps for its recompute."""
SELECTIVE = "sac"
"""The region the selective modes announce their outputs in; a report puts them in the region
whose forward runs, and keeps this name only where none runs (torch's own checkpoint)."""
_INPUTS = "inputs of "  # a region's inputs, kept for it by its parent
_SPAN = re.compile(r"^keep\(.*?\) in ")  # what a kept span holds, in its region
# How the builders name a collective's output: its op qualified by its namespace (NOTE
# [Collectives under selective checkpointing], Rule 1, says which ops; both builders ask it).
COLLECTIVE_NAMESPACES = ("_c10d_functional::", "_c10d_functional_autograd::", "_dtensor::")


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

    @property
    def collective(self) -> bool:
        """Whether a functional collective made the tensor (its op is named with the
        collective's namespace, ``_c10d_functional::all_reduce``): selective checkpointing
        keeps these unless the policy answers ``MUST_RECOMPUTE``."""
        return self.op.startswith(COLLECTIVE_NAMESPACES)


@dataclass
class SavedTensorsReport:
    """What a step saved for backward. ``str(report)`` is a summary with one line per region
    (``summary()``), ``table()`` one row per tensor; the fields are the data."""

    records: list[SavedTensorRecord] = field(default_factory=list)
    recompute_ops: int = 0
    recompute_flops: int = 0
    kept_bytes: int = 0
    """Bytes of the distinct storages kept between forward and backward (device memory),
    inputs and parameters included: not what a plan calls ``kept_bytes``, which is
    ``activation_bytes`` here."""
    activation_bytes: int = 0
    """The part of ``kept_bytes`` that is activations: storages that ops made inside the block
    (saved masks included, though they do not require grad), each once, not those of inputs and
    parameters, which stay in memory whether or not anything is checkpointed. A view shares its
    base's storage: the transposed weight ``linear`` saves is the parameter's, not an
    activation. This is what an ``ActivationPlan``'s ``kept_bytes`` predicts for the same
    step: a plan made on the model's forward alone (``plan_checkpointing`` without
    ``loss_fn``, torchtitan's ``MemoryBudgetAC``) leaves out what the loss saves (cross-entropy
    keeps its log-softmax, tokens x vocabulary), which a report around forward and loss
    counts. A report built from a loss sees no block: there, every kept storage is an
    activation but those of leaf tensors that require grad and, with ``model=`` given, those of
    the model's parameters and buffers; tensors made before the step without grad (token ids,
    a buffer of a model not given) count, by their whole storage."""
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
        totals["compressed"] = 0  # a key of its own (NOTE [Compressed saves])
        for record in self.records:
            totals[record.decision] += record.nbytes
        return totals

    @property
    def collective_bytes(self) -> int:
        """Tensor bytes of the collectives' outputs kept for backward (saved or offloaded):
        what keeping them instead of running them again in backward costs (a tensor listed
        twice counts twice)."""
        return sum(r.nbytes for r in self.records if r.decision != "recomputed" and r.collective)

    def bytes_by_region(self, decision: Decision = "saved") -> dict[str, int]:
        """Tensor bytes per region for one decision, largest first (a tensor saved twice
        counts twice): which region holds what."""
        totals: dict[str, int] = {}
        for record in self.records:
            if record.decision == decision:
                totals[record.region] = totals.get(record.region, 0) + record.nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def regions(self) -> dict[str, RegionTotals]:
        """Per region, in the order the step met them: its rows' count and bytes per decision.
        A region's inputs (rows "inputs of R") and what its kept spans hold ("keep(name) in
        R") count towards R: the region keeps them. A tensor listed twice counts twice."""
        found: dict[str, RegionTotals] = {}
        for record in self.records:
            region = region_of_row(record.region)
            totals = found.get(region)
            if totals is None:
                totals = found[region] = RegionTotals()
            totals.add(record)
        for totals in found.values():
            totals.sort()
        return found

    def summary(self) -> str:
        """One line per region (tensors, bytes saved, recomputed and offloaded, and kept
        compressed where the step compressed anything) and, under it, the ops whose outputs the
        region kept (saved, offloaded or compressed: the proof that a policy took effect), then
        the totals, the recompute cost and the notes. The default printout (``str(report)``)."""
        regions = self.regions()
        width = max([len("region"), *(len(name) for name in regions)])
        compressed = any(totals.compressed for totals in regions.values())
        header = (
            f"{'region':<{width}}  {'tensors':>7}  {'saved':>10}  {'recomputed':>10}  "
            f"{'offloaded':>10}" + (f"  {'compressed':>10}" if compressed else "")
        )
        lines = [self._headline(len(regions)), header, "-" * len(header)]
        for name, totals in regions.items():
            lines.append(
                f"{name:<{width}}  {totals.tensors:>7}  {format_bytes(totals.saved):>10}  "
                f"{format_bytes(totals.recomputed):>10}  {format_bytes(totals.offloaded):>10}"
                + (f"  {format_bytes(totals.compressed):>10}" if compressed else "")
            )
            listed = (
                ("kept", totals.kept_ops),
                ("offloaded", totals.offloaded_ops),
                ("compressed", totals.compressed_ops),
            )
            for label, ops in listed:
                if ops:
                    lines.append(f"  {label}: {_list_ops(ops)}")
            if totals.recomputed and not any(ops for _, ops in listed):
                lines.append("  kept: no op outputs (recomputes every op)")
        lines.append("-" * len(header))
        lines.extend(self._footer())
        lines.append("(one row per tensor: print(report.table()))")
        return "\n".join(lines)

    def table(self) -> str:
        """A fixed-width table of the records (one row per tensor), then the totals. Columns
        are as wide as their longest entry: op names and tensor names are never cut."""
        shapes = [str(list(r.shape)) for r in self.records]
        op_w = max([len("op"), *(len(r.op) for r in self.records)])
        name_w = max([len("name"), *(len(r.name or "") for r in self.records)])
        shape_w = max([len("shape"), *map(len, shapes)])
        header = (
            f"{'op':<{op_w}} {'name':<{name_w}} {'shape':<{shape_w}} {'dtype':<9} "
            f"{'bytes':>10}  {'decision':<10} region"
        )
        lines = [self._headline(len(self.regions())), header, "-" * len(header)]
        for r, shape in zip(self.records, shapes, strict=True):
            dtype = str(r.dtype).removeprefix("torch.")
            lines.append(
                f"{r.op:<{op_w}} {r.name or '':<{name_w}} {shape:<{shape_w}} "
                f"{dtype:<9} {format_bytes(r.nbytes):>10}  {r.decision:<10} {r.region}"
            )
        lines.append("-" * len(header))
        lines.extend(self._footer())
        return "\n".join(lines)

    detail = table
    """The table of rows: ``print(report.detail())`` is ``print(report.table())``."""

    def _headline(self, n_regions: int) -> str:
        return (
            f"saved-tensor report: {len(self.records)} tensors in {n_regions} regions; "
            f"activations kept: {format_bytes(self.activation_bytes)} (each storage once; "
            f"{format_bytes(self.kept_bytes)} with inputs and parameters)"
        )

    def _footer(self) -> list[str]:
        totals = self.bytes_by_decision()
        lines = [
            "tensor bytes by decision (a tensor listed twice counts twice): "
            + ", ".join(
                f"{k} {format_bytes(v)}" for k, v in totals.items() if v or k != "compressed"
            )
        ]
        collective = [r for r in self.records if r.decision != "recomputed" and r.collective]
        if collective:
            lines.append(
                f"kept collective outputs: {len(collective)} tensors, "
                f"{format_bytes(self.collective_bytes)} (not run again in backward; a policy "
                "answering MUST_RECOMPUTE for a collective re-runs it)"
            )
        if self.recompute_counted:
            lines.append(
                f"recompute cost: {self.recompute_ops} ops, {self.recompute_flops:,} FLOPs "
                "(FLOPs only for ops torch.utils.flop_counter knows)"
            )
        else:
            lines.append("recompute cost: not counted (no backward ran under the report)")
        lines.extend(f"note: {note}" for note in self.notes)
        return lines

    def __str__(self) -> str:
        return self.summary()


@dataclass
class RegionTotals:
    """One region's lines of the summary: how many rows, their bytes per decision, and per op
    name the outputs the region kept (``kept_ops``: saved, ``offloaded_ops``: in host memory,
    ``compressed_ops``: compressed on the device) as ``(tensors, bytes)``, largest first once
    read through ``SavedTensorsReport.regions``.
    Kept ops are the region's own outputs that backward gets without recompute (a policy's
    answer, a kept span's): not the region's inputs, nor its RNG states, nor leaf tensors."""

    tensors: int = 0
    saved: int = 0
    recomputed: int = 0
    offloaded: int = 0
    kept_ops: dict[str, tuple[int, int]] = field(default_factory=dict)
    offloaded_ops: dict[str, tuple[int, int]] = field(default_factory=dict)
    compressed: int = 0
    """Bytes kept compressed on the device (``Compress``): the packed bytes, not the
    original's; compressed tensors moved to host memory count as offloaded, by packed bytes."""
    compressed_ops: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, record: SavedTensorRecord) -> None:
        self.tensors += 1
        if record.decision == "saved":
            self.saved += record.nbytes
        elif record.decision == "recomputed":
            self.recomputed += record.nbytes
        elif record.decision == "compressed":
            self.compressed += record.nbytes
        else:
            self.offloaded += record.nbytes
        if record.decision != "recomputed" and _is_kept_output(record):
            ops = {
                "saved": self.kept_ops,
                "compressed": self.compressed_ops,
            }.get(record.decision, self.offloaded_ops)
            tensors, nbytes = ops.get(record.op, (0, 0))
            ops[record.op] = (tensors + 1, nbytes + record.nbytes)

    def sort(self) -> None:
        """Largest kept bytes first (ties by name), for the printout."""
        for ops in (self.kept_ops, self.offloaded_ops, self.compressed_ops):
            ordered = sorted(ops.items(), key=lambda item: (-item[1][1], item[0]))
            ops.clear()
            ops.update(ordered)


def _is_kept_output(record: SavedTensorRecord) -> bool:
    """Whether ``record`` is a region's own kept output (see ``RegionTotals``)."""
    return not record.region.startswith(_INPUTS) and record.op not in (LEAF, RNG_STATE)


# At most this many kept ops per line of the summary; the rest are counted.
_OPS_SHOWN = 6


def _list_ops(ops: dict[str, tuple[int, int]]) -> str:
    """``addmm x2 (768 B), bmm x1 (256 B)``, largest first, the tail counted."""
    shown = [
        f"{op} x{tensors} ({format_bytes(nbytes)})"
        for op, (tensors, nbytes) in list(ops.items())[:_OPS_SHOWN]
    ]
    rest = len(ops) - _OPS_SHOWN
    if rest > 0:
        shown.append(f"{rest} more op(s): print(report.table())")
    return ", ".join(shown)


def region_of_row(region: str) -> str:
    """The region a row counts towards in the summary: "inputs of R" and "keep(name) in R"
    are R's."""
    return _SPAN.sub("", region.removeprefix(_INPUTS))


class Tally:
    """Adds rows to a report and counts each kept storage once in its byte totals."""

    def __init__(self, report: SavedTensorsReport) -> None:
        self.report = report
        self.kept_storages: dict[StorageKey, int] = {}
        self.activation_storages: dict[StorageKey, int] = {}
        self.rng_storages: dict[StorageKey, int] = {}

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
        nbytes = storage_nbytes(tensor)
        report = self.report
        self.kept_storages[key] = nbytes
        report.kept_bytes = sum(self.kept_storages.values())
        if activation or rng:
            self.activation_storages[key] = nbytes
            report.activation_bytes = sum(self.activation_storages.values())
        if rng:
            self.rng_storages[key] = nbytes
            report.rng_state_bytes = sum(self.rng_storages.values())

    def keep_bytes(self, device: torch.device, nbytes: int) -> None:
        """Count ``nbytes`` kept on ``device`` in place of a tensor (a compressed copy: a
        storage of its own) in ``kept_bytes`` and ``activation_bytes``."""
        key = (device, -1 - len(self.kept_storages))  # no storage has a negative key
        self.kept_storages[key] = self.activation_storages[key] = nbytes
        self.report.kept_bytes = sum(self.kept_storages.values())
        self.report.activation_bytes = sum(self.activation_storages.values())

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
