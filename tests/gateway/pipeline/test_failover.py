"""Chaos: two engine replicas (fakes) and a fake hosted provider behind the gateway, under load.

Replicas are killed with SIGKILL (no goodbye) and restarted on the same port; the load keeps
going the whole time and every answer is recorded.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import read_log_rows, start_gateway

MASTER = "sk-master-chaos"
_BROKE = "upstream_stream_error"


def _fake(port: int | None = None) -> ManagedServer:
    return ManagedServer(
        lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60, port=port
    )


@dataclass
class Answer:
    at: float
    status: int
    backend: str
    failover: str


class Load:
    """`workers` clients sending non-streamed chat requests back to back, in a thread."""

    def __init__(self, url: str, key: str, workers: int = 4, body: dict[str, Any] | None = None) -> None:
        self.url, self.key, self.workers = url, key, workers
        self.body = body or {"model": "local", "messages": [{"role": "user", "content": "steady load"}]}
        self.answers: list[Answer] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        body = self.body
        headers = {"Authorization": f"Bearer {self.key}"}
        async with httpx.AsyncClient(timeout=30) as client:

            async def worker() -> None:
                while not self._stop.is_set():
                    try:
                        r = await client.post(self.url, json=body, headers=headers)
                        self.answers.append(Answer(time.monotonic(), r.status_code,
                                                   r.headers.get("x-gateway-backend", ""),
                                                   r.headers.get("x-gateway-failover", "")))  # fmt: skip
                        if r.status_code != 200:
                            self.errors.append(r.text)
                    except httpx.HTTPError as exc:
                        self.errors.append(repr(exc))

            await asyncio.gather(*(worker() for _ in range(self.workers)))

    def since(self, t: float) -> list[Answer]:
        return [a for a in self.answers if a.at >= t]


class Chaos:
    def __init__(self, root: Path, silence: float = 30.0) -> None:
        self.a, self.b, self.hosted = _fake(), _fake(), _fake()
        policy = root / "policy.yaml"
        policy.write_text(f"""
backends:
  pool:
    type: engine
    urls: ["{self.a.base_url}", "{self.b.base_url}"]
    timeouts: {{connect: 0.5, first_token: 1.5, total: 10, between_tokens: {silence}}}
  frontier: {{type: hosted, model: openai/fake-model, api_key_env: FAKE_PROVIDER_KEY,
             base_url: "{self.hosted.base_url}/v1"}}
models:
  local: {{backend: pool, model: fake-model, fallbacks: [hosted]}}
  hosted: {{backend: frontier}}
health:
  interval: 0.2
  timeout: 0.5
  breaker: {{consecutive_failures: 2, cooldown: 1}}
overrides:
  - {{team: eu, data_residency: self_hosted_only}}
