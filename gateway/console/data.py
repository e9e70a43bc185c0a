"""What the console's pages read: bounded queries over the aggregates and the indexed raw log.

Spend comes from the daily aggregates (`store.reports.spend`, the same function as `gateway report
spend`). The overview reads the raw log over the last hour or day through its `created_at` index:
counts and sums exactly, percentiles from at most PERCENTILE_ROWS most recent requests. The request
list is paginated by (created_at, id), never by offset, so page 1,000 costs what page 1 does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.governance.periods import Period, period_bounds
from gateway.store.models import RequestLog, UsageDaily

PERCENTILE_ROWS = 20_000
PAGE_ROWS = 50
RECENT_FAILOVERS = 20


@dataclass(frozen=True)
class BackendUse:
    """One backend's share of a window."""

    backend: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal


@dataclass(frozen=True)
class Window:
    """The overview's figures for one window (the last hour or day)."""

    seconds: int
    requests: int
    errors: int
    latency_p50: float | None
    latency_p99: float | None
    overhead_p50: float | None
    overhead_p99: float | None
    sampled: int  # how many requests the percentiles come from
    backends: list[BackendUse] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Requests per second over the window."""
        return self.requests / self.seconds

    @property
    def error_rate(self) -> float:
        """Share of requests answered with an error."""
        return self.errors / self.requests if self.requests else 0.0


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted `values`."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, round(q * len(values) + 0.5) - 1))]


async def window(db: AsyncEngine, seconds: int, now: datetime) -> Window:
    """Requests, errors, latency and overhead percentiles, and use per backend since now - seconds."""
    since = now - timedelta(seconds=seconds)
    recent = RequestLog.created_at >= since
    counts = select(func.count(), func.count().filter(RequestLog.status >= 400)).where(recent)
    per_backend = (
        select(
            RequestLog.backend,
            func.count(),
            func.coalesce(func.sum(RequestLog.prompt_tokens), 0),
            func.coalesce(func.sum(RequestLog.completion_tokens), 0),
            func.coalesce(func.sum(RequestLog.cost_usd), 0),
        )
        .where(recent)
        .group_by(RequestLog.backend)
    )
    timings = (
        select(RequestLog.latency_ms, RequestLog.overhead_ms)
        .where(recent)
        .order_by(RequestLog.created_at.desc())
        .limit(PERCENTILE_ROWS)
    )
    async with db.connect() as conn:
        total, errors = (await conn.execute(counts)).one()
        uses = (await conn.execute(per_backend)).all()
        times = (await conn.execute(timings)).all()
    latency = sorted(float(t[0]) for t in times if t[0] is not None)
    overhead = sorted(float(t[1]) for t in times if t[1] is not None)
    backends = sorted(
        (
            BackendUse(b or "(none)", int(n), int(p or 0), int(c or 0), Decimal(cost or 0))
            for b, n, p, c, cost in uses
        ),
        key=lambda u: (-u.requests, u.backend),
    )
    return Window(
        seconds, int(total), int(errors), _percentile(latency, 0.5), _percentile(latency, 0.99),
        _percentile(overhead, 0.5), _percentile(overhead, 0.99), len(times), backends,
    )  # fmt: skip


async def recent_failovers(db: AsyncEngine, since: datetime) -> list[dict[str, Any]]:
    """The latest requests that failed over (what was tried first, and why), newest first."""
    query = (
        select(
            RequestLog.created_at,
            RequestLog.id,
            RequestLog.requested_model,
            RequestLog.backend,
            RequestLog.status,
            RequestLog.failover,
        )
        .where(RequestLog.created_at >= since, RequestLog.failover.is_not(None))
        .order_by(RequestLog.created_at.desc())
        .limit(RECENT_FAILOVERS)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [
        {"at": at, "id": rid, "model": model, "backend": backend, "status": status, "failover": failover}
        for at, rid, model, backend, status, failover in rows
    ]


async def key_spend(db: AsyncEngine, periods: dict[str, Period], now: datetime) -> dict[str, Decimal]:
    """Each key's spend in its budget's current period (keys without a budget: this month's)."""
    by_start: dict[date, list[str]] = {}
    for key_id, period in periods.items():
        by_start.setdefault(period_bounds(period, now)[0].date(), []).append(key_id)
    spent: dict[str, Decimal] = {}
    async with db.connect() as conn:
        for start, ids in by_start.items():
            query = (
                select(UsageDaily.key_id, func.sum(UsageDaily.cost_usd))
                .where(UsageDaily.key_id.in_(ids), UsageDaily.day >= start)
                .group_by(UsageDaily.key_id)
            )
            spent.update({k: Decimal(v or 0) for k, v in (await conn.execute(query)).all()})
    return spent


async def daily_by_backend(db: AsyncEngine, start: date, end: date) -> dict[date, dict[str, Decimal]]:
    """Cost per day and backend from the aggregates, every day of the range present (maybe empty)."""
    query = (
        select(UsageDaily.day, UsageDaily.backend, func.sum(UsageDaily.cost_usd))
        .where(UsageDaily.day >= start, UsageDaily.day <= end)
        .group_by(UsageDaily.day, UsageDaily.backend)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
    span = (end - start).days + 1
    days: dict[date, dict[str, Decimal]] = {start + timedelta(days=i): {} for i in range(span)}
    for day, backend, cost in rows:
        days[day][backend or "(none)"] = Decimal(cost or 0)
    return days


@dataclass(frozen=True)
class RequestFilter:
    """The request list's search: every field optional."""

    key_id: str | None = None
    model: str | None = None
    backend: str | None = None
    status: int | None = None
    since: datetime | None = None
    until: datetime | None = None


def _cursor(at: datetime, rid: str) -> str:
    return f"{at.astimezone(UTC).isoformat()}|{rid}"


def parse_cursor(cursor: str | None) -> tuple[datetime, str] | None:
    """A page cursor back into (created_at, id); None for none or a malformed one."""
    if not cursor or "|" not in cursor or len(cursor) > 200:
        return None
    at, _, rid = cursor.partition("|")
    try:
        parsed = utc_time(at)
    except ValueError:
        return None
    return (parsed, rid) if plain_text(rid) else None


def utc_time(text: str) -> datetime:
    """An ISO date and time as UTC (one without a zone is UTC); ValueError for anything else,
    including a time whose UTC reading falls outside the calendar (9999-12-31T23:00-14:00)."""
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except OverflowError as exc:
        raise ValueError(f"{text!r} is outside the calendar in UTC") from exc


def plain_text(text: str) -> bool:
    """No control characters: what a filter may compare (PostgreSQL's text refuses NUL outright)."""
    return text.isprintable()


LIST_COLUMNS = (
    RequestLog.created_at, RequestLog.id, RequestLog.key_id, RequestLog.team, RequestLog.requested_model,
    RequestLog.backend, RequestLog.route_tier, RequestLog.status, RequestLog.error_type,
    RequestLog.prompt_tokens, RequestLog.completion_tokens, RequestLog.latency_ms,
    RequestLog.cost_usd.label("cost_usd"),  # (its column is cost_picousd; the value is in USD)
    RequestLog.failover,
)  # fmt: skip


async def requests_page(
    db: AsyncEngine, search: RequestFilter, after: tuple[datetime, str] | None
) -> tuple[list[dict[str, Any]], str | None]:
    """One page of the log, newest first, after `after`; and the next page's cursor (None: last)."""
    conditions: list[Any] = [
        column == value
        for column, value in (
            (RequestLog.key_id, search.key_id),
            (RequestLog.requested_model, search.model),
            (RequestLog.backend, search.backend),
            (RequestLog.status, search.status),
        )
        if value is not None
    ]
    if search.since is not None:
        conditions.append(RequestLog.created_at >= search.since)
    if search.until is not None:
        conditions.append(RequestLog.created_at < search.until)
    if after is not None:
        at, rid = after
        same_time_before = and_(RequestLog.created_at == at, RequestLog.id < rid)
        conditions.append(or_(RequestLog.created_at < at, same_time_before))
    query = (
        select(*LIST_COLUMNS)
        .where(*conditions)
        .order_by(RequestLog.created_at.desc(), RequestLog.id.desc())
        .limit(PAGE_ROWS + 1)
    )
    async with db.connect() as conn:
        rows = [dict(r._mapping) for r in (await conn.execute(query)).all()]
    if len(rows) <= PAGE_ROWS:
        return rows, None
    rows = rows[:PAGE_ROWS]
    return rows, _cursor(rows[-1]["created_at"], rows[-1]["id"])


async def request_detail(db: AsyncEngine, request_id: str) -> dict[str, Any] | None:
    """Every column of one logged request (bodies are there only when the policy logs them)."""
    # named as the model's attributes: cost_usd, whose column is cost_picousd, holds USD
    columns = [attr.columns[0].label(attr.key) for attr in sa_inspect(RequestLog).column_attrs]
    query = select(*columns).where(RequestLog.id == request_id)
    async with db.connect() as conn:
        row = (await conn.execute(query)).first()
    return dict(row._mapping) if row is not None else None
