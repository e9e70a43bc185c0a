"""RequestRecord: one finished request, as every sink of it reads it (request log, metrics, access
log, trace), and the one set of defaults its row is built from.

`LogRow` is the request_log row: exactly the table's columns (RowSanitizer passes a row with
exactly those keys through untouched, the common case). The record adds what only the telemetry
reads (the key's display prefix, the attempts, the trace ids); the request log writes `row` alone.
It lives under the pipeline's floors so that the store and the telemetry both read one type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Protocol, TypedDict

from gateway.config.policy import EngineBackend, HostedBackend


class LogRow(TypedDict):
    """The request_log row of one request (keys are RequestLog's columns)."""

    id: str
    created_at: datetime
    finished_at: datetime
    key_id: str | None
    team: str | None
    requested_model: str | None
    backend: str | None
    deployment: str | None
    route_reason: str | None
    route_tier: str | None
    complexity_score: float | None
    failover: str | None  # every attempt before the answer, replica URLs included (never a client's)
    status: int
    error_type: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    latency_ms: float
    ttft_ms: float | None
    overhead_ms: float
    attempts: int  # upstream calls made (a backend skipped as unavailable is no call)
    resumptions: int  # times a stream broke mid-answer and went on on another replica
    cost_picousd: Decimal | None
    reference_cost_picousd: Decimal | None
    cost_estimated: bool  # usage counted by the gateway, not reported by the upstream
    request_body: str | None  # only when the policy's log_bodies is on
    response_body: str | None


def blank_row(request_id: str, created_at: datetime, status: int, latency_ms: float) -> LogRow:
    """A row with nothing known but its id, times and status: the defaults every row starts from
    (a request refused before the proxy keeps them all)."""
    return {
        "id": request_id, "created_at": created_at, "finished_at": created_at, "key_id": None, "team": None,
        "requested_model": None, "backend": None, "deployment": None, "route_reason": None,
        "route_tier": None, "complexity_score": None, "failover": None, "status": status,
        "error_type": None, "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
        "latency_ms": latency_ms, "ttft_ms": None, "overhead_ms": latency_ms, "attempts": 0, "resumptions": 0,
        "cost_picousd": None, "reference_cost_picousd": None, "cost_estimated": False,
        "request_body": None, "response_body": None,
    }  # fmt: skip


class Tried(Protocol):
    """An upstream attempt as the metrics count it (backends.base.Attempt)."""

    @property
    def backend(self) -> str:
        """The backend tried."""
        ...

    @property
    def reason(self) -> str:
        """Why it did not serve, as a bounded label."""
        ...


@dataclass(frozen=True, slots=True)
class Resumption:
    """A stream that broke mid-answer and went on on another replica of its pool."""

    backend: str
    deployment: str  # the replica that failed (the log's, never a client's)
    reason: str  # bounded: reset | timeout | error_event | ended_early
    tokens: int  # output tokens the client had when it broke (the new replica went on from there)

    def describe(self) -> str:
        """For the log row's failover column."""
        return f"{self.backend}@{self.deployment}=resumed after {self.tokens} tokens ({self.reason})"


@dataclass(slots=True)
class RequestRecord:
    """One finished request: its log row and what the telemetry adds (built once, never changed)."""

    row: LogRow
    key_prefix: str | None = None  # the key's stored display prefix, never the key
    stream: bool = False
    attempts: Sequence[Tried] = ()  # every try that did not serve, in order
    known_model: bool = False  # the requested model is a name the policy has (else "unknown" in metrics)
    response_model: str | None = None  # the `model` the upstream answered with
    backend_spec: EngineBackend | HostedBackend | None = None  # the serving backend's spec (the trace)
    trace_ids: tuple[str, str] | None = None  # (trace id, span id) when tracing is on
    resumptions: Sequence[Resumption] = ()  # a stream's resumptions, in order


class RecordSink(Protocol):
    """Whatever takes one finished request: the request log, metrics, access log, the request's trace."""

    def record(self, rec: RequestRecord) -> None:
        """Take one finished request (never waits)."""
        ...


def clip(text: str | None, limit: int) -> str | None:
    """Column-sized text: PostgreSQL refuses a whole batch over one value that is too long."""
    return text if text is None or len(text) <= limit else text[: limit - 1] + "…"
