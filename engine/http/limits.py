"""HTTP limits of the engine server: what one connection or one request body may cost.

The body limit is enforced here, in ASGI middleware, before anything parses the body: a declared
`Content-Length` over the limit is refused without reading a byte, and a chunked body is counted
as it arrives and refused at the first byte over. The header limit is checked here too (431);
h11 (`engine/http/h11_protocol.py`) bounds the memory a head can take before it is complete, and
closes connections whose head is too slow or whose client stops taking an answer. The connection
limits are uvicorn's own options.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.http.error_mapping import NOSNIFF

logger = logging.getLogger(__name__)

MIB = 1 << 20
_BODY_FLOOR = 2 * MIB
# JSON bytes one prompt token may take: ~4 for text, up to 6 for an escaped character or a token id
# written out with its comma; 32 leaves room for chat framing and a few prompts per request.
_BODY_BYTES_PER_TOKEN = 32
_LINGER_SECONDS = 1.0  # after a 413, how long the rest of a body is read and dropped (at most `limit` bytes)


@dataclass(frozen=True)
class HTTPLimits:
    """Limits of the engine's HTTP side; None means derived (body) or unlimited (concurrency)."""

    max_body_bytes: int | None = None  # None: max(2 MiB, 32 bytes x max_model_len)
    max_header_bytes: int = 32 * 1024  # request line + headers
    header_read_timeout: float = 10.0  # from the first byte (or the connection) to the end of the headers
    body_read_timeout: float = 30.0  # from the end of the headers to the end of the body
    send_timeout: float = 120.0  # a client that takes no bytes of an answer this long is cut off
    limit_concurrency: int | None = 1024  # requests in progress; past it, 503 (connections: twice it)
    timeout_keep_alive: int = (
        75  # idle keep-alive; above the gateway's pool (60 s), so the client closes first
    )
    timeout_graceful_shutdown: int = 5  # after draining, how long open connections get to finish

    def __post_init__(self) -> None:
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.header_read_timeout <= 0 or self.body_read_timeout <= 0 or self.send_timeout <= 0:
            raise ValueError("header_read_timeout, body_read_timeout and send_timeout must be > 0")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        if self.timeout_keep_alive < 1 or self.timeout_graceful_shutdown < 0:
            raise ValueError("timeout_keep_alive must be >= 1 and timeout_graceful_shutdown >= 0")

    @property
    def connection_limit(self) -> int | None:
        """Open connections at most (h11_protocol.py closes the longest idle one past it)."""
        return None if self.limit_concurrency is None else 2 * self.limit_concurrency

    def body_limit(self, max_model_len: int | None) -> int:
        """The body limit in bytes: the configured one, else sized from the context length."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(_BODY_FLOOR, _BODY_BYTES_PER_TOKEN * (max_model_len or 0))


def _error(status: int, message: str, code: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "api_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json.dumps(body).encode()


async def _answer(
    send: Send,
    status: int,
    message: str,
    code: str,
    linger: Callable[[], Awaitable[None]] | None = None,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    body = _error(status, message, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),  # the rest of the body is never used
                NOSNIFF,
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": linger is not None})
    if linger is not None:
        # The client has the whole answer; closing now, with its body still arriving, would reset
        # the connection and could destroy the answer in its kernel before it reads it. Discard
        # what comes for a bounded time first (nginx's lingering close).
        await linger()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


_NEVER_REFUSED = frozenset({"/health", "/metrics"})  # cheap, and what orchestrators watch


class ConcurrencyLimit:
    """At most `limit` HTTP requests in progress; past it, 503 `server_overloaded` in OpenAI's format.
    `/health` and `/metrics` are never refused: an overloaded engine is alive, and a liveness probe
    that met a 503 could have a busy, healthy engine restarted.

    Connections are bounded apart (twice this limit, `HTTPLimits.connection_limit`, in
    h11_protocol.py): uvicorn's own `limit_concurrency` answers in plain text and counts idle
    keep-alive connections.
    """

    def __init__(self, app: ASGIApp, limit: int | None) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http" or self.limit is None or scope["path"] in _NEVER_REFUSED:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            logger.warning("%d requests in progress: 503 for %s", self.in_flight, scope.get("path"))
            message = "the engine is at its request limit; retry shortly"
            # when to retry, as the gateway's own overload answer says (the SDKs wait that long)
            await _answer(send, 503, message, "server_overloaded", extra=((b"retry-after", b"1"),))
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class RequestSizeMiddleware:
    """Headers over the limit: 431. Then reads the body up to the limit (413 past it, 408 if too
    slow) and hands it on.

    The app then reads the buffered body; after it, `receive` is the connection's own again, so
    disconnect detection works as before. `limit()` is read per request (it grows once the model
    has loaded and its context length is known).
    """

    def __init__(
        self, app: ASGIApp, limit: Callable[[], int], read_timeout: float, max_header_bytes: int
    ) -> None:
        self.app = app
        self.limit = limit
        self.read_timeout = read_timeout
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
        head += sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        if head > self.max_header_bytes:
            logger.warning("request head of %d bytes on %s: 431", head, scope.get("path"))
            await _answer(
                send,
                431,
                f"Request headers too large: at most {self.max_header_bytes} bytes on this server",
                "request_header_fields_too_large",
            )
            return
        limit = self.limit()
        declared = _content_length(scope)
        if declared is not None and (declared < 0 or declared > limit):
            await self._too_large(scope, receive, send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                logger.warning("request body not received within %.0fs: 408", self.read_timeout)
                await _answer(send, 408, "The request body was not received in time", "request_timeout")
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._too_large(scope, receive, send, limit)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        logger.warning("request body over %d bytes on %s: 413", limit, scope.get("path"))

        async def discard() -> None:
            deadline = time.monotonic() + _LINGER_SECONDS
            discarded = 0
            while discarded <= limit:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    return
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return
                discarded += len(message.get("body", b""))

        await _answer(
            send,
            413,
            f"The request body is too large: at most {limit} bytes on this server",
            "request_too_large",
            discard,
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1  # refused like an oversized body
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that returns the buffered body once, then the connection's own messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        message: dict[str, Any] = {"type": "http.request", "body": body, "more_body": False}
        return message

    return replay
