"""The gateway's HTTP surface limits on `python -m gateway serve`: bodies, headers, slow clients,
connections, /metrics, and the error format of every refusal (raw sockets: the client misbehaves)."""

from __future__ import annotations

import gzip
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.api.errors import install_error_handlers
from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import start_gateway

MASTER = "sk-master-limits"
METRICS_TOKEN = "metrics-limits-token"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
LIMITS = {
    "GATEWAY_MAX_BODY_BYTES": "65536",
    "GATEWAY_MAX_ADMIN_BODY_BYTES": "4096",
    "GATEWAY_MAX_HEADER_BYTES": "8192",
    "GATEWAY_HEADER_TIMEOUT": "1",
    "GATEWAY_BODY_TIMEOUT": "1",
    "GATEWAY_LIMIT_CONCURRENCY": "6",
}
MIB = 1 << 20


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """A gateway with small limits, its policy's engine absent (no test here reaches an upstream)."""
    root = tmp_path_factory.mktemp("limits")
    env = {
        "GATEWAY_MASTER_KEY": MASTER,
        "GATEWAY_KEY_SECRET": "limits-secret",
        "GATEWAY_METRICS_TOKEN": METRICS_TOKEN,
        "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'gateway.db'}",
        **LIMITS,
    }
    server = start_gateway(Path("policies/default.yaml"), env)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def key(gateway: ManagedServer) -> str:
    r = httpx.post(f"{gateway.base_url}/admin/keys", json={"name": "limits"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def connect(server: ManagedServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response read from `sock` (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body[:length]


def exchange(server: ManagedServer, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw request on a new connection, and its response (read_response); the socket is closed."""
    sock = connect(server)
    try:
        sock.sendall(request)
        return read_response(sock)
    finally:
        sock.close()


def openai_error(body: bytes) -> dict[str, Any]:
    """The `error` object, checked to have OpenAI's four fields."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def rss_mib(server: ManagedServer) -> float:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def send_until_refused(sock: socket.socket, total: int) -> int:
    """Send up to `total` body bytes; returns how many went out before the server closed on us."""
    sock.settimeout(5)
    chunk, sent = b"x" * MIB, 0
    try:
        while sent < total:
            sent += sock.send(chunk)
    except OSError:  # reset or broken pipe: the server closed without reading the rest
        pass
    return sent


@pytest.mark.parametrize(
    ("authorization", "status"), [(None, 401), ("Bearer sk-wrong", 403)], ids=["no key", "wrong key"]
)
def test_an_unauthenticated_128_mib_admin_body_is_refused_before_the_server_reads_it(
    gateway: ManagedServer, authorization: str | None, status: int
) -> None:
    before = rss_mib(gateway)
    sock = connect(gateway)
    try:
        auth = f"Authorization: {authorization}\r\n" if authorization else ""
        sock.sendall(
            f"POST /admin/keys HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {128 * MIB}\r\n\r\n".encode()
        )
        # the answer comes before any of the body was sent: the key is checked from the headers
        answered, headers, body = read_response(sock)
        assert answered == status
        assert openai_error(body)["type"] in ("authentication_error", "permission_error")
        assert headers.get("connection") == "close"
        sent = send_until_refused(sock, 128 * MIB)
    finally:
        sock.close()
    assert sent < 32 * MIB, f"the server read {sent} bytes of a body it refused"
    assert rss_mib(gateway) - before < 32


def test_the_master_key_is_checked_before_a_small_admin_body_arrives(gateway: ManagedServer) -> None:
    sock = connect(gateway)
    try:
        sock.sendall(b"POST /admin/keys HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        status, headers, body = read_response(sock)  # no body sent at all
    finally:
        sock.close()
    assert status == 401
    assert openai_error(body)["code"] == "missing_api_key"
    assert "connection" not in headers  # within the limit: the body is read and dropped, no reset


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_admin_body_over_its_limit_is_413_even_with_the_master_key(
    gateway: ManagedServer, chunked: bool
) -> None:
    big = json.dumps({"name": "x", "metadata": {"pad": "y" * 8000}}).encode()
    if chunked:  # no length to judge by: the bytes are counted as they stream in
        r = httpx.post(
            f"{gateway.base_url}/admin/keys", content=iter([big[:3000], big[3000:]]), headers=ADMIN
        )
    else:
        r = httpx.post(f"{gateway.base_url}/admin/keys", content=big, headers=ADMIN)
    assert r.status_code == 413
    assert openai_error(r.content)["code"] == "body_too_large"
    ok = httpx.post(f"{gateway.base_url}/admin/keys", json={"name": "small"}, headers=ADMIN)
    assert ok.status_code == 201


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_completion_body_over_its_limit_is_413(gateway: ManagedServer, key: str, chunked: bool) -> None:
    big = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "z" * 70000}]}).encode()
    content: Any = iter([big[:40000], big[40000:]]) if chunked else big
    r = httpx.post(
        f"{gateway.base_url}/v1/chat/completions", content=content, headers={"Authorization": f"Bearer {key}"}
    )
    assert r.status_code == 413
    assert openai_error(r.content)["code"] == "body_too_large"


def test_headers_over_the_limit_are_refused_with_431_whether_sent_at_once_or_bit_by_bit(
    gateway: ManagedServer,
) -> None:
    padding = "a" * 9000
    r = httpx.get(f"{gateway.base_url}/health", headers={"X-Padding": padding})
    assert r.status_code == 431
    assert openai_error(r.content)["code"] == "headers_too_large"
    sock = connect(gateway)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sent = 0
        while not select.select([sock], [], [], 0.02)[0]:  # a header that never ends, 1 KiB at a time
            sent += sock.send(b"X-Slow: " + b"b" * 1024)
            assert sent < 64 << 10, "still reading headers well past the limit"
        status, _, _ = read_response(sock)
    finally:
        sock.close()
    assert status == 431


def test_a_client_still_sending_its_body_after_refused_headers_reads_the_431_not_a_reset(
    gateway: ManagedServer,
) -> None:
    # Closing with the body still arriving reset the connection, and the reset could destroy the
    # 431 in the client's kernel before it was read (seen in the fuzz run).
    for _ in range(5):
        sock = connect(gateway)
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Long: " + b"v" * 60_000
                         + b"\r\nContent-Length: %d\r\n\r\n" % MIB)  # fmt: skip
            assert send_until_refused(sock, MIB) == MIB  # the server reads and drops it
            status, headers, body = read_response(sock)
        finally:
            sock.close()
        assert status == 431 and headers["connection"] == "close"
        assert openai_error(body)["code"] == "headers_too_large"


@pytest.mark.parametrize(
    ("path", "auth", "status"),
    [("/v1/chat/completions", True, 413), ("/v1/chat/completions", False, 401), ("/admin/keys", False, 401)],
    ids=["completion over its limit", "completion without a key", "admin without the master key"],
)
def test_a_client_that_sends_its_whole_body_before_reading_reads_the_refusal_not_a_reset(
    gateway: ManagedServer, key: str, path: str, auth: bool, status: int
) -> None:
    # Refused from its headers alone, a request's body was never read; closing with it unread reset
    # the connection, and the reset destroyed the answer before a client like this one read it.
    authorization = f"Authorization: Bearer {key}\r\n" if auth else ""
    for _ in range(5):
        sock = connect(gateway)
        try:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\n{authorization}Content-Type: application/json\r\n"
                f"Content-Length: {2 * MIB}\r\n\r\n".encode()
            )
            assert send_until_refused(sock, 2 * MIB) == 2 * MIB  # read and dropped, not reset
            answered, headers, body = read_response(sock)
        finally:
            sock.close()
        assert answered == status and headers["connection"] == "close"
        assert openai_error(body)["type"] in ("invalid_request_error", "authentication_error")


