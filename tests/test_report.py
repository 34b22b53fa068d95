"""The saved-tensor report: rows, decisions, totals and recompute cost."""

from __future__ import annotations

from collections.abc import Callable

import torch

import checkpointing
from checkpointing import policies, saved_tensors_report

RNG_STATE_BYTES = torch.get_rng_state().nbytes  # what a checkpoint keeps per distinct state


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
    """Inside a checkpoint rows are 'recomputed'; only the region's input and its CPU RNG state
    are kept."""
    model = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors_report() as report:
        y = checkpointing.checkpoint(model, x, use_reentrant=False)
        y.sum().backward()
    kept = [(r.op, r.region) for r in report.records if r.decision == "saved"]
    assert kept == [
        ("(input or parameter)", "inputs of Sequential #1"),
        ("rng state", "Sequential #1"),
    ]
    assert report.kept_bytes == x.numel() * x.element_size() + RNG_STATE_BYTES
    assert report.activation_bytes == RNG_STATE_BYTES  # the input is a leaf: not an activation
    recomputed = [r for r in report.records if r.decision == "recomputed"]
    assert {r.region for r in recomputed} == {"Sequential #1"}
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
    """Activation bytes of N checkpointed layers equal the region inputs and one CPU RNG state
    (no region draws, so all share it); without checkpointing every layer keeps two activations
    (Linear's input, GELU's input)."""
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
    assert run(True) == 5 * activation + RNG_STATE_BYTES  # region 1's input is x: a leaf
    assert run(False) == 11 * activation  # 6 GELU inputs and 5 Linear inputs (x is a leaf)


def test_table_has_header_rows_and_totals() -> None:
    """``report.table()`` (and ``detail()``) is the headline, a header, one line per row and
    the totals."""
    x = torch.randn(3, requires_grad=True)
    with saved_tensors_report() as report:
        checkpointing.checkpoint(torch.sin, x, use_reentrant=False).exp().sum().backward()
    text = report.table()
    assert report.detail() == text
    lines = text.splitlines()
    assert lines[0].startswith("saved-tensor report:")
    assert lines[1].startswith("op")
    assert "activations kept:" in text
    assert "recompute cost:" in text
    assert len(lines) == len(report.records) + 6


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
    # the region's input, the mm output and the region's CPU RNG state
    assert kept_after_forward == x.nbytes + 4 * 8 * 4 + RNG_STATE_BYTES


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


def test_rng_states_are_rows_and_identical_ones_count_once() -> None:
    """Each checkpoint's CPU RNG state is an "rng state" row; consecutive regions that draw
    nothing share one state, whose bytes count once; ``preserve_rng_state=False`` keeps none."""
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors_report() as report:
        h = x.sin()  # region inputs made in the block are activations: count them too
        h = checkpointing.checkpoint(torch.nn.functional.dropout, h, 0.5, use_reentrant=False)
        h = checkpointing.checkpoint(torch.cos, h, use_reentrant=False)  # after a draw: a new state
        h = checkpointing.checkpoint(torch.exp, h, use_reentrant=False)  # no draw since: shared
        h = checkpointing.checkpoint(torch.tanh, h, use_reentrant=False, preserve_rng_state=False)
        h.sum().backward()
    states = [r for r in report.records if r.op == "rng state"]
    assert [(r.shape, r.dtype, r.decision) for r in states] == [
        ((RNG_STATE_BYTES,), torch.uint8, "saved")
    ] * 3
    functions = (torch.nn.functional.dropout, torch.cos, torch.exp)
    assert [r.region for r in states] == [f"checkpoint({f.__qualname__})" for f in functions]
    assert report.activation_bytes == 4 * x.nbytes + 2 * RNG_STATE_BYTES
    assert report.kept_bytes == report.activation_bytes + x.nbytes


def test_keyword_inputs_are_rows_and_count_as_kept() -> None:
    """A tensor a checkpoint receives by keyword is kept by the frame itself, out of every
    hook's sight: it is a "keyword input" row and its bytes count (an activation when the block
    made it; a leaf made before the block is kept, not an activation)."""
    x = torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(8)  # made before the block

    def scaled(t: torch.Tensor, *, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return t * scale + shift

    with saved_tensors_report() as report:
        scale = torch.full((4, 8), 2.0)  # made in the block; mul saves it, but in the region
        y = checkpointing.checkpoint(
            scaled, x, scale=scale, shift=bias, use_reentrant=False, preserve_rng_state=False
        )
        y.sum().backward()
    region = f"checkpoint({scaled.__qualname__})"
    rows = [(r.op, r.region, r.shape) for r in report.records if r.decision == "saved"]
    assert ("keyword input", region, (4, 8)) in rows
    assert ("keyword input", region, (8,)) in rows
    assert report.activation_bytes == scale.nbytes
    assert report.kept_bytes == x.nbytes + scale.nbytes + bias.nbytes
