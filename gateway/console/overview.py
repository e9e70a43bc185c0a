"""/ui: the overview (live), and /ui/api/overview, the JSON its script refreshes from."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from fastapi import APIRouter, Response

from gateway.api.services import Database, Watcher
from gateway.console.data import Window, recent_failovers, window
from gateway.console.web import SECURITY_HEADERS, ConsoleSession, page
from gateway.store.db import DATABASE_ERRORS, unavailable
from gateway.store.reports import usd

router = APIRouter(prefix="/ui")

HOUR, DAY = 3600, 86400


def _window(w: Window) -> dict[str, Any]:
    return {
        "seconds": w.seconds, "requests": w.requests, "rate": round(w.rate, 4), "errors": w.errors,
        "error_rate": round(w.error_rate, 4),
        "latency_p50_ms": w.latency_p50, "latency_p99_ms": w.latency_p99,
        "overhead_p50_ms": w.overhead_p50, "overhead_p99_ms": w.overhead_p99, "sampled": w.sampled,
        "backends": [
            {"backend": b.backend, "requests": b.requests, "prompt_tokens": b.prompt_tokens,
             "completion_tokens": b.completion_tokens, "cost_usd": usd(b.cost_usd)}
            for b in w.backends
        ],
    }  # fmt: skip


async def overview(db: Database, watcher: Watcher) -> dict[str, Any]:
    """The last hour and day from the log, recent failovers, and each pool's replicas now."""
    now = datetime.now(UTC)
    try:
        hour, day = await window(db, HOUR, now), await window(db, DAY, now)
        failovers = await recent_failovers(db, now - timedelta(seconds=DAY))
    except DATABASE_ERRORS as exc:
        raise unavailable("the request log cannot be read", exc) from exc
    status = watcher.status()
    return {
        "at": now.isoformat(),
        "hour": _window(hour),
        "day": _window(day),
        "failovers": [{**f, "at": f["at"].isoformat() if f["at"] else None} for f in failovers],
        "backends": status["backends"],
        "policy": {key: status[key] for key in ("version", "loaded_at", "last_error")},
    }


@router.get("")
async def overview_page(db: Database, watcher: Watcher, session: ConsoleSession) -> Response:
    """Traffic, errors, latency, overhead, use per backend, failovers, replica health."""
    data = await overview(db, watcher)
    return page("overview.html", {"title": "Overview", "active": "Overview", "o": data}, 200, session)


@router.get("/api/overview")
async def overview_json(db: Database, watcher: Watcher, _: ConsoleSession) -> Response:
    """The overview's figures as JSON (the page's script polls this)."""
    body = orjson.dumps(await overview(db, watcher))
    return Response(body, media_type="application/json", headers=SECURITY_HEADERS)
