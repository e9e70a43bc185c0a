"""HTTP/1.1 to one engine replica over an asyncio protocol: the engine pool's hot path, lean.

Why not aiohttp (which the health checks still use): on the stream relay benchmark a relayed chunk
went through aiohttp's protocol, its parser wrapper, a StreamReader, `iter_any` and a timer context
before our line splitter saw it, and opening a request cost ~0.15 ms of Python before the first
byte left. Here httptools (llhttp, the parser uvicorn uses) calls back into one small protocol
object; the body lands in one buffer that the reader splits in place; one timer bounds the whole
exchange. What the engine pool needs and nothing else: POST with a body, keep-alive reuse, the
status, a bounded whole body or bounded lines, and a close that the engine sees as a disconnect.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from gateway.backends.wire_connection import Connection, WireError, reset

logger = logging.getLogger(__name__)


class More(enum.Enum):
    """WireResponse.buffered_line's answer when the line has not all arrived yet."""

    MORE = "more"


class WireResponse:
    """An answer being received: `status` now, the body by `read` or line by line by `lines`.

    `release()` ends it: a connection whose answer was read to the end goes back to the pool; one
    abandoned in the middle is closed, which the engine takes as the client leaving (it aborts).
    """

    def __init__(self, pool: WirePool, conn: Connection, timer: asyncio.TimerHandle | None) -> None:
        self.status = conn.status
        self.retry_after = conn.retry_after  # raw: upstream_errors.retry_after_seconds reads it
        self._pool = pool
        self._conn = conn
        self._timer = timer
        # watch_silence: (check period, bytes seen at the last check, quiet checks in a row)
        self._quiet: tuple[float, int, int] | None = None
        self._start = 0  # where the next line begins in the connection's buffer
        self._scanned = 0  # bytes of the buffer already searched for a newline
        self._released = False

    @property
    def complete(self) -> bool:
        """Whether the whole answer has arrived."""
        return self._conn.complete

    async def read(self, limit: int) -> bytes:
        """The whole body, at most `limit` bytes (past it: WireError)."""
        conn = self._conn
        while len(conn.buffer) <= limit:
            if conn.complete:
                return bytes(conn.buffer)
            if conn.error is not None:
                raise conn.error
            await conn.more()
        logger.warning("an upstream answer passed %d bytes: refused", limit)
        raise WireError(f"the answer is longer than {limit} bytes")

    async def next_line(self, limit: int) -> str | None:
        """The next non-blank line (at most `limit` bytes, else WireError); None at the end.

        Bytes that are not UTF-8 become U+FFFD, so invalid text never reaches a client; blank lines
        (SSE event separators) are skipped: the relay frames each event itself.
        """
        while (line := self.buffered_line(limit)) is More.MORE:
            await self.more()
        return line

    def more(self) -> asyncio.Future[None]:
        """What a reader awaits when `buffered_line` says MORE."""
        return self._conn.more()

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Call `listener` (None: stop) from the connection's own callbacks each time more body,
        the end or an error arrives, instead of waking a task: a reader that can take lines there
        (`buffered_line`) saves a task's wake-up per upstream write. It must not raise. A socket
        paused for a reader that fell behind reads again."""
        conn = self._conn
        conn.listener = listener
        if listener is not None and conn.transport is not None and conn.transport.is_reading() is False:
            conn.transport.resume_reading()

    def buffered_line(self, limit: int) -> str | More | None:
        """`next_line` without waiting: the next line if the buffer holds it, None at the end, MORE
        when the answer goes on beyond the buffer (await `more()`, then ask again). A stream's
        reader calls this once or twice per upstream write: no coroutine made per line."""
        conn = self._conn
        buffer = conn.buffer
        if not buffer:  # all handed out (the usual state between an upstream's writes): no search
            if conn.complete:
                return None
            if conn.error is not None:
                raise conn.error
            return More.MORE
        while True:
            end = buffer.find(b"\n", self._scanned)
            if end != -1:
                start = self._start
                self._start = self._scanned = end + 1
                if end - start > limit:
                    raise WireError(f"an SSE line longer than {limit} bytes")
                if end - start > 1 or (end > start and buffer[start] != 13):  # not "" nor "\r"
                    line = _sse_line(buffer[start:end])
                    tail = len(buffer) - end - 1  # what follows: nothing or the event's blank line,
                    if (
                        not tail
                        or (tail == 1 and buffer[-1] == 10)
                        or (tail == 2 and buffer.endswith(b"\r\n"))
                    ):
                        buffer.clear()  # mostly: then the next ask is answered without a search
                        self._start = self._scanned = 0
                    return line
                continue
            if self._start:  # drop what was handed out; the rest is a line still growing
                del buffer[: self._start]
                self._start = 0
            self._scanned = len(buffer)
            if self._scanned > limit:
                raise WireError(f"an SSE line longer than {limit} bytes")
            if conn.complete:
                self._scanned = 0
                if buffer.strip(b"\r"):
                    line = _sse_line(buffer)
                    buffer.clear()
                    return line
                return None
            if conn.error is not None:
                raise conn.error
            return More.MORE

    def watch_silence(self, seconds: float) -> None:
        """End the answer with TimeoutError once no byte has arrived for `seconds` (noticed within
        1.25 x that): a replica gone silent mid-stream. One timer a quarter of that, not one a line."""
        self._quiet = (seconds / 4, self._conn.received, 0)
        asyncio.get_running_loop().call_later(seconds / 4, self._check_silence)

    def _check_silence(self) -> None:
        conn, quiet = self._conn, self._quiet
        if quiet is None or self._released or conn.complete or conn.error is not None:
            return
        period, seen, periods = quiet
        # a socket we paused (a megabyte unread: the relay's client is not reading) can bring no
        # byte; that quiet is the reader's, not the replica's
        paused = conn.transport is not None and conn.transport.is_reading() is False
        periods = periods + 1 if conn.received == seen and not paused else 0
        if periods >= 4:
            conn.fail(TimeoutError())
            return
        self._quiet = (period, conn.received, periods)
        asyncio.get_running_loop().call_later(period, self._check_silence)

    def release(self) -> None:
        """Give the connection back (read to the end) or close it (abandoned); idempotent."""
        if self._released:
            return
        self._released = True
        self._quiet = None
        if self._timer is not None:
            self._timer.cancel()
        self._pool.put_back(self._conn)


class WirePool:
    """Keep-alive connections to one replica URL (`http://host:port/base` or https)."""

    def __init__(
        self, url: str, headers: Mapping[str, str], limit: int = 1000, idle_seconds: float = 60.0
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._base = parts.path.rstrip("/")
        self._static = _header_block({"host": parts.netloc, **headers})
        self._idle: list[Connection] = []  # most recently used last
        self._lent: set[Connection] = set()  # in an exchange now (fail_lent)
        self._open = 0
        self._limit = limit
        self._idle_seconds = idle_seconds
        self._slots: list[asyncio.Future[None]] = []  # callers waiting for a connection under the limit
        self._pruning: asyncio.TimerHandle | None = None  # when the oldest idle connection expires
        self._closed = False  # close() ran: a connection given back after it is closed, not kept

    async def post(
        self,
        path: str,
        body: bytes,
        connect_timeout: float | None,
        total: float | None,
        headers: Mapping[str, str] | None = None,
    ) -> WireResponse:
        """Send a POST and wait for the answer's head; `total` bounds the whole exchange, body included.

        A reused connection that the replica had closed while idle fails before any byte of an
        answer; such a request never reached the application, so it is sent once more on a new one.
        """
        request = b"".join(
            (
                b"POST %s HTTP/1.1\r\n" % (self._base + path).encode(),
                self._static,
                _header_block(headers) if headers else b"",
                b"content-length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        loop = asyncio.get_running_loop()
        deadline = None if total is None else loop.time() + total
        for attempt in (0, 1):
            conn = await self._acquire(connect_timeout)
            self._lent.add(conn)
            reused = conn.exchanges > 0
            conn.head = loop.create_future()
            timer = None if deadline is None else loop.call_at(deadline, conn.fail, TimeoutError())
            assert conn.transport is not None
            conn.transport.write(request)
            try:
                await conn.head
            except WireError:
                if timer is not None:
                    timer.cancel()
                self.put_back(conn)
                if reused and conn.received == 0 and attempt == 0:
                    continue
                raise
            except BaseException:
                if timer is not None:
                    timer.cancel()
                conn.fail(WireError("the request was abandoned"))
                self.put_back(conn)
                raise
            return WireResponse(self, conn, timer)
        raise AssertionError("unreachable")

    async def _acquire(self, connect_timeout: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._idle:
            conn = self._idle.pop()
            transport = conn.transport
            if (
                transport is not None
                and not transport.is_closing()
                and now - conn.idle_since < self._idle_seconds
            ):
                reset(conn)
                return conn
            self._drop(conn)
        while self._open >= self._limit:
            slot = loop.create_future()
            self._slots.append(slot)
            try:
                await slot
            finally:
                if slot in self._slots:
                    self._slots.remove(slot)
            if self._idle:
                return await self._acquire(connect_timeout)
        self._open += 1
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(
                    Connection, self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl else None,
                )  # fmt: skip
        except BaseException:
            self._open -= 1
            self._free_slot()
            raise
        return conn

    def put_back(self, conn: Connection) -> None:
        """Keep a connection whose exchange ended cleanly; close any other."""
        self._lent.discard(conn)
        conn.head = conn.listener = None
        # freed now: the connection and its parser refer to each other, so a dropped one lives
        # until the cyclic GC runs, and a kept one would hold its last answer while idle
        conn.buffer = bytearray()
        if (
            conn.reusable
            and not self._closed
            and conn.transport is not None
            and not conn.transport.is_closing()
        ):
            conn.exchanges += 1
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
            if self._pruning is None:
                self._prune_at(conn.idle_since + self._idle_seconds)
            self._free_slot()
            return
        self._drop(conn)

    def _prune_at(self, when: float) -> None:
        self._pruning = asyncio.get_running_loop().call_at(when, self._prune)

    def _prune(self) -> None:
        """Close the connections idle for `idle_seconds` (the oldest first in the list): a burst's
        connections were kept until the pool's next call, however long that took."""
        self._pruning = None
        cutoff = asyncio.get_running_loop().time() - self._idle_seconds
        expired = 0
        while expired < len(self._idle) and self._idle[expired].idle_since <= cutoff:
            expired += 1
        for conn in self._idle[:expired]:
            self._drop(conn)
        del self._idle[:expired]
        if self._idle:
            self._prune_at(self._idle[0].idle_since + self._idle_seconds)

    def _drop(self, conn: Connection) -> None:
        if conn.transport is not None:
            conn.transport.close()
        self._open -= 1
        self._free_slot()

    def _free_slot(self) -> None:
        while self._slots:
            slot = self._slots.pop(0)
            if not slot.done():
                slot.set_result(None)
                return

    def fail_lent(self, error: BaseException) -> int:
        """End every exchange in progress with `error` (its caller raises it) and drop its connection:
        the replica went silent, and its answers will not come. Returns how many there were."""
        lent = list(self._lent)
        for conn in lent:
            conn.fail(error)
        return len(lent)

    def close(self) -> None:
        """Close every idle connection (lent ones close when their exchange ends)."""
        self._closed = True
        if self._pruning is not None:
            self._pruning.cancel()
            self._pruning = None
        while self._idle:
            self._drop(self._idle.pop())


def _header_block(headers: Mapping[str, str]) -> bytes:
    """`name: value\\r\\n` lines; a CR or LF in a name or value would split the request (refused)."""
    lines = []
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0"):
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


def _sse_line(raw: bytes | bytearray) -> str:
    """One SSE line as text: trailing blanks dropped, a byte order mark before it too (SSE allows one
    at the stream's start: the stream failed as "not an event stream"), and `data:` given its optional
    space, so that `data:[DONE]` ends a stream and `data:{...}` is counted as `data: {...}` is."""
    line = raw.decode("utf-8", "replace").rstrip("\r \t")
    if line[:1] == "\ufeff":
        line = line[1:]
    return "data: " + line[5:] if line[:6] != "data: " and line[:5] == "data:" else line
