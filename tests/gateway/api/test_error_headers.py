"""Every error answer of the gateway says `X-Content-Type-Options: nosniff`, whoever builds it: the
HTTP layer's refusals, the ASGI guards, the completion endpoint, FastAPI's handlers, the pipeline and
an upstream's error passed on (a live gateway in front of tests/fakes/hostile_upstream.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.fuzz.stack import MASTER, HostileStack

ADMIN = {"Authorization": f"Bearer {MASTER}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    s = HostileStack(tmp_path_factory.mktemp("nosniff"))
    try:
        yield s
    finally:
        s.close()


def _raw(stack: HostileStack, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw request on a new connection: (status, headers, body) of its answer."""
    with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers.get("content-length", "0")):
            chunk = sock.recv(65536)
            assert chunk, body
            body += chunk
    return int(lines[0].split()[1]), headers, body


def _chat(stack: HostileStack, content: str, key: str | None = None) -> httpx.Response:
    body = {"model": "eng", "messages": [{"role": "user", "content": content}], "max_tokens": 5}
    headers = {"Authorization": f"Bearer {key or stack.key}"}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


# (method, path, body, who: "key", "master" or None for no key, status)
PLAIN_CASES = {
    "404 unknown route": ("GET", "/no/such/path", None, None, 404),
    "405 fastapi route": ("DELETE", "/v1/models", None, "key", 405),
    "405 completion endpoint": ("GET", "/v1/chat/completions", None, None, 405),
    "401 completion without key": ("POST", "/v1/chat/completions", b"{}", None, 401),
    "401 models without key": ("GET", "/v1/models", None, None, 401),
    "403 admin with a virtual key": ("GET", "/admin/keys", None, "key", 403),
    "404 admin unknown key": ("GET", "/admin/keys/nope", None, "master", 404),
    "400 admin invalid body": ("POST", "/admin/keys", b"{no", "master", 400),
    "413 admin body": ("POST", "/admin/keys", b" " * (128 << 10), "master", 413),
    "404 unknown model": ("POST", "/v1/chat/completions", b'{"model": "nope", "messages": []}', "key", 404),
}
UPSTREAM_CASES = {  # the hostile upstream's misbehaviour, as the engine backend `eng`
    "429 upstream's, passed on": ("mode=rate_limited:3", 429),
    "400 upstream's, passed on": ("mode=error_leak:400", 400),
    "502 upstream's 500, replaced": ("mode=status:500", 502),
}


@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_every_error_answer_says_nosniff(stack: HostileStack, case: str) -> None:
    method, path, body, who, status = PLAIN_CASES[case]
    headers = {"content-type": "application/json"}
    if who is not None:
        headers["authorization"] = f"Bearer {MASTER if who == 'master' else stack.key}"
    r = httpx.request(method, f"{stack.url}{path}", content=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert "error" in orjson.loads(r.content)
    assert r.headers.get("x-content-type-options") == "nosniff", r.headers


@pytest.mark.parametrize("case", list(UPSTREAM_CASES))
def test_an_upstreams_error_passed_on_says_nosniff(stack: HostileStack, case: str) -> None:
    mode, status = UPSTREAM_CASES[case]
    r = _chat(stack, mode)
    assert r.status_code == status, r.text
    assert "error" in orjson.loads(r.content)
    assert r.headers.get("x-content-type-options") == "nosniff", r.headers


def test_a_rate_limited_key_is_told_so_with_nosniff(stack: HostileStack) -> None:
    key = stack.create_key(name="one-a-minute", rpm_limit=1)
    assert _chat(stack, "mode=ok", key).status_code == 200
    r = _chat(stack, "mode=ok", key)
    assert r.status_code == 429 and r.headers.get("x-content-type-options") == "nosniff", r.headers


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (64 << 10) + b"\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n", 400),
        (b"POST /admin/keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + MASTER.encode()
         + b"\r\nContent-Length: 2\r\nContent-Encoding: gzip\r\n\r\n{}", 415),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer KEY\r\n"
         b"Content-Length: 99999999\r\n\r\n", 413),
    ],
    ids=["431 headers", "400 bad framing", "415 content coding", "413 completion body"],
)  # fmt: skip
def test_every_refusal_of_the_http_layer_says_nosniff(
    stack: HostileStack, request_bytes: bytes, status: int
) -> None:
    answered, headers, body = _raw(stack, request_bytes.replace(b"KEY", stack.key.encode()))
    assert answered == status, body
    assert "error" in orjson.loads(body)
    assert headers.get("x-content-type-options") == "nosniff", headers


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("DELETE", "/v1/models", "GET"), ("GET", "/v1/chat/completions", "POST"), ("POST", "/health", "GET")],
)
def test_a_405_names_the_methods_the_route_takes(
    stack: HostileStack, method: str, path: str, allow: str
) -> None:
    """RFC 9110 asks a 405 for its Allow header, FastAPI's routes' as the completion endpoint's."""
    headers = {"authorization": f"Bearer {stack.key}"}
    r = httpx.request(method, f"{stack.url}{path}", headers=headers, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"]
    assert r.headers.get("allow") == allow, r.headers
