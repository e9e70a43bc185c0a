"""A replica's streamed answer as lines: awaited one by one, or pumped into a callback.

Awaited (`async for`), each line that is not buffered yet costs the reader's task a wake-up: the
connection's callback resolves a future, the loop schedules the task, and the task resumes through
its stack of coroutines and generators. Pumped (`pump(take)`), the connection's callback hands the
lines to `take` itself, and the reader's task sleeps until `take` declines a line or the stream
ends: the relay's steady state (one event per upstream write) then costs no task switch at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.backends.base import PROMPT_TOKENS, UpstreamStreamError
from gateway.backends.wire import More, WireResponse
from gateway.backends.wire_connection import WireError

# Bounds on what a replica may send back. An honest engine's SSE event stays far below the line
# bound (it splits big deltas); past it, or past the reply bound (base.MAX_REPLY_BYTES), the answer
# is a fault, not data.
MAX_LINE_BYTES = 8 << 20


def _no_verdict(ok: bool) -> None:
    """The verdict of an answer already whole: nothing more to tell."""


class ReplicaLines:
    """A stream's non-blank lines (an async iterator, and `pump`). The first line's delay is the
    replica's first-token verdict; after it, `silence` seconds without a byte break the stream
    (timeouts.between_tokens); a connection's failure is an UpstreamStreamError naming the replica."""

    __slots__ = ("_name", "_resp", "_silence", "_slo", "_started", "_taken", "_verdict")

    def __init__(self, resp: WireResponse, name: str, started: float, slo: float | None,
                 verdict: Callable[[bool], None], silence: float) -> None:  # fmt: skip
        self._resp = resp
        self._name = name  # "pool (replica url)", for the error
        self._started = started
        self._slo = slo
        self._verdict = verdict
        self._silence = silence
        self._taken = 0  # lines handed out

    def __aiter__(self) -> ReplicaLines:
        return self

    async def __anext__(self) -> str:
        resp = self._resp
        if self._taken < 3:
            self._asked()
        try:
            while (line := resp.buffered_line(MAX_LINE_BYTES)) is More.MORE:
                await resp.more()
        except (WireError, TimeoutError) as exc:
            raise self._broke(exc) from exc
        if line is None:
            raise StopAsyncIteration
        if self._taken < 2 and not line.startswith(PROMPT_TOKENS):  # the engine's count comes at once
            self._took()
        return line

    async def pump(self, take: Callable[[str], bool]) -> str | None:
        """Hand each line to `take` as it arrives, from the connection's callbacks, until `take`
        returns False for one (returned, for the caller to handle) or the stream ends (None). What
        `take` raises, or the stream's failure, is raised here; `take` must not wait on anything."""
        resp = self._resp
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

        def fed() -> None:
            if done.done():  # decided already: what arrives waits in the buffer for the next reader
                return
            try:
                while True:
                    if self._taken < 3:
                        self._asked()
                    line = resp.buffered_line(MAX_LINE_BYTES)
                    if line is More.MORE:
                        return
                    if line is not None and self._taken < 2 and not line.startswith(PROMPT_TOKENS):
                        self._took()
                    if line is None or not take(line):
                        done.set_result(line)
                        return
            except (WireError, TimeoutError) as exc:
                broke = self._broke(exc)
                broke.__cause__ = exc  # as `raise ... from exc` in __anext__: a silence reads as a timeout
                done.set_exception(broke)
            except Exception as exc:  # take's: raised in the reader's task, as if it had read the line
                done.set_exception(exc)

        resp.listen(fed)
        try:
            fed()  # what is buffered already
            return await done
        finally:
            resp.listen(None)

    def _took(self) -> None:
        """A line is handed out: the first one's delay is the replica's first-token verdict."""
        self._taken += 1
        if self._taken == 1:
            self._verdict(self._slo is None or time.perf_counter() - self._started <= self._slo)

    def _asked(self) -> None:
        """The reader asks for a line: for the third, the silence watch starts. A chat stream's
        first is its role chunk, sent at once, and the wait for the first token is first_token's to
        bound (a prefill behind a grammar compile on a busy CPU may take longer than
        between_tokens); nor is it set on the first token's way out."""
        if self._taken == 2:
            self._taken = 3
            self._resp.watch_silence(self._silence)

    def answered(self) -> None:
        """The answer is whole ([DONE] came): a break while what follows it is drained is not the
        replica's failure (its breaker heard the answer's verdict already)."""
        self._verdict = _no_verdict

    def _broke(self, exc: WireError | TimeoutError) -> UpstreamStreamError:
        self._verdict(False)
        reason = "timeout" if isinstance(exc, TimeoutError) else str(exc)
        return UpstreamStreamError(f"{self._name}: {reason}")
