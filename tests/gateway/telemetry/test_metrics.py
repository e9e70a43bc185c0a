"""The gateway's /metrics after real traffic: successes, errors, a failover, an open breaker.

The gateway also exports its spans over OTLP here (to a fake collector): metrics are the same with
tracing on, and the settings' OTEL_* path is exercised end to end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.otlp_collector import OtlpCollector
from tests.gateway.processes import FailingPairStack

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(stack: FailingPairStack) -> tuple[str, Series]:
    text = httpx.get(
        f"{stack.gateway.base_url}/metrics", headers={"Authorization": f"Bearer {stack.MASTER}"}
    ).text
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return text, series


def _value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    c = OtlpCollector()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def traffic(
    tmp_path_factory: pytest.TempPathFactory, collector: OtlpCollector
) -> Iterator[tuple[FailingPairStack, dict[str, int]]]:
    stack = FailingPairStack(tmp_path_factory.mktemp("metrics"), otlp_endpoint=collector.url)
    try:
        whole = stack.chat("fast", "one two three")
        streamed = stack.chat("fast", "four five", stream=True, stream_options={"include_usage": True})
        failed_over = stack.chat("shaky", "six")
        broken = stack.chat("broken", "seven")
        unknown = stack.chat("nope", "eight")
        no_key = stack.chat("fast", "nine", key="sk-not-a-key")
        statuses = [r.status_code for r in (whole, streamed, failed_over, broken, unknown, no_key)]
        assert statuses == [200, 200, 200, 502, 404, 401]  # an upstream 500 is a bad gateway
        usage = whole.json()["usage"]
        last = [line for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
        stream_usage = httpx.Response(200, content=last[6:]).json()["usage"]
        tokens = {
            "input": usage["prompt_tokens"] + stream_usage["prompt_tokens"],
            "output": usage["completion_tokens"] + stream_usage["completion_tokens"],
            "shaky_output": failed_over.json()["usage"]["completion_tokens"],
        }
        yield stack, tokens
    finally:
        stack.close()


def test_requests_are_counted_by_model_backend_status_and_tier(
    traffic: tuple[FailingPairStack, dict[str, int]],
) -> None:
    stack, _ = traffic
    _, series = _scrape(stack)
    name = "gateway_requests_total"
    assert _value(series, name, model="fast", backend="ok", status="200", tier="none") == 2
    assert _value(series, name, model="shaky", backend="ok", status="200", tier="none") == 1
    assert _value(series, name, model="broken", backend="none", status="502", tier="none") == 1
    assert _value(series, name, model="unknown", backend="none", status="404", tier="none") == 1
    assert _value(series, name, model="unknown", backend="none", status="401", tier="none") == 1
    assert _value(series, "gateway_request_duration_seconds_count", model="fast", backend="ok") == 2
    assert _value(series, "gateway_time_to_first_token_seconds_count", model="fast", backend="ok") == 1
    assert _value(series, "gateway_overhead_seconds_count") == 6
    assert 0 < _value(series, "gateway_overhead_seconds_sum") < 6 * 0.05


def test_tokens_and_cost_add_up_to_what_the_upstream_reported(
    traffic: tuple[FailingPairStack, dict[str, int]],
) -> None:
    stack, tokens = traffic
    _, series = _scrape(stack)
    assert _value(series, "gateway_input_tokens_total", model="fast", backend="ok") == tokens["input"]
    assert _value(series, "gateway_output_tokens_total", model="fast", backend="ok") == tokens["output"]
    assert (
        _value(series, "gateway_output_tokens_total", model="shaky", backend="ok") == tokens["shaky_output"]
    )
    cost = _value(series, "gateway_cost_usd_total", model="fast", backend="ok")
    assert cost == pytest.approx((tokens["input"] * 1.0 + tokens["output"] * 2.0) / 1e6)


def test_failovers_are_counted_from_and_to_with_their_reason(
    traffic: tuple[FailingPairStack, dict[str, int]],
) -> None:
    stack, _ = traffic
    _, series = _scrape(stack)
    name = "gateway_failovers_total"
    assert _value(series, name, from_backend="bad", to_backend="ok", reason="status_500") == 1
    assert _value(series, name, from_backend="bad", to_backend="none", reason="status_500") == 1


def test_replica_breakers_and_the_log_writer_are_exported(
    traffic: tuple[FailingPairStack, dict[str, int]],
) -> None:
    stack, _ = traffic
    _, series = _scrape(stack)
    bad, ok = stack.bad.base_url, stack.ok.base_url
    assert _value(series, "gateway_circuit_breaker_state", backend="bad", replica=bad) == 2  # open
    assert _value(series, "gateway_circuit_breaker_state", backend="ok", replica=ok) == 0  # closed
    assert _value(series, "gateway_replica_up", backend="ok", replica=ok) == 1
    assert ("gateway_request_log_queue_depth", frozenset()) in series
    deadline = time.monotonic() + 5
    while _value(series, "gateway_request_log_written_total") < 5:  # the 401 has no row
        assert time.monotonic() < deadline
        time.sleep(0.1)
        _, series = _scrape(stack)
    assert _value(series, "gateway_request_log_dropped_total") == 0
    assert ("gateway_policy_reloads_total", frozenset()) in series


def test_no_label_carries_a_key_or_a_request_id(traffic: tuple[FailingPairStack, dict[str, int]]) -> None:
    stack, _ = traffic
    text, _ = _scrape(stack)
    assert stack.key not in text and stack.key_prefix not in text
    assert "req-" not in text and "sk-not-a-key" not in text and "nope" not in text


def test_with_an_otlp_endpoint_every_request_is_exported_as_a_span(
    traffic: tuple[FailingPairStack, dict[str, int]], collector: OtlpCollector
) -> None:
    stack, _ = traffic
    service = os.environ.get("OTEL_SERVICE_NAME", "switchboard-gateway")
    spans = collector.wait_for(lambda got: sum(s.kind == 2 for s in got) >= 6)
    requests = sorted((s for s in spans if s.kind == 2), key=lambda s: s.start_ns)
    assert [s.name for s in requests] == [
        "chat fast",
        "chat fast",
        "chat shaky",
        "chat broken",
        "chat",  # "nope", a model the policy does not know: it names no span
        "chat",
    ]
    assert {s.service for s in spans} == {service}
    assert [s.attributes["http.response.status_code"] for s in requests] == [200, 200, 200, 502, 404, 401]
    assert requests[3].status_code == 2 and requests[5].attributes["error.type"] == "invalid_api_key"
    shaky = requests[2]
    attempts = [s for s in spans if s.parent_span_id == shaky.span_id and s.kind == 3]
    assert sorted(a.attributes["switchboard.backend"] for a in attempts) == ["bad", "ok"]
    assert "failover" in shaky.events and shaky.attributes["switchboard.failover.count"] == 1
    assert stack.key not in repr(spans)
