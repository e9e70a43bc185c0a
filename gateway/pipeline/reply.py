"""Reply: the gateway's answer to one completion request, framework-free (the endpoint sends it)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import GatewayError, error_answer

DONE_EVENT = b"data: [DONE]\n\n"  # a stream's end, as its client is sent it


class ClientWriter(Protocol):
    """The client's connection, written to at once (api/http_protocol.py's, under our own server)."""

    def writable(self) -> bool:
        """Whether a body part written now leaves at once: the stream's head has gone, the client
        is there and its socket can take more."""

    def write_part(self, body: bytes) -> None:
        """A streamed answer's next body part, sent now."""


@dataclass
class Outlet:
    """Where a stream's relay may write its events itself, as the upstream's bytes arrive (no task
    switch per event): set by the endpoint once it sends the stream; None under another server."""

    writer: ClientWriter | None = None


@dataclass
class Reply:
    """The gateway's answer, framework-free: a whole body, or SSE events when `events` is set
    (which `outlet`, when given, lets write some events themselves)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    events: AsyncGenerator[bytes, None] | None = None
    outlet: Outlet | None = None


def error_reply(exc: GatewayError) -> Reply:
    """`exc`'s OpenAI-format answer (gateway/errors.py's `error_answer`) as a Reply."""
    status, headers, body = error_answer(exc)
    return Reply(status, [JSON_HEADER, *headers], body)


async def one_event(event: bytes) -> AsyncGenerator[bytes, None]:
    """A stream of one event (an error after the stream's head went out)."""
    yield event


# sends a stream's status and headers before its first token, with an opening event or None (the
# endpoint's; proxy.py decides when); gives the client's connection to write the stream's next events
# to at once (None: under another server, they go through the Reply's events)
HeadSender = Callable[[int, list[tuple[bytes, bytes]], bytes | None], Awaitable[ClientWriter | None]]
JSON_HEADER = (b"content-type", b"application/json")
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]  # fmt: skip
