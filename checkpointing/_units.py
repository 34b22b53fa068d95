"""How sizes print: bytes in B, KiB, MiB, GiB or TiB, and work in FLOP, kFLOP, ... TFLOP.

Owns ``format_bytes`` and ``format_flops``. Reports, plans, schedules and the out-of-memory
printout call them, so that a size reads the same everywhere. It imports nothing of ours: every
module may use it. Values kept as data (``kept_bytes`` and the like) stay exact integers; only
their printing is rounded.
"""

from __future__ import annotations

from typing import Final

__all__ = ["format_bytes", "format_flops"]

_UNITS: Final = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(size: int | float) -> str:
    """``size`` bytes for a reader: exact below 1 KiB, else one decimal in the largest binary
    unit that keeps the number at least 1 (powers of 1024, as torch's memory summaries print).

    >>> format_bytes(512), format_bytes(1536), format_bytes(5 * 2**20), format_bytes(-3 * 2**30)
    ('512 B', '1.5 KiB', '5.0 MiB', '-3.0 GiB')
    """
    magnitude = abs(size)
    if magnitude < 1024:
        return f"{size:.0f} B" if isinstance(size, float) else f"{size} B"
    value = float(magnitude)
    unit = _UNITS[0]
    for unit in _UNITS:
        value /= 1024
        # Move up while the value would print as 1024.0 or more (1023.96 KiB is 1.0 MiB).
        if round(value, 1) < 1024 or unit == _UNITS[-1]:
            break
    sign = "-" if size < 0 else ""
    return f"{sign}{value:.1f} {unit}"


_FLOP_UNITS: Final = ("kFLOP", "MFLOP", "GFLOP", "TFLOP")


def format_flops(count: int | float) -> str:
    """``count`` floating-point operations for a reader: ``"none"`` for 0, exact below 1000,
    else four significant digits in the largest decimal unit that keeps the number at least 1
    (a small plan's recompute reads "12.6 kFLOP", not "0.000 GFLOP").

    >>> format_flops(0), format_flops(750), format_flops(12_600), format_flops(1.074e9)
    ('none', '750 FLOP', '12.6 kFLOP', '1.074 GFLOP')
    """
    if count == 0:
        return "none"
    if abs(count) < 1000:
        return f"{count:.0f} FLOP"
    value = float(count)
    unit = _FLOP_UNITS[0]
    for unit in _FLOP_UNITS:
        value /= 1000
        # Move up while the value would print as 1000 or more (999.99 kFLOP is 1 MFLOP).
        if abs(float(f"{value:.4g}")) < 1000 or unit == _FLOP_UNITS[-1]:
            break
    return f"{value:.4g} {unit}"
