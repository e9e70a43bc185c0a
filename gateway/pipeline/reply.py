"""Reply: the gateway's answer to one completion request, framework-free (the endpoint sends it)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from gateway.errors import error_body


@dataclass
class Reply:
    """The gateway's answer, framework-free: a whole body, or SSE events when `events` is set."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    events: AsyncGenerator[bytes, None] | None = None


def error_reply(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> Reply:
    """An OpenAI-format error answer."""
    return Reply(status, [JSON_HEADER], error_body(message, type_, param, code))


JSON_HEADER = (b"content-type", b"application/json")
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]  # fmt: skip