""")  # fmt: skip
        self.database_url = f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        self.env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "chaos-secret",
                    "GATEWAY_DATABASE_URL": self.database_url, "FAKE_PROVIDER_KEY": "sk-fake"}  # fmt: skip
        try:  # a set-up that fails stops what it started
            self.gateway = start_gateway(policy, self.env)
            self.key = self.create_key(name="chaos")
        except BaseException:
            self.close()
            raise
        self.url = f"{self.gateway.base_url}/v1/chat/completions"

    def create_key(self, **body: Any) -> str:
        r = httpx.post(
            f"{self.gateway.base_url}/admin/keys", json=body, headers={"Authorization": f"Bearer {MASTER}"}
        )
        assert r.status_code == 201, f"creating a key: {r.status_code} {r.text}"
        return str(r.json()["key"])

    def requests_seen(self, server: ManagedServer) -> int:
        return int(httpx.get(f"{server.base_url}/stats").json()["requests"])

    def kill(self, server: ManagedServer) -> None:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()

    def close(self) -> None:
        gateway: ManagedServer | None = getattr(self, "gateway", None)  # None: it never started
        if gateway is not None:
            gateway.stop()
        for s in (self.a, self.b, self.hosted):
            if s.proc.poll() is None:
                s.stop()


@pytest.fixture
def chaos(tmp_path: Path) -> Iterator[Chaos]:
    c = Chaos(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_replicas_dying_and_returning_under_load_fail_no_request(chaos: Chaos) -> None:
    with Load(chaos.url, chaos.key) as load:
        time.sleep(1.0)
        assert chaos.requests_seen(chaos.a) > 0 and chaos.requests_seen(chaos.b) > 0  # both share the load

        killed_a = time.monotonic()
        chaos.kill(chaos.a)
        time.sleep(3.0)
        after = load.since(killed_a + 2.0)
        assert after and all(a.backend == "pool" for a in after)
        assert not any(chaos.a.base_url in a.failover for a in after), "traffic still tried the dead replica"

        killed_b = time.monotonic()
        chaos.kill(chaos.b)
        time.sleep(3.0)
        after = load.since(killed_b + 2.0)
        assert after and all(a.backend == "frontier" for a in after)

        restarted = time.monotonic()
        chaos.a = _fake(chaos.a.port)
        deadline = restarted + 8.0
        while not any(a.backend == "pool" for a in load.since(restarted)):
            assert time.monotonic() < deadline, "traffic did not return to the recovered replica"
            time.sleep(0.1)
    assert not load.errors, load.errors[:3]
    assert len(load.answers) > 50


def _stream(chaos: Chaos, body: dict[str, Any]) -> tuple[int, dict[str, str], list[str]]:
    headers = {"Authorization": f"Bearer {chaos.key}"}
    with httpx.stream("POST", chaos.url, json={**body, "stream": True}, headers=headers, timeout=30) as r:
        return r.status_code, dict(r.headers), [line for line in r.iter_lines() if line]


def test_a_stream_whose_replica_dies_before_the_first_byte_is_served_elsewhere(chaos: Chaos) -> None:
    chaos.kill(chaos.b)
    httpx.post(f"{chaos.a.base_url}/control", json={"latency_ms": 3000})
    body = {"model": "local", "messages": [{"role": "user", "content": "one two three"}]}
    result: dict[str, Any] = {}

    def run() -> None:
        result.update(zip(("status", "headers", "lines"), _stream(chaos, body), strict=True))

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.8)  # the request is waiting on replica a
    chaos.kill(chaos.a)
    thread.join(30)
    assert result["status"] == 200
    assert result["headers"]["x-gateway-backend"] == "frontier"
    assert result["headers"]["x-gateway-failover"].startswith("local=")
    assert chaos.a.base_url not in result["headers"]["x-gateway-failover"]  # replica URLs stay inside
    text = "".join(line for line in result["lines"] if "content" in line)
    assert "three" in text and result["lines"][-1] == "data: [DONE]"
    assert not any('"error"' in line for line in result["lines"])


def test_a_whole_answer_waiting_on_a_replica_gone_silent_is_tried_on_another(tmp_path: Path) -> None:
    """A frozen replica (SIGSTOP: its process alive, nothing answered) sends a whole answer never; a
    stream notices the silence, a whole answer sends nothing until it is done. Once the replica has
    failed its health checks for `between_tokens` s (2 here), what it has in flight is given up on
    as a timeout and tried on the other replica: the client waits that long, not `total` (10)."""
    chaos = Chaos(tmp_path, silence=2.0)
    stopped: ManagedServer | None = None
    try:
        for replica in (chaos.a, chaos.b):
            httpx.post(f"{replica.base_url}/control", json={"latency_ms": 60_000})
        body = {"model": "local", "messages": [{"role": "user", "content": "are you there"}]}
        headers = {"Authorization": f"Bearer {chaos.key}"}
        answer: dict[str, Any] = {}

        def ask() -> None:
            r = httpx.post(chaos.url, json=body, headers=headers, timeout=30)
            answer.update(status=r.status_code, headers=r.headers, at=time.monotonic())

        asking = threading.Thread(target=ask)
        started = time.monotonic()
        asking.start()
        deadline = started + 5
        arrived = lambda r: httpx.get(f"{r.base_url}/stats").json()["arrived"]  # noqa: E731
        while not (busy := [r for r in (chaos.a, chaos.b) if arrived(r)]):
            assert time.monotonic() < deadline, "the request reached no replica"
            time.sleep(0.05)
        stopped = busy[0]
        other = chaos.b if stopped is chaos.a else chaos.a
        httpx.post(f"{other.base_url}/control", json={"latency_ms": 0})
        stopped.proc.send_signal(signal.SIGSTOP)
        asking.join(30)
        assert answer["status"] == 200, answer
        assert (
            answer["headers"]["x-gateway-backend"] == "pool"
            and "=timeout" in answer["headers"]["x-gateway-failover"]
        )
        assert 2.0 < answer["at"] - started < 6.0  # the silence (2 s, checks every 0.2 s), not total (10 s)
        assert arrived(other) == 1 and chaos.requests_seen(other) == 1
    finally:
        if stopped is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        chaos.close()


def test_a_stalled_replica_is_left_before_the_first_token(chaos: Chaos) -> None:
    httpx.post(f"{chaos.a.base_url}/control", json={"latency_ms": 5000})
    httpx.post(f"{chaos.b.base_url}/control", json={"latency_ms": 5000})
    started = time.monotonic()
    status, headers, lines = _stream(
        chaos, {"model": "local", "messages": [{"role": "user", "content": "are you there"}]}
    )
    assert status == 200 and headers["x-gateway-backend"] == "frontier"
    assert headers["x-gateway-failover"].count("=timeout") == 2  # each replica gave up on once
    assert time.monotonic() - started < 4.5  # two first-token timeouts of 1.5 s, not two 5 s stalls
    assert lines[-1] == "data: [DONE]"


def test_a_replica_dying_mid_stream_ends_it_with_an_error_event_and_a_log_row(chaos: Chaos) -> None:
    chaos.kill(chaos.b)
    httpx.post(f"{chaos.a.base_url}/control", json={"chunk_delay_ms": 300})
    headers = {"Authorization": f"Bearer {chaos.key}"}
    body = {"model": "local", "stream": True,
            "messages": [{"role": "user", "content": " ".join(["word"] * 30)}]}  # fmt: skip
    seen: list[str] = []
    with httpx.stream("POST", chaos.url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                seen.append(line)
            if len([s for s in seen if "content" in s]) == 3:
                chaos.kill(chaos.a)
    assert '"error"' in seen[-1] and "upstream_stream_error" in seen[-1]
    assert not any(s == "data: [DONE]" for s in seen)
    deadline = time.monotonic() + 5
    while not (
        rows := [r for r in read_log_rows(chaos.database_url) if r["error_type"] == "upstream_stream_error"]
    ):
        assert time.monotonic() < deadline, "no log row for the broken stream"
        time.sleep(0.1)
    assert rows[0]["status"] == 502 and rows[0]["backend"] == "pool"


def test_self_hosted_only_requests_get_a_clear_503_and_never_reach_the_hosted_provider(chaos: Chaos) -> None:
    eu = chaos.create_key(name="eu", team="eu")
    body = {"model": "local", "messages": [{"role": "user", "content": "patient record"}]}
    ok = httpx.post(chaos.url, json=body, headers={"Authorization": f"Bearer {eu}"})
    assert ok.status_code == 200 and ok.headers["x-gateway-backend"] == "pool"
    chaos.kill(chaos.a)
    chaos.kill(chaos.b)
    hosted_before = chaos.requests_seen(chaos.hosted)
    for _ in range(5):  # first contact (connection refused) and after the checks marked the pool down
        r = httpx.post(chaos.url, json=body, headers={"Authorization": f"Bearer {eu}"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] in ("self_hosted_unavailable", "model_unavailable")
        assert "self-hosted" in r.json()["error"]["message"] or "self_hosted" in r.json()["error"]["message"]
        time.sleep(0.2)
    assert chaos.requests_seen(chaos.hosted) == hosted_before
    other = httpx.post(chaos.url, json=body, headers={"Authorization": f"Bearer {chaos.key}"})
    assert other.status_code == 200 and other.headers["x-gateway-backend"] == "frontier"
