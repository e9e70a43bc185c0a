"""OpenTelemetry traces of the server's completion requests; imported only when tracing is configured.

Each request gets a SERVER span that continues the caller's W3C trace context (`traceparent`, e.g.
the gateway's attempt span). When an engine request finishes, the timestamps the engine keeps
anyway (RequestMetrics: arrival, first scheduled, first token, finished) become three child spans,
`queue`, `prefill` and `decode`, and a `first_token` event; nothing is added to the step loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.http.protocol import ChatCompletionRequest, CompletionRequest
from engine.outputs import RequestOutput

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent and tracestate


class EngineTracing:
    """The server's tracer; owns its TracerProvider."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("switchboard.engine")

    def start(self, headers: Mapping[str, str], path: str) -> RequestSpan:
        """A request's SERVER span, the child of the caller's span when the headers carry one."""
        operation = "chat" if path.endswith("/chat/completions") else "text_completion"
        span = self._tracer.start_span(
            operation,
            context=_PROPAGATOR.extract(headers),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "switchboard",
                "http.request.method": "POST",
                "url.path": path,
            },
        )
        return RequestSpan(self._tracer, span, operation)

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter."""
        self.provider.shutdown()


def otlp_tracing(endpoint: str, service_name: str) -> EngineTracing:
    """Spans batched to an OTLP/HTTP collector at `endpoint` (the full traces URL)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return EngineTracing(provider)


def exporting_to(exporter: SpanExporter, service_name: str = "switchboard-engine") -> EngineTracing:
    """Every span handed to `exporter` as it ends (tests: an InMemorySpanExporter)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return EngineTracing(provider)


class RequestSpan:
    """One HTTP request's span; its engine requests (several for a list of prompts) add to it."""

    def __init__(self, tracer: Tracer, span: Span, operation: str) -> None:
        self._tracer = tracer
        self.span = span
        self._operation = operation
        self._input_tokens = 0
        self._output_tokens = 0
        self._cached_tokens = 0
        self._finish_reasons: list[str] = []
        self.recording = span.is_recording()  # False when sampled out (e.g. the caller's flag)

    def parsed(self, req: ChatCompletionRequest | CompletionRequest, model: str) -> None:
        """The request's model and sampling parameters (never its prompt)."""
        if not self.recording:
            return
        self.span.update_name(f"{self._operation} {model}")
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        attributes: dict[str, Any] = {
            "gen_ai.request.model": req.model or model,
            "gen_ai.response.model": model,
            "gen_ai.request.stream": bool(req.stream),
        }
        for name, value in (
            ("gen_ai.request.max_tokens", max_tokens),
            ("gen_ai.request.temperature", req.temperature),
            ("gen_ai.request.top_p", req.top_p),
            ("gen_ai.request.top_k", req.top_k),
            ("gen_ai.request.seed", req.seed),
            ("gen_ai.request.choice.count", req.n),
        ):
            if value is not None:
                attributes[name] = value
        self.span.set_attributes(attributes)

    def admitted(self, request_id: str) -> None:
        """An engine request was queued for this HTTP request."""
        self.span.add_event("admitted", {"switchboard.engine.request_id": request_id})

    def finished(self, out: RequestOutput) -> None:
        """An engine request ended: its queue, prefill and decode phases as child spans."""
        if not self.recording:
            return
        m = out.metrics
        offset = time.time_ns() - time.monotonic_ns()  # monotonic seconds -> epoch nanoseconds

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        end = m.finished_time or time.monotonic()
        scheduled, first = m.first_scheduled_time, m.first_token_time
        prompt, cached = len(out.prompt_token_ids), m.num_cached_tokens
        generated = out.num_generated_tokens
        reasons = [c.finish_reason or "abort" for c in out.outputs]
        ids = {"switchboard.engine.request_id": out.request_id}
        self._phase("queue", ns(m.arrival_time), ns(scheduled if scheduled is not None else end), ids)
        if scheduled is not None:
            attributes = {**ids, "gen_ai.usage.input_tokens": prompt,
                          "gen_ai.usage.cache_read.input_tokens": cached}  # fmt: skip
            self._phase("prefill", ns(scheduled), ns(first if first is not None else end), attributes)
        if first is not None:
            self.span.add_event("first_token", ids, timestamp=ns(first))
            attributes = {**ids, "gen_ai.usage.output_tokens": generated,
                          "gen_ai.response.finish_reasons": reasons,
                          "switchboard.engine.preemptions": m.num_preemptions}  # fmt: skip
            self._phase("decode", ns(first), ns(end), attributes)
        self._input_tokens += prompt
        self._output_tokens += generated
        self._cached_tokens += cached
        self._finish_reasons.extend(reasons)
        self.span.set_attributes(
            {
                "gen_ai.usage.input_tokens": self._input_tokens,
                "gen_ai.usage.output_tokens": self._output_tokens,
                "gen_ai.usage.cache_read.input_tokens": self._cached_tokens,
                "gen_ai.response.finish_reasons": self._finish_reasons,
            }
        )

    def _phase(self, name: str, start: int, end: int, attributes: Mapping[str, Any]) -> None:
        phase = self._tracer.start_span(
            name, context=set_span_in_context(self.span), start_time=start, attributes=attributes
        )
        phase.end(end_time=max(start, end))

    def end(self, status: int, error: str | None = None) -> None:
        """The response is complete (or failed with `status` and `error`)."""
        self.span.set_attribute("http.response.status_code", status)
        if error is not None:
            self.span.set_attribute("error.type", error)
            if status >= 500:
                self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()

    async def streaming(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Pass SSE events through; the span ends with the stream (499 if the client left)."""
        status: int = 499
        error: str | None = "client_disconnected"  # unless the loop below runs to its end
        try:
            async for event in events:
                yield event
            status, error = 200, None
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # at once: it aborts unfinished requests
            self.end(status, error)
