"""What the pipeline asks of a request's trace, and the trace of a request nobody traces.

Tracing off is `NO_TRACING`: its `start` hands every request the same `NoTrace`, whose methods do
nothing, so that no module checks for a missing trace. OpenTelemetry is imported only by
gateway/telemetry/tracing.py, and only when an OTLP endpoint is configured.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from gateway.config.policy import EngineBackend, HostedBackend
from gateway.governance.keys import KeyInfo
from gateway.routing.router import RouteDecision
from gateway.store.record import RequestRecord

BackendSpec = EngineBackend | HostedBackend


class Trace(Protocol):
    """One request's trace: events as the request goes, attempts as child spans, the end as a sink."""

    @property
    def ids(self) -> tuple[str, str] | None:
        """(trace id, span id) in hex, as the access log writes them; None when not traced."""
        ...

    def authenticated(self, key: KeyInfo) -> None:
        """The key was accepted."""
        ...

    def parsed(self, model: str, body: Mapping[str, Any]) -> None:
        """The request's model and sampling parameters are known."""
        ...

    def routed(self, decision: RouteDecision) -> None:
        """The router decided."""
        ...

    def begin_attempt(self, model: str, upstream_model: str, backend: str, spec: BackendSpec,
                      stream: bool) -> dict[str, str] | None:  # fmt: skip
        """An upstream attempt starts; the headers that carry its context upstream (None: none)."""
        ...

    def end_attempt(
        self, deployment: str | None, status: int | None, error: str | None = None, detail: str | None = None
    ) -> None:
        """The open attempt is over."""
        ...

    def failed_over(self, model: str, backend: str, deployment: str | None, outcome: str, reason: str,
                    status: int | None = None) -> None:  # fmt: skip
        """This model or replica could not serve; the walk moves on."""
        ...

    def no_call(self, model: str, backend: str, outcome: str, noted: bool) -> None:
        """The backend had nothing to offer: the attempt begun for it made no call."""
        ...

    def resumed(self, backend: str, deployment: str, reason: str, tokens: int) -> None:
        """The open stream broke mid-answer (its attempt ends); another replica goes on after `tokens`."""
        ...

    def record(self, rec: RequestRecord) -> None:
        """The request is over: its outcome, from its record (a RecordSink)."""
        ...


class Tracing(Protocol):
    """Starts one Trace per request."""

    def start(self, path: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> Trace:
        """A request's trace, started now (before authentication)."""
        ...

    def shutdown(self) -> None:
        """Export what is still buffered."""
        ...


class NoTrace:
    """The trace of a request nobody traces: every method does nothing."""

    __slots__ = ()
    ids = None

    def authenticated(self, key: KeyInfo) -> None:
        """Nothing."""

    def parsed(self, model: str, body: Mapping[str, Any]) -> None:
        """Nothing."""

    def routed(self, decision: RouteDecision) -> None:
        """Nothing."""

    def begin_attempt(self, model: str, upstream_model: str, backend: str, spec: BackendSpec,
                      stream: bool) -> dict[str, str] | None:  # fmt: skip
        """No headers."""
        return None

    def end_attempt(
        self, deployment: str | None, status: int | None, error: str | None = None, detail: str | None = None
    ) -> None:
        """Nothing."""

    def failed_over(self, model: str, backend: str, deployment: str | None, outcome: str, reason: str,
                    status: int | None = None) -> None:  # fmt: skip
        """Nothing."""

    def no_call(self, model: str, backend: str, outcome: str, noted: bool) -> None:
        """Nothing."""

    def resumed(self, backend: str, deployment: str, reason: str, tokens: int) -> None:
        """Nothing."""

    def record(self, rec: RequestRecord) -> None:
        """Nothing."""


NO_TRACE = NoTrace()


class NoTracing:
    """Tracing off: every request gets NO_TRACE."""

    __slots__ = ()

    def start(self, path: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> Trace:
        """NO_TRACE."""
        return NO_TRACE

    def shutdown(self) -> None:
        """Nothing to export."""


NO_TRACING = NoTracing()