def test_headers_under_the_limit_with_a_body_in_the_same_packet_are_served(gateway: ManagedServer) -> None:
    """The header count stops at the end of the headers: a body sent along is never counted."""
    body = json.dumps({"name": "packed", "metadata": {"pad": "p" * 3000}}).encode()
    sock = connect(gateway)
    try:
        head = (
            f"POST /admin/keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {MASTER}\r\n"
            f"Content-Type: application/json\r\nX-Pad: {'h' * 6000}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        for _ in range(3):  # keep-alive: each next request's headers are counted from zero
            sock.sendall(head.encode() + body)
            status, _, answer = read_response(sock)
            assert status == 201, answer
    finally:
        sock.close()


@pytest.mark.parametrize("kept_alive", [False, True], ids=["first request", "after a request"])
def test_a_client_that_never_finishes_its_headers_is_cut_off_after_the_header_timeout(
    gateway: ManagedServer, kept_alive: bool
) -> None:
    sock = connect(gateway)
    try:
        if kept_alive:  # the timer starts with the next request's first bytes, not with the connection
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock)[0] == 200
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(10)
        for _ in range(4):  # a byte now and then: each send would reset a mere idle timer
            time.sleep(0.3)
            sock.sendall(b"X")
        status, _, body = read_response(sock)
        assert status == 408
        assert openai_error(body)["code"] == "headers_timeout"
        assert time.monotonic() - started < 5
        assert sock.recv(1) == b""  # closed
    finally:
        sock.close()


