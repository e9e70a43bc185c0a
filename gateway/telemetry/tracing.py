"""OpenTelemetry traces of completion requests; imported only when an OTLP endpoint is configured.

One SERVER span per request, named as the GenAI conventions name it ("chat fast"), with events for
authentication, the routing decision and each failover, and one CLIENT child span per upstream
attempt. The attempt's W3C `traceparent` goes out with the engine request, so the engine's own
spans join the trace. With tracing off nothing here is imported and no span is ever created:
every request gets gateway/telemetry/trace.py's NO_TRACE instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config.policy import EngineBackend, HostedBackend
from gateway.governance.keys import KeyInfo
from gateway.routing.router import RouteDecision
from gateway.store.record import RequestRecord

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent and tracestate
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
_REQUEST_FIELDS = (  # request body field -> GenAI attribute
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("top_k", "gen_ai.request.top_k"),
    ("seed", "gen_ai.request.seed"),
    ("n", "gen_ai.request.choice.count"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
)


class GatewayTracing:
    """The gateway's tracer: starts one RequestTrace per request; owns its TracerProvider."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("switchboard.gateway")

    def start(self, path: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> RequestTrace:
        """A request's span, started now (before authentication); the child of the client's span
        when its raw ASGI `headers` carry a W3C traceparent."""
        operation = "chat" if path.endswith("/chat/completions") else "text_completion"
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers
                   if name in _TRACE_HEADERS}  # fmt: skip
        span = self._tracer.start_span(
            operation,
            context=_PROPAGATOR.extract(carrier) if carrier else None,
            kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "http.request.method": "POST", "url.path": path},
        )
        return RequestTrace(self._tracer, span, operation)

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter."""
        self.provider.shutdown()


def otlp_tracing(endpoint: str, service_name: str) -> GatewayTracing:
    """Spans batched to an OTLP/HTTP collector at `endpoint` (the full traces URL)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return GatewayTracing(provider)


def exporting_to(exporter: SpanExporter, service_name: str = "switchboard-gateway") -> GatewayTracing:
    """Every span handed to `exporter` as it ends (tests: an InMemorySpanExporter)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return GatewayTracing(provider)


def provider_name(spec: EngineBackend | HostedBackend) -> str:
    """`gen_ai.provider.name`: ours for engine pools, litellm's provider prefix for hosted models."""
    if isinstance(spec, EngineBackend):
        return "switchboard"
    return spec.model.partition("/")[0] if "/" in spec.model else "openai"


