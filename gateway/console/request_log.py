"""/ui/requests: the request log, searchable, paginated by index; one request's detail."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Response

from gateway.api.services import Database
from gateway.console.data import (
    RequestFilter,
    parse_cursor,
    plain_text,
    request_detail,
    requests_page,
    utc_time,
)
from gateway.console.web import ConsoleSession, page
from gateway.errors import GatewayError
from gateway.store.db import DATABASE_ERRORS, unavailable
from gateway.store.reports import usd

router = APIRouter(prefix="/ui/requests")

Text = Annotated[str | None, Query(max_length=200)]


def _time(value: str | None, param: str) -> datetime | None:
    """A datetime-local field (no zone: UTC) or an ISO time; None when empty."""
    if not value:
        return None
    try:
        return utc_time(value)
    except ValueError as exc:
        message = f"'{param}' is not a date and time"
        raise GatewayError(400, message, param=param, code="invalid_value") from exc


def _plain(value: str | None, param: str) -> str | None:
    """A text filter, refused when it holds control characters (no key, model or backend does)."""
    if value and not plain_text(value):
        message = f"'{param}' holds control characters"
        raise GatewayError(400, message, param=param, code="invalid_value")
    return value or None


@router.get("")
async def requests_list(
    db: Database,
    session: ConsoleSession,
    key: Text = None,
    model: Text = None,
    backend: Text = None,
    status: Annotated[int | None, Query(ge=100, le=599)] = None,
    since: Text = None,
    until: Text = None,
    after: Annotated[str | None, Query(max_length=300)] = None,
) -> Response:
    """Newest first, 50 a page; the filters are exact matches (status, key id, model, backend)."""
    search = RequestFilter(
        _plain(key, "key"), _plain(model, "model"), _plain(backend, "backend"), status,
        _time(since, "since"), _time(until, "until"),
    )  # fmt: skip
    try:
        rows, cursor = await requests_page(db, search, parse_cursor(after))
    except DATABASE_ERRORS as exc:
        raise unavailable("the request log cannot be read", exc) from exc
    asked = {"key": key, "model": model, "backend": backend, "status": status, "since": since, "until": until}
    kept = {k: v for k, v in asked.items() if v not in (None, "")}
    following = f"/ui/requests?{urlencode({**kept, 'after': cursor})}" if cursor else None
    context = {
        "title": "Requests", "active": "Requests", "rows": rows, "next": following,
        "filters": {k: ("" if v is None else v) for k, v in asked.items()}, "first": after is None,
    }  # fmt: skip
    return page("requests.html", context, 200, session)


@router.get("/{request_id}")
async def request_page(request_id: str, db: Database, session: ConsoleSession) -> Response:
    """Every logged field of one request (bodies only when the policy logs them)."""
    if len(request_id) > 64 or not plain_text(request_id):
        raise GatewayError(404, "No such request", code="not_found")
    try:
        row = await request_detail(db, request_id)
    except DATABASE_ERRORS as exc:
        raise unavailable("the request log cannot be read", exc) from exc
    if row is None:
        raise GatewayError(404, "No such request", code="not_found")
    bodies = {name: row.pop(name) for name in ("request_body", "response_body")}
    row = {name: usd(value) if isinstance(value, Decimal) else value for name, value in row.items()}
    context = {"title": f"Request {request_id}", "active": "Requests", "row": row, "bodies": bodies}
    return page("request.html", context, 200, session)
