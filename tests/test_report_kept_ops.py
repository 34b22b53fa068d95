"""A report names, per region, the ops whose outputs the region kept: proof that a policy took
effect without reading the per-tensor table; and the table never cuts an op name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import checkpointing
from checkpointing import saved_tensors_report
from checkpointing._units import format_bytes
from checkpointing.policies import as_context_fn, offload_ops, save_attention, save_matmuls


class Block(nn.Module):
    """Attention (the CPU kernel, no dropout) and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).unbind(2)
        attended = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return x + self.mlp(x + attended.transpose(1, 2).reshape(2, 8, 16))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _report(context_fn: object, *, from_loss: bool = False) -> checkpointing.SavedTensorsReport:
    model = _model()
    x = torch.randn(2, 8, 16, requires_grad=True)

    def forward() -> torch.Tensor:
        h = x
        for block in model:
            h = checkpointing.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
        return h.sum()

    if from_loss:
        return saved_tensors_report(forward(), model=model)
    with saved_tensors_report(model=model) as report:
        forward().backward()
    return report


KERNEL = "_scaled_dot_product_flash_attention_for_cpu"


def test_each_region_names_the_ops_it_kept_with_counts_and_bytes() -> None:
    """Under ``save_matmuls()`` each block's summary line is followed by the ops it kept, with
    their tensor counts and bytes, as the rows say; ``RegionTotals.kept_ops`` holds the same."""
    report = _report(as_context_fn(save_matmuls()))
    text = report.summary()
    for region, totals in report.regions().items():
        rows = [
            r
            for r in report.records
            if r.region == region and r.decision == "saved" and r.op in totals.kept_ops
        ]
        assert sum(n for n, _ in totals.kept_ops.values()) == len(rows)
        assert set(totals.kept_ops) == {"addmm", KERNEL}
        tensors, nbytes = totals.kept_ops["addmm"]
        assert f"addmm x{tensors} ({format_bytes(nbytes)})" in text
    assert text.count("  kept: ") == 2


def test_plain_checkpointing_says_it_kept_no_op_outputs() -> None:
    """Without a policy each region says it recomputes every op (and lists no kept op)."""
    report = _report(checkpointing.noop_context_fn)
    assert all(not totals.kept_ops for totals in report.regions().values())
    assert report.summary().count("  kept: no op outputs (recomputes every op)") == 2


def test_offloaded_ops_are_named_apart() -> None:
    """An offload policy's ops are listed as offloaded, not as kept."""
    report = _report(as_context_fn(offload_ops(torch.ops.aten.gelu)))
    for totals in report.regions().values():
        assert list(totals.offloaded_ops) == ["gelu"]
        assert not totals.kept_ops
    assert report.summary().count("  offloaded: gelu x1 (") == 2


def test_op_names_are_never_cut() -> None:
    """The attention kernel's 43-character name appears whole in the summary and in the table
    (it was cut at 28, where it reads like the flash kernel of CUDA), in both report forms."""
    for from_loss in (False, True):
        report = _report(as_context_fn(save_attention()), from_loss=from_loss)
        assert any(r.op == KERNEL for r in report.records)
        table = report.table()
        assert all(r.op in table for r in report.records)
        assert f"{KERNEL} x" in report.summary()
        header = table.splitlines()[1]
        assert header.index("name") > len(KERNEL)
