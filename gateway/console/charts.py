"""Bar charts as SVG geometry, computed on the server: no chart library, no script, printable.

Each chart is also given as a table on its page (screen readers read the table; the SVG has a
text alternative), so the picture adds nothing a reader without it would miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from decimal import Decimal

# Okabe-Ito: distinguishable with the common colour-vision deficiencies, dark enough on white
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#999999")


@dataclass(frozen=True)
class Segment:
    """One backend's part of a day's bar."""

    y: float
    height: float
    series: str
    colour: str
    value: Decimal


@dataclass(frozen=True)
class Bar:
    """One day's stacked bar."""

    label: str  # the day, ISO
    x: float
    width: float
    total: Decimal
    segments: list[Segment]


@dataclass(frozen=True)
class StackedChart:
    """A stacked bar chart's geometry: bars left to right, the series in legend order."""

    width: int
    height: int
    top: Decimal  # the value at the top of the plot
    bars: list[Bar]
    series: list[tuple[str, str]]  # (name, colour)


def stacked_by_day(days: dict[date, dict[str, Decimal]], width: int = 720, height: int = 220) -> StackedChart:
    """One bar per day (every day of the range, empty ones too), stacked by series, dearest first."""
    totals: dict[str, Decimal] = {}
    for parts in days.values():
        for name, value in parts.items():
            totals[name] = totals.get(name, Decimal(0)) + value
    names = sorted(totals, key=lambda n: (-totals[n], n))
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}
    top = max((sum(parts.values(), Decimal(0)) for parts in days.values()), default=Decimal(0))
    scale = float(height) / float(top) if top > 0 else 0.0
    slot = width / max(1, len(days))
    bars = []
    for i, (day, parts) in enumerate(sorted(days.items())):
        y = float(height)
        segments = []
        for name in names:
            value = parts.get(name, Decimal(0))
            if value <= 0:
                continue
            h = float(value) * scale
            y -= h
            segments.append(Segment(round(y, 2), round(h, 2), name, colours[name], value))
        bars.append(Bar(day.isoformat(), round(i * slot + slot * 0.1, 2), round(slot * 0.8, 2),
                        sum(parts.values(), Decimal(0)), segments))  # fmt: skip
    return StackedChart(width, height, top, bars, [(n, colours[n]) for n in names])
