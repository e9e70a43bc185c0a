"""Sending one request to the gateway and reading its whole answer (streamed or not) as `Answer`."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from tests.fuzz.answers import Answer


async def post(
    client: httpx.AsyncClient,
    path: str,
    key: str | None,
    body: bytes | dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Answer:
    """POST `body` (JSON-encoded when a dict) and read everything the gateway sends back."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    sent = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    try:
        async with client.stream("POST", path, content=content, headers=sent) as resp:
            chunks: list[bytes] = []
            try:
                async for chunk in resp.aiter_raw():
                    chunks.append(chunk)
            except httpx.HTTPError as exc:  # the gateway cut the answer: what came so far, and why
                return Answer(resp.status_code, dict(resp.headers), b"".join(chunks), _named(exc))
            return Answer(resp.status_code, dict(resp.headers), b"".join(chunks))
    except httpx.HTTPError as exc:
        return Answer(None, error=_named(exc))


def _named(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def chat(model: str, content: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A chat/completions body with one user message."""
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}
