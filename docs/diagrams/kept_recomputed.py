"""Draws ``kept-recomputed.svg``, the mental model page's diagram: what a checkpointed region
keeps in forward and what backward does with it.

The site must read offline (clusters without internet read the docs from disk), so the diagram
is a plain SVG file, not a diagram language rendered by a script from the web. Run
``python docs/diagrams/kept_recomputed.py`` after editing the boxes below; tests/test_docs.py
fails while the committed SVG differs from what this script draws.
"""

from __future__ import annotations

from html import escape
from itertools import pairwise
from pathlib import Path

WIDTH = 720
FONT = 13  # px; a line of a box holds about 20 characters
LINE = 17  # px between baselines
PAD = 16  # px around a panel's boxes

# Colours: kept things green, the region's work blue, backward's steps orange.
KEPT = ("#e8f5e9", "#2e7d32")
WORK = ("#e3f2fd", "#1565c0")
BACKWARD = ("#fff3e0", "#e65100")

Box = tuple[float, float, float, float]  # x, y, width, height


def _box(
    x: float,
    y: float,
    w: float,
    h: float,
    lines: list[str],
    colours: tuple[str, str],
) -> str:
    fill, stroke = colours
    top = y + h / 2 - (len(lines) - 1) * LINE / 2 + FONT * 0.35
    text = "".join(
        f'<text x="{x + w / 2:g}" y="{top + i * LINE:g}">{escape(line)}</text>'
        for i, line in enumerate(lines)
    )
    return (
        f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" rx="6" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>{text}'
    )


def _arrow(points: list[tuple[float, float]], dashed: bool = False) -> str:
    path = " ".join(f"{x:g},{y:g}" for x, y in points)
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    return (
        f'<polyline points="{path}" fill="none" stroke="#424242" stroke-width="1.5"{dash} '
        'marker-end="url(#head)"/>'
    )


def _panel(y: float, h: float, title: str) -> str:
    return (
        f'<rect x="1" y="{y:g}" width="{WIDTH - 2}" height="{h:g}" rx="10" fill="none" '
        f'stroke="#9e9e9e" stroke-width="1.2"/>'
        f'<text x="{PAD}" y="{y + 20:g}" text-anchor="start" font-weight="bold">{title}</text>'
    )


def render() -> str:
    """The SVG document, as text."""
    parts: list[str] = []
    # Forward: input -> ops -> output, the RNG state under the input.
    fy, fh = 1, 200
    parts.append(_panel(fy, fh, "forward"))
    row = fy + 34
    w, h = 190, 70
    gap = (WIDTH - 2 * PAD - 3 * w) / 2
    xs = [PAD + i * (w + gap) for i in range(3)]
    parts.append(_box(xs[0], row, w, h, ["region input", "(kept)"], KEPT))
    parts.append(
        _box(
            xs[1],
            row,
            w,
            h,
            [
                "ops inside the region:",
                "saved tensors become",
                "small holders",
            ],
            WORK,
        )
    )
    parts.append(_box(xs[2], row, w, h, ["region output"], WORK))
    parts.append(
        _box(xs[0], row + h + 24, w, 48, ["RNG state", "(kept)"], KEPT)
    )
    parts.append(
        _arrow([(xs[0] + w, row + h / 2), (xs[1] - 2, row + h / 2)])
    )
    parts.append(
        _arrow([(xs[1] + w, row + h / 2), (xs[2] - 2, row + h / 2)])
    )
    # Backward: four steps in a row.
    by, bh = fy + fh + 48, 150
    parts.append(_panel(by, bh, "backward"))
    brow = by + 34
    bw, bhh = 152, 96
    bgap = (WIDTH - 2 * PAD - 4 * bw) / 3
    bxs = [PAD + i * (bw + bgap) for i in range(4)]
    texts = [
        ["first unpack", "of a holder"],
        [
            "re-run the region",
            "from its input, with",
            "the forward's RNG,",
            "autocast, device",
        ],
        ["fill the holders it", "needs; stop early", "once all exist"],
        [
            "each recomputed",
            "tensor is freed as",
            "soon as backward",
            "has used it",
        ],
    ]
    for x, lines in zip(bxs, texts, strict=True):
        parts.append(_box(x, brow, bw, bhh, lines, BACKWARD))
    for left, right in pairwise(bxs):
        parts.append(
            _arrow(
                [(left + bw, brow + bhh / 2), (right - 2, brow + bhh / 2)]
            )
        )
    # loss.backward(): from the output down, across the gap, into the first unpack.
    mid = fy + fh + 24
    out_x = xs[2] + w / 2
    start_x = bxs[0] + bw * 0.6  # right of the panel title
    parts.append(
        _arrow(
            [
                (out_x, row + h),
                (out_x, mid),
                (start_x, mid),
                (start_x, brow - 2),
            ],
            dashed=True,
        )
    )
    parts.append(
        f'<text x="{(out_x + start_x) / 2:g}" y="{mid - 6:g}" font-family="monospace">'
        "loss.backward()</text>"
    )
    height = by + bh + 1
    body = "".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height:g}" '
        f'width="{WIDTH}" height="{height:g}" role="img" aria-labelledby="title desc" '
        f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="{FONT}" '
        'text-anchor="middle" fill="#212121">\n'
        '<title id="title">What a checkpointed region keeps, and what backward does</title>\n'
        '<desc id="desc">Forward: the region input and the RNG state are kept; the ops inside '
        "the region store small holders instead of their saved tensors. Backward: the first "
        "unpack of a holder re-runs the region from its input with the forward's RNG, autocast "
        "and device state, fills the holders it needs and stops early once all exist; each "
        "recomputed tensor is freed as soon as backward has used it.</desc>\n"
        '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" '
        'markerHeight="8" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#424242"/></marker></defs>\n'
        f"{body}\n</svg>\n"
    )


TARGET = Path(__file__).with_name("kept-recomputed.svg")

if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
