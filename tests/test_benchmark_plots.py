"""The pictures in docs/ are redrawn from the tables recorded in benchmarks/RESULTS.md
(``--from-results``): their readers find every row, so an edit of RESULTS.md that breaks a
picture fails here (drawing itself needs matplotlib, which the test group leaves out)."""

from __future__ import annotations

import itertools

import pytest
from benchmark_support import load_benchmark

# Run in CI's first stage only (the `once` marker): reading RESULTS.md is the same on every release.
pytestmark = pytest.mark.once


def test_sequential_plot_reads_every_variant_of_the_recorded_table() -> None:
    """The 14 variants of the checkpoint_sequential table, "none" first at step time 1."""
    points = load_benchmark("sequential").recorded_points()
    assert len(points) == 14
    assert points[0] == ("none", 10.75, 11.28, 1.0)
    labels = [label for label, *_ in points]
    assert len(set(labels)) == len(labels)
    assert all("`" not in label for label in labels)
    assert all(0 < kept <= peak for _, kept, peak, _ in points)


def test_planner_plot_reads_both_workloads_of_the_recorded_tables() -> None:
    """W1 and W2: the bytes kept without checkpointing, every plan that fits (W1's budgets
    below its floor have none), the seven hand policies, "none" at (baseline, 1), and for each
    of the six others the plan made at its own bytes, which keeps no more than it."""
    panels = load_benchmark("planner").recorded_panels()
    assert [key.split(" ")[0] for key, *_ in panels] == ["W1", "W2"]
    (_, w1_base, w1_plans, w1_hands, w1_at), (_, w2_base, w2_plans, w2_hands, w2_at) = panels
    assert [budget for budget, *_ in w1_plans] == [0.5, 0.6, 0.7, 0.8, 0.9]
    assert [budget for budget, *_ in w2_plans] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    hand_names = [
        "full",
        "save_matmuls",
        "every 2nd matmul",
        "every 2 layers",
        "every 3 layers",
        "every 4 layers",
    ]
    for base, plans, hands, at_hand in (
        (w1_base, w1_plans, w1_hands, w1_at),
        (w2_base, w2_plans, w2_hands, w2_at),
    ):
        assert hands["none"] == (base, 1.0)
        assert list(hands)[1:] == hand_names
        assert all(kept <= budget * base for budget, kept, _ in plans)
        assert list(at_hand) == hand_names
        assert all(at_hand[name][0] <= hands[name][0] for name in hand_names)


def test_sweep_plot_reads_every_family_of_the_recorded_tables() -> None:
    """The budget sweep's six families: 12 plans each, from budget 1.0 (kept bytes 1.0) down to
    the floor, each keeping at most its budget (measured against the predicted baseline: a
    rounding's worth of slack) and no more than the wider budget's plan; the hand strategies
    (full checkpointing and ``checkpoint_sequential``'s segments among them), each at its kept
    bytes and step time."""
    load_benchmark("planner")  # puts benchmarks/ on the path, where the sweep imports it from
    sweep = load_benchmark("planner_sweep")
    panels = sweep.recorded_panels()
    assert len(panels) == 6
    for key, plans, hands in panels:
        assert len(plans) == 12, key
        budgets = [budget for budget, _, _ in plans]
        assert budgets[0] == 1.0
        assert budgets == sorted(budgets, reverse=True)
        assert plans[0][1] == 1.0
        assert all(kept <= budget + 0.002 for budget, kept, _ in plans), key
        assert all(b[1] <= a[1] for a, b in itertools.pairwise(plans)), key
        assert all(time > 0 for _, _, time in plans)
        assert {"full", "checkpoint_sequential, 2 segments"} <= set(hands), key
        assert set(hands) <= set(sweep.hands()), key
        assert all(0 < kept <= 1 and time > 0 for kept, time in hands.values()), key