class RequestTrace:
    """One request's span and its open upstream attempt (at most one at a time)."""

    def __init__(self, tracer: Tracer, span: Span, operation: str) -> None:
        self._tracer = tracer
        self.span = span
        self._operation = operation
        self._attempt: Span | None = None
        self._attempts = 0
        self.recording = span.is_recording()  # False when sampled out: attributes are not even built

    @property
    def ids(self) -> tuple[str, str]:
        """(trace id, span id) in hex, as the access log writes them."""
        context = self.span.get_span_context()
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"

    def authenticated(self, key: KeyInfo) -> None:
        """Event: the key was accepted (its id and team go on the span at the end, never the key)."""
        self.span.add_event("auth")

    def parsed(self, model: str, body: Mapping[str, Any]) -> None:
        """The request's model and sampling parameters (never its messages)."""
        if not self.recording:
            return
        self.span.update_name(f"{self._operation} {model}")
        self.span.set_attribute("gen_ai.request.model", model)
        self.span.set_attribute("gen_ai.request.stream", body.get("stream") is True)
        for field, attribute in _REQUEST_FIELDS:
            value = body.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.span.set_attribute(attribute, value)
        stop = body.get("stop")
        if isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            self.span.set_attribute(
                "gen_ai.request.stop_sequences", [stop] if isinstance(stop, str) else stop
            )

    def routed(self, decision: RouteDecision) -> None:
        """Attributes: the route, tier and complexity score; event `route` with the chain to try."""
        if not self.recording:
            return
        attributes: dict[str, Any] = {
            "switchboard.route.alias": decision.alias,
            "switchboard.route.reason": decision.reason,
        }
        if decision.tier is not None:
            attributes["switchboard.route.tier"] = decision.tier
        if decision.score is not None:
            attributes["switchboard.route.complexity_score"] = round(decision.score, 4)
        self.span.set_attributes(attributes)
        self.span.add_event("route", {"switchboard.route.chain": list(decision.chain)})

    def begin_attempt(
        self, model: str, upstream_model: str, backend: str, spec: EngineBackend | HostedBackend, stream: bool
    ) -> dict[str, str]:
        """A CLIENT span for one upstream call; returns the headers that carry it (traceparent)."""
        self._attempts += 1
        provider = provider_name(spec)
        self._attempt = self._tracer.start_span(
            f"{self._operation} {upstream_model}",
            context=set_span_in_context(self.span),
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": self._operation,
                "gen_ai.provider.name": provider,
                "gen_ai.system": provider,
                "gen_ai.request.model": upstream_model,
                "gen_ai.request.stream": stream,
                "switchboard.model": model,
                "switchboard.backend": backend,
                "switchboard.attempt": self._attempts,
            },
        )
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, set_span_in_context(self._attempt))
        return headers

    def end_attempt(
        self, deployment: str | None, status: int | None, error: str | None = None, detail: str | None = None
    ) -> None:
        """The open attempt is over: its replica, HTTP status and, when it failed, why."""
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if deployment:
            span.set_attribute("switchboard.replica", deployment)
            if deployment.startswith("http"):
                parts = urlsplit(deployment)
                span.set_attribute("server.address", parts.hostname or "")
                if parts.port is not None:
                    span.set_attribute("server.port", parts.port)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        failed = error is not None or (status is not None and status >= 400)
        if failed:
            span.set_attribute("error.type", error or str(status))
            span.set_status(Status(StatusCode.ERROR, detail or error or f"status {status}"))
        span.end()

    def failed_over(self, model: str, backend: str, deployment: str | None, outcome: str, reason: str,
                    status: int | None = None) -> None:  # fmt: skip
        """Event: this model or replica could not serve, the walk moves on (the open attempt ends)."""
        if self._attempt is not None:
            self.end_attempt(deployment, status, reason, outcome)
        attributes = {
            "switchboard.failover.from_model": model,
            "switchboard.failover.from_backend": backend,
            "switchboard.failover.reason": reason,
            "switchboard.failover.outcome": outcome,
        }
        if deployment:
            attributes["switchboard.failover.from_replica"] = deployment
        self.span.add_event("failover", attributes)

    def no_call(self, model: str, backend: str, outcome: str, noted: bool) -> None:
        """The backend had nothing to offer: the attempt begun for it is dropped (no call was made)."""
        self._attempt = None  # never ended, so never exported
        if noted:
            self.failed_over(model, backend, None, outcome, "unavailable")

    def resumed(self, backend: str, deployment: str, reason: str, tokens: int) -> None:
        """Event: the stream broke mid-answer (its attempt ends) and goes on on another replica."""
        if self._attempt is not None:
            self.end_attempt(deployment, None, reason, f"stream broke ({reason})")
        self.span.add_event(
            "stream_resumed",
            {
                "switchboard.resume.backend": backend,
                "switchboard.resume.from_replica": deployment,
                "switchboard.resume.reason": reason,
                "switchboard.resume.tokens": tokens,
            },
        )

    def record(self, rec: RequestRecord) -> None:
        """The request's outcome from its record; ends the open attempt (a stream's) and the span."""
        row = rec.row
        spec = rec.backend_spec
        provider = provider_name(spec) if spec is not None else None
        status = row["status"]
        error = row["error_type"]
        if self._attempt is not None:
            self.end_attempt(row["deployment"], status, error)
        span = self.span
        if not self.recording:
            span.end()
            return
        attributes: dict[str, Any] = {
            "http.response.status_code": status,
            "switchboard.request_id": row["id"],
            "switchboard.failover.count": len(rec.attempts),
            "switchboard.resume.count": row["resumptions"],
            "switchboard.overhead_ms": row["overhead_ms"],
        }
        for name, value in (
            ("gen_ai.response.model", rec.response_model),
            ("gen_ai.provider.name", provider),
            ("gen_ai.system", provider),
            ("gen_ai.usage.input_tokens", row["prompt_tokens"]),
            ("gen_ai.usage.output_tokens", row["completion_tokens"]),
            ("gen_ai.usage.cache_read.input_tokens", row["cached_tokens"]),
            ("switchboard.backend", row["backend"]),
            ("switchboard.replica", row["deployment"]),
            ("switchboard.key.id", row["key_id"]),
            ("switchboard.team", row["team"]),
            ("error.type", error),
        ):
            if value is not None:
                attributes[name] = value
        if row["ttft_ms"] is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = row["ttft_ms"] / 1e3
        if row["cost_picousd"] is not None:
            attributes["switchboard.cost_usd"] = float(row["cost_picousd"])
            attributes["switchboard.cost_estimated"] = bool(row["cost_estimated"])
        span.set_attributes(attributes)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, error or f"status {status}"))
        span.end()
