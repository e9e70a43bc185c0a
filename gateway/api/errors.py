"""The FastAPI routes' exception -> OpenAI-format answer: every GatewayError through `error_answer`,
the framework's own errors (validation, HTTP) and the unexpected translated here."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import GatewayError, error_answer

logger = logging.getLogger(__name__)

_SOURCES = ("body", "query", "path", "header", "cookie")  # where FastAPI found a value: not its name
_NOT_JSON = "We could not parse the JSON body of your request"


def error_response(exc: GatewayError) -> Response:
    """The JSON error response to `exc`, with the headers it needs."""
    status, headers, body = error_answer(exc)
    response = Response(body, status_code=status, media_type="application/json")
    response.raw_headers.extend(headers)
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the routes raise to OpenAI's error format."""

    async def gateway_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":  # its loc is ("body", <offset>): no name the client used
            return error_response(GatewayError(400, _NOT_JSON, code="invalid_value"))
        loc = list(first.get("loc", ()))
        if loc and loc[0] in _SOURCES:  # the client named `limit`, not `query.limit`
            loc = loc[1:]
        # ["allowed_models", 0] -> allowed_models[0], as OpenAI and the engine name a list's items
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        message = f"Invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
        return error_response(GatewayError(400, message, param=param, code="invalid_value"))

    async def unexpected(request: Request, exc: Exception) -> Response:
        # the exception's text (e.g. a driver's message quoting hosts or values) stays in our log
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = "The gateway failed to handle the request"
        return error_response(GatewayError(500, message, "api_error", code="internal_error"))

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:  # FastAPI's only 400: a body it could not decode (not UTF-8)
            return error_response(GatewayError(400, _NOT_JSON, code="invalid_value"))
        # a 405's Allow kept (RFC 9110 asks for it); no other header of the framework's
        given = (exc.headers or {}).items()
        allow = [(b"allow", v.encode("latin-1")) for k, v in given if k.lower() == "allow"]
        return error_response(GatewayError(exc.status_code, str(exc.detail), headers=allow))

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(Exception, unexpected)  # last resort: OpenAI's format, no raw text
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
