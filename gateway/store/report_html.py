"""The spend report as one self-contained HTML file: inline SVG charts, no scripts, no external assets.

Charts: daily spend by backend (stacked bars), top keys and top teams (horizontal bars),
self-hosted vs frontier token share, and what the self-hosted requests cost against what the
reference model would have charged.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date, timedelta
from decimal import Decimal
from html import escape

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.models import UsageDaily
from gateway.store.reports import MAX_CHART_DAYS, SpendRow, spend

_PALETTE = ("#3b6fb6", "#e07b39", "#4e9a5b", "#b5485d", "#7d5ba6", "#c2a23a", "#3fa3a8", "#8c6d4f")


async def html_report(db: AsyncEngine, start: date, end: date, self_hosted: frozenset[str]) -> str:
    """Everything finance reads for `start`..`end` (both included), as one HTML document."""
    long = (end - start).days >= MAX_CHART_DAYS
    daily = {} if long else await _daily_by_backend(db, start, end)
    keys = await spend(db, start, end, "key")
    teams = await spend(db, start, end, "team")
    backends = await spend(db, start, end, "backend")
    total = sum((r.cost_usd for r in backends), Decimal(0))
    own = [r for r in backends if r.group in self_hosted]
    own_tokens = sum(r.prompt_tokens + r.completion_tokens for r in own)
    all_tokens = sum(r.prompt_tokens + r.completion_tokens for r in backends)
    reference = sum((r.reference_cost_usd for r in backends), Decimal(0))
    basis = sum((r.reference_basis_usd for r in backends), Decimal(0))
    sections = [
        f"<h1>Switchboard spend, {start.isoformat()} to {end.isoformat()}</h1>",
        f"<p class='summary'>Total <b>${total:,.4f}</b> over <b>{sum(r.requests for r in backends):,}</b> "
        f"requests; self-hosted engines served <b>{_share(own_tokens, all_tokens)}</b> of the tokens; "
        f"savings against the reference model <b>${reference - basis:,.4f}</b>.</p>",
        "<h2>Daily spend by backend</h2>",
        f"<p>No daily chart over more than {MAX_CHART_DAYS} days: ask for a shorter range.</p>"
        if long
        else _stacked_days(daily, start, end),
        "<h2>Top keys</h2>",
        _bars(keys[:10]),
        "<h2>Top teams</h2>",
        _bars(teams[:10]),
        "<h2>Tokens: self-hosted vs frontier</h2>",
        _share_bar(own_tokens, all_tokens - own_tokens),
        "<h2>Self-hosted requests: actual cost vs the reference model</h2>",
        _versus(basis, reference),
        "<h2>By backend</h2>",
        _table(backends),
    ]
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:960px}"
        "h2{margin-top:1.6em;font-size:1.1em}table{border-collapse:collapse}"
        "td,th{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:right}"
        "td:first-child,th:first-child{text-align:left}.summary{font-size:1.05em}"
        "svg text{font-size:11px;fill:#333}"
    )
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>Switchboard spend {start.isoformat()}..{end.isoformat()}</title><style>{style}</style>"
        f"</head><body>{''.join(sections)}</body></html>"
    )


async def _daily_by_backend(db: AsyncEngine, start: date, end: date) -> dict[date, dict[str, Decimal]]:
    query = (
        select(UsageDaily.day, UsageDaily.backend, func.sum(UsageDaily.cost_usd))
        .where(UsageDaily.day >= start, UsageDaily.day <= end)
        .group_by(UsageDaily.day, UsageDaily.backend)
    )
    out: dict[date, dict[str, Decimal]] = defaultdict(dict)
    async with db.connect() as conn:
        for day, backend, cost in (await conn.execute(query)).all():
            out[day][backend or "(none)"] = Decimal(cost or 0)
    return out


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _stacked_days(daily: dict[date, dict[str, Decimal]], start: date, end: date) -> str:
    days = [start + timedelta(days=i) for i in range((end - start).days + 1)]
    backends = sorted({b for spent in daily.values() for b in spent})
    colour = {b: _PALETTE[i % len(_PALETTE)] for i, b in enumerate(backends)}
    top = max([sum(daily.get(d, {}).values(), Decimal(0)) for d in days] + [Decimal(0)])
    width, height, left = 900, 220, 60
    step = (width - left) / max(1, len(days))
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height + 40}' role='img' "
             f"aria-label='daily spend by backend'>"]  # fmt: skip
    parts.append(f"<text x='0' y='12'>${top:,.2f}</text><text x='0' y='{height}'>$0</text>")
    for i, day in enumerate(days):
        y = float(height)
        for backend in backends:
            value = daily.get(day, {}).get(backend, Decimal(0))
            h = float(value / top * (height - 20)) if top else 0.0
            y -= h
            parts.append(f"<rect x='{left + i * step:.1f}' y='{y:.1f}' width='{max(1.0, step - 2):.1f}' "
                         f"height='{h:.1f}' fill='{colour[backend]}'><title>{day} {escape(backend)}: "
                         f"${value:,.4f}</title></rect>")  # fmt: skip
        if len(days) <= 31 and (i % max(1, len(days) // 10) == 0):
            parts.append(f"<text x='{left + i * step:.1f}' y='{height + 14}'>{day.strftime('%m-%d')}</text>")
    for j, backend in enumerate(backends):
        x = left + j * 140
        parts.append(f"<rect x='{x}' y='{height + 24}' width='10' height='10' fill='{colour[backend]}'/>"
                     f"<text x='{x + 14}' y='{height + 33}'>{escape(backend)}</text>")  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def _bars(rows: list[SpendRow]) -> str:
    if not rows:
        return "<p>No spend in this period.</p>"
    top = max(r.cost_usd for r in rows) or Decimal(1)
    width, bar = 900, 22
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{len(rows) * bar + 4}' role='img'>"
    ]
    for i, row in enumerate(rows):
        w = float(row.cost_usd / top * 560)
        y = i * bar
        label = f"<text x='0' y='{y + 15}'>{escape(row.label[:32])}</text>"
        rect = (
            f"<rect x='230' y='{y + 3}' width='{max(1.0, w):.1f}' height='{bar - 6}' fill='{_PALETTE[0]}'/>"
        )
        value = f"<text x='{236 + w:.1f}' y='{y + 15}'>${row.cost_usd:,.4f} · {row.requests:,} req</text>"
        parts.append(label + rect + value)
    parts.append("</svg>")
    return "".join(parts)


def _share_bar(own: int, frontier: int) -> str:
    whole = own + frontier
    w = 800 * own / whole if whole else 0.0
    return (
        "<svg xmlns='http://www.w3.org/2000/svg' width='900' height='48' role='img'>"
        f"<rect x='0' y='4' width='{w:.1f}' height='22' fill='{_PALETTE[2]}'/>"
        f"<rect x='{w:.1f}' y='4' width='{800 - w:.1f}' height='22' fill='{_PALETTE[1]}'/>"
        f"<text x='0' y='42'>self-hosted {_share(own, whole)} ({own:,} tokens)</text>"
        f"<text x='420' y='42'>frontier {_share(frontier, whole)} ({frontier:,} tokens)</text></svg>"
    )


def _versus(actual: Decimal, reference: Decimal) -> str:
    top = max(actual, reference) or Decimal(1)
    bars = [("actual", actual, _PALETTE[2]), ("reference model", reference, _PALETTE[1])]
    parts = ["<svg xmlns='http://www.w3.org/2000/svg' width='900' height='60' role='img'>"]
    for i, (label, value, colour) in enumerate(bars):
        w = float(value / top * 560)
        parts.append(f"<text x='0' y='{i * 28 + 17}'>{label}</text>"
                     f"<rect x='130' y='{i * 28 + 4}' width='{max(1.0, w):.1f}' height='20' fill='{colour}'/>"
                     f"<text x='{136 + w:.1f}' y='{i * 28 + 17}'>${value:,.4f}</text>")  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def _table(rows: list[SpendRow]) -> str:
    names = ("backend", "requests", "errors", "prompt tokens", "output tokens", "cost USD", "saved USD")
    head = "<tr>" + "".join(f"<th>{n}</th>" for n in names) + "</tr>"
    body = "".join(
        f"<tr><td>{escape(r.label)}</td><td>{r.requests:,}</td><td>{r.errors:,}</td>"
        f"<td>{r.prompt_tokens:,}</td><td>{r.completion_tokens:,}</td><td>{r.cost_usd:,.6f}</td>"
        f"<td>{r.savings_usd:,.6f}</td></tr>"
        for r in rows
    )
    return f"<table>{head}{body}</table>"
