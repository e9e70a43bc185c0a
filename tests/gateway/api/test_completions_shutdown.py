"""A completion request that the gateway's shutdown cuts off (api/completions.py, cancelled with
errors.SHUTDOWN once GATEWAY_SHUTDOWN_TIMEOUT is over) before its body is in or its key checked is
answered 503 `gateway_shutdown` and counted as refused, as one cut off later is: not a traceback and
uvicorn's plain-text 500."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, MutableMapping
from types import SimpleNamespace
from typing import Any

import orjson

from gateway.api.asgi import Send
from gateway.api.completions import BodyPart, CompletionsEndpoint, _answer_until_disconnect
from gateway.errors import SHUTDOWN, GatewayError
from gateway.pipeline.reply import Reply, error_reply
from gateway.telemetry.trace import NO_TRACING


class _Keys:
    async def authenticate(self, presented: str | None, client: object = None) -> object:
        return SimpleNamespace(id="k")


class _Refusals:
    tracing = NO_TRACING

    def __init__(self) -> None:
        self.refused: list[str | None] = []

    def refuse(self, started: float, exc: GatewayError, trace: object) -> Reply:
        self.refused.append(exc.code)
        return error_reply(exc)


def test_a_request_whose_body_is_still_arriving_at_the_cut_off_is_answered_503_gateway_shutdown() -> None:
    proxy = _Refusals()
    endpoint = CompletionsEndpoint(lambda: SimpleNamespace(keys=_Keys(), proxy=proxy), 1 << 20, 30.0)  # type: ignore[arg-type,return-value]
    sent: list[MutableMapping[str, Any]] = []
    reading = asyncio.Event()

    async def receive() -> dict[str, Any]:  # a body that does not come
        reading.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "client": ("127.0.0.1", 1),
             "headers": [(b"authorization", b"Bearer sk-x"), (b"content-length", b"20")]}  # fmt: skip

    async def main() -> None:
        task = asyncio.ensure_future(endpoint(scope, receive, send))
        await reading.wait()
        task.cancel(msg=SHUTDOWN)
        await task  # answered, not raised to the server

    asyncio.run(main())
    assert sent[0]["status"] == 503 and (b"connection", b"close") in sent[0]["headers"]
    assert orjson.loads(sent[1]["body"])["error"]["code"] == "gateway_shutdown"
    assert proxy.refused == ["gateway_shutdown"]


async def _never_receives() -> dict[str, Any]:
    """A client that neither sends more nor leaves."""
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


def _cut_off(
    events: AsyncGenerator[bytes, None], send: Send, body_part: BodyPart, ready: asyncio.Event
) -> None:
    """`events` answered as a stream, cut off by the gateway's shutdown once `ready` is set."""

    async def answer(head: object) -> Reply:
        return Reply(200, [], events=events)

    async def main() -> None:
        task = asyncio.ensure_future(_answer_until_disconnect(answer, _never_receives, send, body_part))
        await ready.wait()
        task.cancel(msg=SHUTDOWN)
        await task

    asyncio.run(main())


def test_a_stream_whose_end_waits_on_the_client_gets_its_done_not_an_error_event_when_cut_off() -> None:
    """A client that stopped reading holds the stream's [DONE], which goes out with the answer's end
    in one send, in uvicorn's flow control (nothing of it written); the cut-off sends that end again,
    with no error event: the request was logged for it (200)."""
    written: list[bytes] = []
    sent: list[MutableMapping[str, Any]] = []
    waiting = asyncio.Event()

    async def events() -> AsyncGenerator[bytes, None]:
        yield b"data: {}\n\n"
        yield b"data: [DONE]\n\n"

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body") and not waiting.is_set():
            waiting.set()  # the client's socket is full: uvicorn's send waits for it to read
            await asyncio.sleep(3600)

    async def body_part(body: bytes) -> None:
        written.append(body)

    _cut_off(events(), send, body_part, waiting)
    assert written == [b"data: {}\n\n"]
    assert sent[-2] == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    assert sent[-1] == {"type": "http.response.body", "body": b"data: [DONE]\n\n"}  # once more, whole


def test_a_stream_cut_off_while_its_upstream_is_drained_after_the_answer_sends_nothing_more() -> None:
    """The answer ended with its [DONE]; the relay still reads what the upstream sends after it when
    the cut-off comes: the relay learns why, and nothing is sent after the complete answer."""
    sent: list[MutableMapping[str, Any]] = []
    draining = asyncio.Event()
    thrown: list[BaseException] = []

    async def events() -> AsyncGenerator[bytes, None]:
        yield b"data: {}\n\n"
        yield b"data: [DONE]\n\n"
        draining.set()
        try:
            await asyncio.sleep(3600)  # the upstream's body, which has not ended
        except BaseException as exc:
            thrown.append(exc)
            raise

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def body_part(body: bytes) -> None:
        sent.append({"part": body})

    _cut_off(events(), send, body_part, draining)
    assert sent[-1] == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    assert len(thrown) == 1 and isinstance(thrown[0], asyncio.CancelledError)
