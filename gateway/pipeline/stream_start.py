"""A stream's first events, read until its first token: which events carry one, which only open
the answer (those may go out with the stream's head: failover.py's commit), and when a stream
that has not produced a token yet counts as broken (the caller then tries the next candidate).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import orjson

from gateway.backends.base import PROMPT_TOKENS, UpstreamStreamError
from gateway.pipeline.resume import TOKEN_IDS


def _failed_upstream(line: str) -> bool:
    """Whether a data line is an error event of the upstream's own (a server error: the next
    candidate may answer); a request's own fault (`invalid_request_error`) is the client's answer."""
    try:
        chunk = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return False
    error = chunk.get("error") if isinstance(chunk, dict) else None
    return isinstance(error, dict) and error.get("type") != "invalid_request_error"


def request_error(line: str) -> bytes | None:
    """The error of a data line that is an error event for the request's own fault (the body an
    upstream would have answered 400 with), else None."""
    if '"error"' not in line or not line.startswith("data:"):
        return None
    body = line[5:].strip().encode()
    try:
        chunk = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = chunk.get("error") if isinstance(chunk, dict) else None
    return body if isinstance(error, dict) and error.get("type") == "invalid_request_error" else None


def _has_token(line: str) -> bool:
    """Whether an SSE line carries output (content, text, tool calls, a finish, usage) or ends the stream."""
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if '"role"' not in payload:
        return True  # only the opening role chunk can be empty: skip parsing everything else
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return True  # not ours to judge: pass it on
    if not isinstance(chunk, dict):
        return True
    if chunk.get("error") or chunk.get("usage"):
        return True
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return True  # not a chunk we understand: not ours to judge either
    for choice in choices:
        if not isinstance(choice, dict):
            return True
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            return True
        if (
            choice.get("finish_reason")
            or choice.get("text")
            or delta.get("content")
            or delta.get("tool_calls")
        ):
            return True
        if delta.get("reasoning_content") or delta.get("function_call") or delta.get("refusal"):
            return True
    return False


def opening_choices(line: str) -> frozenset[int] | None:
    """The choices a data line opens when it is an opening event and no more (None otherwise): a
    JSON object of the usual fields whose choices' deltas hold nothing but a role (an empty content
    at most), with no finish, logprobs, usage or error. Only such a line goes out with a stream's
    head, and only such lines of a later upstream, for choices the client has an opening of, are
    dropped (anything else in them is the client's)."""
    try:
        chunk = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(chunk, dict) or not chunk.keys() <= _CHUNK_KEYS or chunk.get("usage") is not None:
        return None
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    indices = set()
    for choice in choices:
        if not isinstance(choice, dict) or any(
            value not in (None, "", [], {})
            for name, value in choice.items()
            if name not in ("index", "delta")
        ):
            return None
        delta, index = choice.get("delta"), choice.get("index", 0)
        if (
            not isinstance(delta, dict)
            or type(index) is not int
            or any(value not in (None, "") for name, value in delta.items() if name != "role")
        ):
            return None
        indices.add(index)
    return frozenset(indices)


# a chunk's fields that carry nothing of the answer (an opening event with others is kept whole)
_CHUNK_KEYS = frozenset({"id", "object", "created", "model", "choices", "usage", "system_fingerprint",
                         "service_tier", "obfuscation"})  # fmt: skip


_HEAD_EVENTS = 64  # events before the first token (a role chunk, a few empty deltas) at most
_SSE_FIELDS = (":", "event:", "id:", "retry:")  # SSE lines that carry no data: skipped


# awaited when a stream's first event arrives, with its line and the choices it opens (None: it is
# not an opening event and no more); True: the line went out with the stream's head
FirstEvent = Callable[[str, frozenset[int] | None], Awaitable[bool]]


async def until_first_token(lines: AsyncIterator[str], first_event: FirstEvent | None = None,
                             opened: frozenset[int] = frozenset()) -> list[str]:  # fmt: skip
    """Data lines up to and including the first that carries a token (the role chunk alone does
    not). A body that is not an event stream (an HTML page, a JSON answer), an end before any
    token, or more than _HEAD_EVENTS events without one is a stream that broke before its first
    token: the caller tries the next candidate, and none of its events reaches the client.
    `first_event` is awaited when the first data line arrives (the upstream has begun a stream);
    a line it sent is not kept. `opened`: the choices whose opening event the client has already
    (an earlier upstream's): this upstream's opening events for those choices are dropped.
    Every line counts toward _HEAD_EVENTS, token id lines too."""
    head: list[str] = []
    events = 0  # data and token id lines seen, kept or not
    async for line in lines:
        if line.startswith("data:"):
            token = _has_token(line)
            opening = None if token else opening_choices(line)
            sent = False
            if first_event is not None:
                sent = await first_event(line, opening)
                first_event = None
            if token:
                if '"error"' in line and _failed_upstream(line):
                    raise UpstreamStreamError("the stream sent an error before its first token")
                head.append(line)
                return head
            if not sent and (opening is None or not opening <= opened):
                head.append(line)
        elif line.startswith((TOKEN_IDS, PROMPT_TOKENS)):  # an engine's token ids (resumption) or its
            head.append(line)  # prompt's count (the log's): the relay's to read
        elif line.startswith(_SSE_FIELDS):
            continue
        else:
            raise UpstreamStreamError("the answer is not an event stream")
        events += 1
        if events >= _HEAD_EVENTS:
            raise UpstreamStreamError(f"no token in the stream's first {_HEAD_EVENTS} events")
    if not events:
        raise UpstreamStreamError("the stream ended before its first event")
    raise UpstreamStreamError("the stream ended before its first token")
