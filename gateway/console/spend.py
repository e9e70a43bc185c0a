"""/ui/spend: the finance report (the same figures as `gateway report spend`), charts, CSV."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response

from gateway.api.services import Database, Watcher
from gateway.config.policy import EngineBackend
from gateway.console.charts import stacked_by_day
from gateway.console.data import daily_by_backend
from gateway.console.web import SECURITY_HEADERS, ConsoleSession, page
from gateway.errors import GatewayError
from gateway.store.db import DATABASE_ERRORS, unavailable
from gateway.store.reports import DIMENSIONS, MAX_CHART_DAYS, Day, Dimension, SpendRow, render, spend

router = APIRouter(prefix="/ui/spend")


def _range(start: date | None, end: date | None) -> tuple[date, date]:
    """The asked range, by default the last 7 days (UTC) up to today."""
    end = end or datetime.now(UTC).date()
    start = start or (end - timedelta(days=6) if end.toordinal() > 6 else date.min)  # (the calendar's start)
    if end < start:
        message = f"The range ends ({end}) before it starts ({start})"
        raise GatewayError(400, message, param="to", code="invalid_value")
    return start, end


def _share(rows: list[SpendRow], engines: set[str]) -> dict[str, int]:
    """Tokens served by our engines vs hosted APIs (a report grouped by backend)."""
    own = sum(r.prompt_tokens + r.completion_tokens for r in rows if r.group in engines)
    total = sum(r.prompt_tokens + r.completion_tokens for r in rows)
    return {"self_hosted": own, "hosted": total - own, "total": total}


@router.get("")
async def spend_page(
    db: Database,
    watcher: Watcher,
    session: ConsoleSession,
    start: Annotated[Day | None, Query(alias="from")] = None,
    end: Annotated[Day | None, Query(alias="to")] = None,
    by: Dimension = "key",
    format: Literal["html", "csv"] = "html",
) -> Response:
    """Spend from `from` to `to` grouped `by`; the daily chart; self-hosted token share; savings."""
    start, end = _range(start, end)
    try:
        rows = await spend(db, start, end, by)
        by_backend = rows if by == "backend" else await spend(db, start, end, "backend")
        days = await daily_by_backend(db, start, end) if (end - start).days < MAX_CHART_DAYS else None
        top_keys = rows if by == "key" else await spend(db, start, end, "key")
        top_teams = rows if by == "team" else await spend(db, start, end, "team")
    except DATABASE_ERRORS as exc:
        raise unavailable("the spend report cannot be read", exc) from exc
    if format == "csv":
        name = f"spend-{start}-{end}-by-{by}.csv"
        headers = {**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="{name}"'}
        return Response(render(rows, "csv", by), media_type="text/csv; charset=utf-8", headers=headers)
    policy = watcher.holder.runtime.policy
    engines = {name for name, spec in policy.backends.items() if isinstance(spec, EngineBackend)}
    context = {
        "title": "Spend", "active": "Spend", "rows": rows, "by": by, "dimensions": DIMENSIONS,
        "start": start.isoformat(), "end": end.isoformat(), "share": _share(by_backend, engines),
        "total_cost": sum((r.cost_usd for r in rows), Decimal(0)),
        "savings": sum((r.savings_usd for r in rows), Decimal(0)),
        "chart": stacked_by_day(days) if days is not None else None,
        "top_keys": top_keys[:5], "top_teams": top_teams[:5],
    }  # fmt: skip
    return page("spend.html", context, 200, session)
