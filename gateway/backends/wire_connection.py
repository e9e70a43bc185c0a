"""One keep-alive HTTP/1.1 connection to an engine replica: an asyncio protocol on httptools' parser
whose body lands in one buffer (wire.py's WireResponse reads it; its WirePool lends it out)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httptools

# A reader that falls this far behind pauses the socket (the replica waits) until it catches up.
_PAUSE_BYTES = 1 << 20
MAX_HEAD_BYTES = 64 << 10  # a response's status line and headers (an engine's are ~200 bytes)


class WireError(Exception):
    """The connection failed, closed before the answer ended, or carried something that is not HTTP."""


class Connection(asyncio.Protocol):
    """One keep-alive connection; one exchange at a time (the pool lends it out)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[None] | None = None  # resolved when the response's headers are in
        self.waiter: asyncio.Future[None] | None = None  # a reader waiting for more body
        self.listener: Callable[[], None] | None = None  # a reader fed from these callbacks (listen)
        self.buffer = bytearray()
        self.received = 0  # bytes of the current response so far
        self.status = 0
        self.framed = False  # the answer declares its length (content-length or chunked)
        self.retry_after: bytes | None = None  # the answer's Retry-After (an overloaded replica's)
        self.complete = False  # the whole response is in
        self.interim = False  # the answer being read is a 1xx, the final one still to come
        self.error: BaseException | None = None
        self.reusable = False  # complete, keep-alive, nothing wrong
        self.exchanges = 0  # responses completed on this connection
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # bytes nobody asked for (an idle connection): not a server we trust
            self.fail(WireError("the upstream sent bytes outside an exchange"))
            return
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # (an upgrade: never asked)
            self.fail(WireError(f"the upstream's answer is not valid HTTP/1.1 ({type(exc).__name__})"))
            return
        if not self.status and self.received > MAX_HEAD_BYTES:  # headers without end: refused early
            self.fail(WireError(f"the upstream's response head passed {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self.status and not self.framed and not self.complete:
            self.complete = True  # a body that ends with the connection (no length given) is whole
            self._wake()
        if not self.complete:
            self.fail(WireError(f"the upstream closed the connection ({exc or 'end of stream'})"))
        self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower in (b"content-length", b"transfer-encoding"):
            self.framed = True
        elif lower == b"retry-after":
            self.retry_after = value[:32]

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status == 101:  # an upgrade nobody asked for: no HTTP follows
            self.fail(WireError("the upstream switched protocols (HTTP 101)"))
            return
        if 100 <= status < 200:
            # an interim answer (100 Continue, 103 Early Hints: RFC 9110 15.2, sent unasked too): the
            # final one follows. Taken for it, the exchange ended at once, and the connection went
            # back to the pool with the real answer still to come: the next request read it
            self.interim = True
            self.framed, self.retry_after = False, None
            return
        self.status = status
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.buffer += body
        self._wake()
        # a listener takes each line as it ends: what it leaves is one line still arriving, which
        # it waits for (a pause would stall it for good: nothing else resumes the socket)
        if len(self.buffer) > _PAUSE_BYTES and self.transport is not None and self.listener is None:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.interim:  # (its head counts toward MAX_HEAD_BYTES with the final one's: no endless 1xx)
            self.interim = False
            return
        self.complete = True
        self.reusable = self.parser.should_keep_alive()
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the exchange with `error` (the first one counts) and drop the connection."""
        if self.error is None and not self.complete:
            self.error = error
        self.reusable = False
        if self.head is not None and not self.head.done():
            self.head.set_exception(self.error or error)
            self.head.exception()  # retrieved here: a caller that left must not log "never retrieved"
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def more(self) -> asyncio.Future[None]:
        """A future resolved when more body, the end or an error arrives (a paused socket reads
        again). A future, not a coroutine: a stream's reader awaits one per upstream write."""
        assert self.transport is not None
        if self.transport.is_reading() is False:
            self.transport.resume_reading()
        self.waiter = waiter = asyncio.get_running_loop().create_future()
        return waiter

    def _wake(self) -> None:
        if self.listener is not None:
            self.listener()
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


def reset(conn: Connection) -> None:
    """A kept-alive connection, ready for its next exchange."""
    conn.parser = httptools.HttpResponseParser(conn)
    conn.received = conn.status = 0
    conn.complete = conn.reusable = conn.framed = conn.interim = False
    conn.retry_after = conn.error = None
    # a long body paused the socket on its last bytes (on_body cannot know they were the last)
    if conn.transport is not None and conn.transport.is_reading() is False:
        conn.transport.resume_reading()
