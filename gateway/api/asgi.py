"""ASGI's types, and an error answer sent straight through ASGI (for code that runs before FastAPI)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.errors import GatewayError, error_answer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# scope key set by the HTTP layer (api/http_protocol.py) when it refuses a request while its body
# arrives (broken chunking, a timeout): (status, message, code), what the client was answered; the
# app's body read sees a disconnect
REFUSED = "gateway.refused"

# scope key set by the HTTP layer: an async callable that sends a streamed answer's next body part
# as `send` would with `more_body` (chunked), without the message dict and uvicorn's checks of it
# (every event of every stream goes through it); absent under another server: `send` then
BODY_PART = "gateway.body_part"

# scope key set by the HTTP layer: the request's ClientWriter (pipeline/reply.py), through which a
# stream's relay writes events itself as the upstream's bytes arrive; absent under another server
CLIENT_WRITER = "gateway.client_writer"

# scope key set by the HTTP layer: a callable that returns the request's body when all of it has
# arrived and nothing read it yet, taken as `receive()` would take it, without a coroutine, an event
# and a timer (None: read it with `receive()`); absent under another server
WHOLE_BODY = "gateway.whole_body"


async def send_error(send: Send, exc: GatewayError, close: bool = False) -> None:
    """`exc`'s OpenAI-format answer; `close`: end the connection after it (a request body left unread)."""
    status, headers, body = error_answer(exc)
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
