"""The engine server as a hostile client meets it: body and header limits, slow clients, request caps,
huge prompts, failing steps and disconnects at every phase (a live subprocess)."""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.server_proc import ServerProcess, free_port

BODY_LIMIT = 4 << 20


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tiny_chat_model,
        "--kv-cache-memory",
        str(64 << 20),
        "--no-access-log",
        "--max-body-bytes",
        str(BODY_LIMIT),
        "--max-header-bytes",
        "8192",
        "--header-read-timeout",
        "1",
        "--body-read-timeout",
        "1",
        "--max-prompts",
        "4",
        "--max-n",
        "4",
        "--max-choices",
        "8",
        "--max-stop-strings",
        "3",
        "--max-stop-string-len",
        "10",
        "--max-logprobs",
        "5",
        hooks=True,
    )
    try:
        yield proc
    finally:
        proc.stop()


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def _clean_log(server: ServerProcess, since: int) -> None:
    out = server.output()[since:]
    for bad in ("Traceback", "InvalidStateError", "Exception in ASGI", "ERROR"):
        assert bad not in out, out[-3000:]


def _reply(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Read one HTTP response with a Content-Length as (status, JSON body); an error says nosniff."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert status < 400 or b"\r\nx-content-type-options: nosniff\r\n" in head.lower() + b"\r\n", head
    return status, json.loads(body)


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


@pytest.mark.parametrize(
    "route", ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "POST /debug/stall"]
)
def test_a_declared_body_over_the_limit_is_413_before_a_byte_is_read(
    server: ServerProcess, route: str
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        # no body follows: the answer cannot depend on reading it
        sock.sendall(f"{route} HTTP/1.1\r\nHost: x\r\nContent-Length: {BODY_LIMIT + 1}\r\n\r\n".encode())
        status, body = _reply(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert body["error"]["type"] == "invalid_request_error"


def test_a_chunked_body_is_counted_and_refused_at_the_limit(server: ServerProcess) -> None:
    chunk = b" " * (64 << 10)
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < 4 * BODY_LIMIT and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, body = _reply(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert BODY_LIMIT <= sent < 4 * BODY_LIMIT  # answered before the whole body (socket buffers aside)


def test_headers_over_the_limit_are_431_in_openai_format(server: ServerProcess) -> None:
    r = httpx.get(f"{server.base_url}/health", headers={"x-padding": "a" * 10_000})
    assert r.status_code == 431 and _error(r)["code"] == "request_header_fields_too_large"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid_http"),
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "invalid_http"),
        (b"GET /health HTTP/1.1\r\nHost: evil.example/x@y\r\n\r\n", 400, "invalid_http"),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
        (b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            400,
            "invalid_http",
        ),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            b"2\r\n{}\r\n0\r\n\r\n",
            501,
            "invalid_http",
        ),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: 2\r\n\r\n{}",
            415,
            "unsupported_content_encoding",
        ),
    ],
    ids=[
        "no host",
        "two hosts",
        "host with a path",
        "http/2.0",
        "http/1.2",
        "length and chunked",
        "gzip, chunked",
        "gzip body",
    ],
)
def test_request_heads_that_frame_ambiguously_are_refused_and_closed(
    server: ServerProcess, head: bytes, status: int, code: str
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        answered, body = _reply(sock)
        assert sock.recv(1024) == b""  # closed after the refusal
    assert answered == status and body["error"]["code"] == code, body
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_an_absolute_target_is_served_and_a_trailing_slash_is_a_404_not_a_redirect(
    server: ServerProcess,
) -> None:
    """RFC 9112 3.2.2: a server accepts an absolute-form target (it was a 404); a trailing slash
    was a 307 to a Location built from the client's Host header."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET http://x/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _reply(sock)[0] == 200
    slashed = httpx.post(
        f"{server.base_url}/v1/completions/", json={"prompt": "hi"}, headers={"Host": "evil.example"}
    )
    assert slashed.status_code == 404 and "location" not in slashed.headers
    assert set(slashed.json()["error"]) == {"message", "type", "param", "code"}


def test_a_request_head_sent_too_slowly_is_cut_off(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert 0.5 < time.monotonic() - start < 4
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        start = time.monotonic()
        assert sock.recv(1024) == b""  # a connection that sends nothing is closed too
        assert time.monotonic() - start < 4


def test_a_body_sent_too_slowly_is_408(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        status, body = _reply(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("completions", {"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
        ("completions", {"prompt": "a", "n": 5}, "n"),
        ("completions", {"prompt": ["a", "b", "c"], "n": 3}, "n"),
        ("completions", {"prompt": "a", "stop": ["1", "2", "3", "4"]}, "stop"),
        ("completions", {"prompt": "a", "stop": "x" * 11}, "stop"),
        ("completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 5}, "n"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop": ["1"] * 4}, "stop"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 6},
            "top_logprobs",
        ),
    ],
)
def test_requests_over_a_cap_are_400_naming_the_parameter(
    server: ServerProcess, route: str, fields: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{server.base_url}/v1/{route}", json={"max_tokens": 2, **fields}, timeout=30)
    assert r.status_code == 400
    err = _error(r)
    assert err["param"] == param and err["code"] == "limit_exceeded" and "at most" in err["message"]


def test_requests_at_the_caps_are_served(server: ServerProcess) -> None:
    body = {"prompt": ["a", "b"], "n": 4, "stop": ["1", "2", "x" * 10], "logprobs": 5, "max_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_completions_without_max_tokens_stop_at_16_tokens(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "go", "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_a_huge_prompt_is_rejected_without_stalling_other_streams(server: ServerProcess) -> None:
    gaps: list[tuple[float, float]] = []  # (previous event, this event) of the streams meanwhile
    done, streaming = threading.Event(), threading.Event()

    def stream_meanwhile() -> None:
        body = {"prompt": "count", "max_tokens": 100, "ignore_eos": True, "stream": True}
        last = None  # across streams too: the wait for the next stream's first event is a gap as well
        while not done.is_set():
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if not line:
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append((last, now))
                        streaming.set()
                    last = now

    streamer = threading.Thread(target=stream_meanwhile)
    streamer.start()
    try:
        assert streaming.wait(30), "the stream beside the huge prompt never started"  # a loaded CI
        huge = "lorem ipsum dolor sit amet, consectetur " * 90_000  # 3.6 MB: ~3 s to tokenize whole
        start = time.monotonic()
        r = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": huge, "max_tokens": 1}, timeout=60
        )
        took = time.monotonic() - start
    finally:
        done.set()
        streamer.join(60)
    assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"
    during = [b - a for a, b in gaps if b > start and a < start + took]  # gaps overlapping the huge one
    assert during, "no stream ran while the huge prompt was handled"
    # before: one gap as long as tokenizing all of it (~3 s here); the bound leaves room for a busy CI
    assert max(during) < 1.5 and took < 1.5, (max(during), took)


def test_a_failed_step_answers_generic_errors_and_the_server_goes_on(server: ServerProcess) -> None:
    url = server.base_url
    httpx.post(f"{url}/debug/fail-steps", json={"steps": 1}).raise_for_status()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=30)
    assert r.status_code == 500
    err = _error(r)
    assert err["code"] == "engine_error" and "hook" not in err["message"]
    httpx.post(f"{url}/debug/fail-steps", json={"steps": 1}).raise_for_status()
    body = {"prompt": "a", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as s:
        events = [line for line in s.iter_lines() if line]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == "engine_error"
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and httpx.get(f"{url}/health").status_code == 200


def _idle(server: ServerProcess) -> None:
    deadline = time.monotonic() + 5
    while True:
        m = server.metrics()
        if m["engine:num_requests_running"] == 0 and m["engine:kv_cache_usage_perc"] == 0.0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


@pytest.mark.parametrize("phase", ["queued_stream", "queued_whole", "mid_stream", "at_finish"])
def test_a_client_leaving_at_any_phase_aborts_cleanly(server: ServerProcess, phase: str) -> None:
    url = server.base_url
    log_start = len(server.output())
    body = {"prompt": "leave", "max_tokens": 200, "ignore_eos": True, "stream": True}
    if phase.startswith("queued"):
        # the client leaves while its request waits for the (stalled) step loop to admit it
        httpx.post(f"{url}/debug/stall", json={"seconds": 1.0}).raise_for_status()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/completions", json={**body, "stream": phase == "queued_stream"}, timeout=0.4
            )
        time.sleep(0.8)
    else:
        body = {**body, "max_tokens": 20} if phase == "at_finish" else body
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as s:
            for n, line in enumerate(s.iter_lines()):
                if phase == "mid_stream" and n >= 5:
                    break
                if phase == "at_finish" and '"finish_reason":"length"' in line:
                    break  # leave before [DONE]
    _idle(server)
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    _clean_log(server, log_start)


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [
        ("client-42.a:b_c", True),
        ("x" * 128, True),
        ("x" * 129, False),  # too long
        ("a b", False),  # not a plain token
        ("<script>", False),
        (None, False),
    ],
)
def test_every_answer_has_a_request_id_echoing_only_a_plain_one_from_the_client(
    server: ServerProcess, sent: str | None, echoed: bool
) -> None:
    headers = {} if sent is None else {"x-request-id": sent}
    body = {"prompt": "a", "max_tokens": 1}
    answers = [
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30),
        httpx.get(f"{server.base_url}/health", headers=headers),
        httpx.post(f"{server.base_url}/v1/completions", json={"prompt": 5}, headers=headers, timeout=30),
        httpx.post(  # refused by the body limit before any route
            f"{server.base_url}/v1/completions",
            content=b"x" * (BODY_LIMIT + 1),
            headers={**headers, "content-type": "application/json"},
            timeout=30,
        ),
    ]
    assert [r.status_code for r in answers] == [200, 200, 400, 413]
    for r in answers:
        assert r.headers.get_list("x-request-id") == [r.headers["x-request-id"]]  # exactly one
        if echoed:
            assert r.headers["x-request-id"] == sent
        else:
            assert re.fullmatch(r"req-[0-9a-f]{32}", r.headers["x-request-id"])
    if not echoed:
        assert len({r.headers["x-request-id"] for r in answers}) == len(answers)  # one per request


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.2)  # the server closed the evicted ones long before
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_the_server_exits_non_zero_when_the_engine_cannot_go_on(tiny_chat_model: Path) -> None:
    proc = ServerProcess(
        tiny_chat_model,
        "--kv-cache-memory",
        str(16 << 20),
        "--max-consecutive-step-failures",
        "1",
        "--limit-concurrency",
        "3",
        hooks=True,
    )
    try:
        url = proc.base_url
        # --limit-concurrency 3: three requests in progress, the fourth is 503 in OpenAI's format;
        # /health and /metrics still answer (a liveness probe must not restart a busy engine)
        httpx.post(f"{url}/debug/stall", json={"seconds": 2}).raise_for_status()
        body = {"prompt": "a", "max_tokens": 2}
        with ThreadPoolExecutor(3) as pool:
            waiting = [
                pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30) for _ in range(3)
            ]
            time.sleep(0.5)
            refused = httpx.get(f"{url}/v1/models", timeout=5)
            assert refused.status_code == 503 and _error(refused)["code"] == "server_overloaded"
            assert refused.headers["retry-after"] == "1"  # the official SDKs wait that long, then retry
            assert refused.headers["x-request-id"].startswith("req-")
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
            assert [f.result().status_code for f in waiting] == [200, 200, 200]
        # connections: at most twice the limit; idle ones (15 sockets that never send a byte, as
        # an attacker's) make room for new ones, the longest idle closed first
        held = [socket.create_connection(("127.0.0.1", proc.port)) for _ in range(15)]
        try:
            time.sleep(0.2)
            for _ in range(3):
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200
            # at most 6 open at once: 9 closed as they came, one more for the first probe
            assert sum(_closed_by_server(sock) for sock in held) >= 15 - 6 + 1
        finally:
            for sock in held:
                sock.close()
        httpx.post(f"{url}/debug/fail-steps", json={"steps": 1}).raise_for_status()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=30)
        assert r.status_code == 503 and _error(r)["code"] == "engine_dead" and "hook" not in r.text
        assert proc.proc.wait(30) == 3
        assert "the engine cannot serve any more" in proc.output()
    finally:
        if proc.proc.poll() is None:
            proc.stop()


@pytest.mark.parametrize("reads", [False, True])
def test_a_client_that_stops_taking_an_answer_is_cut_off_and_a_slow_one_is_not(reads: bool) -> None:
    """A client that keeps its connection open but reads nothing held its response (and its request
    slot) forever; one that reads slowly, but reads, gets the whole answer."""
    from uvicorn import Config, Server

    from engine.http.h11_protocol import limited_h11_protocol

    total = 8 << 20  # more than the socket buffers on both sides hold
    ended: list[float] = []  # when the app's last send returned

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        piece = b"x" * (1 << 20)
        for _ in range(total // len(piece)):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        ended.append(time.monotonic())

    port = free_port()
    config = Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                    http=limited_h11_protocol(10.0, None, send_timeout=0.5))  # fmt: skip
    server = Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            start, got = time.monotonic(), 0
            sock.settimeout(5)
            if not reads:
                time.sleep(3)  # takes nothing, well past the send timeout
                assert ended and ended[0] - start < 2  # the response gave up: its slot is free
            try:
                while chunk := sock.recv(1 << 16):
                    got += len(chunk)
                    if reads:
                        time.sleep(0.001)  # slow, but always taking some
            except ConnectionResetError:
                pass
        if reads:
            assert got > total and len(ended) == 1
        else:
            assert got < total  # cut off
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("pieces", [4000, 20_000])
def test_a_body_in_thousands_of_tiny_chunks_is_refused(server: ServerProcess, pieces: int) -> None:
    """1-byte chunks cost the event loop ~10 us each (2 MiB of them: 12 s, in stalls of up to 1 s):
    past 4096 pieces a body must average 256 bytes a piece."""
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    body += b" " * (pieces - len(body))  # JSON allows trailing blanks
    wire = b"".join(b"1\r\n" + body[i : i + 1] + b"\r\n" for i in range(len(body))) + b"0\r\n\r\n"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        with contextlib.suppress(ConnectionError):  # refused and closed while the rest was on its way
            sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + wire)
        status, answer = _reply(sock)
    if pieces < 4096:
        assert status == 200, answer
    else:
        assert status == 400 and answer["error"]["code"] == "invalid_http", answer
        assert "pieces" in answer["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
