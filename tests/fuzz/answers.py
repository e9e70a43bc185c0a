"""What a client may get back from the gateway, checked: the contract every fuzz case asserts.

A whole answer is 2xx JSON, a 4xx, or a documented 502/503/504, each error in OpenAI's format. A
stream that started (200, text/event-stream) is valid UTF-8, every `data:` line is JSON or
`[DONE]`, and it ends with `data: [DONE]` or with an OpenAI-format error event: never cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

UPSTREAM_DOWN = frozenset({502, 503, 504})  # the only 5xx the gateway may answer (docs/gateway.md)
MAX_TOKENS = 1 << 24  # gateway/governance/usage.py's bound on a believable count


@dataclass
class Answer:
    """One response as read by a client (or what happened instead)."""

    status: int | None  # None: no response at all (the client left, or the connection failed)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None  # the client-side exception, if the exchange failed

    @property
    def request_id(self) -> str | None:
        """The gateway's id for the request (every answer after authentication carries one)."""
        return self.headers.get("x-request-id")

    @property
    def is_stream(self) -> bool:
        """The gateway committed to a stream."""
        return self.status == 200 and self.headers.get("content-type", "").startswith("text/event-stream")


def problems(answer: Answer) -> list[str]:
    """Everything wrong with one answer (empty: it keeps the contract)."""
    if answer.status is None:
        return [f"no answer: {answer.error}"]
    if answer.error is not None:
        return [f"status {answer.status}, then the connection broke: {answer.error}"]
    if answer.status >= 500 and answer.status not in UPSTREAM_DOWN:
        return [f"status {answer.status}: {answer.body[:300]!r}"]
    if answer.is_stream:
        return _stream_problems(answer.body)
    try:
        parsed = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return [f"status {answer.status} with a body that is not JSON: {answer.body[:300]!r}"]
    if answer.status >= 400:
        return (
            []
            if _is_openai_error(parsed)
            else [f"status {answer.status}, not an OpenAI error: {parsed!r:.300}"]
        )
    if not isinstance(parsed, dict):
        return [f"status {answer.status} with a JSON body that is not an object"]
    return []


def _is_openai_error(parsed: Any) -> bool:
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error


def _stream_problems(body: bytes) -> list[str]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [f"a stream that is not UTF-8: {exc}"]
    data = [line[5:].strip() for line in text.split("\n") if line.startswith("data:")]
    if not data:
        return ["a stream without a single event"]
    found = []
    for payload in data:
        if payload == "[DONE]":
            continue
        try:
            orjson.loads(payload)
        except orjson.JSONDecodeError:
            found.append(f"an event that is not JSON: {payload[:200]!r}")
    last = data[-1]
    if last != "[DONE]":
        try:
            ended_with_error = _is_openai_error(orjson.loads(last))
        except orjson.JSONDecodeError:
            ended_with_error = False
        if not ended_with_error:
            found.append(f"a stream cut without [DONE] or an error event (last: {last[:200]!r})")
    return found


def stream_error(body: bytes) -> dict[str, Any] | None:
    """The error event a stream ended with, if it did."""
    lines = [line for line in body.split(b"\n") if line.startswith(b"data:")]
    if not lines or lines[-1].strip() == b"data: [DONE]":
        return None
    try:
        last = orjson.loads(lines[-1][5:])
    except orjson.JSONDecodeError:
        return None
    return last.get("error") if isinstance(last, dict) and isinstance(last.get("error"), dict) else None


def row_problems(row: dict[str, Any]) -> list[str]:
    """A request-log row's usage must be non-negative and bounded (None: not counted)."""
    found = []
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        value = row.get(name)
        if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_TOKENS):
            found.append(f"{name}={value!r}")
    cost = row.get("cost_picousd")
    if cost is not None and int(cost) < 0:
        found.append(f"cost_picousd={cost}")
    return found
