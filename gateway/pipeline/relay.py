"""A streamed answer relayed event by event: usage taken for the log, hidden where the client did
not ask for it, and an error event (never a silent switch) when the upstream breaks off.

The relay owns the served upstream: it closes it (`aclosing`) however the stream ends, then
hands the request's status to `done` (the log row, exactly once). Gateway time is what the relay
spends between reading a line and handing its event on; everything else (waiting on the upstream,
the client reading) is upstream time. Two clock reads a line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

import orjson

from gateway.backends.base import UpstreamStreamError
from gateway.backends.upstream_errors import error_event
from gateway.governance.usage import checked_usage
from gateway.pipeline.call import Call
from gateway.pipeline.failover import Served

logger = logging.getLogger(__name__)

_DONE = "data: [DONE]"


async def relay(call: Call, served: Served, wants_usage: bool,
                done: Callable[[Call, int, str | None], None]) -> AsyncGenerator[bytes, None]:  # fmt: skip
    """The client's events of an open stream whose first lines (`served.head`) are read already."""
    upstream = served.stream
    assert upstream is not None
    status, error = 200, None
    perf_counter = time.perf_counter
    mark = perf_counter()  # gateway time up to here is counted; what follows is the upstream's
    try:
        async with aclosing(served):
            try:
                ended = _DONE in served.head  # the upstream's end arrived (it may be in the head)
                call.upstream_seconds += perf_counter() - mark
                # read before committing to this upstream: one event for the client (one send)
                head = [e for line in served.head if (e := relay_line(call, line, wants_usage)) is not None]
                mark = perf_counter()
                if head:
                    yield b"".join(head)
                async for line in upstream.lines:
                    call.upstream_seconds += perf_counter() - mark
                    ended = ended or line == _DONE
                    event = relay_line(call, line, wants_usage)
                    mark = perf_counter()
                    if event is not None:
                        yield event
                call.upstream_seconds += perf_counter() - mark
                if not ended:  # the upstream closed the stream in the middle of the answer
                    raise UpstreamStreamError("the stream ended before data: [DONE]")
            except (asyncio.CancelledError, GeneratorExit):
                status, error = 499, "client_disconnected"
                raise
            except Exception as exc:  # broke off mid-stream: tell the client, never switch silently
                status, error = 502, "upstream_stream_error"
                if isinstance(exc, UpstreamStreamError):
                    logger.warning("request %s: the stream from %s broke: %s", call.id, call.backend, exc)
                else:
                    logger.exception("request %s: relaying %s's stream failed", call.id, call.backend)
                yield error_event(f"the upstream stream ({call.backend}) failed", error)
    finally:
        done(call, status, error)


def relay_line(call: Call, line: str, wants_usage: bool) -> bytes | None:
    """One upstream SSE line as the client should see it (usage taken for the log; None: nothing)."""
    if not line:
        return None
    if call.ttft is None:
        call.ttft = time.perf_counter() - call.started
    if not line.startswith("data:") or line == _DONE:
        return line.encode() + b"\n\n"
    # Every event is parsed (about a microsecond each): one that is not a JSON object would
    # break the client's SDK mid-answer, so it ends the stream with an error event instead.
    try:
        chunk = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        raise UpstreamStreamError("the upstream sent an event that is not JSON") from None
    if not isinstance(chunk, dict):
        raise UpstreamStreamError("the upstream sent an event that is not a JSON object")
    call.lines.append(line)  # kept for the token count if the stream ends without usage
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        call.usage = checked_usage(usage) or {}
        model = chunk.get("model")
        call.response_model = model if isinstance(model, str) else None
        if not wants_usage:
            if not chunk.get("choices"):
                return None  # the usage-only chunk the client did not ask for
            chunk.pop("usage", None)
            return b"data: " + orjson.dumps(chunk) + b"\n\n"
    elif not wants_usage and usage is None and '"usage":null' in line:  # text edit: no re-encoding
        line = line.replace(',"usage":null', "")
    return line.encode() + b"\n\n"
