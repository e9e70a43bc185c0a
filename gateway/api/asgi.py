"""ASGI's types, and an error answer sent straight through ASGI (for code that runs before FastAPI)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(
    send: Send,
    status: int,
    message: str,
    type_: str,
    code: str | None,
    close: bool = False,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """An OpenAI-format error; `close`: end the connection after it (a request body left unread)."""
    body = error_body(message, type_, code=code)
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *(headers or [])]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
