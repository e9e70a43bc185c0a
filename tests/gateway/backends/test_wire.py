"""The engine pool's HTTP/1.1 client against raw loopback servers that misbehave on purpose.

Each server is a plain asyncio server whose handler reads one request (or several, kept alive)
and writes exactly the bytes a test wants: chunk boundaries in the middle of a line, bytes that
are not UTF-8, a close in the middle of a body, nothing at all.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.backends.wire import More, WirePool
from gateway.backends.wire_connection import WireError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port; yields its URL and a list counting its connections."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (content-length framed, as the pool sends them)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def all_lines(pool: WirePool, limit: int = 1 << 20) -> list[str]:
    resp = await pool.post("/v1/x", b"{}", 1.0, 5.0)
    try:
        lines = []
        while (line := await resp.next_line(limit)) is not None:
            lines.append(line)
        return lines
    finally:
        resp.release()


def test_lines_split_across_chunks_survive_bytes_that_are_not_utf8_and_skip_blank_lines() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            SSE_HEAD + chunked(b'data: {"a"', b":1}\r\n\r\ndata: \xff\xfe ok\n\n", b"data: [DO", b"NE]")
        )

    async def main() -> list[str]:
        async with serving(handler) as (url, _):
            return await all_lines(WirePool(url, {}))

    assert asyncio.run(main()) == ['data: {"a":1}', "data: \ufffd\ufffd ok", "data: [DONE]"]


def test_a_line_past_the_bound_is_an_error_and_a_line_at_it_is_not() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        long = b"x" * (50 if body.endswith(b"{}") else 80)
        writer.write(SSE_HEAD + chunked(b"data: " + long[:20], long[20:] + b"\n", b"data: y\n"))

    async def main() -> None:
        async with serving(handler) as (url, _):
            assert await all_lines(WirePool(url, {}), limit=64) == ["data: " + "x" * 50, "data: y"]
            pool = WirePool(url, {})
            resp = await pool.post("/v1/x", b"{}!", 1.0, 5.0)
            with pytest.raises(WireError, match="longer than 64 bytes"):
                while await resp.next_line(64) is not None:
                    pass
            resp.release()

    asyncio.run(main())


def test_connections_are_kept_alive_and_an_abandoned_answer_closes_its_connection() -> None:
    async def main() -> None:
        closed = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    body = await read_request(reader)
                except asyncio.IncompleteReadError:
                    closed.set()  # the client closed the connection
                    return
                if body.endswith(b"endless"):
                    writer.write(SSE_HEAD + b"8\r\ndata: 1\n\r\n")  # and never ends
                    await writer.drain()
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

        async with serving(handler) as (url, connections):
            pool = WirePool(url, {"authorization": "Bearer k"})
            for _ in range(3):
                resp = await pool.post("/v1/x", b"{}", 1.0, 5.0)
                assert (resp.status, await resp.read(100)) == (200, b"ok")
                resp.release()
            assert len(connections) == 1  # one connection served all three
            resp = await pool.post("/v1/x", b"endless", 1.0, 5.0)
            assert await resp.next_line(100) == "data: 1"
            resp.release()  # abandoned mid-answer: the server must see the connection end
            await asyncio.wait_for(closed.wait(), 2)
            resp = await pool.post("/v1/x", b"{}", 1.0, 5.0)
            assert await resp.read(100) == b"ok"
            resp.release()
            assert len(connections) == 2  # the abandoned one was not reused

    asyncio.run(main())


def test_a_body_past_its_bound_a_close_mid_answer_and_garbage_are_wire_errors() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        if body.endswith(b"big"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n" + b"x" * 5000)
        elif body.endswith(b"cut"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        else:
            writer.write(b"SMTP ready, not HTTP\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, _):
            pool = WirePool(url, {})
            for body, message in ((b"big", "longer than 1000 bytes"), (b"cut", "closed the connection")):
                resp = await pool.post("/", body, 1.0, 5.0)
                with pytest.raises(WireError, match=message):
                    await resp.read(1000)
                resp.release()
            with pytest.raises(WireError, match="not valid HTTP"):
                await pool.post("/", b"junk", 1.0, 5.0)

    asyncio.run(main())


def test_the_total_timeout_bounds_the_whole_exchange_and_the_head_wait() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        if body.endswith(b"silent"):
            await asyncio.sleep(5)
        writer.write(SSE_HEAD + b"8\r\ndata: 1\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def main() -> None:
        async with serving(handler) as (url, _):
            pool = WirePool(url, {})
            resp = await pool.post("/", b"slow", 1.0, 0.3)
            assert await resp.next_line(100) == "data: 1"
            with pytest.raises(TimeoutError):
                await resp.next_line(100)
            resp.release()
            with pytest.raises(TimeoutError):
                await pool.post("/", b"silent", 1.0, 0.3)

    asyncio.run(main())


def test_a_kept_alive_connection_the_server_closed_is_replaced_without_failing_the_request() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        # then the server closes the idle connection (its keep-alive timeout)

    async def main() -> None:
        async with serving(handler) as (url, connections):
            pool = WirePool(url, {})
            for _ in range(3):
                resp = await pool.post("/", b"{}", 1.0, 5.0)
                assert await resp.read(10) == b"ok"
                resp.release()
            assert len(connections) == 3

    asyncio.run(main())


def test_a_body_that_ends_with_the_connection_is_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async def main() -> bytes:
        async with serving(handler) as (url, _):
            resp = await WirePool(url, {}).post("/", b"{}", 1.0, 5.0)
            try:
                return await resp.read(100)
            finally:
                resp.release()

    assert asyncio.run(main()) == b"until the end"


def test_unreachable_replicas_and_headers_that_would_split_a_request_are_refused() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)

        async with serving(handler) as (url, _):
            pass  # closed: nothing listens there any more
        with pytest.raises(OSError):
            await WirePool(url, {}).post("/", b"{}", 1.0, 5.0)

    asyncio.run(main())
    with pytest.raises(ValueError, match="line break"):
        WirePool("http://127.0.0.1:1", {"x-trace": "a\r\nx-injected: 1"})
    with pytest.raises(ValueError, match="not an http"):
        WirePool("ftp://example.com", {})


def test_past_the_connection_limit_a_request_waits_for_a_free_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def main() -> None:
        async with serving(handler) as (url, connections):
            pool = WirePool(url, {}, limit=1)
            first = await pool.post("/", b"{}", 1.0, 5.0)
            second = asyncio.ensure_future(pool.post("/", b"{}", 1.0, 5.0))
            await asyncio.sleep(0.05)
            assert not second.done()  # waits: the only connection is lent out
            assert await first.read(10) == b"ok"
            first.release()
            resp = await asyncio.wait_for(second, 2)
            assert await resp.read(10) == b"ok"
            resp.release()
            assert len(connections) == 1

    asyncio.run(main())


def test_a_stream_silent_for_its_limit_times_out_and_one_that_trickles_does_not() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        writer.write(SSE_HEAD + b"8\r\ndata: 1\n\r\n")
        await writer.drain()
        gaps = [0.05] * 8 if body.endswith(b"trickle") else [5.0]  # bytes every 50 ms, or silence
        for gap in gaps:
            await asyncio.sleep(gap)
            writer.write(b"8\r\ndata: 2\n\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, _):
            pool = WirePool(url, {})
            resp = await pool.post("/", b"silent", 1.0, 10.0)
            assert await resp.next_line(100) == "data: 1"
            resp.watch_silence(0.2)
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await resp.next_line(100)
            assert 0.2 <= asyncio.get_running_loop().time() - started < 0.5  # within 1.25 x, plus slack
            resp.release()
            resp = await pool.post("/", b"trickle", 1.0, 10.0)
            resp.watch_silence(0.2)  # 0.4 s in all, but never 0.2 s without a byte
            lines = []
            while (line := await resp.next_line(100)) is not None:
                lines.append(line)
            assert lines == ["data: 1"] + ["data: 2"] * 8
            resp.release()

    asyncio.run(main())


def test_a_stream_the_reader_holds_back_is_not_silent_while_its_socket_is_paused() -> None:
    """A relay whose client stops reading stops reading the upstream too: past a megabyte buffered
    the socket is paused, no byte can arrive, and that quiet is ours, not the replica's (it was
    failed as a timeout, the stream broken and the healthy replica blamed)."""
    line = b"data: " + b"x" * 1000 + b"\n"
    count = 3000  # 3 MB: past the pause threshold and what loopback's buffers hold

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for _ in range(count):
            writer.write(b"%x\r\n%s\r\n" % (len(line), line))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, _):
            pool = WirePool(url, {})
            resp = await pool.post("/", b"{}", 1.0, 10.0)
            try:
                assert await resp.next_line(2000) is not None
                resp.watch_silence(0.2)
                await asyncio.sleep(0.8)  # the client is not reading: neither are we
                lines = 1
                while await resp.next_line(2000) is not None:
                    lines += 1
                assert lines == count
            finally:
                resp.release()

    asyncio.run(main())


def test_a_connection_kept_alive_after_a_body_past_the_pause_threshold_answers_its_next_request() -> None:
    """A whole body over a megabyte pauses the socket on its last bytes; the connection went back to
    the pool still paused and the next request on it heard nothing until its timeout (fuzz seed 1:
    a 9 MiB answer, then a 504 for the next request to that replica)."""
    big = b"y" * (3 << 20)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            answer = big if body.endswith(b"big") else b"ok"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()

    async def main() -> None:
        async with serving(handler) as (url, connections):
            pool = WirePool(url, {})
            resp = await pool.post("/v1/x", b"big", 1.0, 5.0)
            assert await resp.read(8 << 20) == big
            resp.release()
            resp = await pool.post("/v1/x", b"{}", 1.0, 2.0)
            assert await resp.read(100) == b"ok"
            resp.release()
            assert len(connections) == 1

    asyncio.run(main())


def test_an_answer_s_buffer_is_freed_when_its_exchange_ends_not_when_the_gc_runs() -> None:
    """A connection and its parser refer to each other (the parser's callbacks), so only the cyclic
    GC frees a dropped one: its buffer (up to the 64 MiB reply bound) outlived the request, and a
    kept-alive one held its last answer while idle (fuzz seeds 4, 6, 8: +330 to +560 MiB RSS)."""
    big = b"y" * (3 << 20)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
            writer.write(big)
            await writer.drain()

    async def held_after(pool: WirePool, limit: int) -> int:
        resp = await pool.post("/v1/x", b"{}", 1.0, 5.0)
        try:
            assert len(await resp.read(limit)) == len(big)
        except WireError:  # past `limit`: refused, the connection dropped
            pass
        finally:
            resp.release()
        await asyncio.sleep(0.05)
        return tracemalloc.get_traced_memory()[0]

    async def main() -> None:
        async with serving(handler) as (url, _):
            pool = WirePool(url, {})
            assert await held_after(pool, 8 << 20) < 1 << 20  # read whole, the connection idle
            assert await held_after(pool, 1 << 20) < 1 << 20  # refused, the connection closed

    gc.disable()
    tracemalloc.start()
    try:
        asyncio.run(main())
    finally:
        tracemalloc.stop()
        gc.enable()


async def pumped_lines(*parts: bytes) -> list[str]:
    """The lines of an SSE answer sent as `parts` (one HTTP chunk each), taken as a pumped reader
    takes them: from the connection's callback, after each part."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for part in parts:  # each its own read, after the reader listens
            await asyncio.sleep(0.002)
            writer.write(b"%x\r\n%s\r\n" % (len(part), part) if part else b"")
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async with serving(handler) as (url, _):
        resp = await WirePool(url, {}).post("/v1/x", b"{}", 1.0, 5.0)
        lines: list[str] = []
        ended = asyncio.get_running_loop().create_future()

        def fed() -> None:
            while (line := resp.buffered_line(1 << 20)) is not More.MORE:
                if line is None:
                    if not ended.done():
                        ended.set_result(None)
                    return
                lines.append(line)

        resp.listen(fed)
        fed()
        await asyncio.wait_for(ended, 5)
        resp.release()
        return lines


def test_lines_read_as_each_part_arrives_are_the_same_wherever_the_parts_split() -> None:
    """Every split of events with LF, CRLF, a leading CR and a comment gives the lines the whole gives."""
    content = b"data: a\r\n\r\ndata: b\n\n\rdata: c\n\ndata: d\r\n\ndata: e\n\r\n: note\n\ndata: f"
    expected = [t.rstrip("\r") for t in content.decode().split("\n") if t.rstrip("\r")]

    async def main() -> None:
        for at in range(1, len(content)):
            for second in (at, min(at + 3, len(content))):
                parts = (content[:at], content[at:second], content[second:])
                assert await pumped_lines(*parts) == expected, parts

    asyncio.run(main())


def test_idle_connections_are_closed_once_idle_for_their_limit_without_another_call() -> None:
    # was: a burst's idle connections stayed open until the pool's next call (31 of them, minutes on)
    async def main() -> None:
        ended = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal ended
            while True:
                try:
                    await read_request(reader)
                except asyncio.IncompleteReadError:
                    ended += 1  # the client closed the connection
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

        async with serving(handler) as (url, connections):
            pool = WirePool(url, {}, idle_seconds=1.0)

            async def one() -> None:
                resp = await pool.post("/v1/x", b"{}", 1.0, 5.0)
                assert await resp.read(100) == b"ok"
                resp.release()

            await asyncio.gather(*(one() for _ in range(4)))  # a burst: four connections
            assert len(connections) == 4 and ended == 0
            await asyncio.sleep(0.5)
            await one()  # one of them used again: it stays (until 1.5 s), the other three go at 1 s
            await asyncio.sleep(0.7)
            assert ended == 3
            await asyncio.sleep(0.6)
            assert ended == 4
            pool.close()

    asyncio.run(main())


def test_a_connection_given_back_after_the_pool_closed_is_closed_not_kept() -> None:
    """A retired pool (a reload removed its backend) kept the connection of an answer that ended
    after its close in its idle list, open until the idle timer (60 s by default)."""

    async def main() -> None:
        ended = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await reader.read()  # until the client closes the connection
            ended.set()

        async with serving(handler) as (url, _):
            pool = WirePool(url, {}, idle_seconds=60.0)
            resp = await pool.post("/v1/x", b"{}", 1.0, 5.0)
            pool.close()  # retired while the answer is read
            assert await resp.read(100) == b"ok"
            resp.release()
            await asyncio.wait_for(ended.wait(), 2.0)

    asyncio.run(main())


def test_an_interim_answer_is_skipped_and_the_next_request_reads_its_own_answer() -> None:
    """A 103 Early Hints (or 100 Continue) was taken for the answer: the exchange ended at once, the
    connection went back to the pool with the real answer still to come, and the next request, any
    client's, read this one's answer."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            answer = b"ANSWER " + body[-1:]
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\ncontent-length: 9\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)  # the final answer in a later read
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))  # fmt: skip
            await writer.drain()

    async def main() -> list[tuple[int, bytes]]:
        async with serving(handler) as (url, connections):
            pool = WirePool(url, {})
            got = []
            for name in (b"A", b"B", b"C"):
                resp = await pool.post("/v1/x", b'"' + name, 1.0, 5.0)
                got.append((resp.status, await resp.read(100)))
                resp.release()
            assert len(connections) == 1  # kept alive through the interim answers
            return got

    assert asyncio.run(main()) == [(200, b"ANSWER A"), (200, b"ANSWER B"), (200, b"ANSWER C")]


def test_endless_interim_answers_pass_the_head_bound_and_an_upgrade_is_a_wire_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        if body.endswith(b"upgrade"):
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\nraw")
            await writer.drain()
            return
        for _ in range(5000):  # 100 KiB of 103s: no final answer ever
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(2)

    async def main() -> None:
        async with serving(handler) as (url, _):
            with pytest.raises(WireError, match="response head passed"):
                await WirePool(url, {}).post("/v1/x", b"{}", 1.0, 5.0)
            with pytest.raises(WireError, match="switched protocols"):
                await WirePool(url, {}).post("/v1/x", b"upgrade", 1.0, 5.0)

    asyncio.run(main())


def test_data_lines_without_the_optional_space_or_with_trailing_blanks_read_as_any_other() -> None:
    """SSE makes the space after `data:` optional: `data:[DONE]` did not end a stream (an error
    event after the whole answer, a 502 row), and `data:{...}` events were not counted when the
    usage had to be (every token free)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        ending = b"data:[DONE] " if body.endswith(b"!") else b"data: [DONE] \t\n\n"  # (no newline: the end)
        bom = b"\xef\xbb\xbf"  # (a byte order mark, as SSE allows at the start)
        writer.write(SSE_HEAD + chunked(bom + b'data:{"a":1}\n\n', b"data:  two\r\n\r\n", ending))

    async def main(body: bytes) -> list[str]:
        async with serving(handler) as (url, _):
            pool = WirePool(url, {})
            resp = await pool.post("/v1/x", body, 1.0, 5.0)
            lines = []
            while (line := await resp.next_line(1 << 20)) is not None:
                lines.append(line)
            resp.release()
            return lines

    for body in (b"{}", b"{}!"):
        assert asyncio.run(main(body)) == ['data: {"a":1}', "data:  two", "data: [DONE]"]
