"""The planner's cost model: what recomputing an op, a policy, a frame and a span costs.

Owns ``DeviceCosts``, the constants of one device class, and ``op_seconds``: an op's predicted
seconds from what the profile counts (FLOPs, bytes read and written), never from a clock, so
a plan is a function of the model, the inputs, the budget and the options (NOTE [Planner measure],
Rules M8 and M12). The constants were measured by ``benchmarks/planner.py --cost-model`` (the
numbers, machine and date in ``benchmarks/RESULTS.md``, "the planner's cost model"); profiling
belongs to ``profile``, weighing seconds against FLOPs to ``problem`` (``Objective``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DeviceCosts", "costs_for", "op_seconds"]


@dataclass(frozen=True, slots=True)
class DeviceCosts:
    """The cost model's constants for one device class (Rule M8)."""

    flops_per_second: float
    """Matrix work: what a large ``mm`` achieves."""
    bytes_per_second: float
    """Memory traffic: what a large elementwise op reads plus writes per second."""
    dispatch_seconds: float
    """What any op costs beyond its work: dispatch, launch, the autograd node."""
    policy_seconds_per_op: float
    """What a selective policy's modes add per op of a region call, forward and replay
    together (Rule S3)."""
    frame_seconds_per_op: float
    """What a checkpointed region costs beyond its ops' recompute, per op its replay runs:
    the frame, its holders, the recompute's graph (Rule M12)."""
    span_call_seconds: float
    """What recording one span call costs beyond its ops (Rule M11)."""

    def op(self, flops: int, nbytes: int) -> float:
        """Rule M8: the predicted seconds of one op call."""
        return (
            self.dispatch_seconds + flops / self.flops_per_second + nbytes / self.bytes_per_second
        )


# CPU, one thread: benchmarks/planner.py --cost-model on the shared 2-core box, 2026-11-27, torch
# 2.13 (RESULTS.md, "the planner's cost model": the machine was loaded, so the Python-side prices
# take the middle of the ranges measured over several days, not one noisy run).
_CPU: Final = DeviceCosts(
    flops_per_second=1.5e11,
    bytes_per_second=1.5e10,
    dispatch_seconds=2e-6,
    policy_seconds_per_op=20e-6,
    frame_seconds_per_op=15e-6,
    span_call_seconds=280e-6,
)
# Accelerators: not measured by this project's machines; the orders of magnitude of a recent
# data-centre GPU (hundreds of TFLOP/s of matrix work, a few TB/s, ~10 us per launch from Python),
# the Python-side prices as on the CPU (the modes run on the host).
_ACCELERATOR: Final = DeviceCosts(
    flops_per_second=4.0e14,
    bytes_per_second=2.0e12,
    dispatch_seconds=10e-6,
    policy_seconds_per_op=_CPU.policy_seconds_per_op,
    frame_seconds_per_op=_CPU.frame_seconds_per_op,
    span_call_seconds=_CPU.span_call_seconds,
)


def costs_for(device: str) -> DeviceCosts:
    """The constants of ``device``'s class (``"cpu"``, ``"cuda:0"``...): the CPU's or an
    accelerator's."""
    return _CPU if device.split(":")[0] == "cpu" else _ACCELERATOR


def op_seconds(device: str, flops: int, nbytes: int) -> float:
    """Rule M8: one op call's predicted seconds on ``device``."""
    return costs_for(device).op(flops, nbytes)
