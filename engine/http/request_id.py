"""`x-request-id` on every answer of the engine server, as OpenAI's API and our gateway give one.

A client's own `x-request-id` is echoed when it is a plain token (letters, digits and `._:-`, at
most 128 characters), so that a caller's logs and ours name a request alike; anything else, or no
header, gets a fresh `req-<32 hex>`. The header is added in ASGI middleware, outermost, so that the
refusals made before any route (503 at the request limit, 413, 431) carry it too. Starlette's own
error middleware sits outside every added one: the 500 it sends for an unexpected error reads the
id from the scope (`scope_request_id`), where the middleware leaves it.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_HEADER = b"x-request-id"
_SCOPE_KEY = "switchboard.request_id"
_PLAIN = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")


def request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The id to answer with: the client's when it is a plain token, else a new one."""
    for name, value in headers:
        if name.lower() == _HEADER:
            return value if _PLAIN.fullmatch(value) else _fresh()
    return _fresh()


def _fresh() -> bytes:
    return f"req-{uuid.uuid4().hex}".encode()


class RequestIdMiddleware:
    """Adds `x-request-id` to the response head of every HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope[_SCOPE_KEY] = request_id(scope.get("headers") or [])

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or [] if k.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def scope_request_id(scope: Scope) -> bytes | None:
    """The id RequestIdMiddleware gave the request of `scope` (None: it did not run)."""
    rid = scope.get(_SCOPE_KEY)
    return rid if isinstance(rid, bytes) else None
