"""The engine server's spans: the caller's trace continues; queue, prefill and decode as children."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engine.__main__ import otlp_traces_endpoint
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.http.server import create_app
from engine.http.tracing import exporting_to


@pytest.fixture(scope="module")
def traced(tiny_chat_model: Path) -> Iterator[tuple[TestClient, InMemorySpanExporter]]:
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_chat_model), kv_cache_memory=32 << 20), "tiny")
    exporter = InMemorySpanExporter()
    with TestClient(create_app(engine, ["tiny"], tracing=exporting_to(exporter))) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client, exporter


def _traceparent() -> tuple[int, int, str]:
    trace_id, span_id = random.getrandbits(128), random.getrandbits(64)
    return trace_id, span_id, f"00-{trace_id:032x}-{span_id:016x}-01"


def _spans_of(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    spans = [s for s in exporter.get_finished_spans() if s.context is not None]
    return [s for s in spans if s.context.trace_id == trace_id]


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id}


def test_server_span_continues_the_callers_trace_with_queue_prefill_and_decode_children(
    traced: tuple[TestClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced
    trace_id, caller, traceparent = _traceparent()
    body = {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body, headers={"traceparent": traceparent})
    assert r.status_code == 200
    spans = _spans_of(exporter, trace_id)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.parent is not None and server.parent.span_id == caller and server.parent.is_remote
    assert server.name == "text_completion tiny"
    attributes = dict(server.attributes or {})
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == "tiny" and attributes["gen_ai.request.max_tokens"] == 3
    assert attributes["gen_ai.request.temperature"] == 0
    assert attributes["gen_ai.usage.input_tokens"] == 5 and attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["http.response.status_code"] == 200
    phases = _children(spans, server)
    assert set(phases) == {"queue", "prefill", "decode"}
    queue, prefill, decode = phases["queue"], phases["prefill"], phases["decode"]
    assert queue.start_time and queue.end_time and prefill.end_time and decode.end_time and server.end_time
    assert server.start_time is not None and server.start_time <= queue.start_time
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert decode.end_time <= server.end_time
    assert (prefill.attributes or {})["gen_ai.usage.input_tokens"] == 5
    assert (decode.attributes or {})["gen_ai.usage.output_tokens"] == 3
    first_token = [e for e in server.events if e.name == "first_token"]
    assert len(first_token) == 1 and first_token[0].timestamp == decode.start_time


def test_a_streamed_chat_span_ends_with_the_stream(traced: tuple[TestClient, InMemorySpanExporter]) -> None:
    client, exporter = traced
    trace_id, _, traceparent = _traceparent()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"traceparent": traceparent}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    spans = _spans_of(exporter, trace_id)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "chat tiny"
    attributes = dict(server.attributes or {})
    assert attributes["gen_ai.request.stream"] is True and attributes["gen_ai.usage.output_tokens"] == 4
    assert attributes["http.response.status_code"] == 200
    assert set(_children(spans, server)) == {"queue", "prefill", "decode"}


def test_a_refused_request_ends_its_span_with_the_status_and_error_type(
    traced: tuple[TestClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced
    trace_id, _, traceparent = _traceparent()
    r = client.post(
        "/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"traceparent": traceparent}
    )
    assert r.status_code == 404
    (server,) = _spans_of(exporter, trace_id)
    attributes = dict(server.attributes or {})
    assert attributes["http.response.status_code"] == 404 and attributes["error.type"] == "model_not_found"
    assert server.status.status_code is StatusCode.UNSET  # a client error is not the server's failure


def test_without_a_traceparent_the_server_span_starts_a_trace(
    traced: tuple[TestClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced
    exporter.clear()
    assert (
        client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1}).status_code
        == 200
    )
    (server,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert server.parent is None


def test_the_otlp_endpoint_comes_from_opentelemetrys_own_variables() -> None:
    assert otlp_traces_endpoint({}) is None
    assert (
        otlp_traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    )
    both = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x",
    }
    assert otlp_traces_endpoint(both) == "http://t/x"
    assert otlp_traces_endpoint({**both, "OTEL_SDK_DISABLED": "true"}) is None


def test_a_caller_that_did_not_sample_gets_no_engine_spans(
    traced: tuple[TestClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced
    trace_id, _, traceparent = _traceparent()
    headers = {"traceparent": traceparent[:-2] + "00"}
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1}, headers=headers
    )
    assert r.status_code == 200 and not _spans_of(exporter, trace_id)
