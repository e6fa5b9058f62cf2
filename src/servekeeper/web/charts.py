"""Inline SVG line charts, rendered on the server (pure; no JavaScript chart library)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

PALETTE = ("#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed", "#0891b2")

Point = tuple[float, float | None]


def _format(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def line_chart(
    title: str,
    unit: str,
    lines: Mapping[str, Sequence[Point]],
    start: float,
    end: float,
    width: int = 360,
    height: int = 140,
) -> str:
    """One chart: a polyline per named series over [start, end]. A None value breaks the line."""
    left, right, top, bottom = 44, 8, 22, 18
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for points in lines.values() for t, v in points if v is not None and start <= t <= end]
    peak = max(values, default=0.0)
    scale = peak * 1.1 if peak > 0 else 1.0
    span = max(end - start, 1e-9)

    def x(t: float) -> float:
        return left + (t - start) / span * plot_w

    def y(v: float) -> float:
        return top + plot_h - v / scale * plot_h

    parts = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{left}" y="14" class="chart-title">{escape(title)} ({escape(unit)})</text>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#ddd"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end" class="axis">{_format(scale)}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end" class="axis">0</text>',
        f'<text x="{left}" y="{height - 4}" class="axis">-{(end - start) / 60:.0f} min</text>',
        f'<text x="{width - right}" y="{height - 4}" text-anchor="end" class="axis">now</text>',
    ]
    for index, (name, points) in enumerate(sorted(lines.items())):
        color = PALETTE[index % len(PALETTE)]
        segment: list[str] = []
        segments: list[list[str]] = [segment]
        for t, v in points:
            if not start <= t <= end:
                continue
            if v is None:
                segment = []
                segments.append(segment)
                continue
            segment.append(f"{x(t):.1f},{y(v):.1f}")
        for run in segments:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="1.5" fill="{color}"/>')
            elif run:
                parts.append(
                    f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(run)}">'
                    f"<title>{escape(name)}</title></polyline>"
                )
    parts.append("</svg>")
    return "".join(parts)


def legend_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]
