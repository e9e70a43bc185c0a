"""The bound on a hosted provider's whole answer (gateway/backends/bounded_body.py), on an httpx client."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from gateway.backends.bounded_body import (
    AnswerTooLargeError,
    _line_after,
    bound_body,
    bound_stream,
    uncompressed,
)
from gateway.backends.replica_lines import MAX_LINE_BYTES

HOOKS: dict[str, list[Callable[..., Any]]] = {"request": [uncompressed], "response": [bound_body]}


def _get(handler: httpx.MockTransport) -> httpx.Response:
    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=handler, event_hooks=HOOKS) as client:
            return await client.get("http://provider/v1/x")

    return asyncio.run(get())


def test_a_provider_is_asked_for_its_answer_uncompressed() -> None:
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("accept-encoding"))
        return httpx.Response(200, content=b'{"ok": true}')

    assert _get(httpx.MockTransport(answer)).json() == {"ok": True}
    assert seen == ["identity"]


def test_a_compressed_answer_is_refused_before_it_is_decoded() -> None:
    # 64 MiB of gzip decodes to gigabytes: the bytes counted must be the bytes decoded
    bomb = gzip.compress(b"x" * (8 << 20))

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=bomb, headers={"content-encoding": "gzip"})

    with pytest.raises(AnswerTooLargeError, match="compressed"):
        _get(httpx.MockTransport(answer))


def test_an_answer_within_the_bound_is_read_whole() -> None:
    body = b"y" * (1 << 20)
    assert _get(httpx.MockTransport(lambda request: httpx.Response(200, content=body))).content == body


def test_a_streams_line_is_bounded_wherever_the_chunks_split_it() -> None:
    limit = 10
    assert _line_after(b"abc", 0, limit) == 3  # a line still growing
    assert _line_after(b"defghij", 3, limit) == 10  # at the bound: fine
    assert _line_after(b"k", 10, limit) == -1  # past it, no line feed yet
    assert _line_after(b"klm\nab", 8, limit) == -1  # a line begun before the chunk ends past it
    assert _line_after(b"kl\nab", 8, limit) == 2  # it ends at the bound; the next has begun
    assert _line_after(b"a\n" + b"x" * 11 + b"\nb", 0, limit) == -1  # a long line inside a chunk
    assert _line_after(b"\n".join([b"y" * 10] * 50) + b"\n", 0, limit) == 0  # many lines at the bound


def _streamed(parts: list[bytes]) -> bytes:
    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    async def read() -> bytes:
        hooks: dict[str, list[Callable[..., Any]]] = {"request": [uncompressed], "response": [bound_stream]}
        transport = httpx.MockTransport(answer)
        async with (
            httpx.AsyncClient(transport=transport, event_hooks=hooks) as client,
            client.stream("GET", "http://provider/v1/x") as response,
        ):
            return b"".join([chunk async for chunk in response.aiter_bytes()])

    return asyncio.run(read())


def test_a_stream_of_many_lines_passes_and_one_line_past_the_bound_is_cut_off() -> None:
    """litellm's SSE reader holds a line until it ends: one of gigabytes was held whole."""
    lines = [b"data: " + b"w" * 1000 + b"\n\n"] * 20_000  # 20 MB in all, every line short
    assert len(_streamed(lines)) == sum(map(len, lines))
    megabyte = b"z" * (1 << 20)
    with pytest.raises(AnswerTooLargeError, match="a line of the stream"):
        _streamed([b"data: {", *[megabyte] * (MAX_LINE_BYTES >> 20), b"}\n\n"])
