"""uvicorn's h11 protocol with a header size limit, a header read timeout and JSON errors.

Why h11 and not httptools (uvicorn's default when installed): llhttp, under httptools, takes
headers of any size, and uvicorn has no option to bound them; h11 bounds its receive buffer
(`h11_max_incomplete_event_size`). h11 costs some microseconds per request in Python, nothing next
to a model step. uvicorn has no timeout for a client that opens a connection and sends its
headers byte by byte; this protocol closes such a connection after `header_read_timeout`. Nor has it
one for a client that stops reading an answer and keeps its connection open: the response then waits
for the socket forever, holding its request slot (limits.ConcurrencyLimit) and the output buffered
for it, so `--limit-concurrency` such clients shut the engine out for good. This protocol aborts a
connection whose client has taken no bytes for `send_timeout` seconds while the server had more to
write (nginx's `send_timeout`); a slow reader that takes some goes on.

Connections are bounded here, not by uvicorn's `limit_concurrency`, which past its count answers
every request, /health included, with a plain-text 503, and counts idle keep-alive sockets: a few
idle connections shut the engine out. Past `connection_limit`, a new connection closes the one idle
longest (no request in progress; nginx does the same with its keep-alive pool); only when every
connection has a request in progress is the new one closed. Requests in progress are bounded by
the app (limits.ConcurrencyLimit, 503 `server_overloaded` in OpenAI's format).

h11 refuses a missing or repeated Host and transfer codings other than chunked, but takes any
`HTTP/x.y` version, a Host that is no host, and Content-Length beside Transfer-Encoding (it reads
the body as chunked: a proxy in front that trusts the length would disagree on where the request
ends). Those heads are refused too (505 and 400), before the app sees them, and so are a
content-coded body (415: it would be parsed still compressed) and a body chunked into thousands of
tiny pieces (400), which costs the event loop seconds to parse. An absolute-form target (RFC 9112
3.2.2) is read as its path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.http.error_mapping import NOSNIFF

logger = logging.getLogger(__name__)


# RFC 9110's host [ ":" port ]: a reg-name (unreserved, sub-delims, %-escapes) or an IP literal
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~%!$&'()*+,;=-]*)(?::[0-9]{0,5})?")
# an absolute-form request target's scheme and authority (what a client sends to a proxy)
_ABSOLUTE = re.compile(rb"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


class HeadRefusedError(h11.RemoteProtocolError):
    """A request (head, or body framing) h11 parsed but this server refuses: its message and code go
    to the client."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message, error_status_hint=status)
        self.message = message
        self.code = code


# A chunked body costs h11 ~7 us per chunk, and uvicorn copies the body so far at each one: 2 MiB
# sent as 1-byte chunks (12 MB) took 12 s of the event loop, in stalls of up to 1 s. Past this many
# pieces, a body must average at least _MIN_PIECE_BYTES a piece (clients send KiBs).
_FREE_BODY_PIECES = 4096
_MIN_PIECE_BYTES = 256


class CheckedConnection(h11.Connection):
    """h11's server connection, refusing the request heads h11 lets through (see the module doc)
    and bodies chunked into pieces too small to be worth their parsing."""

    _pieces = 0  # Data events of the current request's body
    _body_bytes = 0

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            refused = head_problem(event)
            if refused is not None:
                raise refused
            self._pieces = self._body_bytes = 0
            if event.target[:1] != b"/" and _ABSOLUTE.match(event.target):  # RFC 9112 3.2.2: accepted
                path = _ABSOLUTE.sub(b"", event.target)
                path = path if path.startswith(b"/") else b"/" + path
                event = h11.Request(method=event.method, target=path, headers=event.headers,
                                    http_version=event.http_version)  # fmt: skip
        elif isinstance(event, h11.Data):
            self._pieces += 1
            self._body_bytes += len(event.data)
            if self._pieces > _FREE_BODY_PIECES and self._body_bytes < _MIN_PIECE_BYTES * self._pieces:
                raise HeadRefusedError(
                    f"the request body came in {self._pieces} pieces of {self._body_bytes // self._pieces}"
                    f" bytes on average: send it whole, or in chunks of at least {_MIN_PIECE_BYTES} bytes",
                    400,
                    "invalid_http",
                )
        return event


