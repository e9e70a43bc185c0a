"""Stream resumption through the gateway, with fake engine replicas that break their streams at a
chosen word (connection reset, an error event, silence): another replica goes on from the tokens
the client has, and the client sees one uninterrupted answer, one usage chunk with the true
totals; the log has one row with the resumption, priced on those totals."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import read_log_rows, start_gateway

MASTER = "sk-master-resume"
WORDS = [f"w{i}" for i in range(12)]
EXPECTED = " ".join(["echo:", *WORDS])  # the fake's answer: 13 tokens


def _fake() -> ManagedServer:
    return ManagedServer(lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60)


class Stack:
    def __init__(self, root: Path) -> None:
        self.a, self.b = _fake(), _fake()
        policy = root / "policy.yaml"
        policy.write_text(f"""
backends:
  pool:
    type: engine
    urls: ["{self.a.base_url}", "{self.b.base_url}"]
    timeouts: {{connect: 0.5, first_token: 2, total: 20, between_tokens: 1}}
    price: {{input_per_mtok: 1000000, output_per_mtok: 2000000}}
models:
  local: {{backend: pool, model: fake-model}}
routes:
  steady: {{candidates: [local], resume_streams: off}}
health:
  interval: 0.2
  timeout: 0.5
  # replica a breaks its streams on purpose, one test after another: its breaker (which counts a
  # break after the first token) would send the next tests' streams to b, with nothing to resume
  breaker: {{consecutive_failures: 1000000, error_rate: 1.0, min_requests: 1000000}}
