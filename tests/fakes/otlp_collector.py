"""A fake OpenTelemetry collector on loopback: OTLP/HTTP protobuf traces in, spans kept for tests.

`POST /v1/traces` takes an ExportTraceServiceRequest (protobuf, gzip or not), as the SDK's OTLP/HTTP
exporter sends it, and answers 200 with an empty ExportTraceServiceResponse. `spans()` returns
every span received so far, flattened, with its resource's service name.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class CollectedSpan:
    """One span as the collector received it (ids in hex, as in traceparent)."""

    service: str
    name: str
    kind: int  # OTLP's enum: 2 server, 3 client
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[str]
    status_code: int  # 0 unset, 1 ok, 2 error


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class OtlpCollector:
    """The collector, serving in a background thread until `close()`."""

    def __init__(self) -> None:
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                collector._receive(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: tests read spans, not request lines

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The base URL (what OTEL_EXPORTER_OTLP_ENDPOINT takes)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _receive(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        CollectedSpan(
                            service=str(resource.get("service.name")),
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[e.name for e in span.events],
                            status_code=span.status.code,
                        )
                    )
        with self._lock:
            self._spans.extend(received)

    def spans(self) -> list[CollectedSpan]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, done: Callable[[list[CollectedSpan]], bool], timeout: float = 10.0
    ) -> list[CollectedSpan]:
        """The spans, once `done(spans)` holds (AssertionError after `timeout` s)."""
        deadline = time.monotonic() + timeout
        while not done(spans := self.spans()):
            assert time.monotonic() < deadline, f"the collector did not get the spans in time: {spans}"
            time.sleep(0.05)
        return spans

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
