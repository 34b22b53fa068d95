"""Which op outputs a plan offloads to host instead of recomputing them (Rule S2).

Owns ``offloads``: after ``solver.solve``, per checkpointed region, the units whose trip to host
and back is predicted cheaper than recomputing them, within a host budget. The caller asks only
on an accelerator.
"""

from __future__ import annotations

from typing import Final

from .problem import Problem, Solution, skipped

__all__ = ["offloads"]

# Host<->device bandwidth assumed for offload, each way (PCIe 4 x16 in practice reaches ~12-25
# GB/s; the lower end keeps offload from looking cheaper than it is).
_HOST_BYTES_PER_SECOND: Final = 10e9


def offloads(problem: Problem, solution: Solution, host_budget: int) -> list[frozenset[int]]:
    """Per region, the units to offload instead of recomputing: where moving the output to host
    and back is predicted cheaper than recomputing it, best gain per host byte first, within
    ``host_budget`` (Rule S2; the caller asks only on an accelerator)."""
    chosen: list[set[int]] = [set() for _ in problem.regions]
    candidates = []
    choices = solution.choices
    for index, (region, choice) in enumerate(zip(problem.regions, choices, strict=True)):
        # Rule S9: a chain's members stay whole (no policy in them)
        joined = index + 1 < len(choices) and choices[index + 1].joined
        if not choice.checkpoint or choice.joined or joined:
            continue
        skips = set(skipped(problem, index, choice))  # Rule S8: nothing to serve
        for position, unit in enumerate(region.units):
            nbytes = sum(problem.storage_bytes[s] for s in unit.storages)
            gain = unit.seconds - 2 * nbytes / _HOST_BYTES_PER_SECOND
            if position in choice.saved or unit.key in skips:
                continue
            if gain > 0 and nbytes > 0:
                candidates.append((-gain / nbytes, index, position, nbytes))
    used = 0
    gains = [0.0] * len(problem.regions)
    for _, index, position, nbytes in sorted(candidates):
        if used + nbytes <= host_budget:
            used += nbytes
            chosen[index].add(position)
            gains[index] += problem.regions[index].units[position].seconds
    for index, choice in enumerate(solution.choices):
        # A region that saves and skips nothing runs without a policy; offloading installs one.
        if (
            not choice.saved
            and not choice.draws
            and not skipped(problem, index, choice)
            and gains[index] <= problem.regions[index].policy_seconds
        ):
            chosen[index].clear()
    return [frozenset(c) for c in chosen]
