"""uvicorn's h11 protocol with a header size limit, a header read timeout and JSON errors.

Why h11 and not httptools (uvicorn's default when installed): llhttp, under httptools, takes
headers of any size, and uvicorn has no option to bound them; h11 bounds its receive buffer
(`h11_max_incomplete_event_size`). h11 costs some microseconds per request in Python, nothing next
to a model step. uvicorn has no timeout for a client that opens a connection and sends its
headers byte by byte; this protocol closes such a connection after `header_read_timeout`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def limited_h11_protocol(header_read_timeout: float) -> type[H11Protocol]:
    """An H11Protocol class that closes connections whose request head takes too long."""

    class LimitedH11Protocol(H11Protocol):
        """H11Protocol + header read timeout + OpenAI-format bodies for malformed requests."""

        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # a new request starts (after keep-alive idling)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the whole head arrived
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """h11 refused the request (malformed, or headers over the limit): answer in JSON."""
            error = sys.exc_info()[1]  # called from uvicorn's `except h11.RemoteProtocolError`
            status = getattr(error, "error_status_hint", 400)
            message = "Request headers too large" if status == 431 else "Invalid HTTP request"
            body = json.dumps(
                {
                    "error": {
                        "message": message,
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "request_header_fields_too_large" if status == 431 else "invalid_http",
                    }
                }
            ).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            self._cancel_header_timer()
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)) or b"")
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

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.info("closing a connection whose request head took over %.0fs", header_read_timeout)
                self.transport.close()

    return LimitedH11Protocol
