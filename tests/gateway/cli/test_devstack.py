"""`python -m gateway dev` (what `make run` starts): engine and gateway up, a working key, clean stop.

The stack runs in its own session, so that whatever happens in a test, the `finally` can kill its
whole process group: no engine or gateway outlives a failed test.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.cli.dev import _stop_children, _StopSignals
from tests.engine.server_proc import free_port


@contextmanager
def _dev_stack(
    model: Path,
    data_dir: Path,
    port: int,
    engine_port: int,
    preexec: Callable[[], None] | None = None,
    **more_env: str,
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`gateway dev` started and past its banner: (the process, what it printed)."""
    env = dict(os.environ, GATEWAY_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", **more_env)
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


def _stuck_stream(port: int, key: str, model: str) -> socket.socket:
    """A streamed chat request whose answer (some hundred kilobytes: top logprobs on every token)
    is never read: the gateway keeps it in flight, blocked on the client, until it is cut off."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "max_tokens": 400, "logprobs": True, "top_logprobs": 20})  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    return sock


def test_a_second_sigterm_is_forwarded_so_the_gateway_cuts_its_requests_off_and_logs_them(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    # was: a second signal killed both children, and the gateway's row for the request was lost
    port, engine_port = free_port(), free_port()
    stack = _dev_stack(tiny_chat_model, tmp_path, port, engine_port, GATEWAY_SHUTDOWN_TIMEOUT="60")
    with stack as (proc, out):
        key = re.search(r"^\s+key\s+(sk-\S+)", out, re.M)
        assert key is not None, out
        stuck = _stuck_stream(port, key.group(1), tiny_chat_model.name)
        try:
            assert select.select([stuck], [], [], 30)[0], "the stream did not start"
            time.sleep(0.3)  # its answer fills the buffers on the way
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0  # not the minute of grace
        finally:
            stuck.close()
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert "Traceback" not in rest, rest
    _nothing_listens_on(port, engine_port)
    with sqlite3.connect(tmp_path / "gateway.db") as db:
        rows = db.execute("SELECT status, error_type FROM request_logs").fetchall()
    assert rows == [(503, "gateway_shutdown")], rest


# a child that prints each SIGTERM's number and exits at the `argv[1]`th
_CHILD = """import signal, sys, time
count = 0
def term(_signum, _frame):
    global count
    count += 1
    print(count, flush=True)
    if count >= int(sys.argv[1]):
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
print(0, flush=True)
while True:
    time.sleep(1)
"""


def _line(child: subprocess.Popen[str], timeout: float = 5) -> str | None:
    """The child's next line, or None when none comes within `timeout` seconds."""
    assert child.stdout is not None
    return child.stdout.readline() if select.select([child.stdout], [], [], timeout)[0] else None


@pytest.mark.parametrize("gateway_exits_at", [2, 99])
def test_a_second_stop_signal_sends_the_gateway_then_the_engine_a_second_sigterm_and_a_third_kills(
    gateway_exits_at: int,
) -> None:
    def child(exits_at: int) -> subprocess.Popen[str]:
        command = [sys.executable, "-c", _CHILD, str(exits_at)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, process_group=0)

    engine, gateway = child(99), child(gateway_exits_at)
    signals = _StopSignals()
    signals.received = 1  # the signal that stopped the stack
    stopper = threading.Thread(target=_stop_children, args=([engine, gateway], signals))
    try:
        assert (_line(engine), _line(gateway)) == ("0\n", "0\n")
        stopper.start()
        assert (_line(engine), _line(gateway)) == ("1\n", "1\n")
        signals.received += 1  # another Ctrl-C
        assert _line(gateway) == "2\n"
        if gateway_exits_at == 2:  # the gateway gone, the engine's turn
            assert gateway.wait(5) == 0
            assert _line(engine) == "2\n"
        else:  # not before
            assert _line(engine, 0.3) is None
        signals.received += 1  # a third
        stopper.join(5)
        assert not stopper.is_alive()
        assert engine.returncode == -signal.SIGKILL
    finally:
        _end((engine, gateway), stopper)


def _end(children: tuple[subprocess.Popen[str], ...], stopper: threading.Thread) -> None:
    """Whatever a test saw: its children's process groups killed and reaped, its stopper joined."""
    for p in children:
        with suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if stopper.is_alive():
        stopper.join(5)


def test_a_second_signal_that_came_before_the_children_were_stopped_still_hurries_the_gateway() -> None:
    # a second Ctrl-C while the first unwound the start-up (asyncio.run's clean-up of the dev key's
    # database, say) was taken for the first: the gateway got one SIGTERM, its whole grace period
    def child() -> subprocess.Popen[str]:
        command = [sys.executable, "-c", _CHILD, "2"]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, process_group=0)

    engine, gateway = child(), child()
    signals = _StopSignals()
    signals.received, signals.stopping = 2, True  # the signal that stopped the stack, and another
    stopper = threading.Thread(target=_stop_children, args=([engine, gateway], signals))
    try:
        assert (_line(engine), _line(gateway)) == ("0\n", "0\n")
        stopper.start()
        assert (_line(gateway), _line(gateway)) == ("1\n", "2\n")
        assert gateway.wait(5) == 0
        assert _line(engine) == "1\n" and _line(engine) == "2\n"  # then the engine's turn
        stopper.join(5)
        assert not stopper.is_alive()
    finally:
        signals.received += 2  # a stopper still waiting kills them
        _end((engine, gateway), stopper)


def test_a_port_in_use_stops_dev_at_once_with_one_line_and_no_engine(tmp_path: Path) -> None:
    """A server answering /health on the engine's port was taken for the engine (its models served
    as ours), and ours died on "address in use"; dev then exited 1 without a word."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        engine_port = taken.getsockname()[1]
        env = {**os.environ, "GATEWAY_DATA_DIR": str(tmp_path)}
        command = [sys.executable, "-m", "gateway", "dev", "--port", str(free_port()),
                   "--engine-port", str(engine_port)]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: port {engine_port} on 127.0.0.1 is in use"), done.stderr
    assert "Traceback" not in done.stderr and "starting the engine" not in done.stdout