@pytest.mark.parametrize(
    "head",
    [
        b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab",  # no key needed
        b"POST /nope HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer KEY\r\n"
        b"Content-Length: 100\r\n\r\n{",
    ],
    ids=["admin route", "chunked unknown route", "completion"],
)
def test_a_body_that_never_ends_is_cut_off_after_the_body_timeout(
    gateway: ManagedServer, key: str, head: bytes
) -> None:
    sock = connect(gateway)
    try:
        started = time.monotonic()
        sock.sendall(head.replace(b"KEY", key.encode()))
        status, _, body = read_response(sock)
        assert status == 408 and openai_error(body)["code"] == "request_timeout"
        assert time.monotonic() - started < 5
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed: the slot is free again
    finally:
        sock.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(gateway: ManagedServer) -> None:
    sock = connect(gateway)
    try:
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed without a word
        assert time.monotonic() - started < 5
    finally:
        sock.close()


def test_past_the_concurrency_limit_the_answer_is_503_in_openai_format(gateway: ManagedServer) -> None:
    idle = [connect(gateway) for _ in range(int(LIMITS["GATEWAY_LIMIT_CONCURRENCY"]))]
    try:
        time.sleep(0.2)  # the server has accepted them all
        r = httpx.get(f"{gateway.base_url}/health")
        assert r.status_code == 503
        assert openai_error(r.content)["code"] == "server_overloaded"
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{gateway.base_url}/health").status_code != 200:  # and serves again once they leave
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_metrics_need_the_metrics_token_or_the_master_key(gateway: ManagedServer) -> None:
    url = f"{gateway.base_url}/metrics"
    anonymous = httpx.get(url)
    assert anonymous.status_code == 401
    assert openai_error(anonymous.content)["type"] == "authentication_error"
    assert httpx.get(url, headers={"Authorization": "Bearer sk-not-it"}).status_code == 403
    for secret in (METRICS_TOKEN, MASTER):
        r = httpx.get(url, headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 200
        assert "gateway_requests_total" in r.text or "# HELP" in r.text
    # the metrics token opens nothing else
    assert (
        httpx.get(
            f"{gateway.base_url}/admin/keys", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        ).status_code
        == 403
    )


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\x00b\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3(\r\n\r\n", 401),
        (b"GET /admin/keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3(\r\n\r\n", 403),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n", 403),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xc3\r\n"
            b"Content-Length: 2\r\n\r\n{}",
            401,
        ),
        (b"POST /admin/keys HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
        (
            b"POST /admin/keys HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Authorization: Bearer " + MASTER.encode() + b"\r\n\r\nzz\r\n",
            400,
        ),
        (b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Nul: a\x00b\r\n\r\n", 400),
    ],
    ids=[
        "nul in authorization",
        "invalid utf-8 key",
        "invalid utf-8 master key",
        "invalid utf-8 metrics",
        "invalid utf-8 completion key",
        "bad content-length",
        "bad chunk",
        "invalid utf-8 path",
        "nul in a header",
    ],
)
def test_malformed_requests_are_refused_in_openai_format_never_500(
    gateway: ManagedServer, request_bytes: bytes, status: int
) -> None:
    answered, _, body = exchange(gateway, request_bytes)
    assert answered == status
    openai_error(body)


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/no/such/path", None, 404),
        ("GET", "/admin/no-such-route", None, 404),
        ("POST", "/health", None, 405),
        ("DELETE", "/v1/models", None, 405),
        ("PUT", "/admin/keys", None, 405),
        ("POST", "/admin/keys", b"{not json", 400),
        ("POST", "/admin/keys", b"[1, 2]", 400),
        ("POST", "/admin/keys", b'{"name": "\xff\xfe"}', 400),
        ("POST", "/admin/keys", b"[" * 3000 + b"]" * 1000, 400),
        ("PATCH", "/admin/keys/nope", b'{"name": 3}', 400),
        ("GET", "/admin/reports/spend?from=x&to=y", None, 400),
        ("GET", "/admin/keys?include_revoked=maybe", None, 400),
    ],
)
def test_framework_errors_are_openai_format(
    gateway: ManagedServer, method: str, path: str, body: bytes | None, status: int
) -> None:
    headers = {**ADMIN, "content-type": "application/json"}
    r = httpx.request(method, f"{gateway.base_url}{path}", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert openai_error(r.content)["type"] == "invalid_request_error"


def test_an_unexpected_route_error_is_an_openai_format_500() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    assert openai_error(r.content) == {
        "message": "The gateway failed to handle the request", "type": "api_error", "param": None,
        "code": "internal_error",
    }  # fmt: skip


def test_pipelined_requests_get_whole_answers_in_order(gateway: ManagedServer) -> None:
    # Writes leave at the end of a loop turn (one send per turn): answers to requests pipelined on
    # one connection must still leave whole and in order.
    sock = connect(gateway)
    try:
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # 401: no key
        last = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        sock.sendall(health + models + health + last)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    answers = [b"HTTP/1.1 " + part for part in data.split(b"HTTP/1.1 ")[1:]]
    assert [a[9:12] for a in answers] == [b"200", b"401", b"200", b"200"], data
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(next(v for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
                          if k.lower() == b"content-length"))  # fmt: skip
        assert len(body) == length, answer
        json.loads(body)


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /health HTTP/1.1\r\nHost: evil.example/x@y\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /health HTTP/1.1\r\nHost: a b\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            501,
            "unsupported_transfer_encoding",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            b"Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            400,  # chunked not last: no framing at all (llhttp's own refusal)
            "invalid_http_request",
        ),
        (  # the completion route read the last, the others the first: one key for a proxy, another here
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n"
            b"Authorization: Bearer b\r\n\r\n",
            400,
            "invalid_http_request",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n"
            b"authorization: Bearer b\r\nContent-Length: 2\r\n\r\n{}",
            400,
            "invalid_http_request",
        ),
    ],
    ids=[
        "no host",
        "two hosts",
        "host with a path",
        "host with a space",
        "http/2.0 line",
        "gzip, chunked",
        "chunked then gzip",
        "two authorizations",
        "two authorizations on a completion",
    ],
)
def test_request_heads_rfc_9112_refuses_are_refused_before_the_app(
    gateway: ManagedServer, request_bytes: bytes, status: int, code: str
) -> None:
    answered, headers, body = exchange(gateway, request_bytes)
    assert answered == status, body
    assert openai_error(body)["code"] == code and headers["connection"] == "close"


