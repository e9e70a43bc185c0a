"""The access log: one JSON line per request on the gateway's stdout, never a key or a prompt."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.gateway.processes import FailingPairStack

PROMPT = "zanzibar quokka marmalade"  # words that appear nowhere else
FIELDS = {
    "ts", "level", "request_id", "trace_id", "span_id", "key_id", "key_prefix", "team", "model", "route",
    "tier", "complexity_score", "backend", "replica", "status", "error", "prompt_tokens",
    "completion_tokens", "cached_tokens", "latency_ms", "ttft_ms", "overhead_ms", "cost_usd",
    "cost_estimated", "failovers", "failover", "attempts", "resumptions", "stream",
}  # fmt: skip


def _access_lines(stack: FailingPairStack, count: int) -> list[dict[str, Any]]:
    """The gateway's JSON lines, once `count` of them are out (every one must parse)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [line for line in stack.gateway.output().splitlines() if line.startswith("{")]
        if len(lines) >= count or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailingPairStack]:
    s = FailingPairStack(tmp_path_factory.mktemp("access"))
    try:
        yield s
    finally:
        s.close()


def test_every_request_gets_one_json_line_without_keys_or_prompts(stack: FailingPairStack) -> None:
    answers = [
        stack.chat("fast", PROMPT),
        stack.chat("fast", PROMPT, stream=True),
        stack.chat("shaky", PROMPT),
        stack.chat("fast", PROMPT, key="sk-wrong-" + PROMPT.replace(" ", "-")),
    ]
    assert [r.status_code for r in answers] == [200, 200, 200, 401]
    lines = _access_lines(stack, 4)
    assert len(lines) == 4
    assert [line["request_id"] for line in lines] == [r.headers["x-request-id"] for r in answers]
    for line in lines:
        assert set(line) == FIELDS
        assert line["trace_id"] is None and line["span_id"] is None  # tracing is off
        assert line["ts"].endswith("+00:00") and line["latency_ms"] >= line["overhead_ms"] >= 0
    whole, streamed, failed_over, refused = lines
    assert whole["key_prefix"] == stack.key_prefix and whole["team"] == "search"
    assert whole["model"] == "fast" and whole["backend"] == "ok" and whole["replica"] == stack.ok.base_url
    assert whole["status"] == 200 and whole["level"] == "info" and whole["error"] is None
    assert whole["prompt_tokens"] == 3 and whole["completion_tokens"] == 4 and whole["stream"] is False
    assert whole["cost_usd"] == pytest.approx((3 * 1.0 + 4 * 2.0) / 1e6) and whole["ttft_ms"] is None
    assert (
        streamed["stream"] is True and streamed["ttft_ms"] is not None and streamed["completion_tokens"] == 4
    )
    assert failed_over["failovers"] == 1 and failed_over["backend"] == "ok"
    assert failed_over["failover"].startswith(f"shaky@{stack.bad.base_url}=status 500")
    assert refused["status"] == 401 and refused["error"] == "invalid_api_key" and refused["key_id"] is None
    output = stack.gateway.output()
    for secret in (stack.key, FailingPairStack.MASTER, "quokka"):
        assert secret not in output


def test_bodies_appear_only_when_the_policy_logs_bodies(stack: FailingPairStack) -> None:
    assert stack.chat("fast", PROMPT).status_code == 200
    stack.write_policy(log_bodies=True)
    deadline = time.monotonic() + 10
    while "request_body" not in _access_lines(stack, 1)[-1]:  # the watcher polls every 0.5 s
        assert time.monotonic() < deadline, "the policy change was not picked up"
        time.sleep(0.2)
        assert stack.chat("fast", PROMPT).status_code == 200
    first, last = _access_lines(stack, 2)[0], _access_lines(stack, 2)[-1]
    assert "request_body" not in first
    assert PROMPT in last["request_body"] and PROMPT in last["response_body"]
    assert stack.key not in stack.gateway.output()
