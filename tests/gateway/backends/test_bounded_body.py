"""The bound on a hosted provider's whole answer (gateway/backends/bounded_body.py), on an httpx client."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.backends.bounded_body import AnswerTooLargeError, bound_body, uncompressed

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
