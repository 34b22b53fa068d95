"""The planner's cost model: what recomputing an op, a policy, a frame and a span costs.

Owns ``DeviceCosts``, the constants of one device class, and ``op_seconds``: an op's predicted
seconds from what the profile counts (FLOPs, bytes read and written), never from a clock, so
a plan is a function of the model, the inputs, the budget and the options (NOTE [Planner measure],
Rules M8 and M12). The constants were measured by ``benchmarks/planner.py --cost-model`` (the
numbers, machine and date in ``benchmarks/RESULTS.md``, "the planner's cost model"); profiling
belongs to ``profile``, weighing seconds against FLOPs to ``problem`` (``Objective``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

__all__ = ["DEVICE_CLASSES", "DeviceCosts", "costs_for", "named_costs", "op_seconds"]


@dataclass(frozen=True, slots=True)
class DeviceCosts:
    """The cost model's constants for one device class (Rule M8): what
    ``plan_checkpointing(..., device=...)`` prices a plan with, by name (``"h100-80gb"``) or
    as such an object of the caller's own; the plan names them (``plan.costs``)."""

    flops_per_second: float
    """Matrix work in a 16-bit type (bfloat16, float16): what a large ``mm`` achieves."""
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
    name: str = "custom"
    """The device class, as ``device=`` names it."""
    float32_flops_per_second: float = 0.0
    """Matrix work in float32 (and float64); 0: at ``flops_per_second``."""
    random_seconds_per_element: float = 0.0
    """What drawing one random number costs beyond the op's memory traffic (dropout's mask,
    ``bernoulli_``, ``rand``); 0: draws run at memory speed."""

    def op(self, flops: int, nbytes: int, float32: bool = False, drawn: int = 0) -> float:
        """Rule M8: the predicted seconds of one op call (``float32``: its matrix work is in
        float32 or float64; ``drawn``: the random numbers it draws)."""
        rate = self.float32_flops_per_second if float32 else 0.0
        return (
            self.dispatch_seconds
            + flops / (rate or self.flops_per_second)
            + nbytes / self.bytes_per_second
            + drawn * self.random_seconds_per_element
        )

    def describe(self) -> str:
        """The constants in words, for a plan's table."""
        wide = self.float32_flops_per_second or self.flops_per_second
        return (
            f"{self.name}: {self.flops_per_second / 1e12:g} TFLOP/s in 16-bit types, "
            f"{wide / 1e12:g} in float32, {self.bytes_per_second / 1e9:g} GB/s, "
            f"{self.dispatch_seconds * 1e6:g} us per op"
            + (
                f", {self.random_seconds_per_element * 1e9:g} ns per random number drawn"
                if self.random_seconds_per_element
                else ""
            )
        )


# CPU, one thread: benchmarks/planner.py --cost-model on the shared 2-core box, 2026-11-27, torch
# 2.13 (RESULTS.md, "the planner's cost model": the machine was loaded, so the Python-side prices
# take the middle of the ranges measured over several days, not one noisy run); the selective
# policy's price per op from four runs on the quiet box, 2026-11-29 (RESULTS.md, "the plan across
# a budget sweep", its reading): plans beside hand strategies had shown 20 us too low; the price of
# a random number from three runs on the quiet box, 2026-11-29 (5.8-7.0 ns beyond the bytes).
_CPU: Final = DeviceCosts(
    flops_per_second=1.5e11,
    bytes_per_second=1.5e10,
    dispatch_seconds=2e-6,
    policy_seconds_per_op=27e-6,
    frame_seconds_per_op=15e-6,
    span_call_seconds=280e-6,
    name="cpu",
    random_seconds_per_element=6.5e-9,
)
# Accelerators: not measured by this project's machines; the orders of magnitude of a recent
# data-centre GPU (hundreds of TFLOP/s of matrix work, a few TB/s, ~10 us per launch from Python),
# the Python-side prices as on the CPU (the modes run on the host), random numbers drawn at memory
# speed (no price beyond their bytes). The class of a plan made on an accelerator whose class is
# not named below.
_ACCELERATOR: Final = DeviceCosts(
    flops_per_second=4.0e14,
    bytes_per_second=2.0e12,
    dispatch_seconds=10e-6,
    policy_seconds_per_op=_CPU.policy_seconds_per_op,
    frame_seconds_per_op=_CPU.frame_seconds_per_op,
    span_call_seconds=_CPU.span_call_seconds,
    name="accelerator",
)
# Named accelerators, for plans made for a device this machine lacks (NOTE [Planning without
# memory]). The FLOP rates and bandwidths are NVIDIA's datasheet peaks: dense tensor-core BF16
# (the sheets print twice that "with sparsity"), FP32 without tensor cores (torch's default:
# float32 matmuls do not use TF32), HBM bandwidth of the SXM boards. Peaks, not what a kernel
# achieves: every plan is priced alike, so the comparison between plans stands. The dispatch and
# Python-side prices are the accelerator estimate's above, not measured on these devices.
_NAMED: Final = {
    costs.name: costs
    for costs in (
        _CPU,
        # A100 80GB SXM: BF16 312 TFLOPS, FP32 19.5 TFLOPS, HBM2e 2,039 GB/s.
        replace(
            _ACCELERATOR,
            name="a100-80gb",
            flops_per_second=312e12,
            float32_flops_per_second=19.5e12,
            bytes_per_second=2.039e12,
        ),
        # H100 SXM5 80GB: BF16 989 TFLOPS (1,979 with sparsity), FP32 67 TFLOPS, HBM3 3.35 TB/s.
        replace(
            _ACCELERATOR,
            name="h100-80gb",
            flops_per_second=989e12,
            float32_flops_per_second=67e12,
            bytes_per_second=3.35e12,
        ),
        # H200 SXM 141GB: BF16 989 TFLOPS (1,979 with sparsity), FP32 67 TFLOPS, HBM3e 4.8 TB/s.
        replace(
            _ACCELERATOR,
            name="h200",
            flops_per_second=989e12,
            float32_flops_per_second=67e12,
            bytes_per_second=4.8e12,
        ),
    )
}
DEVICE_CLASSES: Final = tuple(_NAMED)
"""The names ``device=`` accepts."""


def costs_for(device: str) -> DeviceCosts:
    """The constants of ``device``'s class (``"cpu"``, ``"cuda:0"``...): the CPU's or an
    accelerator's."""
    return _CPU if device.split(":")[0] == "cpu" else _ACCELERATOR


def named_costs(name: str) -> DeviceCosts | None:
    """The constants of the device class ``name`` (one of ``DEVICE_CLASSES``), or None."""
    return _NAMED.get(name)


def op_seconds(device: str, flops: int, nbytes: int) -> float:
    """Rule M8: one op call's predicted seconds on ``device``."""
    return costs_for(device).op(flops, nbytes)
