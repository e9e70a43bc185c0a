"""When a stream's status and headers reach the client (the policy's `stream_head`), and what a
failure before the first token looks like either way.

Two gateways serve the same two fake engines: one with the default (`first_event`: the head goes
with the first upstream event, the events wait for the first token) and one with `first_token`
(the head waits too). `local` fails over from replica A to replica B; `solo` has only A.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import create_key_cli, read_log_rows, start_gateway

RESET = {"chunk_delay_ms": 0, "break_after": None, "break_mode": "reset", "latency_ms": 0}


@dataclass
class Streamed:
    status: int
    headers: dict[str, str]
    lines: list[str]
    head_at: float  # seconds from sending to the status and headers
    text_at: float | None  # ... to the first event that carries text
    first_at: float | None  # ... to the first event


@dataclass
class Stack:
    a: ManagedServer
    b: ManagedServer
    gateways: dict[str, tuple[ManagedServer, str, str]]  # stream_head -> (gateway, key, database url)

    def stream(self, head: str, model: str, content: str = "one two") -> Streamed:
        gateway, key, _ = self.gateways[head]
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": content}]}
        started = time.monotonic()
        lines: list[str] = []
        text_at = first_at = None
        with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=30) as r:  # fmt: skip
            head_at = time.monotonic() - started
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                first_at = first_at or time.monotonic() - started
                if text_at is None and '"content":"' in line and '"content":""' not in line:
                    text_at = time.monotonic() - started
        return Streamed(r.status_code, dict(r.headers), lines, head_at, text_at, first_at)

    def row(self, head: str, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            rows = [r for r in read_log_rows(self.gateways[head][2]) if r["id"] == request_id]
            if rows:
                assert len(rows) == 1
                return rows[0]
            assert time.monotonic() < deadline, "no log row"
            time.sleep(0.1)

    def control(self, server: ManagedServer, **settings: Any) -> None:
        httpx.post(f"{server.base_url}/control", json={**RESET, **settings}).raise_for_status()


def _fake() -> ManagedServer:
    return ManagedServer(lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    servers: list[ManagedServer] = []
    try:
        a, b = _fake(), _fake()
        servers += [a, b]
        gateways = {}
        for head in ("first_event", "first_token"):
            root = tmp_path_factory.mktemp(head)
            policy = root / "policy.yaml"
            policy.write_text(f"""
backends:
  first: {{type: engine, urls: ["{a.base_url}"], timeouts: {{connect: 1, first_token: 5, total: 20}}}}
  second: {{type: engine, urls: ["{b.base_url}"], timeouts: {{connect: 1, first_token: 5, total: 20}}}}
models:
  local: {{backend: first, model: fake-model, fallbacks: [spare]}}
  spare: {{backend: second, model: fake-model}}
  solo: {{backend: first, model: fake-model}}
