"""RequestStream: one request's outputs, handed from the engine thread to its asyncio handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.outputs import RequestOutput


class RequestStream:
    """The outputs of one request, handed from the engine thread to its handler.

    Only the latest cumulative output is kept, so a slow reader gets several tokens at once.
    `close()` (also on an early exit) aborts the request if it has not finished.
    """

    def __init__(self, request_id: str, release: Callable[[str, bool], None]) -> None:
        self.request_id = request_id
        self._release = release  # (request_id, abort): the engine frees the request
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False  # the reader has seen the final output
        self.closed = False
        self.on_final: Callable[[RequestOutput], None] | None = None  # e.g. tracing's phase spans

    def put(self, output: RequestOutput) -> None:
        """Replace the pending output (event-loop thread only)."""
        self._latest = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error (event-loop thread only)."""
        self._error = error
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise self._error
            out = self._latest
            assert out is not None
            self.finished = out.finished
            if self.finished and self.on_final is not None:
                self.on_final(out)
            yield out

    def close(self) -> None:
        """Stop reading: an unfinished request is aborted and its KV blocks freed."""
        if self.closed:
            return
        self.closed = True
        self._release(self.request_id, not self.finished)

    async def aclose(self) -> None:
        """`close()`, for `contextlib.aclosing` and friends."""
        self.close()
