"""The predicted peak of a planned step's memory (NOTE [Planner solve], Rule S6).

Owns ``predicted_peak``: per region, what is live while backward runs it under a choice (its
working set), and what the plain step held above its own working set there (measured by
``live_bytes``); the highest of them, or the forward's end. Choosing belongs to ``solver``,
measuring to ``profile`` and ``live_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .problem import Choice, Problem, kept_bytes, kept_storages

__all__ = ["predicted_peak"]


def predicted_peak(problem: Problem, choices: Sequence[Choice]) -> int:
    """Rule S6: the step's peak bytes under ``choices`` (0 where the plain peak is unknown).

    While backward runs a region, a plan holds the region's working set under its choice and
    what the plain step held beyond its own working set there (the gradient flowing in, the
    backward's temporaries, the gradients made so far: measured per region as the most bytes
    live while the plain step's backward ran it, less its plain working set). Where a region
    was not measured (a device without a per-region reading), the whole of the plain step's
    extra over its highest working set stands in, which errs high."""
    if not problem.plain_peak:
        return 0
    plain = _working_sets(problem, [Choice(False)] * len(problem.regions))
    start = problem.plain_peak - max(plain, default=0)
    highest = 0
    for region, mine, base in zip(
        problem.regions, _working_sets(problem, choices), plain, strict=True
    ):
        extra = region.backward_peak - base if region.backward_peak else start
        highest = max(highest, mine + max(0, extra))
    return max(kept_bytes(problem, choices) + start, highest)


def _working_sets(problem: Problem, choices: Sequence[Choice]) -> list[int]:
    """Rule S6: per region, the bytes live while backward runs it that the model counts: what
    the regions before it keep, all it saves (recompute has restored it) and keeps, and the
    gradients of the parameters of the regions after it; in a chain (Rule S9), all that the
    members before it save too: one recompute restored the chain's whole."""
    kept_before = set(problem.outside)
    grads_after = sum(r.grad_bytes for r in problem.regions)
    chain: set[int] = set()  # what the members of the chain so far save (Rule S9)
    sets = []
    for index, (region, choice) in enumerate(zip(problem.regions, choices, strict=True)):
        mine = kept_storages(problem, index, choice)
        grads_after -= region.grad_bytes
        if not choice.joined:
            chain = set()
        working = kept_before | chain | region.saved | mine
        sets.append(sum(problem.storage_bytes[s] for s in working) + grads_after)
        kept_before |= mine
        chain |= region.saved
    return sets