def test_sound_request_heads_are_served(gateway: ManagedServer) -> None:
    """HTTP/1.0 needs no Host; an IPv6 literal with a port, and a lone chunked, are hosts and codings."""
    chunked = b"GET /health HTTP/1.1\r\nHost: gw.example.com\r\nTransfer-Encoding: Chunked\r\n\r\n0\r\n\r\n"
    for head in (
        b"GET /health HTTP/1.0\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: [::1]:8000\r\n\r\n",
        chunked,
    ):
        answered, _, body = exchange(gateway, head)
        assert answered == 200, (head, body)


@pytest.mark.parametrize(
    ("path", "coding"),
    [("/v1/chat/completions", b"gzip"), ("/v1/completions", b"deflate"), ("/admin/keys", b"br"),
     ("/v1/chat/completions", b"identity, gzip")],
)  # fmt: skip
def test_a_content_coded_body_is_refused_with_415_unread_not_parsed_as_json(
    gateway: ManagedServer, key: str, path: str, coding: bytes
) -> None:
    """A gzip bomb (64 KiB that inflate to 64 MiB) is neither inflated nor taken for a body of
    invalid UTF-8 (a misleading 400); a plain body that says it is gzip is not served as if not."""
    bomb = gzip.compress(b'{"model": "x", "prompt": "' + b"a" * (64 * MIB) + b'"}')
    authorization = MASTER if path.startswith("/admin") else key
    for body in (bomb, b'{"name": "plain"}'):
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {authorization}\r\n"
                f"Content-Length: {len(body)}\r\nContent-Encoding: ").encode()  # fmt: skip
        answered, headers, answer = exchange(gateway, head + coding + b"\r\n\r\n" + body)
        assert answered == 415, answer
        assert openai_error(answer)["code"] == "unsupported_content_encoding"
        assert headers["accept-encoding"] == "identity" and headers["connection"] == "close"
    r = httpx.post(f"{gateway.base_url}/admin/keys", json={"name": "identity"},
                   headers={**ADMIN, "content-encoding": "identity"})  # fmt: skip
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    "broken",
    [
        b"\x00\x00\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    ],
    ids=["not a request", "two lengths", "two hosts"],
)
def test_requests_before_a_malformed_one_are_answered_first_then_the_400_and_the_close(
    gateway: ManagedServer, key: str, broken: bytes
) -> None:
    sock = connect(gateway)
    try:
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        payload = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
        completion = (  # answered after the routing: takes a while
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
        )  # fmt: skip
        sock.sendall(health + completion + broken)
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):  # until the close (the answers may come in one read)
            data += chunk
    finally:
        sock.close()
    statuses = [int(part[:3]) for part in data.split(b"HTTP/1.1 ")[1:]]
    assert len(statuses) == 3 and statuses[0] == 200 and statuses[1] != 400 and statuses[2] == 400, data
    assert "write_eof" not in gateway.output(), "a write after the close"


def _requests_with_status(gateway: ManagedServer, status: int) -> float:
    r = httpx.get(f"{gateway.base_url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    lines = [ln for ln in r.text.splitlines() if ln.startswith("gateway_requests_total{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if f'status="{status}"' in ln)


def test_a_body_whose_chunking_breaks_is_counted_as_the_400_the_client_got_not_a_499(
    gateway: ManagedServer, key: str
) -> None:
    before = {s: _requests_with_status(gateway, s) for s in (400, 499)}
    sock = connect(gateway)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
            + b"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n"
        )  # fmt: skip
        time.sleep(0.2)  # the key is checked and the body read has begun
        sock.sendall(b"zz\r\nnot a chunk\r\n")
        status, _, body = read_response(sock)
    finally:
        sock.close()
    assert status == 400 and openai_error(body)["code"] == "invalid_http_request"
    deadline = time.monotonic() + 5
    while _requests_with_status(gateway, 400) == before[400]:
        assert time.monotonic() < deadline, "the refused request was not counted as a 400"
        time.sleep(0.1)
    assert _requests_with_status(gateway, 499) == before[499]
