"""From request streams to one HTTP response: merged outputs, and SSE events that end cleanly.

A response may carry several requests (`n`, prompt lists). `EventStream` ends a broken stream with
an OpenAI error event (the status is already sent) and, however the response ends, even if it never
starts, releases every request it holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from engine.http.error_mapping import api_error
from engine.http.openai_format import error_event
from engine.http.protocol import INTERNAL_ERROR, APIError
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream

logger = logging.getLogger(__name__)


def stream_error(exc: Exception) -> APIError:
    """The OpenAI error that ends a stream broken by `exc` (no internal text)."""
    error = api_error(exc)
    if error is INTERNAL_ERROR:
        logger.error("a stream failed", exc_info=exc)
    return error


class EventStream:
    """The SSE events of one response. An error ends them with an error event; however the
    response ends, even if it never starts, `aclose()` closes its requests (aborting unfinished ones).
    """

    def __init__(self, events: AsyncIterator[bytes], streams: list[RequestStream]) -> None:
        self._events = _until_error(events, streams)
        self._streams = streams

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._events.__anext__()
        except BaseException:  # the end, an error, or a cancelled (disconnected) response
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop: the event generator is closed and the requests released."""
        try:
            await self._events.aclose()  # type: ignore[attr-defined]
        finally:
            close_all(self._streams)


async def _until_error(events: AsyncIterator[bytes], streams: list[RequestStream]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    except Exception as exc:  # after the first byte the status is sent: say it in the stream
        yield error_event(stream_error(exc))
    finally:  # also when the loop finalizes an abandoned generator
        await events.aclose()  # type: ignore[attr-defined]
        close_all(streams)


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def whole_output(deltas: RequestStream) -> RequestOutput:
    """A request's deltas folded into its whole output (for a response that is not streamed)."""
    whole = None
    async for delta in deltas:
        if whole is None:
            whole = delta
        else:
            whole.add(delta)
    assert whole is not None and whole.finished
    return whole


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await q.put((k, out))
        except Exception as exc:
            await q.put((k, exc))
        finally:
            await q.put(None)

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await q.get()
            if item is None:
                remaining -= 1
                continue
            k, value = item
            if isinstance(value, BaseException):
                raise value
            yield k, value
    finally:
        for t in tasks:
            t.cancel()
