"""RequestStream: one request's deltas, handed from the engine thread to its asyncio handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.outputs import RequestOutput


class RequestStream:
    """The deltas of one request, handed from the engine thread to its handler.

    Deltas the reader has not taken yet are folded into one (`RequestOutput.add`), so a slow
    reader gets several tokens at once and the queue never grows.
    `close()` (also on an early exit) aborts the request if it has not finished.
    """

    def __init__(self, request_id: str, release: Callable[[str, bool], None]) -> None:
        self.request_id = request_id
        self._release = release  # (request_id, abort): the engine frees the request
        self._pending: RequestOutput | None = None  # deltas not read yet, folded into one
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False  # the reader has seen the final output
        self.closed = False
        self.on_final: Callable[[RequestOutput], None] | None = None  # e.g. tracing's phase spans
        self.prompt_tokens = 0  # the prompt's tokens once admitted (chat template applied)

    def put(self, delta: RequestOutput) -> None:
        """Queue a delta, folded into any not read yet (event-loop thread only)."""
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.add(delta)
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
            out, self._pending = self._pending, None
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
