"""Spend reports from the daily aggregates (never the raw log): by key, team, model, backend or day."""

from __future__ import annotations

import csv
import io
import re
import unicodedata
from dataclasses import asdict, dataclass
from datetime import date
from decimal import Decimal
from typing import Annotated, Any, Literal

import orjson
from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.models import ApiKey, UsageDaily

Dimension = Literal["key", "team", "model", "backend", "day"]
DIMENSIONS: tuple[Dimension, ...] = ("key", "team", "model", "backend", "day")
Format = Literal["table", "csv", "json"]
# the longest range drawn day by day (the console's chart, the HTML report's): 0001-01-01..9999-12-31
# drew 3.65M days, an 817 MB file built in 2.5 GB of memory
MAX_CHART_DAYS = 366

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def parse_day(text: str) -> date:
    """A report's day, exactly YYYY-MM-DD: the one parser of the CLI, the admin API and the console,
    so each accepts what the others do (the CLI took 20261128, the API a Unix timestamp)."""
    if not _DAY.fullmatch(text):
        raise ValueError("must be a day as YYYY-MM-DD, e.g. 2026-11-28")
    try:
        return date.fromisoformat(text)
    except ValueError as exc:  # 2026-02-30
        raise ValueError(f"{text} is not a day of the calendar ({exc})") from exc


def _day(value: object) -> object:
    if isinstance(value, date) or not isinstance(value, str):
        return value  # a date already, or pydantic's own type error
    try:
        return parse_day(value)
    except ValueError as exc:  # a custom error: its message without pydantic's "Value error, "
        raise PydanticCustomError("day", str(exc)) from exc


Day = Annotated[date, BeforeValidator(_day)]  # for a route's query parameter

_COLUMN = {
    "key": UsageDaily.key_id,
    "team": UsageDaily.team,
    "model": UsageDaily.requested_model,
    "backend": UsageDaily.backend,
    "day": UsageDaily.day,
}


@dataclass(frozen=True)
class SpendRow:
    """One group of a report; money in USD (exact)."""

    group: str
    label: str  # e.g. a key's name; the group itself otherwise
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_usd: Decimal
    reference_cost_usd: Decimal  # what the reference model would have charged for the self-hosted part
    reference_basis_usd: Decimal  # what that self-hosted part really cost

    @property
    def savings_usd(self) -> Decimal:
        """What the reference model would have charged for our engines' requests, minus their cost."""
        return self.reference_cost_usd - self.reference_basis_usd


async def spend(db: AsyncEngine, start: date, end: date, by: Dimension) -> list[SpendRow]:
    """Spend from `start` to `end` (both included) grouped `by`, dearest first."""
    if end < start:
        raise ValueError(f"the report ends ({end}) before it starts ({start})")
    group = _COLUMN[by]
    query = (
        select(
            group,
            func.sum(UsageDaily.requests),
            func.sum(UsageDaily.errors),
            func.sum(UsageDaily.prompt_tokens),
            func.sum(UsageDaily.completion_tokens),
            func.sum(UsageDaily.cached_tokens),
            func.sum(UsageDaily.cost_usd),
            func.sum(UsageDaily.reference_cost_usd),
            func.sum(UsageDaily.reference_basis_usd),
        )
        .where(UsageDaily.day >= start, UsageDaily.day <= end)
        .group_by(group)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
        names: dict[str, str] = {}
        if by == "key" and rows:  # the keys that spent, as a subquery: a parameter per key id stopped
            # PostgreSQL's reports past 32,767 keys (asyncpg's limit per statement)
            spent = select(UsageDaily.key_id).where(UsageDaily.day >= start, UsageDaily.day <= end)
            found = await conn.execute(select(ApiKey.id, ApiKey.name).where(ApiKey.id.in_(spent)))
            names = {i: n for i, n in found.all()}
    report = [
        SpendRow(
            # no team (key, backend): an empty group, never a name one could give (a team named
            # "(none)" stays apart from the requests of keys without a team)
            str(g) if g not in ("", None) else "",
            names.get(str(g), str(g)) if g not in ("", None) else "(none)",
            int(n or 0),
            int(e or 0),
            int(p or 0),
            int(c or 0),
            int(k or 0),
            Decimal(cost or 0),
            Decimal(ref or 0),
            Decimal(basis or 0),
        )
        for g, n, e, p, c, k, cost, ref, basis in rows
    ]
    if by == "day":
        return sorted(report, key=lambda r: r.group)
    return sorted(report, key=lambda r: (-r.cost_usd, r.group))


def render(rows: list[SpendRow], fmt: Format, by: Dimension) -> str:
    """The report as an aligned table, CSV, or JSON (money as decimal strings)."""
    records = [_record(r) for r in rows]
    if fmt == "json":
        return orjson.dumps({"by": by, "rows": records, "total": _record(_total(rows))}).decode()
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(_record(_total(rows)).keys()))
        writer.writeheader()
        writer.writerows({**r, "group": _inert(r["group"]), "label": _inert(r["label"])} for r in records)
        return out.getvalue()
    return _table(rows, by)


