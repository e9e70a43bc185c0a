"""HTTP/1.0 answers of unknown length: their bytes, ended by closing the connection (http_protocol.py)."""

from __future__ import annotations

from typing import Any

_UNBOUNDED = 1 << 62  # the length uvicorn counts down for an answer that the connection's close ends


def close_delimited(cycle: Any) -> None:
    """An HTTP/1.0 client cannot read chunked transfer coding, and RFC 9112 (7.1) forbids sending it
    one; uvicorn chunks every answer without a Content-Length, whatever the request's version. Here
    such an answer (a stream) goes as its bytes, ended by closing the connection: uvicorn's own
    framing with a length it never reaches, set to what is left when the last part comes (its
    checks then pass, and without keep-alive it closes). The cycle's writer and `body_part` see
    no chunked coding and go through this `send` as well."""
    send = cycle.send
    unbounded = False

    async def close_delimited_send(message: Any) -> None:
        nonlocal unbounded
        if message["type"] == "http.response.start" and not cycle.response_started:
            headers = message.get("headers", ())
            if (
                cycle.scope["method"] != "HEAD"
                and message["status"] not in (204, 304)
                and not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in headers)
            ):
                unbounded = True
                cycle.chunked_encoding = False
                cycle.expected_content_length = _UNBOUNDED
                cycle.keep_alive = False  # (uvicorn then sends `connection: close` and closes at the end)
        elif unbounded and message["type"] == "http.response.body" and not message.get("more_body", False):
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = close_delimited_send