health: {{interval: 5, breaker: {{consecutive_failures: 1000}}}}
stream_head: {head}
""")  # fmt: skip
            url = f"sqlite+aiosqlite:///{root / 'gateway.db'}"
            env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": url}
            gateway = start_gateway(policy, env)
            servers.append(gateway)
            gateways[head] = (gateway, create_key_cli(env, head), url)
        yield Stack(a, b, gateways)
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.fixture(autouse=True)
def _reset(stack: Stack) -> None:
    stack.control(stack.a)
    stack.control(stack.b)


def _error(line: str) -> dict[str, Any]:
    assert line.startswith("data: ")
    error = orjson.loads(line[6:])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_the_head_goes_with_the_first_event_and_the_text_when_it_comes(stack: Stack) -> None:
    stack.control(stack.a, chunk_delay_ms=1000)  # the role chunk at once, each word a second later
    early = stack.stream("first_event", "local", "hi")
    assert early.status == 200 and early.text_at is not None
    assert early.head_at < 0.6 < 0.9 < early.text_at  # the client had the head while the model worked
    assert early.first_at is not None and early.first_at < 0.6  # and the role chunk, sent with it
    assert '"role":"assistant"' in early.lines[0]
    assert early.headers["x-gateway-backend"] == "first" and early.lines[-1] == "data: [DONE]"
    held = stack.stream("first_token", "local", "hi")
    assert held.status == 200 and held.text_at is not None
    assert held.head_at > 0.9  # held until the first token, with it
    assert held.first_at is not None and held.first_at > 0.9


def test_a_replica_that_breaks_after_its_first_event_is_left_invisibly_in_the_events(stack: Stack) -> None:
    stack.control(stack.a, break_after=0)  # A sends its role chunk, then drops the connection
    early = stack.stream("first_event", "local")
    assert early.status == 200 and early.lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in early.lines)
    assert sum('"role":"assistant"' in line for line in early.lines) == 1  # A's, with the head; B's dropped
    deltas = [orjson.loads(line[6:])["choices"][0]["delta"] for line in early.lines[:-1]]
    text = "".join(delta.get("content", "") for delta in deltas)
    assert text == "echo: one two"
    # the head went with A's first event and names it; the log row names what served and what failed
    assert early.headers["x-gateway-backend"] == "first" and "x-gateway-failover" not in early.headers
    row = stack.row("first_event", early.headers["x-request-id"])
    assert row["status"] == 200 and row["backend"] == "second" and row["attempts"] == 2
    assert row["failover"].startswith(f"local@{stack.a.base_url}=stream broke")
    held = stack.stream("first_token", "local")
    assert held.status == 200 and held.headers["x-gateway-backend"] == "second"
    assert held.headers["x-gateway-failover"] == "local=stream_broke"


def test_a_stream_taken_over_before_its_first_token_keeps_the_id_of_its_first_event(stack: Stack) -> None:
    # the client had A's role chunk (with the head); B's events carried B's id: one stream, two ids
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}]}
    for _ in range(3):  # A's request ids run ahead of B's
        httpx.post(f"{stack.a.base_url}/v1/chat/completions", json=chat).raise_for_status()
    stack.control(stack.a, break_after=0)
    early = stack.stream("first_event", "local")
    assert early.status == 200 and early.lines[-1] == "data: [DONE]"
    ids = [orjson.loads(line[6:])["id"] for line in early.lines[:-1]]
    assert len(ids) > 2 and len(set(ids)) == 1


@pytest.mark.parametrize("head", ["first_event", "first_token"])
def test_an_error_event_before_the_first_token_is_left_for_the_next(stack: Stack, head: str) -> None:
    # A sends its role chunk, then a server error event: a failure before the first token, not a
    # token (it used to commit the stream to A and end it with an error, the fallback never tried)
    stack.control(stack.a, break_after=0, break_mode="error_event")
    answer = stack.stream(head, "local")
    assert answer.status == 200 and answer.lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in answer.lines)
    assert sum('"role":"assistant"' in line for line in answer.lines) == 1
    row = stack.row(head, answer.headers["x-request-id"])
    assert row["status"] == 200 and row["backend"] == "second"
    assert row["failover"].startswith(f"local@{stack.a.base_url}=stream broke")


def test_a_request_error_before_the_first_token_is_the_clients_answer_not_a_failover(stack: Stack) -> None:
    stack.control(stack.a, break_after=0, break_mode="request_error")  # the request's own fault
    answer = stack.stream("first_event", "local")
    assert answer.status == 200 and _error(answer.lines[-1])["code"] == "invalid_json_schema"
    row = stack.row("first_event", answer.headers["x-request-id"])
    assert (row["status"], row["backend"], row["failover"]) == (400, "first", None)  # B never asked
    # held until the first token, the head has not gone: the client gets the error's own status
    # and a JSON body, as for a whole request (it was a 200 stream of one error event)
    held = stack.stream("first_token", "local")
    assert held.status == 400 and held.headers["content-type"] == "application/json"
    assert orjson.loads(held.lines[0])["error"]["code"] == "invalid_json_schema"
    assert held.headers["x-gateway-backend"] == "first"
    row = stack.row("first_token", held.headers["x-request-id"])
    assert (row["status"], row["backend"], row["failover"]) == (400, "first", None)


def test_every_candidate_breaking_after_its_first_event_ends_the_stream_with_an_error_event(
    stack: Stack,
) -> None:
    stack.control(stack.a, break_after=0)
    early = stack.stream("first_event", "solo")
    assert early.status == 200 and "data: [DONE]" not in early.lines
    # the role chunk went with the head; the error is the stream's next and last event
    assert len(early.lines) == 2 and '"role":"assistant"' in early.lines[0]
    error = _error(early.lines[1])
    assert error["type"] == "api_error" and error["code"] == "upstream_unavailable"
    assert stack.a.base_url not in error["message"] and "127.0.0.1" not in error["message"]
    row = stack.row("first_event", early.headers["x-request-id"])
    assert (row["status"], row["error_type"], row["backend"]) == (502, "upstream_unavailable", None)
    held = stack.stream("first_token", "solo")
    assert held.status == 502 and held.headers["content-type"] == "application/json"
    assert orjson.loads(held.lines[0])["error"]["code"] == "upstream_unavailable"


def test_a_client_that_leaves_after_the_head_before_the_first_token_is_logged_and_released(
    stack: Stack,
) -> None:
    stack.control(stack.a, chunk_delay_ms=3000)
    gateway, key, _ = stack.gateways["first_event"]
    before = httpx.get(f"{stack.a.base_url}/stats").json()["streams_cut_off"]
    body = {"model": "solo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    started = time.monotonic()
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=30) as r:  # fmt: skip
        assert r.status_code == 200 and time.monotonic() - started < 2
        request_id = r.headers["x-request-id"]
    row = stack.row("first_event", request_id)
    assert (row["status"], row["error_type"], row["backend"]) == (499, "client_disconnected", "first")
    deadline = time.monotonic() + 5
    while httpx.get(f"{stack.a.base_url}/stats").json()["streams_cut_off"] == before:  # A was let go
        assert time.monotonic() < deadline, "the upstream stream was not closed"
        time.sleep(0.05)
