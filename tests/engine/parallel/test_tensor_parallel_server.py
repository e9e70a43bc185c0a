"""The HTTP server with tensor_parallel_size=2 through the official openai client, and what a killed
worker rank does to it: /health turns 503 and the server exits non-zero within a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import openai

from tests.engine.server_proc import ServerProcess


def _spawned_children(pid: int) -> list[int]:
    """Worker processes (multiprocessing spawn) of `pid`, found through /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                found.append(int(child))
    return found


def test_a_tensor_parallel_server_answers_then_dies_cleanly_when_a_worker_is_killed(
    tiny_chat_model: Path,
) -> None:
    server = ServerProcess(tiny_chat_model, "--tensor-parallel-size", "2", "--kv-cache-memory", str(16 << 20))
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model=str(tiny_chat_model), messages=[{"role": "user", "content": "hello"}], max_tokens=8,
            temperature=0,
        )  # fmt: skip
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        (worker,) = _spawned_children(server.proc.pid)
        signal_time = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        deadline = signal_time + 30
        saw_503 = False
        while server.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                saw_503 = saw_503 or httpx.get(f"{server.base_url}/health", timeout=2).status_code == 503
            time.sleep(0.1)
        code = server.proc.wait(max(1.0, deadline - time.monotonic()))
        assert code != 0 and saw_503
    finally:
        server.stop()
