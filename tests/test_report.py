"""The saved-tensor report: rows, decisions, totals and recompute cost."""

from __future__ import annotations

from collections.abc import Callable

import torch

import checkpointing
from checkpointing import policies, saved_tensors_report


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))


def test_uncheckpointed_step_reports_everything_as_saved() -> None:
    """Without checkpointing every row is 'saved' and named after the op that produced it."""
    model = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors_report() as report:
        model(x).sum().backward()
    assert report.records
    assert {r.decision for r in report.records} == {"saved"}
    assert {"addmm", "gelu"} <= {r.op for r in report.records}
    assert report.recompute_ops == 0


def test_checkpointed_region_rows_are_recomputed_and_only_inputs_kept() -> None:
    """Inside a checkpoint rows are 'recomputed'; only the region's input is kept."""
    model = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors_report() as report:
        y = checkpointing.checkpoint(model, x, use_reentrant=False)
        y.sum().backward()
    kept = [r for r in report.records if r.decision == "saved"]
    assert [r.region for r in kept] == ["inputs of checkpoint(Sequential)"]
    assert report.kept_bytes == x.numel() * x.element_size()
    assert report.activation_bytes == 0  # the only kept tensor is a leaf input
    recomputed = [r for r in report.records if r.decision == "recomputed"]
    assert {r.region for r in recomputed} == {"checkpoint(Sequential)"}
    assert "gelu" in {r.op for r in recomputed}


def test_recompute_cost_counts_ops_and_matmul_flops() -> None:
    """Recompute cost counts the re-run ops and the FLOPs of the matmul (2*m*k*n)."""
    w = torch.randn(5, 6, requires_grad=True)
    x = torch.randn(4, 5, requires_grad=True)
    with saved_tensors_report() as report:
        y = checkpointing.checkpoint(lambda a: (a @ w).sin(), x, use_reentrant=False)
        y.sum().backward()
    assert report.recompute_ops >= 2
    assert report.recompute_flops == 2 * 4 * 5 * 6


def test_kept_bytes_matches_the_floor_for_a_chain() -> None:
    """Activation bytes of N checkpointed layers equal the region inputs; without checkpointing
    every layer keeps two activations (Linear's input, GELU's input)."""
    layers = [torch.nn.Linear(32, 32) for _ in range(6)]
    x = torch.randn(16, 32, requires_grad=True)

    def layer_fn(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: torch.nn.functional.gelu(layer(t))

    def run(use_checkpoint: bool) -> int:
        with saved_tensors_report() as report:
            h = x
            for layer in layers:
                fn = layer_fn(layer)
                ckpt = checkpointing.checkpoint
                h = ckpt(fn, h, use_reentrant=False) if use_checkpoint else fn(h)
        return report.activation_bytes

    activation = 16 * 32 * 4
    assert run(True) == 5 * activation  # the inputs of regions 2..6; region 1's input is x
    assert run(False) == 11 * activation  # 6 GELU inputs and 5 Linear inputs (x is a leaf)


def test_table_has_header_rows_and_totals() -> None:
    """``str(report)`` is a table with a header, one line per row and the totals."""
    x = torch.randn(3, requires_grad=True)
    with saved_tensors_report() as report:
        checkpointing.checkpoint(torch.sin, x, use_reentrant=False).exp().sum().backward()
    text = str(report)
    assert text.splitlines()[0].startswith("op")
    assert "kept for backward:" in text
    assert "recompute cost:" in text
    assert len(text.splitlines()) == len(report.records) + 5


def test_selective_cache_counts_towards_kept_bytes() -> None:
    """What a selective policy saves is kept outside the graph and still counted as kept."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors_report() as report:
        y = checkpointing.checkpoint(
            lambda a: (a @ w).relu(),
            x,
            use_reentrant=False,
            context_fn=policies.as_context_fn(policies.save_matmuls()),
        )
        kept_after_forward = report.kept_bytes
        y.sum().backward()
    saved = [r for r in report.records if r.decision == "saved" and r.op == "mm"]
    assert len(saved) == 1
    assert kept_after_forward == x.nbytes + 4 * 8 * 4  # the region's input and the mm output


def test_saved_masks_made_in_the_step_are_activations_but_no_grad_inputs_are_not() -> None:
    """Saved tensors that do not require grad are activations when ops made them in the step
    (a bool mask, dropout's noise), not when they were made before it (token ids)."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 8)
    ids = torch.randint(0, 10, (4,))
    with saved_tensors_report() as report:
        h = embedding(ids)  # saves the ids: an input, not an activation
        mask = h > 0  # bool, made in the step, saved by masked_fill
        y = torch.nn.functional.dropout(h.masked_fill(mask, 0.0), 0.5, training=True)
        y.sum().backward()
    assert report.activation_bytes == 4 * 8 * 1 + 4 * 8 * 4  # the mask and dropout's noise
    assert report.kept_bytes == report.activation_bytes + ids.nbytes
