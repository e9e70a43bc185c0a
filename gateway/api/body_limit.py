"""Request bodies read with a size limit, before any parsing: the completion endpoint's and BodyLimit's.

A body is refused with 413 as soon as its Content-Length, or the bytes counted while a chunked body
streams in, pass the limit; nothing past the limit is kept; and with 408 when it has not all arrived
within the body timeout. The refusal closes the connection, so the server does not read the rest of
a body it refused; the close lingers (gateway/api/http_protocol.py: what still arrives is dropped
unparsed for a bounded time) so that the answer is not reset away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.api.asgi import ASGIApp, Message, Receive, Scope, Send, send_error
from gateway.errors import GatewayError


class ClientLeftError(Exception):
    """The client disconnected while sending its body: nobody is left to answer."""


def too_large(limit: int) -> GatewayError:
    """The 413 for a body over `limit` bytes."""
    return GatewayError(413, f"the request body exceeds {limit} bytes", code="body_too_large")


def declared_length(scope: Scope) -> bytes | None:
    """The raw Content-Length header; b"chunked" for a chunked body; None without either."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return bytes(value)
        if name == b"transfer-encoding":
            return b"chunked"
    return None


def may_exceed(declared: bytes | None, limit: int) -> bool:
    """Whether a body not read yet may be over `limit`: a refusal then closes the connection rather
    than let the server read the rest only to discard it (a body within the limit is read, so that
    the client, still sending, gets the answer instead of a reset connection)."""
    return declared is not None and not (declared.isdigit() and int(declared) <= limit)


async def read_body(receive: Receive, declared: bytes | None, limit: int, timeout: float,
                    whole: Callable[[], bytes | None] | None = None) -> bytes:  # fmt: skip
    """The request body; GatewayError 413 as soon as it is declared or grows past `limit` bytes,
    408 when it has not all arrived `timeout` seconds after the headers (a client that starts a body
    and never ends it would hold its connection, and a concurrency slot, for ever: the header
    timeout no longer applies once the headers are in). Both are answered with a close.

    `whole` (the scope's WHOLE_BODY): a body that came with its headers, as nearly all do, is taken
    from it at once; no timer is set for a body that has nothing left to wait for."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = None if whole is None else whole()
    if body is not None:
        if len(body) > limit:
            raise too_large(limit)
        return body
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientLeftError
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except TimeoutError:
        late = f"the request body did not arrive within {timeout:g} seconds"
        raise GatewayError(408, late, code="request_timeout") from None


class BodyLimit:
    """ASGI wrapper: the app gets the whole body, read up to `limit` bytes, before it runs.

    For the FastAPI routes (admin, models, health, metrics), whose bodies are small: FastAPI would
    otherwise read a body of any size, then parse it, before a route's dependencies run.
    """

    def __init__(self, app: ASGIApp, limit: int, timeout: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, declared_length(scope), self.limit, self.timeout)
        except GatewayError as exc:
            await send_error(send, exc, close=True)
            return
        except ClientLeftError:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:  # after the body: what the server says next (a disconnect)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
