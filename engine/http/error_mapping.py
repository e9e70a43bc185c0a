"""The one exception -> OpenAI error answer mapping of the engine's HTTP server.

Domain errors carry their answer (`EngineError`: status, type, code, param, headers); starlette's
HTTP errors carry a status; a cancelled request's client is gone (499, nobody reads it). Anything
else is a bug: the client gets a fixed text (`INTERNAL_ERROR`; the caller logs the details). No
message is read to choose a status or a param. Every error answer, these and the refusals made before
any route (limits.py, h11_protocol.py), carries `NOSNIFF`.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import ClientDisconnectedError, EngineError
from engine.http.protocol import INTERNAL_ERROR, APIError

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}

# its body is JSON, whatever a browser guesses: an error that quotes what a client sent is never HTML
NOSNIFF = (b"x-content-type-options", b"nosniff")


def api_error(exc: BaseException) -> APIError:
    """The OpenAI-format answer for `exc` (no internal text for unexpected errors)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return APIError(exc.status, exc.public_message, exc.type, exc.param, exc.code, exc.headers)
    if isinstance(exc, StarletteHTTPException):  # a 405's Allow kept (RFC 9110 asks for it); nothing else
        allow = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}
        code = _HTTP_CODES.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=allow)
    if isinstance(exc, asyncio.CancelledError):
        return api_error(ClientDisconnectedError())
    return INTERNAL_ERROR
