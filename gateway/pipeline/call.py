"""Call: what one proxied request accumulates, and the request-log row it ends as.

The row is built once per request; the database log, the metrics, the access log and the trace
all read that same dict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from gateway.backends.base import Attempt
from gateway.governance.costs import PriceBook
from gateway.governance.keys import KeyInfo
from gateway.pipeline.admission import Ticket
from gateway.routing.router import RouteDecision

if TYPE_CHECKING:  # imported only when tracing is on
    from gateway.telemetry.tracing import RequestTrace


@dataclass
class Call:
    """What one request accumulates for its headers, its log row and its telemetry."""

    id: str
    key: KeyInfo
    started: float  # perf_counter
    created_at: datetime
    model: str | None = None
    backend: str | None = None
    deployment: str | None = None
    upstream_seconds: float = 0.0
    ttft: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    request_body: bytes | None = None
    response_body: bytes | None = None
    decision: RouteDecision | None = None
    attempts: list[Attempt] = field(default_factory=list)
    prices: PriceBook | None = None
    ticket: Ticket | None = None  # rate-limit and budget reservations, released with the log row
    body: dict[str, Any] | None = None  # the parsed request (to count tokens if no usage comes back)
    reply_body: bytes | None = None  # a whole answer (same reason)
    lines: list[str] = field(default_factory=list)  # a stream's data lines (same reason)
    stream: bool = False
    response_model: str | None = None  # the `model` the upstream answered with (for the trace)
    trace: RequestTrace | None = None  # None unless tracing is on
    logged: bool = False  # the row is written (or being counted): exactly one per request

    def overhead_ms(self) -> float:
        """Milliseconds spent in the gateway so far: total minus waiting on the upstream."""
        return max(0.0, (time.perf_counter() - self.started - self.upstream_seconds) * 1e3)

    def row(self, status: int, error: str | None, cost: Decimal | None, reference: Decimal | None,
            estimated: bool) -> dict[str, Any]:  # fmt: skip
        """The request-log row (keys are RequestLog's columns)."""
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        decision = self.decision
        return {
            "id": self.id,
            "created_at": self.created_at,
            "finished_at": datetime.now(UTC),
            "key_id": self.key.id,
            "team": self.key.team,
            "requested_model": clip(self.model, 200),
            "backend": self.backend,
            "deployment": clip(self.deployment, 500),
            "route_reason": clip(decision.reason, 500) if decision else None,
            "route_tier": clip(decision.tier, 100) if decision else None,
            "complexity_score": round(decision.score, 4) if decision and decision.score is not None else None,
            "failover": ", ".join(a.describe() for a in self.attempts) or None,
            "status": status,
            "error_type": clip(error, 100),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
            "latency_ms": round((time.perf_counter() - self.started) * 1e3, 3),
            "ttft_ms": round(self.ttft * 1e3, 3) if self.ttft is not None else None,
            "overhead_ms": round(self.overhead_ms(), 3),
            "attempts": len([a for a in self.attempts if not a.outcome.startswith("unavailable")])
            + (1 if self.backend and self.deployment else 0),
            "cost_picousd": cost,
            "reference_cost_picousd": reference,
            "cost_estimated": estimated,
            "request_body": self.request_body.decode(errors="replace") if self.request_body else None,
            "response_body": self.response_body.decode(errors="replace") if self.response_body else None,
        }


def refused_row(request_id: str, started: float, status: int, error: str | None) -> dict[str, Any]:
    """The row-shaped record of a request refused before the proxy (bad method, key or body).

    Not written to the database (no key to charge it to): for the metrics and the access log.
    """
    now = datetime.now(UTC)
    latency = round((time.perf_counter() - started) * 1e3, 3)
    return {
        "id": request_id, "created_at": now, "finished_at": now, "key_id": None, "team": None,
        "requested_model": None, "backend": None, "deployment": None, "route_reason": None,
        "route_tier": None, "complexity_score": None, "failover": None, "status": status,
        "error_type": error, "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
        "latency_ms": latency, "ttft_ms": None, "overhead_ms": latency, "attempts": 0, "cost_picousd": None,
        "reference_cost_picousd": None, "cost_estimated": False, "request_body": None, "response_body": None,
    }  # fmt: skip


def clip(text: str | None, limit: int) -> str | None:
    """Column-sized text: PostgreSQL refuses a whole batch over one value that is too long."""
    return text if text is None or len(text) <= limit else text[: limit - 1] + "…"
