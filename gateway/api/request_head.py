"""What RFC 9112 says a server must refuse in a request head that llhttp lets through: checked by
the gateway's HTTP protocol (http_protocol.py) once a request's headers are in, before the app."""

from __future__ import annotations

import re
from collections.abc import Sequence

# RFC 9110's host [ ":" port ]: a reg-name (unreserved, sub-delims, %-escapes) or an IP literal
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~%!$&'()*+,;=-]*)(?::[0-9]{0,5})?")


def framing_problem(version: str, headers: Sequence[tuple[bytes, bytes]]) -> tuple[int, str, str] | None:
    """What RFC 9112 says a server must refuse in a request head that llhttp lets through, as
    (status, message, code); None when the head is sound.

    An HTTP version other than 1.0 and 1.1 (505), a missing Host in HTTP/1.1, more than one Host or
    one that is not a host, more than one Authorization (RFC 9110 5.3: not a list; 400), and a
    transfer coding other than a lone `chunked` (501: llhttp reads `gzip, chunked` as chunked and
    hands the app the still-compressed bytes; a proxy in front that reads the codings otherwise
    would disagree with us on where the request ends). And, though not framing, a content coding
    (415, RFC 9110 15.5.16): the body would be parsed still compressed, and inflating it would let
    a small body (a gzip bomb) pass the body limit.
    """
    if version not in ("1.0", "1.1"):
        return 505, f"HTTP/{version} is not supported: use HTTP/1.1", "http_version_not_supported"
    hosts: list[bytes] = []
    authorizations = 0
    transfer: list[bytes] = []  # the Transfer-Encoding and Content-Encoding values, as sent
    content: list[bytes] = []
    for name, value in headers:  # one pass: every request's head is checked, on a cold CPU mostly
        if name == b"host":
            hosts.append(value)
        elif name == b"authorization":
            authorizations += 1
        elif name == b"transfer-encoding":
            transfer.append(value)
        elif name == b"content-encoding":
            content.append(value)
    if len(hosts) > 1:
        return 400, "the request has more than one Host header", "invalid_http_request"
    if not hosts and version == "1.1":
        return 400, "an HTTP/1.1 request needs a Host header", "invalid_http_request"
    if hosts and not _HOST.fullmatch(hosts[0].strip(b" \t")):
        return 400, "the Host header is not a host[:port]", "invalid_http_request"
    if authorizations > 1:  # which one? routes disagreed
        return 400, "the request has more than one Authorization header", "invalid_http_request"
    # (the comprehensions only when there is something to read: each is a call of its own)
    if transfer and [c.strip(b" \t").lower() for v in transfer for c in v.split(b",")] != [b"chunked"]:
        return 501, "the only transfer coding supported is a lone chunked", "unsupported_transfer_encoding"
    if content and {c.strip(b" \t").lower() for v in content for c in v.split(b",")} - {b"identity", b""}:
        return 415, "the request body must not be content-coded (e.g. gzip)", "unsupported_content_encoding"
    return None
