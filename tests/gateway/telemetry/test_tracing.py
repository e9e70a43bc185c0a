"""Traces of a routed request that fails over: the gateway's spans (in memory) and the engine's (OTLP).

The gateway runs in this process with an in-memory exporter; the engine (a tiny model) runs as a
subprocess exporting over OTLP/HTTP to a fake collector, so the trace crosses a real process
boundary: the engine's spans must carry the gateway's trace id, under the gateway's attempt span.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from gateway.config.policy import EngineBackend
from gateway.routing.router import RouteDecision
from gateway.store.record import RequestRecord, blank_row
from gateway.telemetry.tracing import GatewayTracing, exporting_to
from tests.engine.server_proc import ManagedServer, ServerProcess
from tests.fakes.otlp_collector import CollectedSpan, OtlpCollector
from tests.gateway.processes import InProcessGateway

MASTER = "sk-master-tracing"
_SERVER, _CLIENT = 2, 3  # OTLP's span kinds


class TracedStack:
    """A failing fake replica and a real engine behind a tiered route; a collector for the engine."""

    def __init__(self, root: Path, model: Path) -> None:
        self.collector = OtlpCollector()
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.collector.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
                "OTEL_SERVICE_NAME": "engine-under-test"}  # fmt: skip
        self.engine = ServerProcess(model, "--kv-cache-memory", str(32 << 20), "--no-access-log", env=otel)
        self.flaky = ManagedServer(
            lambda port: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(port)], 60
        )
        httpx.post(f"{self.flaky.base_url}/control", json={"fail_status": 500}).raise_for_status()
        policy = root / "policy.yaml"
        policy.write_text(f"""
backends:
  flaky: {{type: engine, urls: ["{self.flaky.base_url}"], timeouts: {{connect: 1, total: 10}}}}
  local: {{type: engine, urls: ["{self.engine.base_url}"], timeouts: {{connect: 1, total: 30}},
          price: {{input_per_mtok: 1.0, output_per_mtok: 2.0}}}}
models:
  flaky-tiny: {{backend: flaky, model: {model.name}}}
  tiny: {{backend: local, model: {model.name}}}
routes:
  auto:
    tiers:
      - {{name: simple, threshold: 0.0, candidates: [flaky-tiny]}}
      - {{name: complex, threshold: 0.99, candidates: [flaky-tiny]}}
    fallbacks: [tiny]
""")  # fmt: skip
        self.exporter = InMemorySpanExporter()
        self.gateway = InProcessGateway(root, policy, MASTER, exporting_to(self.exporter))
        self.headers = {"Authorization": f"Bearer {self.gateway.create_key(name='traced')}"}
        self.model_name = model.name

    def gateway_spans(self, request_id: str) -> tuple[ReadableSpan, list[ReadableSpan]]:
        """The request's span (found by its request id) and its attempt spans, in order. The span
        ends once the answer is out (pipeline/finish.py records after the answer's bytes), on the
        gateway's loop: the client, in this thread, may have the answer a moment before."""
        deadline = time.monotonic() + 5
        while True:
            spans = self.exporter.get_finished_spans()
            found = [s for s in spans if (s.attributes or {}).get("switchboard.request_id") == request_id]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        (request,) = found
        assert request.context is not None
        attempts = [s for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id]
        return request, sorted(attempts, key=lambda s: s.start_time or 0)

    def engine_spans(self, trace_id: int) -> list[CollectedSpan]:
        """The engine's spans of one trace, once its server span and three phases have arrived."""
        wanted = f"{trace_id:032x}"
        return [
            s
            for s in self.collector.wait_for(lambda got: sum(s.trace_id == wanted for s in got) >= 4)
            if s.trace_id == wanted
        ]

    def close(self) -> None:
        self.gateway.stop()
        self.engine.stop()
        self.flaky.stop()
        self.collector.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_chat_model: Path) -> Iterator[TracedStack]:
    s = TracedStack(tmp_path_factory.mktemp("traced"), tiny_chat_model)
    try:
        yield s
    finally:
        s.close()


def _attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _hex(span_id: int) -> str:
    return f"{span_id:016x}"


