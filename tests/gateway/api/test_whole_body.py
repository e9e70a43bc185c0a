"""The HTTP layer's WHOLE_BODY (api/http_protocol.py): a request body that arrived with its head is
handed over at once, taken as uvicorn's `receive()` takes it; one still arriving, or one the
client holds back for 100 Continue, is left to `receive()`. An app in the same process, served by
uvicorn with GatewayHttpProtocol on a loopback port, records what it saw."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvicorn

from gateway.api.asgi import WHOLE_BODY, Receive, Scope, Send
from gateway.api.body_limit import read_body
from gateway.api.http_protocol import LimitedConfig
from gateway.errors import GatewayError


class Recorder:
    """An ASGI app that takes the body through WHOLE_BODY when it can, else through `receive()`,
    answers with what it got, then waits on `receive()` as the endpoint's disconnect watcher does."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.after: asyncio.Queue[str] = asyncio.Queue()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        whole = scope[WHOLE_BODY]()
        again = scope[WHOLE_BODY]()  # taken once: the second ask has nothing
        body = whole
        if body is None:
            parts = []
            while True:
                message = await receive()
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            body = b"".join(parts)
        self.seen.append({"whole": whole, "again": again, "body": body})
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})
        message = (
            await receive()
        )  # after the answer: the disconnect (or the answer's end), never the body again
        await self.after.put(message["type"])


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[tuple[Recorder, int]]:
    app = Recorder()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = LimitedConfig(app, max_header_bytes=8192, header_timeout=5.0, host="127.0.0.1", port=port,
                           lifespan="off", log_level="warning")  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield app, port
    finally:  # ends the server even when the scenario failed
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _exchange(port: int, *parts: bytes, pause: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(pause)
            writer.write(part)
            await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(
            next(v for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k == b"content-length")
        )
        return await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()


def run(scenario: Callable[[Recorder, int], Awaitable[None]]) -> None:
    async def main() -> None:
        async with served() as (app, port):
            await asyncio.wait_for(scenario(app, port), 20)

    asyncio.run(main())


def _head(length: int, *extra: bytes) -> bytes:
    return b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n%s\r\n" % (length, b"".join(extra))


def test_a_body_that_came_with_its_head_is_handed_over_once_and_receive_then_waits_for_the_end() -> None:
    async def scenario(app: Recorder, port: int) -> None:
        body = b'{"a": 1}'
        assert await _exchange(port, _head(len(body)) + body) == body
        assert app.seen == [{"whole": body, "again": None, "body": body}]
        assert await asyncio.wait_for(app.after.get(), 5) == "http.disconnect"

    run(scenario)


def test_a_whole_body_is_handed_over_as_bytes_as_receive_hands_it() -> None:
    # uvicorn's buffer is a bytearray: handed over as such, the body was mutable and unhashable
    # where every reader of it (the proxy, the request log) takes bytes
    async def scenario(app: Recorder, port: int) -> None:
        body = b'{"a": 1}'
        assert await _exchange(port, _head(len(body)) + body) == body
        assert type(app.seen[0]["whole"]) is bytes

    run(scenario)


def test_a_body_still_arriving_is_left_to_receive() -> None:
    async def scenario(app: Recorder, port: int) -> None:
        body = b"x" * 1000
        assert await _exchange(port, _head(len(body)) + body[:10], body[10:], pause=0.2) == body
        assert app.seen == [{"whole": None, "again": None, "body": body}]

    run(scenario)


def test_a_client_waiting_for_100_continue_gets_it_from_receive() -> None:
    async def scenario(app: Recorder, port: int) -> None:
        body = b"y" * 100
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_head(len(body), b"expect: 100-continue\r\n"))
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim.startswith(b"HTTP/1.1 100")
            writer.write(body)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.readexactly(len(body)), 5) == body
        finally:
            writer.close()
        assert app.seen == [{"whole": None, "again": None, "body": body}]

    run(scenario)


def test_pipelined_requests_each_get_their_own_body() -> None:
    async def scenario(app: Recorder, port: int) -> None:
        first, second = b"first", b"second!"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_head(len(first)) + first + _head(len(second)) + second)
            answers = []
            for expected in (first, second):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200")
                answers.append(await asyncio.wait_for(reader.readexactly(len(expected)), 5))
        finally:
            writer.close()
        assert answers == [first, second]
        assert [seen["body"] for seen in app.seen] == [first, second]
        assert [seen["again"] for seen in app.seen] == [None, None]

    run(scenario)


def test_a_whole_body_over_the_limit_is_413_without_a_read() -> None:
    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was there: nothing to receive")

    async def main() -> None:
        body = b"z" * 11
        assert await read_body(receive, b"chunked", 11, 1.0, lambda: body) == body
        with pytest.raises(GatewayError) as refused:
            await read_body(receive, b"chunked", 10, 1.0, lambda: body)
        assert (refused.value.status, refused.value.code) == (413, "body_too_large")

    asyncio.run(main())