""")  # fmt: skip
        self.database_url = f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "resume-secret",
               "GATEWAY_DATABASE_URL": self.database_url}  # fmt: skip
        self.gateway = start_gateway(policy, env)
        r = httpx.post(f"{self.gateway.base_url}/admin/keys", json={"name": "resume"},
                       headers={"Authorization": f"Bearer {MASTER}"})  # fmt: skip
        self.key = str(r.json()["key"])

    def breaks(self, cut: int | None, mode: str = "reset") -> None:
        """Replica a (the one an idle pool picks first) breaks its new streams after `cut` words; b never."""
        httpx.post(
            f"{self.a.base_url}/control", json={"break_after": cut, "break_mode": mode}
        ).raise_for_status()
        httpx.post(f"{self.b.base_url}/control", json={"break_after": None}).raise_for_status()

    def stream(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], list[str]]:
        body = {**body, "stream": True}
        with httpx.stream("POST", f"{self.gateway.base_url}{path}", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {self.key}"}) as r:  # fmt: skip
            return r.status_code, dict(r.headers), [line for line in r.iter_lines() if line]

    def row(self, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            rows = [r for r in read_log_rows(self.database_url) if r["id"] == request_id]
            if rows:
                assert len(rows) == 1
                return rows[0]
            assert time.monotonic() < deadline, "no log row"
            time.sleep(0.1)

    def close(self) -> None:
        self.gateway.stop()
        for fake in (self.a, self.b):
            if fake.proc.poll() is None:
                fake.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("resume"))
    try:
        yield s
    finally:
        s.close()


def _chunks(lines: list[str]) -> list[dict[str, Any]]:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert not any(line.startswith(":") for line in lines), "token id lines reached the client"
    return [orjson.loads(line[6:]) for line in lines[:-1]]


def _text(chunks: list[dict[str, Any]]) -> str:
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


CHAT = (
    "/v1/chat/completions",
    {"model": "local", "messages": [{"role": "user", "content": " ".join(WORDS)}]},
)
TEXT = ("/v1/completions", {"model": "local", "prompt": " ".join(WORDS)})


@pytest.mark.parametrize(
    ("endpoint", "mode", "cut"),
    [
        (CHAT, "reset", 0),  # before the first token: plain failover
        (CHAT, "reset", 1),
        (CHAT, "reset", 6),
        (CHAT, "reset", 13),  # every word sent, the finish not
        (CHAT, "error_event", 4),
        (CHAT, "stall", 3),
        (TEXT, "reset", 1),
        (TEXT, "reset", 7),
        (TEXT, "error_event", 13),
    ],
    ids=lambda v: v if isinstance(v, (str, int)) else v[0].rsplit("/", 1)[-1],
)
def test_a_stream_broken_mid_answer_goes_on_on_the_other_replica(
    stack: Stack, endpoint: tuple[str, dict[str, Any]], mode: str, cut: int
) -> None:
    stack.breaks(cut, mode)
    path, body = endpoint
    status, headers, lines = stack.stream(path, {**body, "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = _chunks(lines)
    assert _text(chunks) == EXPECTED  # nothing missing, nothing twice
    assert len({c["id"] for c in chunks}) == 1  # one answer
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 13  # the true totals, once
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == ["stop"]
    if path.endswith("chat/completions"):
        assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    row = stack.row(headers["x-request-id"])
    assert row["status"] == 200 and row["completion_tokens"] == 13 and row["prompt_tokens"] == 12
    assert row["resumptions"] == (0 if cut == 0 else 1)
    if cut:
        assert f"resumed after {cut} tokens" in row["failover"]
        assert int(row["cost_picousd"]) == (12 * 1 + 13 * 2) * 10**12  # priced once, on the totals


def test_without_a_usage_request_the_client_gets_none_and_the_log_still_has_the_totals(stack: Stack) -> None:
    stack.breaks(5, "reset")
    status, headers, lines = stack.stream(*CHAT)
    chunks = _chunks(lines)
    assert status == 200 and _text(chunks) == EXPECTED and not any("usage" in c for c in chunks)
    assert stack.row(headers["x-request-id"])["completion_tokens"] == 13


def test_a_route_with_resumption_off_ends_the_stream_with_an_error_event_as_before(stack: Stack) -> None:
    stack.breaks(4, "reset")
    path, body = CHAT
    status, headers, lines = stack.stream(path, {**body, "model": "steady"})
    assert status == 200 and '"error"' in lines[-1] and "upstream_stream_error" in lines[-1]
    row = stack.row(headers["x-request-id"])
    assert row["status"] == 502 and row["resumptions"] == 0


def test_resumptions_are_counted_by_reason_in_the_metrics(stack: Stack) -> None:
    stack.breaks(2, "error_event")
    assert stack.stream(*CHAT)[0] == 200
    metrics = httpx.get(
        f"{stack.gateway.base_url}/metrics", headers={"Authorization": f"Bearer {MASTER}"}
    ).text
    assert 'gateway_stream_resumptions_total{backend="pool",reason="error_event"}' in metrics
    assert 'gateway_stream_resumed_tokens_total{backend="pool"}' in metrics


def test_a_client_cannot_send_the_engines_resumption_fields(stack: Stack) -> None:
    stack.breaks(None)
    path, body = CHAT
    forged = {**body, "resume": {"token_ids": [0, 1, 2], "id": "x"}, "stream_token_ids": True}
    status, _, lines = stack.stream(path, forged)
    assert status == 200 and _text(_chunks(lines)) == EXPECTED  # the whole answer, no ids for the client


@pytest.mark.parametrize("model", ["local", "steady"])  # resumable, and a route with resumption off
def test_a_mid_stream_invalid_request_error_is_passed_on_once_never_resumed(stack: Stack, model: str) -> None:
    """The request's own fault (the engine's guided grammar outgrowing its parser's limits): another
    replica would meet it again, and the client should read the engine's reason, not ours."""
    stack.breaks(4, "request_error")
    served_before = [httpx.get(f"{f.base_url}/stats").json()["requests"] for f in (stack.a, stack.b)]
    path, body = CHAT
    status, headers, lines = stack.stream(path, {**body, "model": model})
    assert status == 200 and "data: [DONE]" not in lines
    errors = [orjson.loads(line[6:])["error"] for line in lines if '"error"' in line]
    assert len(errors) == 1 and '"error"' in lines[-1]
    error = errors[0]
    assert set(error) == {"message", "type", "param", "code"}  # nothing else of the upstream's object
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "invalid_json_schema", "response_format.json_schema.schema"
    )  # fmt: skip
    assert error["message"].startswith("the JSON schema is too complex") and len(error["message"]) <= 1000
    assert _text([orjson.loads(line[6:]) for line in lines[:-1]]) == "echo: w0 w1 w2"  # words before it
    served_after = [httpx.get(f"{f.base_url}/stats").json()["requests"] for f in (stack.a, stack.b)]
    assert sum(served_after) - sum(served_before) == 1  # not resumed elsewhere
    row = stack.row(headers["x-request-id"])
    assert row["status"] == 400 and row["error_type"] == "invalid_json_schema" and row["resumptions"] == 0
    # the words streamed before the error were served: counted and billed, not free
    assert row["completion_tokens"] and row["prompt_tokens"] and int(row["cost_picousd"]) > 0


def test_with_no_other_replica_left_the_stream_ends_with_an_error_event(stack: Stack) -> None:
    """(Last: it kills replica b.) The gateway tries b, finds it gone, and gives up cleanly."""
    stack.breaks(3, "reset")
    stack.b.proc.kill()
    stack.b.proc.wait()
    status, headers, lines = stack.stream(*CHAT)
    assert status == 200 and '"error"' in lines[-1]
    assert stack.row(headers["x-request-id"])["status"] == 502