def test_a_failed_over_request_is_one_trace_from_gateway_attempts_to_engine_phases(
    stack: TracedStack,
) -> None:
    body = {"model": "auto", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 2,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(
        f"{stack.gateway.base_url}/v1/chat/completions", json=body, headers=stack.headers, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-gateway-failover"].startswith("flaky-tiny=status_500")
    request, attempts = stack.gateway_spans(r.headers["x-request-id"])

    assert request.kind is SpanKind.SERVER and request.parent is None and request.name == "chat auto"
    got = _attributes(request)
    usage = r.json()["usage"]
    assert got["gen_ai.operation.name"] == "chat" and got["gen_ai.request.model"] == "auto"
    assert got["gen_ai.request.max_tokens"] == 2 and got["gen_ai.request.temperature"] == 0
    assert got["gen_ai.request.stream"] is False
    assert got["gen_ai.response.model"] == stack.model_name
    assert got["gen_ai.provider.name"] == "switchboard" and got["gen_ai.system"] == "switchboard"
    assert got["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert got["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 2
    assert got["switchboard.route.tier"] == "simple" and 0 <= got["switchboard.route.complexity_score"] < 0.99
    assert got["switchboard.backend"] == "local" and got["switchboard.replica"] == stack.engine.base_url
    assert got["switchboard.failover.count"] == 1 and got["switchboard.cost_usd"] > 0
    assert got["http.response.status_code"] == 200 and request.status.status_code is StatusCode.UNSET
    events = {e.name: dict(e.attributes or {}) for e in request.events}
    assert list(events) == ["auth", "route", "failover"]
    assert events["route"]["switchboard.route.chain"] == ("flaky-tiny", "tiny")
    assert events["failover"]["switchboard.failover.from_backend"] == "flaky"
    assert events["failover"]["switchboard.failover.reason"] == "status_500"

    assert [a.kind for a in attempts] == [SpanKind.CLIENT, SpanKind.CLIENT]
    failed, served = attempts
    assert _attributes(failed)["switchboard.backend"] == "flaky"
    assert _attributes(failed)["http.response.status_code"] == 500
    assert failed.status.status_code is StatusCode.ERROR and _attributes(failed)["error.type"] == "status_500"
    assert _attributes(served)["switchboard.backend"] == "local"
    assert _attributes(served)["gen_ai.request.model"] == stack.model_name
    assert _attributes(served)["switchboard.replica"] == stack.engine.base_url
    assert served.status.status_code is StatusCode.UNSET

    assert request.context is not None and served.context is not None
    engine = stack.engine_spans(request.context.trace_id)
    (server,) = [s for s in engine if s.kind == _SERVER]
    assert server.service == "engine-under-test" and server.name == f"chat {stack.model_name}"
    assert server.parent_span_id == _hex(served.context.span_id)  # under the attempt that reached it
    assert server.attributes["gen_ai.usage.output_tokens"] == 2
    phases = {s.name for s in engine if s.parent_span_id == server.span_id}
    assert phases == {"queue", "prefill", "decode"}


def test_a_made_up_model_never_names_a_span(stack: TracedStack) -> None:
    """Its name (5,000 characters, a line break, a direction override) named the span and its
    model attribute in full: a trace backend's cardinality attack; metrics say `unknown`."""
    made_up = "x" * 5000 + "\n\u202e"
    body = {"model": made_up, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        f"{stack.gateway.base_url}/v1/chat/completions", json=body, headers=stack.headers, timeout=30
    )
    assert r.status_code == 404, r.text
    request, _ = stack.gateway_spans(r.headers["x-request-id"])
    assert len(request.name) < 50 and "gen_ai.request.model" not in _attributes(request), request.name
    assert _attributes(request)["http.response.status_code"] == 404


def test_a_streamed_request_keeps_its_served_attempt_open_until_the_stream_ends(stack: TracedStack) -> None:
    body = {"model": "auto", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 2,
            "stream": True, "ignore_eos": True}  # fmt: skip
    url = f"{stack.gateway.base_url}/v1/chat/completions"
    client_trace, client_span = random.getrandbits(128), random.getrandbits(64)
    headers = {**stack.headers, "traceparent": f"00-{client_trace:032x}-{client_span:016x}-01"}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    request, (failed, served) = stack.gateway_spans(r.headers["x-request-id"])
    assert request.parent is not None and request.parent.span_id == client_span  # the client's trace goes on
    assert request.context is not None and request.context.trace_id == client_trace
    got = _attributes(request)
    assert got["gen_ai.request.stream"] is True and got["gen_ai.response.time_to_first_chunk"] > 0
    assert got["gen_ai.usage.output_tokens"] == 2
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.end_time is not None and served.start_time is not None and served.end_time is not None
    assert failed.end_time <= served.start_time and request.end_time is not None
    assert served.end_time <= request.end_time
    assert request.context is not None and served.context is not None
    engine = stack.engine_spans(request.context.trace_id)
    (server,) = [s for s in engine if s.kind == _SERVER]
    assert server.parent_span_id == _hex(served.context.span_id)
    # the attempt covers the engine's whole answer: its last token came before the attempt ended (the
    # gateway ends it at [DONE], releasing the request before the client can ask again; the engine's
    # own span ends a little later, once it has written its body's end, so it is not the bound)
    (decode,) = [s for s in engine if s.name == "decode"]
    assert decode.parent_span_id == server.span_id and decode.end_ns <= served.end_time


def test_without_an_otlp_endpoint_no_span_is_made_and_the_sdk_is_never_imported(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text('backends:\n  down: {type: engine, urls: ["http://127.0.0.1:9"]}\n'
                      "models:\n  m: {backend: down}\n")  # fmt: skip
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import httpx
        from gateway.telemetry.trace import NO_TRACING
        from tests.gateway.processes import InProcessGateway

        gateway = InProcessGateway(Path({str(tmp_path)!r}), Path({str(policy)!r}), "m")
        key = gateway.create_key(name="untraced")
        body = {{"model": "m", "messages": [{{"role": "user", "content": "x"}}]}}
        auth = {{"Authorization": "Bearer " + key}}
        r = httpx.post(gateway.base_url + "/v1/chat/completions", headers=auth, json=body, timeout=30)
        assert r.status_code in (502, 503), r.text
        assert gateway.app.services.proxy.tracing is NO_TRACING
        gateway.stop()
        ours = (
            "gateway.telemetry.tracing", "engine.http.tracing", "opentelemetry.sdk", "opentelemetry.exporter"
        )  # fmt: skip
        loaded = sorted(m for m in sys.modules if m.startswith(ours))  # FastAPI imports the API itself
        print("loaded:", loaded)
    """)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "loaded: []" in done.stdout, done.stdout


def test_a_request_sampled_out_exports_nothing_and_tells_the_engine_so() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace = GatewayTracing(provider).start("/v1/chat/completions")
    assert not trace.recording
    trace.parsed("auto", {"max_tokens": 3})
    trace.routed(RouteDecision("auto", ("tiny",), "direct"))
    headers = trace.begin_attempt(
        "tiny", "tiny", "local", EngineBackend(type="engine", urls=["http://e"]), False
    )
    assert int(headers["traceparent"][-2:], 16) & 1 == 0  # not sampled: the engine records nothing either
    trace.end_attempt("http://e", 200)
    trace.record(RequestRecord(blank_row("req-1", datetime.now(UTC), 200, 1.0), response_model="tiny"))
    assert exporter.get_finished_spans() == ()


def test_a_resumed_stream_ends_its_broken_attempt_and_notes_where_it_went_on() -> None:
    exporter = InMemorySpanExporter()
    trace = exporting_to(exporter).start("/v1/chat/completions")
    spec = EngineBackend(type="engine", urls=["http://a:8001", "http://b:8001"])
    trace.begin_attempt("local", "tiny", "pool", spec, True)
    trace.resumed("pool", "http://a:8001", "reset", 12)
    trace.begin_attempt("local", "tiny", "pool", spec, True)
    row = blank_row("req-1", datetime.now(UTC), 200, 5.0)
    row.update(backend="pool", deployment="http://b:8001", resumptions=1)
    trace.record(RequestRecord(row, stream=True))
    spans = {s.name: s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER}
    attempts = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert [s.status.status_code for s in attempts] == [StatusCode.ERROR, StatusCode.UNSET]
    assert [_attributes(s)["switchboard.replica"] for s in attempts] == ["http://a:8001", "http://b:8001"]
    (request,) = spans.values()
    (event,) = [e for e in request.events if e.name == "stream_resumed"]
    assert dict(event.attributes or {}) == {
        "switchboard.resume.backend": "pool", "switchboard.resume.from_replica": "http://a:8001",
        "switchboard.resume.reason": "reset", "switchboard.resume.tokens": 12,
    }  # fmt: skip
    assert _attributes(request)["switchboard.resume.count"] == 1
