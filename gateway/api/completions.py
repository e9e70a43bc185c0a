"""`POST /v1/chat/completions` and `POST /v1/completions` as a bare ASGI endpoint.

These two routes are the gateway's hot path, so they skip the framework: FastAPI's routing,
middleware stack and dependency solving cost about as much CPU per request as the whole proxy
(profiled with py-spy at 1,000 requests/s). Everything else (models, admin, health, metrics) stays
on FastAPI. The endpoint only translates: bearer key -> KeyStore, body -> Proxy, Reply -> ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.api.asgi import BODY_PART, CLIENT_WRITER, REFUSED, WHOLE_BODY, Receive, Scope, Send
from gateway.api.body_limit import ClientLeftError, may_exceed, read_body
from gateway.api.services import Services
from gateway.errors import GatewayError, error_answer, shutdown_error, stopped_by_shutdown
from gateway.pipeline.reply import DONE_EVENT, ClientWriter, HeadSender, Reply, error_reply

logger = logging.getLogger(__name__)

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

BodyPart = Callable[[bytes], Awaitable[None]]  # sends a stream's next body part (asgi.BODY_PART)


class CompletionsEndpoint:
    """Answers the completion paths; `services()` gives the app's Services once it started.

    The key is checked before the body is read, and the body is read at most `max_body_bytes`.
    """

    def __init__(self, services: Callable[[], Services], max_body_bytes: int, body_timeout: float) -> None:
        self._services = services
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        services = self._services()
        keys, proxy = services.keys, services.proxy
        trace = proxy.tracing.start(scope["path"], scope["headers"])
        if scope["method"] != "POST":
            message = f"{scope['method']} is not allowed here: use POST"
            refused = GatewayError(405, message, code="method_not_allowed", headers=[(b"allow", b"POST")])
            await _send_whole(proxy.refuse(started, refused, trace), send)
            return
        authorization, declared = _headers(scope)
        close = may_exceed(declared, self.max_body_bytes)  # refused unread: do not read it to discard
        try:
            key = await keys.authenticate(_bearer(authorization), scope.get("client"))
            trace.authenticated(key)
            whole = scope.get(WHOLE_BODY)
            raw = await read_body(receive, declared, self.max_body_bytes, self.body_timeout, whole)
        except GatewayError as exc:  # the key refused (or its database away), the body too large or slow
            await _send_whole(proxy.refuse(started, exc, trace), send, close or exc.status in (408, 413))
            return
        except asyncio.CancelledError as exc:  # the gateway stopped, its grace period over (else: raised)
            if not stopped_by_shutdown(exc):
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()  # answered here: nothing to report to the server
            proxy.refuse(started, shutdown_error(), trace)
            await _told_of_shutdown(send, {"head": False, "complete": False})
            return
        except ClientLeftError:  # or its body's framing broke: the HTTP layer answered (REFUSED)
            status, message, code = scope.get(REFUSED, (499, "the client left", "client_disconnected"))
            proxy.refuse(started, GatewayError(status, message, code=code), trace)
            return
        except Exception:  # a fault nothing above names: an OpenAI-format 503, the traceback in our log
            logger.exception("authenticating a request to %s failed", scope["path"])
            message = "the request could not be authenticated now; retry later"
            failed = GatewayError(503, message, "api_error", code="authentication_unavailable")
            await _send_whole(proxy.refuse(started, failed, trace), send, close)
            return
        body_part = scope.get(BODY_PART) or _through(send)
        await _answer_until_disconnect(lambda head: proxy.handle(scope["path"], raw, key, trace, head),
                                       receive, send, body_part, scope.get(CLIENT_WRITER))  # fmt: skip


def _headers(scope: Scope) -> tuple[bytes, bytes | None]:
    """(authorization, content-length or b"chunked") from the raw header list (names arrive lower-cased)."""
    authorization, length = b"", None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value
        elif name == b"content-length":
            length = value
        elif name == b"transfer-encoding":
            length = b"chunked"
    return authorization, length


def _bearer(authorization: bytes) -> str | None:
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def _through(send: Send) -> BodyPart:
    """A stream's body parts through `send` (a server other than ours: api/http_protocol.py)."""

    async def body_part(body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": True})

    return body_part


async def _answer_until_disconnect(answer: Callable[[HeadSender], Awaitable[Reply]], receive: Receive,
                                   send: Send, body_part: BodyPart,
                                   writer: ClientWriter | None = None) -> None:  # fmt: skip
    """Await `answer` and send it; if the client disconnects first, cancel it (and the upstream call).

    `answer` may send a stream's status and headers before its Reply is ready (the head sender it is
    given); the Reply's own are then spent. A watcher waits on `receive()`, which returns
    `http.disconnect` when the client goes away (or once the response is complete); it starts from
    the loop once `answer` first waits, so that making it does not delay the upstream request (a
    client gone before then is seen at once: `receive()` returns the disconnect it had noted). The handler
    task is cancelled only while the answer is still being produced or streamed; that cancellation
    is absorbed here, not passed to the server.
    """
    task = asyncio.current_task()
    assert task is not None
    state = {"done": False, "left": False, "head": False, "ended": False, "complete": False}

    async def head(status: int, headers: list[tuple[bytes, bytes]],
                   opening: bytes | None) -> ClientWriter | None:  # fmt: skip
        state["head"] = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if opening is not None:  # in the same send as the head (api/http_protocol.py)
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        return writer

    async def watch() -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not state["done"]:
            state["left"] = True
            task.cancel()

    watcher: asyncio.Task[None] | None = None

    def start_watching() -> None:  # from the loop, once the answer waits (not on the request's way out)
        nonlocal watcher
        if not state["done"]:
            watcher = asyncio.ensure_future(watch())

    asyncio.get_running_loop().call_soon(start_watching)
    try:
        reply = await answer(head)
        if reply.events is None:
            state["done"] = True
            await _send_whole(reply, send)
        else:
            await _send_stream(reply, send, body_part, state, writer)
    except asyncio.CancelledError as exc:
        if not state["left"] and not stopped_by_shutdown(exc):
            raise
        task.uncancel()  # the client left: nothing to answer, nothing to report to the server
        if not state["left"]:  # the gateway stops: the client is told, if it still reads (logged already)
            await _told_of_shutdown(send, state)
    finally:
        state["done"] = True
        if watcher is not None:
            watcher.cancel()


_SHUTDOWN_WRITE_SECONDS = 1.0  # how long the last words to a client may wait for it to read


async def _told_of_shutdown(send: Send, state: dict[str, bool]) -> None:
    """A request the gateway's shutdown cut off gets 503 `gateway_shutdown` (retryable), or, when its
    stream has begun, that error as its last event and the stream's end, so that its client sees an
    error rather than a cut connection. A client that does not read gets nothing: the write is
    bounded, and the server closes the connection."""
    try:
        async with asyncio.timeout(_SHUTDOWN_WRITE_SECONDS):
            if state["complete"]:  # the answer went out whole (the relay was reading what the
                return  # upstream sent after its [DONE]): nothing is left to say
            if state["head"]:
                # ended: the [DONE] and the answer's end waited on the client's socket (none of it
                # went out), sent again; done: only the answer's end is left; else the error event
                if state["ended"]:
                    last = DONE_EVENT
                elif state["done"]:
                    last = b""
                else:
                    last = b"data: " + error_answer(shutdown_error()).body + b"\n\n"
                await send({"type": "http.response.body", "body": last})
            else:
                await _send_whole(error_reply(shutdown_error()), send, close=True)
    except Exception:  # a client gone or not reading: the connection is closed as the server stops
        logger.debug("a request cut off by the shutdown could not be told", exc_info=True)


async def _send_whole(reply: Reply, send: Send, close: bool = False) -> None:
    headers = [*reply.headers, (b"content-length", b"%d" % len(reply.body))]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


async def _send_stream(reply: Reply, send: Send, body_part: BodyPart, state: dict[str, bool],
                       writer: ClientWriter | None) -> None:  # fmt: skip
    assert reply.events is not None
    events, outlet = reply.events, reply.outlet
    if outlet is not None:  # the relay writes the stream's middle itself (asgi.CLIENT_WRITER)
        outlet.writer = writer
    try:
        try:  # start the generator before any other await: from here its cleanup always runs
            first: bytes | None = await events.__anext__()
        except StopAsyncIteration:
            first = None
        if not state["head"]:  # else it went with the first upstream event (proxy.py)
            state["head"] = True
            await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
        event = first
        while event is not None:
            if event.endswith(DONE_EVENT):  # (the end comes this way, never pumped) with the answer's
                # end, in one write: a client reading to the answer's end has it with [DONE], not once
                # the relay has drained the upstream (up to a second), and one that stops at [DONE]
                # (the official SDKs) closes an answer already complete
                state["ended"] = state["done"] = True
                await send({"type": "http.response.body", "body": event, "more_body": False})
                state["complete"] = True
            else:
                await body_part(event)
            event = await anext(events, None)
        if not state["done"]:
            state["done"] = True
            await send({"type": "http.response.body", "body": b""})
            state["complete"] = True
    except asyncio.CancelledError as exc:
        if stopped_by_shutdown(exc):  # cut off while writing (a client not reading): the relay, which
            with contextlib.suppress(BaseException):  # logs the request, learns why, not a GeneratorExit
                await events.athrow(exc)
        raise
    finally:
        if outlet is not None:
            outlet.writer = None
        await events.aclose()  # runs the proxy's cleanup and log row, however the stream ended