def _table(rows: list[SpendRow], by: Dimension) -> str:
    """An aligned table for a terminal: names made printable, every amount exact and with as many
    decimals as the finest one needs, so the rows add up to the total on screen (a fixed .6f
    showed 0.000000 rows under a total that was not)."""
    shown = [*rows, _total(rows)]
    places = _places([a for r in shown for a in (r.cost_usd, r.savings_usd)])
    cost = [f"{r.cost_usd:.{places}f}" for r in shown]
    saved = [f"{r.savings_usd:.{places}f}" for r in shown]
    wide_cost, wide_saved = max(14, *map(len, cost)), max(12, *map(len, saved))
    header = (f"{by:<28} {'requests':>9} {'errors':>7} {'prompt tok':>11} {'output tok':>11} "
              f"{'cost USD':>{wide_cost}} {'saved USD':>{wide_saved}}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for r, c, v in zip(shown, cost, saved, strict=True):
        lines.append(f"{terminal_text(r.label)[:28]:<28} {r.requests:>9} {r.errors:>7} {r.prompt_tokens:>11} "
                     f"{r.completion_tokens:>11} {c:>{wide_cost}} {v:>{wide_saved}}")  # fmt: skip
    return "\n".join(lines)


def _places(amounts: list[Decimal]) -> int:
    """Decimals that show every amount exactly: at least cents, at most picodollars (what is stored)."""
    exponents = [a.normalize().as_tuple().exponent for a in amounts if a]
    return min(12, max([2, *(-e for e in exponents if isinstance(e, int))]))


def terminal_text(text: str) -> str:
    """`text` with nothing a terminal would act on: key, team and model names are chosen by clients
    and admins, and an ESC or OSC sequence, CR or LF in one could retitle or clear the operator's
    terminal or forge a row. Control, format (bidi), surrogate and line-separator characters become
    Python-style escapes; a backslash is doubled so an escape cannot be forged."""
    return "".join(_escaped(c) for c in text)


def _escaped(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if unicodedata.category(char) not in ("Cc", "Cf", "Cs", "Zl", "Zp"):
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _record(row: SpendRow) -> dict[str, Any]:
    record = asdict(row)
    for money in ("cost_usd", "reference_cost_usd", "reference_basis_usd"):
        record[money] = usd(record[money])
    record["savings_usd"] = usd(row.savings_usd)
    return record


def usd(amount: Decimal | float | int) -> str:
    """An amount in plain positional notation (never `7.4E-7`, which spreadsheets misread); a
    Decimal exactly, a float (a database that returns one) as its shortest repr's digits."""
    return format(amount if isinstance(amount, Decimal) else Decimal(str(amount)), "f")


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _inert(text: str) -> str:
    """A text cell a spreadsheet will not run as a formula: key, team and model names are chosen by
    clients and admins, so one that starts like a formula gets a leading apostrophe (OWASP's advice)."""
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def _total(rows: list[SpendRow]) -> SpendRow:
    return SpendRow(
        "total", "total", sum(r.requests for r in rows), sum(r.errors for r in rows),
        sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows),
        sum(r.cached_tokens for r in rows), sum((r.cost_usd for r in rows), Decimal(0)),
        sum((r.reference_cost_usd for r in rows), Decimal(0)),
        sum((r.reference_basis_usd for r in rows), Decimal(0)),
    )  # fmt: skip
