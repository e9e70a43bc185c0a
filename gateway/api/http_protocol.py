"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol with the limits it lacks.

uvicorn 0.54 bounds request headers only on its pure-Python h11 protocol
(`h11_max_incomplete_event_size`), which costs throughput on the hot path, and it has no header read
timeout on either: with httptools a client could send headers without end (the parser buffers them
all) or keep a connection open forever by sending one header byte at a time. This subclass counts
the bytes received while a request's headers are incomplete (431 past `max_header_bytes`) and closes
a connection whose headers take longer than `header_timeout` (408). Its own answers (those two, a
malformed request, the server's concurrency limit) use OpenAI's error format like every other one.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.api.asgi import BODY_PART, CLIENT_WRITER, REFUSED, WHOLE_BODY, send_error
from gateway.api.close_delimited import close_delimited
from gateway.api.request_head import framing_problem
from gateway.errors import GatewayError, error_answer


class LimitedConfig(uvicorn.Config):
    """uvicorn's Config with the header limits GatewayHttpProtocol enforces (picklable for workers)."""

    def __init__(
        self,
        app: Any,
        *,
        max_header_bytes: int,
        header_timeout: float,
        body_timeout: float = 30.0,
        **options: Any,
    ) -> None:
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        super().__init__(
            app, http=GatewayHttpProtocol, h11_max_incomplete_event_size=max_header_bytes, **options
        )


class GatewayHttpProtocol(HttpToolsProtocol):
    """One client connection: httptools parsing plus a header size limit and a header read timeout."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, LimitedConfig), "GatewayHttpProtocol needs a LimitedConfig"
        self.max_header_bytes = config.max_header_bytes
        self.header_timeout = config.header_timeout
        self.body_timeout = config.body_timeout
        # a request answered before its body was in (401, 413 from the headers alone): the time its
        # body still has, whether the app reads it or not
        self.unread_timer: asyncio.TimerHandle | None = None
        # the requests not answered yet, oldest first: uvicorn keeps only the newest (pipelining),
        # and a client gone mid-answer left the one being answered running, and billed
        self.cycles: list[Any] = []
        # bytes received for the request whose headers are still incomplete (None: past its headers)
        self.header_bytes: int | None = 0
        self.head_start = b""  # the first bytes of the request being read
        self.header_timer: asyncio.TimerHandle | None = None
        self.unsent: list[_CycleTransport] = []  # requests' transports holding writes, oldest first
        self.lingering: int | None = None  # bytes discarded since a refusal (None: not refused)
        self.linger_timer: asyncio.TimerHandle | None = None
        # a refusal waiting for the answers of the requests before it (pipelining): (status, message, code)
        self.refusal: tuple[int, str, str] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection has `header_timeout` seconds to send its first request's headers."""
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timers with the connection; every request not answered yet learns the client left."""
        self._cancel_header_timer()
        for timer in (self.linger_timer, self.unread_timer):
            if timer is not None:
                timer.cancel()
        for cycle in self.cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Count header bytes around the parser: a chunk that completes the headers is not counted."""
        if self.lingering is not None:  # refused: what the client still sends is read and dropped
            self.lingering += len(data)
            if self.lingering > LINGER_BYTES:
                self.transport.close()
            return
        if self.refusal is not None:  # past a request the parser refused: nothing more is parsed
            return
        if self.header_bytes is not None:
            if not self.header_bytes:  # a request's first bytes: its request line, if llhttp refuses it
                self.head_start = data[:_REQUEST_LINE_BYTES]
            self.header_bytes += len(data)
        super().data_received(data)
        # Checked after parsing: headers complete within this chunk reset the count, so a body sent
        # with them is never counted; headers still incomplete are at most one read past the limit.
        if self.header_bytes:  # a request's headers begun, not complete
            if self.header_bytes > self.max_header_bytes:
                self._headers_too_large()
            elif self.header_timer is None and self.lingering is None and self.refusal is None:
                # timed from the first chunk that leaves them incomplete: a request whose headers
                # come in one read (nearly all) never sets a timer, which costs every request
                self._arm_header_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        """A header field; a trailer field (after a chunked body) is dropped: uvicorn added it to the
        request's headers, where an Authorization sent as a trailer authenticated."""
        if self.header_bytes is not None:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """The headers are in: stop counting and timing them; measure them if they came in one read."""
        self.header_bytes = None
        self._cancel_header_timer()
        # a request in the read that ended an early-answered body: the keep-alive timer armed for the
        # idle connection (on_message_complete) would close it mid-answer
        self._unset_keepalive_if_required()
        size = len(self.url)
        for name, value in self.headers:  # a loop, not sum(generator): every request, a cold CPU mostly
            size += len(name) + len(value) + 4  # (": " and CRLF: 15,000 empty-ish headers passed 32 KiB)
        if size > self.max_header_bytes:
            self._headers_too_large()
            raise _RefusedError  # stops the parser: no request task starts
        problem = framing_problem(self.parser.get_http_version(), self.headers)
        if problem is not None:
            self.logger.info("%s: %s", _address(self.client), problem[1])
            self._refuse(*problem)
            raise _RefusedError
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycles.append(self.cycle)
            transport = _CycleTransport(self, self.cycle)
            self.cycle.transport = transport  # type: ignore[assignment]
            scope = cast(dict[str, Any], self.cycle.scope)
            scope[BODY_PART], scope[CLIENT_WRITER] = transport.body_part, transport
            scope[WHOLE_BODY] = transport.whole_body
            if scope["http_version"] == "1.0":
                close_delimited(self.cycle)

    def on_response_complete(self) -> None:
        """An answer is out: a refusal that waited for it (and those before it) goes now; an answer
        given before its request's body was in leaves that body `body_timeout` seconds to end."""
        super().on_response_complete()
        self.cycles = [cycle for cycle in self.cycles if not cycle.response_complete]
        if self.refusal is not None and not self._answering():
            status, message, code = self.refusal
            self.refusal = None
            self._refuse(status, message, code)
        elif (  # (the answer is this request's own: not one before a pipelined request still arriving)
            self.header_bytes is None
            and self.cycle is not None
            and self.cycle.response_complete
            and self.unread_timer is None
            and not self.transport.is_closing()
        ):
            self.unread_timer = self.loop.call_later(self.body_timeout, self._unread_timed_out)

    def _unread_timed_out(self) -> None:
        self.unread_timer = None
        self.logger.info("%s: an answered request's body took longer than %g s", _address(self.client),
                         self.body_timeout)  # fmt: skip
        self.transport.close()

    def _answering(self) -> bool:
        """Whether a request of this connection is still being answered (or waits in the pipeline)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def on_message_complete(self) -> None:
        """The request's body is in: bytes after it belong to the next request's headers. One answered
        already is idle from now: uvicorn armed its keep-alive timer with the answer, and the body's
        bytes cancelled it (the connection stayed open for good, a slot of the concurrency limit)."""
        super().on_message_complete()
        self.header_bytes = 0
        if self.unread_timer is not None:
            self.unread_timer.cancel()
            self.unread_timer = None
            if not self._answering() and not self.transport.is_closing():
                self._unset_keepalive_if_required()
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def shutdown(self) -> None:
        """The server stops: an answer's tail still waiting goes out before the connection closes."""
        self.flush_all()
        super().shutdown()

    def flush_all(self) -> None:
        """Send every request's waiting writes now, in the order they were written."""
        while self.unsent:
            self.unsent[0].flush()

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (NUL in a header, bad Content-Length, bad chunking); an
        HTTP version llhttp does not know (HTTP/1.2) is a 505, as the heads it parses are."""
        found = _VERSION.search(self.head_start.partition(b"\n")[0])
        version = found.group(1).decode("ascii") if found is not None else "1.1"
        problem = framing_problem(version, []) if version not in ("1.0", "1.1") else None
        self._refuse(*(problem or (400, msg, "invalid_http_request")))

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if app is service_unavailable:  # past limit_concurrency: OpenAI's format, not plain text
            app = _overloaded
        super()._start_asgi_task(cycle, app)

    def _headers_too_large(self) -> None:
        message = f"the request headers exceed {self.max_header_bytes} bytes"
        self.logger.warning("%s: %s", _address(self.client), message)
        self._refuse(431, message, "headers_too_large")

    def _arm_header_timer(self) -> None:
        self.header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_timed_out(self) -> None:
        self.header_timer = None
        if self.header_bytes == 0:  # nothing sent: close quietly (a 408 could race a client's request)
            self.transport.close()
        elif self.header_bytes is not None:
            message = f"the request headers took longer than {self.header_timeout:g} s"
            self.logger.warning("%s: %s", _address(self.client), message)
            self._refuse(408, message, "headers_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` and close. Bytes refused after a whole request (pipelining: a valid
        request, then bytes that are not one) are answered after that request's answer; a request
        refused while its own body arrives is answered now, unless its answer has begun (then the
        connection is just closed)."""
        if self.transport.is_closing() or self.lingering is not None:
            return
        reading = self.cycle is not None and self.cycle.more_body  # the refused bytes are its body
        if not reading and self._answering():
            if self.refusal is None:
                self.refusal = (status, message, code)
                self._cancel_header_timer()
            return
        self.flush_all()  # an answer's tail still waiting goes out before ours
        if reading:  # the app's body read ends as a disconnect: this says what the client was told
            cast(dict[str, Any], self.cycle.scope)[REFUSED] = (status, message, code)
            # and what the app still sends goes nowhere (an early 401 written after ours, past
            # write_eof, was a RuntimeError in the log)
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if not (reading and self.cycle.response_started):  # (a started answer is just cut off)
            _, headers, body = error_answer(GatewayError(status, message, code=code))
            fields = b"".join(b"%s: %s\r\n" % field for field in headers)
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{_EXTRA_HEADERS.get(status, '')}connection: close\r\n"
            )
            self.transport.write(head.encode("ascii") + fields + b"\r\n" + body)
        self._linger()

    def _linger(self) -> None:
        """Close after a refusal without resetting the answer away.

        Closing a socket with unread input sends a TCP reset, which can destroy the answer in the
        client's kernel before the client reads it (a client still sending a body after its
        oversized headers saw "connection reset" instead of 431). So: finish our side (FIN), read
        and drop what still arrives for at most LINGER_SECONDS or LINGER_BYTES, then close.
        """
        self._cancel_header_timer()
        self.lingering = 0
        self.flow.resume_reading()  # a refused body may have filled the buffer and paused reads
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)


