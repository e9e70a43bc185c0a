"""A replica's stream pumped into a callback (backends/replica_lines.py) against raw loopback
servers: the lines reach `take` from the connection's own callbacks, in order, whatever the chunk
boundaries; a declined line is handed back and the next pump goes on after it; what `take` raises
and what breaks the connection are raised in the reader's task; a reader that leaves stops the feed."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends.base import UpstreamStreamError
from gateway.backends.replica_lines import ReplicaLines
from gateway.backends.wire import WirePool, WireResponse
from gateway.backends.wire_connection import WireError
from tests.gateway.backends.test_wire import SSE_HEAD, read_request, serving

Writes = list[bytes]


def _chunk(part: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(part), part)


def _paced(writes: Writes, end: bytes = b"0\r\n\r\n", gap: float = 0.01):  # type: ignore[no-untyped-def]
    """A handler that sends the SSE head, then each write `gap` seconds apart, then `end`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for part in writes:
            await asyncio.sleep(gap)
            writer.write(part)
            await writer.drain()
        await asyncio.sleep(gap)
        writer.write(end)
        await writer.drain()

    return handler


async def _opened(url: str) -> tuple[WireResponse, ReplicaLines, list[bool]]:
    verdicts: list[bool] = []
    resp = await WirePool(url, {}).post("/v1/x", b"{}", 1.0, 5.0)
    return resp, ReplicaLines(resp, "pool (replica)", 0.0, None, verdicts.append, 30.0), verdicts


def test_lines_reach_take_from_the_connection_callbacks_in_order_until_the_end() -> None:
    writes = [_chunk(b"data: 1\n\ndata: 2\n"), _chunk(b"\ndata: 3"), _chunk(b"\n\n"), _chunk(b"data: 4\n\n")]

    async def main() -> None:
        async with serving(_paced(writes)) as (url, _):
            resp, lines, verdicts = await _opened(url)
            taken: list[tuple[str, bool]] = []

            def take(line: str) -> bool:  # whether it runs inside a task (a woken reader) or not
                taken.append((line, asyncio.current_task() is not None))
                return True

            try:
                assert await lines.pump(take) is None
            finally:
                resp.release()
            assert [line for line, _ in taken] == ["data: 1", "data: 2", "data: 3", "data: 4"]
            assert not any(in_task for _, in_task in taken)  # none woke the reader's task
            assert verdicts == [True]

    asyncio.run(main())


def test_a_declined_line_is_handed_back_and_the_next_pump_goes_on_after_it() -> None:
    writes = [_chunk(b"data: 1\n\ndata: stop\n\ndata: 2\n\n"), _chunk(b"data: [DONE]\n\n")]

    async def main() -> None:
        async with serving(_paced(writes)) as (url, _):
            resp, lines, _ = await _opened(url)
            taken: list[str] = []

            def take(line: str) -> bool:
                if line in ("data: stop", "data: [DONE]"):
                    return False
                taken.append(line)
                return True

            try:
                assert await lines.pump(take) == "data: stop"
                assert taken == ["data: 1"]
                assert await lines.pump(take) == "data: [DONE]"
                assert taken == ["data: 1", "data: 2"]
                assert [line async for line in lines] == []  # the end, read as lines
            finally:
                resp.release()

    asyncio.run(main())


def test_what_take_raises_and_a_connection_that_breaks_are_raised_in_the_reader() -> None:
    async def main() -> None:
        async with serving(_paced([_chunk(b"data: 1\n\n"), _chunk(b"data: bad\n\n")])) as (url, _):
            resp, lines, _ = await _opened(url)

            def take(line: str) -> bool:
                if line == "data: bad":
                    raise ValueError("not an event")
                return True

            try:
                with pytest.raises(ValueError, match="not an event"):
                    await lines.pump(take)
            finally:
                resp.release()
        cut = _paced([_chunk(b"data: 1\n\n"), _chunk(b"data: 2\n\n")], end=b"")  # closes mid-answer
        async with serving(cut) as (url, _):
            resp, lines, verdicts = await _opened(url)
            try:
                with pytest.raises(
                    UpstreamStreamError, match=r"pool \(replica\): the upstream closed"
                ) as broke:
                    await lines.pump(lambda line: True)
            finally:
                resp.release()
            # its cause, as when awaited: what the break is labelled by (a silence's TimeoutError: "timeout",
            # was "reset" when pumped)
            assert isinstance(broke.value.__cause__, WireError)
            assert verdicts == [True, False]  # the first line's, then the break's (the pool keeps the first)

    asyncio.run(main())


def test_a_reader_cancelled_while_pumping_stops_the_feed() -> None:
    async def main() -> None:
        async with serving(_paced([_chunk(b"data: %d\n\n" % i) for i in range(20)], gap=0.02)) as (url, _):
            resp, lines, _ = await _opened(url)
            taken: list[str] = []
            pumping = asyncio.ensure_future(lines.pump(lambda line: taken.append(line) is None))  # type: ignore[func-returns-value]
            await asyncio.sleep(0.1)
            pumping.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pumping
            count = len(taken)
            assert 0 < count < 20
            await asyncio.sleep(0.1)  # more arrives: nobody is fed it
            assert len(taken) == count
            resp.release()

    asyncio.run(main())


def test_a_line_longer_than_the_read_ahead_reaches_take_though_the_socket_paused_for_it() -> None:
    """The connection stops reading a megabyte ahead of its reader (wire.py's pause); a line that
    long is still one line (up to MAX_LINE_BYTES): the pump, which is waiting for its end, reads on."""
    big = b"data: " + b"x" * (3 << 20)
    writes = [_chunk(b"data: 1\n\n"), _chunk(big + b"\n\n"), _chunk(b"data: 2\n\n")]

    async def main() -> None:
        async with serving(_paced(writes)) as (url, _):
            resp, lines, _ = await _opened(url)
            taken: list[int] = []

            def take(line: str) -> bool:
                taken.append(len(line))
                return True

            try:
                async with asyncio.timeout(5):
                    assert await lines.pump(take) is None
            finally:
                resp.release()
            assert taken == [7, len(big), 7]

    asyncio.run(main())


@pytest.mark.parametrize("pumped", [False, True])
def test_the_engines_prompt_count_line_is_not_the_first_token(pumped: bool) -> None:
    """`: prompt_tokens N` comes the moment the engine admits the request, before prefill: the
    first-token verdict (and the silence watch after it) wait for the stream's own first line."""
    import time

    writes = [_chunk(b": prompt_tokens 5\n\n"), _chunk(b"data: 1\n\n"), _chunk(b"data: 2\n\n")]

    async def main() -> None:
        async with serving(_paced(writes, gap=0.15)) as (url, _):
            started = time.perf_counter()
            resp = await WirePool(url, {}).post("/v1/x", b"{}", 1.0, 5.0)
            verdicts: list[bool] = []
            lines = ReplicaLines(resp, "pool (replica)", started, 0.2, verdicts.append, 30.0)
            try:
                if pumped:
                    assert await lines.pump(lambda line: True) is None
                else:
                    assert [line async for line in lines] == [": prompt_tokens 5", "data: 1", "data: 2"]
            finally:
                resp.release()
            assert verdicts == [False]  # the first data line came 0.3 s in: past the 0.2 s SLO

    asyncio.run(main())
