"""Connections a client holds or leaves on `python -m gateway serve`: a request answered before its
body was in (401 from the headers) cannot keep its connection for good; trailer fields are no
headers; a pipelined request whose client leaves is cancelled and logged 499 (raw sockets)."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.api.test_http_limits import openai_error, read_response
from tests.gateway.processes import create_key_cli, read_log_rows, start_gateway

MASTER = "sk-master-connections"
GAP_MS, TOKENS = 50, 100  # a 5 s stream


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedServer, str, str]]:
    """(the gateway, a key, its database's URL) in front of a slow fake stream."""
    root: Path = tmp_path_factory.mktemp("connections")
    servers: list[ManagedServer] = []
    try:
        upstream = ManagedServer(
            lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port),
                          "--gap-ms", str(GAP_MS), "--tokens", str(TOKENS)]
        )  # fmt: skip
        servers.append(upstream)
        policy = root / "policy.yaml"
        policy.write_text(f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"]}}\n'
                          "models:\n  fast: {backend: fake}\n")  # fmt: skip
        database = f"sqlite+aiosqlite:///{root / 'g.db'}"
        env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": database,
               "GATEWAY_KEEP_ALIVE_TIMEOUT": "1", "GATEWAY_HEADER_TIMEOUT": "1", "GATEWAY_BODY_TIMEOUT": "1",
               "GATEWAY_MAX_HEADER_BYTES": "8192"}  # fmt: skip
        servers.append(start_gateway(policy, env))
        yield servers[-1], create_key_cli(env, "connections"), database
    finally:
        for server in reversed(servers):
            server.stop()


def _connect(server: ManagedServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (what it sends meanwhile is read and dropped)."""
    started = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit} s")
    except ConnectionResetError:
        pass
    return time.monotonic() - started


UNAUTHENTICATED = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"


def test_a_connection_answered_before_its_body_came_is_closed_once_idle(
    stack: tuple[ManagedServer, str, str],
) -> None:
    """The 401 went out, the body came after it: the connection stayed open for good (20 such
    sockets took every slot of the concurrency limit)."""
    gateway, _, _ = stack
    with _connect(gateway) as sock:
        sock.sendall(UNAUTHENTICATED)
        assert read_response(sock)[0] == 401
        time.sleep(0.2)
        sock.sendall(b"0123456789")
        assert _closed_after(sock, 5) < 3  # the keep-alive timeout (1 s), not never


def test_a_body_that_drips_after_its_answer_is_cut_off_after_the_body_timeout(
    stack: tuple[ManagedServer, str, str],
) -> None:
    gateway, _, _ = stack
    with _connect(gateway) as sock:
        sock.sendall(UNAUTHENTICATED)
        assert read_response(sock)[0] == 401
        started = time.monotonic()
        sock.settimeout(0.3)
        closed = False
        for _ in range(20):  # a byte every 0.3 s: each one cancelled the idle timer
            try:
                sock.sendall(b"x")
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - started < 3


def test_a_key_sent_as_a_trailer_field_is_no_authorization(stack: tuple[ManagedServer, str, str]) -> None:
    gateway, _, _ = stack
    with _connect(gateway) as sock:
        sock.sendall(b"GET /admin/keys HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"0\r\nAuthorization: Bearer " + MASTER.encode() + b"\r\n\r\n")  # fmt: skip
        status, _, body = read_response(sock)
    assert status == 401 and openai_error(body)["code"] == "missing_api_key"


def test_many_small_headers_count_their_separators_toward_the_limit(
    stack: tuple[ManagedServer, str, str],
) -> None:
    """2,000 `a:b` fields are 10 KiB on the wire: past the 8 KiB limit (counted as 6 KB before)."""
    gateway, _, _ = stack
    with _connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a:b\r\n" * 2000 + b"\r\n")
        status, _, body = read_response(sock)
    assert status == 431 and openai_error(body)["code"] == "headers_too_large"


def test_a_broken_chunk_after_an_early_refusal_is_one_400_and_no_server_error(
    stack: tuple[ManagedServer, str, str],
) -> None:
    gateway, _, _ = stack
    with _connect(gateway) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
        )
        status, _, body = read_response(sock)
        assert status == 400 and openai_error(body)["code"] == "invalid_http_request"
        assert _closed_after(sock, 5) < 3
    time.sleep(0.3)
    assert "Exception in ASGI application" not in Path(gateway.log.name).read_text()


def test_a_pipelined_request_whose_client_leaves_is_cancelled_and_logged_499(
    stack: tuple[ManagedServer, str, str],
) -> None:
    """uvicorn marks only the newest request of a connection disconnected: the one being answered
    ran its whole 5 s upstream stream and was billed as a 200."""
    gateway, key, database = stack
    body = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    one = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
           f"content-length: {len(body)}\r\n\r\n{body}").encode()  # fmt: skip
    before = len(read_log_rows(database))
    with _connect(gateway) as sock:
        sock.sendall(one + one)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the first stream has begun
        time.sleep(0.3)
    deadline = time.monotonic() + TOKENS * GAP_MS / 1000
    rows = read_log_rows(database)[before:]
    while not rows and time.monotonic() < deadline:
        time.sleep(0.1)
        rows = read_log_rows(database)[before:]
    assert [row["status"] for row in rows] == [499], rows


@pytest.mark.parametrize(
    ("line", "status"), [(b"GET /health HTTP/1.2", 505), (b"GET /health HTTP/1.1 x", 400)]
)
def test_a_version_llhttp_does_not_know_is_505_like_the_others(
    stack: tuple[ManagedServer, str, str], line: bytes, status: int
) -> None:
    """HTTP/2.0 was a 505 (refused after parsing), HTTP/1.2 a 400 (llhttp refuses it first)."""
    gateway, _, _ = stack
    with _connect(gateway) as sock:
        sock.sendall(line + b"\r\nHost: x\r\n\r\n")
        answered, _, body = read_response(sock)
    assert answered == status, body


def test_a_request_in_the_read_that_ends_an_answered_body_is_not_cut_off_by_the_idle_timer(
    stack: tuple[ManagedServer, str, str],
) -> None:
    """The idle timer armed when the 401's body ended closed the stream that came with it (1 s in)."""
    gateway, key, _ = stack
    body = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    stream = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
              f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}").encode()  # fmt: skip
    with _connect(gateway) as sock:
        sock.sendall(UNAUTHENTICATED)
        assert read_response(sock)[0] == 401
        sock.sendall(b"0123456789" + stream)
        received = b""
        sock.settimeout(TOKENS * GAP_MS / 1000 + 10)
        while chunk := sock.recv(65536):
            received += chunk
    assert b"data: [DONE]" in received, received[-200:]


def test_a_pipelined_request_whose_body_is_slow_gets_its_408(stack: tuple[ManagedServer, str, str]) -> None:
    """The timer for an answered request's body was armed for the next one's, and closed it silently."""
    gateway, key, _ = stack
    slow = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Length: 100\r\n\r\n{").encode()  # fmt: skip
    with _connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + slow)
        assert read_response(sock)[0] == 200
        status, _, body = read_response(sock)  # (the rest never comes)
    assert status == 408 and openai_error(body)["code"] == "request_timeout", body
