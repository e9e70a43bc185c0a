"""`python -m gateway dev` (what `make run` starts): engine and gateway up, a working key, clean stop.

The stack runs in its own session, so that whatever happens in a test, the `finally` can kill its
whole process group: no engine or gateway outlives a failed test.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

from tests.engine.server_proc import free_port


@contextmanager
def _dev_stack(
    model: Path, data_dir: Path, port: int, engine_port: int, preexec: Callable[[], None] | None = None
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`gateway dev` started and past its banner: (the process, what it printed)."""
    env = dict(os.environ, GATEWAY_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    for name in ("GATEWAY_MASTER_KEY", "GATEWAY_KEY_SECRET", "GATEWAY_DATABASE_URL"):
        env.pop(name, None)
    # the engine option as make run gives it
    cmd = [sys.executable, "-m", "gateway", "dev", "--model", str(model), "--port", str(port),
           "--engine-port", str(engine_port), "--engine-option=--no-batch-invariant"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=preexec,
    )  # fmt: skip
    try:
        out = ""
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while "Ctrl-C stops both." not in out:
            assert time.monotonic() < deadline and proc.poll() is None, out
            out += proc.stdout.readline()
        yield proc, out
    finally:
        _kill_session(proc.pid)  # the stack and its children (each in a group of its own), stopped or not
        proc.wait(10)


def _kill_session(sid: int) -> None:
    listed = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout
    for pid in [int(p) for p in listed.split()]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _nothing_listens_on(*ports: int) -> None:
    for p in ports:
        try:
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=2)
            raise AssertionError(f"something still listens on {p}")
        except httpx.TransportError:
            pass


def _chat(port: int, key: str, model: str, **fields: Any) -> httpx.Response:
    """One chat completion through the dev stack's gateway."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip


def test_dev_stack_serves_through_the_gateway_and_stops_on_sigint(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    port, engine_port = free_port(), free_port()
    with _dev_stack(tiny_chat_model, tmp_path, port, engine_port) as (proc, out):
        key = re.search(r"^\s+key\s+(sk-\S+)", out, re.M)
        example = re.search(r'"model": "([^"]+)"', out)  # the model the printed examples use
        assert key is not None and example is not None, out
        session = subprocess.run(["pgrep", "-a", "-s", str(proc.pid)], capture_output=True, text=True).stdout
        assert any(" engine serve " in p and p.endswith("--no-batch-invariant") for p in session.splitlines())
        for model in {tiny_chat_model.name, example.group(1)}:
            r = _chat(port, key.group(1), model, max_tokens=3)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    _nothing_listens_on(port, engine_port)


def test_dev_stack_started_with_sigint_ignored_still_stops_both_on_sigint(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    port, engine_port = free_port(), free_port()

    def ignore_sigint() -> None:  # what a background job, `nohup` or a CI runner does
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with _dev_stack(tiny_chat_model, tmp_path, port, engine_port, ignore_sigint) as (proc, _):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        _nothing_listens_on(port, engine_port)


def test_ctrl_c_at_the_terminal_stops_both_gracefully_and_keeps_every_request_log_row(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    port, engine_port = free_port(), free_port()
    with _dev_stack(tiny_chat_model, tmp_path, port, engine_port) as (proc, out):
        key = re.search(r"^\s+key\s+(sk-\S+)", out, re.M)
        assert key is not None, out
        for _ in range(3):  # answered, their rows still queued (written every 0.5 s) at the Ctrl-C
            r = _chat(port, key.group(1), "no-such-model")
            assert r.status_code == 404, r.text
        os.killpg(proc.pid, signal.SIGINT)  # a terminal signals its whole foreground process group
        assert proc.wait(60) == 0
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert "Traceback" not in rest, rest  # was: a second signal (SIGINT, then ours) forced both out
    _nothing_listens_on(port, engine_port)
    with sqlite3.connect(tmp_path / "gateway.db") as db:
        assert db.execute("SELECT count(*) FROM request_logs").fetchone() == (3,)
