"""A streamed answer to a client that stops reading: `python -m gateway serve` waits for it (its
socket's buffer full, the relay's writes wait: api/http_protocol.py `body_part`) and, once the
client reads again, the whole stream arrives in order, nothing lost or repeated."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import create_key_cli, start_gateway

WORDS = 40_000  # ~7 MB of events: more than loopback's socket buffers hold


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedServer, str]]:
    root: Path = tmp_path_factory.mktemp("backpressure")
    servers: list[ManagedServer] = []
    try:
        upstream = ManagedServer(
            lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port),
                          "--gap-ms", "0.001", "--tokens", str(WORDS)]
        )  # fmt: skip
        servers.append(upstream)
        policy = root / "policy.yaml"
        policy.write_text(f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"]}}\n'
                          "models:\n  fast: {backend: fake}\n")  # fmt: skip
        env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s",
               "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'g.db'}"}  # fmt: skip
        servers.append(start_gateway(policy, env))
        yield servers[-1], create_key_cli(env, "backpressure")
    finally:
        for server in reversed(servers):
            server.stop()


def test_a_client_that_stops_reading_gets_the_whole_stream_when_it_reads_again(
    stack: tuple[ManagedServer, str],
) -> None:
    gateway, key = stack
    body = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n{body}"
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # a small window: it fills
        sock.sendall(request.encode())
        time.sleep(3)  # the upstream sends it all meanwhile; the gateway's writes to us wait
        received = bytearray()
        while chunk := sock.recv(1 << 20):
            received += chunk
    head, _, chunked = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in head.lower()
    words = []
    for line in _dechunked(chunked).split(b"\n"):
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:])["choices"]
            words += [c["delta"].get("content") for c in choices if c["delta"].get("content")]
    assert words == [f" w{i}" for i in range(WORDS)]
    assert _dechunked(chunked).rstrip().endswith(b"data: [DONE]")


def _dechunked(data: bytes) -> bytes:
    """A chunked body's payload (checks its framing on the way: a bad size line fails the test)."""
    out, at = bytearray(), 0
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        assert data[end + 2 + size : end + 4 + size] == b"\r\n"
        at = end + 4 + size