_REQUEST_LINE_BYTES = 1024  # kept of a request's first read, for the version llhttp refused
_VERSION = re.compile(rb" HTTP/([0-9]+\.[0-9]+)\r?$")
LINGER_SECONDS = 1.0  # after a refusal, how long what the client still sends is read and dropped
LINGER_BYTES = 8 << 20  # and how much of it, at most (a completion body's default limit)


class _CycleTransport:
    """A request cycle's transport: writes made in one loop turn leave in one send; close() lingers
    while the request's body is still coming.

    uvicorn writes a response's head, then each body part, each at once: a streamed answer's head,
    its role chunk and its first text were three sends, three wake-ups of the client before it had
    its first token. The head waits for the first body part and leaves with it in one send (or at
    the end of the turn, call_soon, when no body part follows in it; order kept across requests);
    later writes (a stream's events, one per upstream read) go straight out, since waiting for the
    end of the turn would cost each event a loop iteration and coalesce nothing.
    The app answers some requests before reading their bodies (401 and 413 from the headers alone,
    with `connection: close`), and uvicorn then closes the socket at once: with the client still
    sending, that is the reset that can destroy the answer (see `_linger`). Once the body is in,
    close() closes.
    """

    def __init__(self, protocol: GatewayHttpProtocol, cycle: Any) -> None:
        self._protocol = protocol
        self._cycle = cycle
        self._transport = protocol.transport
        self._pending: list[bytes] | None = None  # written this turn, not sent yet
        self._direct = False  # the first turn's writes have gone: write through from now on
        self.is_closing = self._transport.is_closing

    def write(self, data: bytes) -> None:
        if self._direct:  # the head has gone: a stream's later events leave as they come
            if not self._transport.is_closing():
                self._transport.write(data)
            return
        if self._pending is None:  # the head: held for the end of the turn, or for the body's first part
            self._pending = [data]
            self._protocol.unsent.append(self)
            self._protocol.loop.call_soon(self.flush)
        else:  # the head and the first body part: one send, now (not a loop iteration later)
            self._pending.append(data)
            self.flush()

    async def body_part(self, body: bytes) -> None:
        """A streamed answer's next part, as uvicorn's `send` writes one with `more_body` (a chunk
        of a chunked answer; nothing once the client has gone; waiting while its socket buffer is
        full), without building and checking an ASGI message for each of a stream's events. Before
        the head or outside a chunked answer it is that `send`."""
        cycle = self._cycle
        if not cycle.chunked_encoding or not cycle.response_started or cycle.response_complete:
            await cycle.send({"type": "http.response.body", "body": body, "more_body": True})
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if not cycle.disconnected and body:
            self.write(b"%x\r\n%s\r\n" % (len(body), body))

    def writable(self) -> bool:
        """Whether a body part written now leaves at once (pipeline/reply.py's ClientWriter): the
        head has gone, the answer is an open chunked one, the client is there and its socket
        buffer is not full (uvicorn's flow control: otherwise `body_part` waits for it)."""
        cycle = self._cycle
        return (
            self._direct
            and cycle.chunked_encoding
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
            and not self._transport.is_closing()
        )

    def whole_body(self) -> bytes | None:
        """The request's body if all of it is in and unread, taken as uvicorn's `receive()` takes it
        (the event cleared, the buffer emptied, reading resumed), so that a later `receive()` waits
        for the disconnect as after a read; None while more may come, after a disconnect or an
        answer, or when the client waits for 100 Continue (`receive()` sends that)."""
        cycle = self._cycle
        if (
            cycle.more_body
            or cycle.disconnected
            or cycle.response_complete
            or cycle.waiting_for_100_continue
            or not cycle.message_event.is_set()
        ):
            return None
        body = bytes(cycle.body)  # uvicorn's buffer is a bytearray: bytes, as `receive()` hands it
        cycle.body = b""
        cycle.message_event.clear()
        cycle.flow.resume_reading()
        return body

    def write_part(self, body: bytes) -> None:
        """A chunk of a streamed answer, sent now (the caller asked `writable` first)."""
        if body:
            self._transport.write(b"%x\r\n%s\r\n" % (len(body), body))

    def flush(self) -> None:
        """Send what was written (nothing once the connection is closing)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._direct = True
        self._protocol.unsent.remove(self)
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        protocol = self._protocol
        if self._cycle.more_body and protocol.lingering is None and not self._transport.is_closing():
            protocol._linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _RefusedError(Exception):
    """Raised from a parser callback to stop parsing a request already answered."""


_REASONS = {400: "Bad Request", 408: "Request Timeout", 415: "Unsupported Media Type",
            431: "Request Header Fields Too Large", 501: "Not Implemented",
            505: "HTTP Version Not Supported"}  # fmt: skip
_EXTRA_HEADERS = {415: "accept-encoding: identity\r\n"}  # what a 415 for a content coding names


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"


async def _overloaded(scope: Any, receive: Any, send: Any) -> None:
    """uvicorn's 503 past `limit_concurrency`, in OpenAI's error format (the connection is closed)."""
    message = "the gateway is at its connection limit; retry shortly"
    busy = GatewayError(503, message, "api_error", code="server_overloaded", headers=[(b"retry-after", b"1")])
    await send_error(send, busy, close=True)
