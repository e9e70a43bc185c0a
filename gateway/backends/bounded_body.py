"""A hosted provider's whole answer read at most MAX_REPLY_BYTES, as an engine's is: httpx event
hooks that refuse a longer Content-Length at once and cut a body that runs past it, so a provider
(or a hostile base_url) answering gigabytes is never held in memory. The bytes counted are the
bytes decoded: the request asks for no compression, and a compressed answer is refused (64 MiB of
gzip can decode to gigabytes).

A stream's body is bounded too: in all, at STREAM_BYTES (the relay bounds the events it re-encodes
at 64 MiB, but the provider's own format is wordier), and line by line at MAX_LINE_BYTES, as an
engine replica's: the SSE reader in litellm's path holds a line until its end comes, so one line
of gigabytes would have been held whole before any bound saw it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

from gateway.backends.base import MAX_REPLY_BYTES
from gateway.backends.replica_lines import MAX_LINE_BYTES

STREAM_BYTES = 4 * MAX_REPLY_BYTES  # a streamed answer's bytes as the provider sends them

# litellm providers whose whole answers are read through a client of ours that bounds them: those
# that take an OpenAI SDK client, and those that take litellm's own handler
_OPENAI_CLIENT = frozenset({"openai", "text-completion-openai"})
_HANDLER_CLIENT = frozenset({"anthropic"})


class AnswerTooLargeError(Exception):
    """A provider's answer passed MAX_REPLY_BYTES, or could (compressed): closed, the rest unread."""


class _BoundedBody(httpx.AsyncByteStream):
    """The response body's bytes until `limit` (and, given `line_limit`, while no line is longer);
    past it, the body is closed and the read fails."""

    def __init__(self, body: httpx.AsyncByteStream, limit: int, line_limit: int | None = None) -> None:
        self._body, self._limit, self._line_limit = body, limit, line_limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = line = 0  # bytes in all; bytes since the last line feed
        async for chunk in self._body:
            read += len(chunk)
            if read > self._limit:
                await self._body.aclose()
                raise AnswerTooLargeError(f"the answer is longer than {self._limit} bytes")
            if self._line_limit is not None:
                line = _line_after(chunk, line, self._line_limit)
                if line < 0:
                    await self._body.aclose()
                    raise AnswerTooLargeError(f"a line of the stream is longer than {self._line_limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._body.aclose()


def _line_after(chunk: bytes, line: int, limit: int) -> int:
    """The bytes since the last line feed once `chunk` is read, `line` of them before it; -1 when a
    line passes `limit` (one that began before the chunk, or one wholly inside a chunk that long)."""
    first = chunk.find(b"\n")
    if first == -1:
        line += len(chunk)
        return line if line <= limit else -1
    if line + first > limit or (len(chunk) > limit and max(map(len, chunk.split(b"\n"))) > limit):
        return -1
    return len(chunk) - chunk.rfind(b"\n") - 1


async def uncompressed(request: httpx.Request) -> None:
    """httpx `request` event hook: the answer is asked for as it is, so its bytes are its size."""
    request.headers["accept-encoding"] = "identity"


async def bound_body(response: httpx.Response) -> None:
    """httpx `response` event hook (it runs before the body is read): the body, bounded."""
    await _bounded(response, MAX_REPLY_BYTES, None)


async def bound_stream(response: httpx.Response) -> None:
    """bound_body for a streamed answer: STREAM_BYTES in all, MAX_LINE_BYTES a line."""
    await _bounded(response, STREAM_BYTES, MAX_LINE_BYTES)


async def _bounded(response: httpx.Response, limit: int, line_limit: int | None) -> None:
    length = response.headers.get("content-length", "")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        await response.aclose()
        raise AnswerTooLargeError(f"the answer is compressed ({encoding[:20]}): its size is unbounded")
    if length.isdigit() and int(length) > limit:
        await response.aclose()
        raise AnswerTooLargeError(f"the answer announces {length} bytes, past {limit}")
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)  # an async client's
    response.stream = _BoundedBody(stream, limit, line_limit)


def bounded_client(
    provider: str | None, api_key: str | None, base_url: str | None, stream: bool = False
) -> tuple[openai.AsyncOpenAI | AsyncHTTPHandler, AsyncHTTPHandler] | None:
    """The `client=` litellm takes for whole answers (or, `stream`, streamed ones) of a model of
    `provider` (litellm_map.provider_of), one that reads them bounded (bound_body, bound_stream),
    and the handler that owns its connections (closed with the model: a handler closes its client
    when it is collected). None for a provider outside _OPENAI_CLIENT and _HANDLER_CLIENT:
    litellm's own client, whose answers are not bounded (docs/security.md)."""
    if provider not in _HANDLER_CLIENT | _OPENAI_CLIENT:
        return None
    bound = bound_stream if stream else bound_body
    hooks: dict[str, list[Callable[..., Any]]] = {"request": [uncompressed], "response": [bound]}
    handler = AsyncHTTPHandler(event_hooks=hooks)
    if provider in _HANDLER_CLIENT:
        return handler, handler
    # litellm's transport, our hooks; an httpx (not httpx2) client, as litellm gives the SDK
    http: Any = handler.client
    key = api_key or os.environ.get("OPENAI_API_KEY") or ""
    return openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0, http_client=http), handler
