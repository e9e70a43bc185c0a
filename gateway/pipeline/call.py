"""Call: what one proxied request accumulates, and the log row and headers it ends with."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

from gateway.backends.base import PROMPT_TOKENS, Attempt
from gateway.config.policy import Policy
from gateway.governance.costs import PriceBook
from gateway.governance.keys import KeyInfo
from gateway.governance.usage import MAX_TOKENS, max_prompt
from gateway.pipeline.admission import Ticket
from gateway.pipeline.reply import Reply
from gateway.routing.router import RouteDecision
from gateway.store.record import LogRow, Resumption, blank_row, clip
from gateway.telemetry.trace import NO_TRACE, Trace

_MAX_PROMPT_DIGITS = 8  # the count bounded as reported usage is (MAX_TOKENS, 2^24: 8 digits)


def request_id() -> str:
    """A new request's id, `req-` and 32 hex digits (random bytes, as uuid4's but without building
    a UUID object: every request makes one)."""
    return "req-" + os.urandom(16).hex()


class Ended(NamedTuple):
    """When a request ended, as its row tells it: perf_counter, wall clock, and the upstream's share
    of the time up to then (a stream's relay counts upstream time on after its end, while it writes
    the last event and drains what follows [DONE]: none of it is the row's)."""

    at: float
    wall: datetime
    upstream_seconds: float


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
    calling: str | None = None  # the backend being called when the client left (nothing served)
    resumptions: list[Resumption] = field(default_factory=list)  # a stream gone on on other replicas
    prices: PriceBook | None = None
    policy: Policy | None = None  # the version it ran under: its row and record read it, not a newer one
    ticket: Ticket | None = None  # rate-limit and budget reservations, released with the log row
    body: dict[str, Any] | None = None  # the parsed request (to count tokens if no usage comes back)
    body_bytes: int = 0  # its size: a bound on its prompt tokens while they are counted
    output_cap: int | None = None  # an answer's token cap when the request names none (costs.output_cap)
    hidden: tuple[str, ...] = ()  # what the served upstream's error text must not show (its key)
    reply_body: bytes | None = None  # a whole answer (same reason)
    lines: list[str] = field(default_factory=list)  # a stream's data lines (same reason)
    stream_chars: int = 0  # their size so far: a stream is bounded as a whole answer is
    chunk_id: object = None  # a stream's id, from its first event: a candidate taking over keeps it
    stream: bool = False
    response_model: str | None = None  # the `model` the upstream answered with (for the trace)
    trace: Trace = NO_TRACE
    logged: bool = False  # the row is written (or being counted): exactly one per request
    committed: bool = False  # a stream's status and headers went to the client (its events may not)
    told_prompt_tokens: int | None = None  # what an engine's stream said its prompt's tokens are

    def overhead_ms(self, at: float | None = None, upstream_seconds: float | None = None) -> float:
        """Milliseconds spent in the gateway up to `at` (perf_counter; default now): the time so far
        minus the upstream's share of it (default: as it stands)."""
        end = time.perf_counter() if at is None else at
        waited = self.upstream_seconds if upstream_seconds is None else upstream_seconds
        return max(0.0, (end - self.started - waited) * 1e3)

    def told_prompt(self, line: str) -> None:
        """Take an engine's `: prompt_tokens N` line (the count a stream left without usage is billed
        for); one that is not a plain bounded count is ignored, as any stray comment line is."""
        digits = line[len(PROMPT_TOKENS) :].strip()
        if self.told_prompt_tokens is not None or not (
            digits.isascii() and digits.isdigit() and len(digits) <= _MAX_PROMPT_DIGITS
        ):  # the first one counts (a resumed stream's replica tells the same prompt again)
            return
        # bounded as a reported usage is: no more than the request's bytes could make
        bound = max_prompt(self.body, self.body_bytes) if self.body is not None else None
        self.told_prompt_tokens = min(int(digits), MAX_TOKENS, bound if bound is not None else MAX_TOKENS)

    def ended(self) -> Ended:
        """The request's end, now (the deferred row is built from it: Finish)."""
        return Ended(time.perf_counter(), datetime.now(UTC), self.upstream_seconds)

    def served_by(self, backend: str, deployment: str, attempts: list[Attempt]) -> None:
        """The upstream that answers, and what was tried before it."""
        self.backend, self.deployment, self.attempts = backend, deployment, attempts

    def row(self, status: int, error: str | None, cost: Decimal | None, reference: Decimal | None,
            estimated: bool, ended: Ended | None = None) -> LogRow:  # fmt: skip
        """The request-log row of a request that ended at `ended` (default now)."""
        end = ended or self.ended()
        row = blank_row(self.id, self.created_at, status, round((end.at - self.started) * 1e3, 3))
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        decision = self.decision
        row["finished_at"] = end.wall
        row["key_id"] = self.key.id
        row["team"] = self.key.team
        row["requested_model"] = clip(self.model, 200)
        row["backend"] = self.backend or self.calling  # a client that left: what it was waiting on
        row["deployment"] = clip(self.deployment, 500)
        if decision is not None:
            row["route_reason"] = clip(decision.reason, 500)
            row["route_tier"] = clip(decision.tier, 100)
            row["complexity_score"] = round(decision.score, 4) if decision.score is not None else None
        tried = [a.describe() for a in self.attempts] + [r.describe() for r in self.resumptions]
        row["failover"] = ", ".join(tried) or None
        row["error_type"] = clip(error, 100)
        row["prompt_tokens"] = usage.get("prompt_tokens")
        row["completion_tokens"] = usage.get("completion_tokens")
        row["cached_tokens"] = details.get("cached_tokens") if isinstance(details, dict) else None
        row["ttft_ms"] = round(self.ttft * 1e3, 3) if self.ttft is not None else None
        row["overhead_ms"] = round(self.overhead_ms(end.at, end.upstream_seconds), 3)
        called = len([a for a in self.attempts if a.called])
        current = 1 if (self.backend and self.deployment) or self.calling else 0
        row["attempts"] = called + current + len(self.resumptions)
        row["resumptions"] = len(self.resumptions)
        row["cost_picousd"] = cost
        row["reference_cost_picousd"] = reference
        row["cost_estimated"] = estimated
        if self.request_body:
            row["request_body"] = self.request_body.decode(errors="replace")
        if self.response_body:
            row["response_body"] = self.response_body.decode(errors="replace")
        return row

    def stamp(self, reply: Reply) -> Reply:
        """`reply` with the gateway's headers: request id, backend, route, failover, overhead."""
        reply.headers.append((b"x-request-id", self.id.encode()))
        if self.backend:
            reply.headers.append((b"x-gateway-backend", self.backend.encode()))
        if self.decision is not None:
            reply.headers.append((b"x-gateway-route", self.decision.header().encode()))
        if self.attempts:
            tried = ", ".join(a.public() for a in self.attempts)
            reply.headers.append((b"x-gateway-failover", tried.encode("ascii", "replace")))
        reply.headers.append((b"x-gateway-overhead-ms", b"%.3f" % self.overhead_ms()))
        return reply
