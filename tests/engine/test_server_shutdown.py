"""SIGTERM drains the server: 503 for new work, requests in flight finish or are aborted, exit 0."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine.server_proc import ServerProcess


def _stream(client: openai.OpenAI, max_tokens: int, first: threading.Event, result: dict[str, Any]) -> None:
    try:
        text, finish = "", None
        for chunk in client.completions.create(
            model="default",
            prompt="Once upon a time",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            first.set()
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        result.update(text=text, finish=finish)
    except openai.APIError as exc:
        result.update(error=exc)
    finally:
        first.set()


@pytest.mark.slow
def test_sigterm_drains_finishes_short_requests_aborts_long_ones_and_exits_0(default_model_dir: Path) -> None:
    # 8 s: the short stream's 12 tokens finish in time even with the other test process busy
    server = ServerProcess("default", "--shutdown-timeout", "8", "--max-model-len", "1024")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    short: dict[str, Any] = {}
    long: dict[str, Any] = {}
    started = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_stream, args=(client, 12, started[0], short)),
        threading.Thread(target=_stream, args=(client, 600, started[1], long)),
    ]
    try:
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        server.signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        late = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10
        )
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_draining"
        for t in threads:
            t.join(60)
        assert short.get("finish") == "length" and short["text"]
        assert "error" in long and "shutting down" in str(long["error"])
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_a_second_signal_aborts_the_requests_in_flight_and_stops_the_engine_without_a_traceback(
    default_model_dir: Path,
) -> None:
    # was: the second signal set uvicorn's force_exit, which skips the app's shutdown: the engine
    # thread was never stopped, and asyncio.run's teardown cancelled the lifespan task, which
    # printed a CancelledError traceback (seen when `gateway dev` forwarded its second SIGTERM)
    server = ServerProcess("default", "--shutdown-timeout", "60", "--max-model-len", "1024")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    long: dict[str, Any] = {}
    started = threading.Event()
    stream = threading.Thread(target=_stream, args=(client, 900, started, long))
    try:
        stream.start()
        assert started.wait(60)
        server.signal(signal.SIGTERM)
        time.sleep(0.5)  # draining: the stream goes on, for up to the minute of grace
        assert stream.is_alive()
        server.signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0
        stream.join(20)
        assert "error" in long and "shutting down" in str(long["error"])
        out = server.output()
        assert "Traceback" not in out, out
        assert "Application shutdown complete" in out, out  # the lifespan's end ran: the engine stopped
    finally:
        server.stop()


@pytest.mark.slow
def test_two_signals_back_to_back_while_idle_exit_0_without_a_traceback(
    tiny_model_factory: Callable[..., Path],
) -> None:
    # the drain of an idle engine ends at once: the second signal lands in uvicorn's own shutdown
    server = ServerProcess(tiny_model_factory("llama"))
    try:
        for gap in (0.0, 0.05):
            server.signal(signal.SIGTERM)
            time.sleep(gap)
        assert server.proc.wait(20) == 0
        out = server.output()
        assert "Traceback" not in out, out
        assert "Application shutdown complete" in out, out
    finally:
        server.stop()