def head_problem(request: h11.Request) -> HeadRefusedError | None:
    """Why a parsed request head is refused, or None."""
    if request.http_version not in (b"1.0", b"1.1"):
        version = request.http_version.decode("ascii", "replace")
        return HeadRefusedError(
            f"HTTP/{version} is not supported: use HTTP/1.1", 505, "http_version_not_supported"
        )
    names = [name for name, _ in request.headers]
    if b"content-length" in names and b"transfer-encoding" in names:
        return HeadRefusedError("Content-Length and Transfer-Encoding together", 400, "invalid_http")
    host = next((value for name, value in request.headers if name == b"host"), None)
    if host is not None and not _HOST.fullmatch(host):
        return HeadRefusedError("the Host header is not a host[:port]", 400, "invalid_http")
    codings = {c.strip().lower() for name, value in request.headers if name == b"content-encoding"
               for c in value.split(b",")}  # fmt: skip
    if codings - {b"identity", b""}:  # read still compressed (a misleading "invalid JSON"); inflated, a bomb
        message = "the request body must not be content-coded (e.g. gzip)"
        return HeadRefusedError(message, 415, "unsupported_content_encoding")
    return None


def limited_h11_protocol(
    header_read_timeout: float, connection_limit: int | None = None, send_timeout: float | None = None
) -> type[H11Protocol]:
    """An H11Protocol class that closes connections whose request head takes too long, keeps at
    most `connection_limit` connections (None: no bound) by closing the longest idle one, and
    aborts those whose client takes no bytes of an answer for `send_timeout` seconds (None: never)."""

    class LimitedH11Protocol(H11Protocol):
        """H11Protocol + header read timeout + connection bound + OpenAI-format bodies for malformed
        requests."""

        _header_timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None
        _send_buffered = 0  # bytes waiting for the client when the send timer was armed

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            limit = config.h11_max_incomplete_event_size
            self.conn = CheckedConnection(h11.SERVER, limit if limit is not None else 16 * 1024)
            self.active_at = 0.0  # loop time of its last bytes in: the longest idle goes first

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.active_at = self.loop.time()
            if connection_limit is not None and len(self.connections) > connection_limit:
                self._make_room()
            self._arm_header_timer()

        def idle(self) -> bool:
            """No request in progress (between keep-alive requests, or a head still arriving)."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _make_room(self) -> None:
            """At the bound: the connection idle longest is closed, else (all busy) this one."""
            idle = [c for c in self.connections
                    if c is not self and isinstance(c, LimitedH11Protocol) and c.idle()]  # fmt: skip
            if idle:
                oldest = min(idle, key=lambda c: c.active_at)
                logger.info("%d connections: closing the one idle longest", len(self.connections))
                oldest.transport.close()
            else:
                logger.warning("%d connections, each with a request in progress: refusing another",
                               len(self.connections))  # fmt: skip
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            self.active_at = self.loop.time()
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # a new request starts (after keep-alive idling)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the whole head arrived
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            self._cancel_send_timer()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            """The client is not taking what is written: it has `send_timeout` seconds to take some."""
            super().pause_writing()
            self._arm_send_timer()

        def resume_writing(self) -> None:
            self._cancel_send_timer()
            super().resume_writing()

        def send_400_response(self, msg: str) -> None:
            """h11 refused the request (malformed, or headers over the limit): answer in JSON."""
            error = sys.exc_info()[1]  # called from uvicorn's `except h11.RemoteProtocolError`
            status = getattr(error, "error_status_hint", 400)
            message = "Request headers too large" if status == 431 else "Invalid HTTP request"
            code = "request_header_fields_too_large" if status == 431 else "invalid_http"
            if isinstance(error, HeadRefusedError):
                message, code = error.message, error.code
            body = json.dumps(
                {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
            ).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                NOSNIFF,
            ]
            self._cancel_header_timer()
            try:
                self.transport.write(
                    self.conn.send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
                    or b""
                )
                self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
                self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
            except h11.LocalProtocolError:  # a response had already started: nothing more to say
                pass
            self.transport.close()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_read_timeout, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _arm_send_timer(self) -> None:
            self._cancel_send_timer()
            if send_timeout is not None:
                self._send_buffered = self.transport.get_write_buffer_size()
                self._send_timer = self.loop.call_later(send_timeout, self._send_timeout)

        def _cancel_send_timer(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _send_timeout(self) -> None:
            self._send_timer = None
            if self.transport.get_write_buffer_size() < self._send_buffered:
                self._arm_send_timer()  # it took some: a slow reader, not a stalled one
                return
            logger.info("aborting a connection whose client took no data for %.0fs", send_timeout)
            # close() would wait for the buffer to drain, which is what never happens
            self.transport.abort()

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.info("closing a connection whose request head took over %.0fs", header_read_timeout)
                self.transport.close()

    return LimitedH11Protocol


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""
