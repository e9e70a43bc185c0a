"""Stream resumption with real engines: two engine servers on a tiny model behind the gateway, the
one serving a stream killed (SIGKILL) before its first token, after one token, mid-answer and just
before the end. The client's text equals an uninterrupted run's (greedy and seeded), an unseeded
answer still comes whole, usage has the true totals, and the log has one row with the resumption."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.engine.server_proc import ServerProcess
from tests.gateway.processes import create_key_cli, read_log_rows, start_gateway

MAX_TOKENS = 16
STEP_DELAY = 0.08  # a tiny model at a big one's pace: a stream lasts long enough to be cut


class Pool:
    def __init__(self, model: Path, root: Path) -> None:
        self.model = model
        self.engines = [self._engine(), self._engine()]
        policy = root / "policy.yaml"
        urls = ", ".join(f'"{e.base_url}"' for e in self.engines)
        policy.write_text(f"""
backends:
  pool:
    type: engine
    urls: [{urls}]
    timeouts: {{connect: 1, first_token: 30, total: 60, between_tokens: 10}}
models:
  tiny: {{backend: pool, model: {model.name}}}
health: {{interval: 0.2, timeout: 1, breaker: {{consecutive_failures: 50, cooldown: 0.2}}}}
""")  # fmt: skip
        self.database_url = f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        env = {"GATEWAY_MASTER_KEY": "m-resume", "GATEWAY_KEY_SECRET": "s-resume",
               "GATEWAY_DATABASE_URL": self.database_url}  # fmt: skip
        self.gateway = start_gateway(policy, env)
        self.key = create_key_cli(env, "resume")

    def _engine(self, port: int | None = None) -> ServerProcess:
        engine = ServerProcess(self.model, "--kv-cache-memory", str(32 << 20), "--no-access-log",
                               hooks=True, port=port)  # fmt: skip
        self.delay(engine, STEP_DELAY)
        return engine

    @staticmethod
    def delay(engine: ServerProcess, seconds: float) -> None:
        httpx.post(f"{engine.base_url}/debug/step-delay", json={"seconds": seconds}).raise_for_status()

    def serving(self) -> ServerProcess:
        """The engine with a request in it (waiting or running)."""
        deadline = time.monotonic() + 10
        while True:
            for engine in self.engines:
                if httpx.get(f"{engine.base_url}/debug/in-flight").json()["in_flight"]:
                    return engine
            assert time.monotonic() < deadline, "no engine got the request"
            time.sleep(0.01)

    def kill(self, engine: ServerProcess) -> None:
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait()

    def revive(self) -> None:
        """Every killed engine started again where it was, and back in the gateway's pool."""
        for i, engine in enumerate(self.engines):
            if engine.proc.poll() is not None:
                engine.log.close()
                self.engines[i] = self._engine(engine.port)
        time.sleep(0.6)  # a few health checks: the gateway sees them up

    def stream(
        self, path: str, body: dict[str, Any], kill_after: int | None
    ) -> tuple[dict[str, str], list[str]]:
        """The stream's lines; the engine serving it is killed after `kill_after` content chunks."""
        seen, killed = 0, kill_after is None
        lines: list[str] = []
        with httpx.stream("POST", f"{self.gateway.base_url}{path}", json={**body, "stream": True},
                          headers={"Authorization": f"Bearer {self.key}"}, timeout=60) as r:  # fmt: skip
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if line.startswith("data: {") and _text([orjson.loads(line[6:])]):
                    seen += 1
                if not killed and seen == kill_after:
                    self.kill(self.serving())
                    killed = True
            return dict(r.headers), lines

    def close(self) -> None:
        self.gateway.stop()
        for engine in self.engines:
            if engine.proc.poll() is None:
                engine.stop()


@pytest.fixture(scope="module")
def pool(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    p = Pool(tiny_chat_model, tmp_path_factory.mktemp("resume-e2e"))
    try:
        yield p
    finally:
        p.close()


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        str(c.get("text") or (c.get("delta") or {}).get("content") or "")
        for ch in chunks
        for c in ch["choices"]
    )


CHAT = ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Tell a story"}]})
TEXT = ("/v1/completions", {"model": "tiny", "prompt": "Once upon a time"})
COMMON = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    ("endpoint", "sampling", "kill_after"),
    [
        (CHAT, {"temperature": 0}, 1),
        (CHAT, {"temperature": 1.0, "seed": 42}, MAX_TOKENS // 2),
        (CHAT, {"temperature": 1.0}, MAX_TOKENS // 2),  # unseeded: a valid answer, whole
        (TEXT, {"temperature": 0}, MAX_TOKENS - 3),  # just before the end (its last tokens in flight)
        (TEXT, {"temperature": 1.0, "seed": 7}, 3),
    ],
    ids=["chat-greedy-1", "chat-seeded-mid", "chat-unseeded-mid", "text-greedy-end", "text-seeded-3"],
)
def test_killing_the_serving_engine_mid_stream_leaves_the_answer_whole(
    pool: Pool, endpoint: tuple[str, dict[str, Any]], sampling: dict[str, Any], kill_after: int
) -> None:
    pool.revive()
    path, base = endpoint
    body = {**base, **COMMON, **sampling}
    _, uncut = pool.stream(path, body, None)
    headers, lines = pool.stream(path, body, kill_after)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    if "seed" in sampling or sampling["temperature"] == 0:
        assert _text(chunks) == _text([orjson.loads(line[6:]) for line in uncut[:-1]])
    assert len({c["id"] for c in chunks}) == 1
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["completion_tokens"] == MAX_TOKENS
    rows = _row(pool, headers["x-request-id"])
    assert rows["status"] == 200 and rows["resumptions"] == 1 and rows["completion_tokens"] == MAX_TOKENS


def test_an_engine_killed_before_the_first_token_is_left_for_the_other(pool: Pool) -> None:
    pool.revive()
    for engine in pool.engines:
        pool.delay(engine, 1.0)  # the prefill step takes a second: time to kill its engine
    path, base = CHAT
    body = {**base, **COMMON, "temperature": 0}
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(out=pool.stream(path, body, None)))
    thread.start()
    serving = pool.serving()
    pool.kill(serving)
    for engine in pool.engines:
        if engine is not serving:
            pool.delay(engine, STEP_DELAY)
    thread.join(60)
    headers, lines = result["out"]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    row = _row(pool, headers["x-request-id"])
    # left before its first token: failover (the engine died before or after it sent its headers)
    assert (
        row["status"] == 200 and row["resumptions"] == 0 and f"{serving.base_url}=" in (row["failover"] or "")
    )


def _row(pool: Pool, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while not (rows := [r for r in read_log_rows(pool.database_url) if r["id"] == request_id]):
        assert time.monotonic() < deadline, "no log row"
        time.sleep(0.1)
    assert len(rows) == 1
    return rows[0]
