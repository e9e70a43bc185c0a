"""/ui/requests: the request log, searchable, paginated by index; one request's detail."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Response

from gateway.api.services import Database
from gateway.console.data import RequestFilter, parse_cursor, request_detail, requests_page
from gateway.console.web import ConsoleSession, page
from gateway.errors import GatewayError
from gateway.store.db import DATABASE_ERRORS, unavailable

router = APIRouter(prefix="/ui/requests")

Text = Annotated[str | None, Query(max_length=200)]


def _time(value: str | None, param: str) -> datetime | None:
    """A datetime-local field (no zone: UTC) or an ISO time; None when empty."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        message = f"'{param}' is not a date and time"
        raise GatewayError(400, message, param=param, code="invalid_value") from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


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
        key or None, model or None, backend or None, status, _time(since, "since"), _time(until, "until")
    )
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
    if len(request_id) > 64:
        raise GatewayError(404, "No such request", code="not_found")
    try:
        row = await request_detail(db, request_id)
    except DATABASE_ERRORS as exc:
        raise unavailable("the request log cannot be read", exc) from exc
    if row is None:
        raise GatewayError(404, "No such request", code="not_found")
    bodies = {name: row.pop(name) for name in ("request_body", "response_body")}
    context = {"title": f"Request {request_id}", "active": "Requests", "row": row, "bodies": bodies}
    return page("request.html", context, 200, session)
