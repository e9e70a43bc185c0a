"""A hosted provider's whole answer read at most MAX_REPLY_BYTES, as an engine's is: httpx event
hooks that refuse a longer Content-Length at once and cut a body that runs past it, so a provider
(or a hostile base_url) answering gigabytes is never held in memory. The bytes counted are the
bytes decoded: the request asks for no compression, and a compressed answer is refused (64 MiB of
gzip can decode to gigabytes)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

from gateway.backends.base import MAX_REPLY_BYTES

# litellm providers whose whole answers are read through a client of ours that bounds them: those
# that take an OpenAI SDK client, and those that take litellm's own handler
_OPENAI_CLIENT = frozenset({"openai", "text-completion-openai"})
_HANDLER_CLIENT = frozenset({"anthropic"})


class AnswerTooLargeError(Exception):
    """A provider's answer passed MAX_REPLY_BYTES, or could (compressed): closed, the rest unread."""


class _BoundedBody(httpx.AsyncByteStream):
    """The response body's bytes until `limit`; past it, the body is closed and the read fails."""

    def __init__(self, body: httpx.AsyncByteStream, limit: int) -> None:
        self._body, self._limit = body, limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = 0
        async for chunk in self._body:
            read += len(chunk)
            if read > self._limit:
                await self._body.aclose()
                raise AnswerTooLargeError(f"the answer is longer than {self._limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._body.aclose()


async def uncompressed(request: httpx.Request) -> None:
    """httpx `request` event hook: the answer is asked for as it is, so its bytes are its size."""
    request.headers["accept-encoding"] = "identity"


async def bound_body(response: httpx.Response) -> None:
    """httpx `response` event hook (it runs before the body is read): the body, bounded."""
    length = response.headers.get("content-length", "")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        await response.aclose()
        raise AnswerTooLargeError(f"the answer is compressed ({encoding[:20]}): its size is unbounded")
    if length.isdigit() and int(length) > MAX_REPLY_BYTES:
        await response.aclose()
        raise AnswerTooLargeError(f"the answer announces {length} bytes, past {MAX_REPLY_BYTES}")
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)  # an async client's
    response.stream = _BoundedBody(stream, MAX_REPLY_BYTES)


def bounded_client(
    provider: str | None, api_key: str | None, base_url: str | None
) -> tuple[openai.AsyncOpenAI | AsyncHTTPHandler, AsyncHTTPHandler] | None:
    """The `client=` litellm takes for whole answers of a model of `provider`
    (litellm_map.provider_of), one that reads at most MAX_REPLY_BYTES of them, and the handler that
    owns its connections (closed with the model: a handler closes its client when it is
    collected). None for a provider outside _OPENAI_CLIENT and _HANDLER_CLIENT: litellm's own
    client, whose answers are not bounded (docs/security.md)."""
    if provider not in _HANDLER_CLIENT | _OPENAI_CLIENT:
        return None
    hooks: dict[str, list[Callable[..., Any]]] = {"request": [uncompressed], "response": [bound_body]}
    handler = AsyncHTTPHandler(event_hooks=hooks)
    if provider in _HANDLER_CLIENT:
        return handler, handler
    # litellm's transport, our hooks; an httpx (not httpx2) client, as litellm gives the SDK
    http: Any = handler.client
    key = api_key or os.environ.get("OPENAI_API_KEY") or ""
    return openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0, http_client=http), handler
