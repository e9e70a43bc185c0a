"""A stopping gateway (SIGTERM) gives requests in flight GATEWAY_SHUTDOWN_TIMEOUT seconds, then
cuts them off: each is logged once as 503 `gateway_shutdown` and told so if it still reads, and the
process exits. A stream to a client that stopped reading used to keep it running for good."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import httpx
import orjson
import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import create_key_cli, read_log_rows, start_gateway

_BODY = b'{"model":"fast","messages":[{"role":"user","content":"hi"}],"stream":true}'


@pytest.fixture
def upstream() -> Iterator[ManagedServer]:
    # a stream that would last half a minute: one word a millisecond, 20,000 of them
    fake = ManagedServer(lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port),
                                       "--gap-ms", "1", "--tokens", "20000"])  # fmt: skip
    try:
        yield fake
    finally:
        fake.stop()


def _stuck_reader(port: int, key: str) -> socket.socket:
    """A client that sends a streamed request and never reads its answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(_BODY)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + _BODY)
    return sock


Stopped = tuple[float, str, list[str], list[BaseException], str]


def _stopped(
    upstream: ManagedServer, tmp_path: Path, grace: int, signals: int, workers: int = 1,
    group: signal.Signals | None = None,
) -> Stopped:  # fmt: skip
    """A gateway (of `workers` processes) with a stuck reader's stream and a reading client's under
    way, sent SIGTERM (`group`: its process group sent that signal, as a terminal's Ctrl-C does
    SIGINT, or systemd's stop SIGTERM) `signals` times half a second apart: (seconds from the first
    signal to its exit, its output, the reading client's lines, what that client raised, the
    database url)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    policy = tmp_path / "policy.yaml"
    policy.write_text(f'backends:\n  fast: {{type: engine, urls: ["{upstream.base_url}"]}}\n'
                      "models:\n  fast: {backend: fast}\n")  # fmt: skip
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": url,
           "GATEWAY_SHUTDOWN_TIMEOUT": str(grace)}  # fmt: skip
    gateway = start_gateway(policy, env, "--workers", str(workers), process_group=True)
    stuck: socket.socket | None = None
    lines: list[str] = []
    failures: list[BaseException] = []
    try:
        key = create_key_cli(env, "shutdown")
        stuck = _stuck_reader(gateway.port, key)

        def read() -> None:  # a client that reads to the end
            try:
                with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", content=_BODY,
                                  headers={"authorization": f"Bearer {key}"}, timeout=30) as r:  # fmt: skip
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
            except BaseException as exc:
                failures.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while len(lines) < 10 and not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) >= 10, failures  # both streams are under way
        stopped = time.monotonic()
        for i in range(signals):
            if i:
                time.sleep(0.5)
            if group is not None:
                os.killpg(gateway.proc.pid, group)
            else:
                gateway.signal(signal.SIGTERM)
        assert gateway.proc.wait(20) == 0
        took = time.monotonic() - stopped
        reader.join(10)
        output = gateway.output()
    finally:
        if stuck is not None:
            stuck.close()
        with suppress(subprocess.TimeoutExpired):
            gateway.stop(5)
        with suppress(ProcessLookupError):  # its workers too, whatever happened
            os.killpg(gateway.proc.pid, signal.SIGKILL)
    return took, output, lines, failures, url


def _cut_off_and_logged(output: str, lines: list[str], failures: list[BaseException], url: str) -> None:
    assert "Traceback" not in output and "Exception in ASGI application" not in output
    # the reading client saw the stream end with the error, not a cut connection
    assert failures == []
    last = orjson.loads(lines[-1].removeprefix("data: "))
    assert last["error"]["code"] == "gateway_shutdown" and last["error"]["type"] == "api_error"
    rows = read_log_rows(url)
    assert len(rows) == 2
    assert {(r["status"], r["error_type"]) for r in rows} == {(503, "gateway_shutdown")}
    assert all(r["completion_tokens"] > 0 for r in rows)  # what they were sent is counted


def test_requests_still_in_flight_at_the_grace_periods_end_are_cut_off_logged_and_told(
    upstream: ManagedServer, tmp_path: Path
) -> None:
    took, output, lines, failures, url = _stopped(upstream, tmp_path, grace=2, signals=1)
    assert 2 <= took < 10  # the grace period, then the cut-off and the log's flush
    _cut_off_and_logged(output, lines, failures, url)


def test_a_second_signal_ends_the_grace_period_at_once_and_still_logs_every_request(
    upstream: ManagedServer, tmp_path: Path
) -> None:
    # uvicorn's own second signal exits without the app's shutdown: no row for either request
    took, output, lines, failures, url = _stopped(upstream, tmp_path, grace=60, signals=2)
    assert took < 8  # not the minute of grace
    _cut_off_and_logged(output, lines, failures, url)


def test_a_second_signal_to_a_gateway_of_several_workers_ends_every_workers_grace_period_and_logs(
    upstream: ManagedServer, tmp_path: Path
) -> None:
    # uvicorn's supervisor sent its workers one SIGTERM and waited out their grace period; its
    # workers, plain uvicorn servers, were forced out without the app's shutdown by a second
    took, output, lines, failures, url = _stopped(upstream, tmp_path, grace=60, signals=2, workers=2)
    assert took < 8
    _cut_off_and_logged(output, lines, failures, url)


@pytest.mark.parametrize("group", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
@pytest.mark.parametrize(("signals", "grace"), [(1, 2), (2, 60)])
def test_a_signal_to_the_whole_group_gives_several_workers_their_grace_period_and_a_second_ends_it(
    upstream: ManagedServer, tmp_path: Path, group: signal.Signals, signals: int, grace: int
) -> None:
    # Ctrl-C at a terminal, systemd's stop (KillMode=control-group, its default) and dumb-init signal
    # every process of the group: each worker gets that signal and the supervisor's SIGTERM, which,
    # counted as two, ended the grace period at once; uvicorn's own workers were forced out,
    # unlogged, by a second Ctrl-C
    took, output, lines, failures, url = _stopped(upstream, tmp_path, grace, signals, workers=2, group=group)
    assert grace <= took < 10 if signals == 1 else took < 8
    _cut_off_and_logged(output, lines, failures, url)


def test_a_cut_off_while_the_upstream_s_body_ends_after_done_adds_nothing_after_the_done(
    tmp_path: Path,
) -> None:
    # the relay reads what an upstream sends after [DONE] for a second; a shutdown's cut-off in that
    # second used to add a `gateway_shutdown` error event after the client's [DONE]
    hostile = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/hostile_upstream.py", "--port", str(port)]
    )
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f'backends:\n  h: {{type: engine, urls: ["{hostile.base_url}"]}}\nmodels:\n  fast: {{backend: h}}\n'
    )
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": url,
           "GATEWAY_SHUTDOWN_TIMEOUT": "30"}  # fmt: skip
    gateway = start_gateway(policy, env, process_group=True)
    lines: list[str] = []
    try:
        key = create_key_cli(env, "after-done")
        body = {
            "model": "fast",
            "stream": True,
            "messages": [{"role": "user", "content": "mode=stall_after_done"}],
        }
        with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body,
                          headers={"authorization": f"Bearer {key}"}, timeout=30) as r:  # fmt: skip
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line == "data: [DONE]":  # the gateway now drains the upstream: stop it twice
                    gateway.signal(signal.SIGTERM)
                    time.sleep(0.1)
                    gateway.signal(signal.SIGTERM)
        assert gateway.proc.wait(20) == 0
        output = gateway.output()
    finally:
        with suppress(subprocess.TimeoutExpired):
            gateway.stop(5)
        with suppress(ProcessLookupError):
            os.killpg(gateway.proc.pid, signal.SIGKILL)
        hostile.stop()
    assert "Traceback" not in output
    assert lines[-1] == "data: [DONE]", lines[-3:]
    rows = read_log_rows(url)
    assert [(r["status"], r["error_type"]) for r in rows] == [(200, None)]
