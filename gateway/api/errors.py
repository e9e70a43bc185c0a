"""The FastAPI routes' exception -> OpenAI-format answer mapping."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import GatewayError, auth_error_type, error_body
from gateway.governance.keys import AuthError, InvalidKeyUpdateError, KeyNotFoundError
from gateway.store.db import DatabaseUnavailableError, DatabaseValueError

logger = logging.getLogger(__name__)


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> Response:
    """The JSON error response."""
    body = error_body(message, type_, param, code)
    return Response(body, status_code=status, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the routes raise to OpenAI's error format."""

    async def gateway_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    async def auth_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, AuthError)
        response = error_response(exc.status, exc.message, auth_error_type(exc.status), code=exc.code)
        response.raw_headers.extend(exc.headers())
        return response

    async def not_found(_: Request, exc: Exception) -> Response:
        return error_response(404, f"no key with id {exc}", "invalid_request_error", code="key_not_found")

    async def invalid_update(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, InvalidKeyUpdateError)
        message = f"Invalid value for '{exc.param}': {exc.message}"
        return error_response(400, message, "invalid_request_error", exc.param, "invalid_value")

    async def validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"Invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    async def database_unavailable(_: Request, exc: Exception) -> Response:
        return error_response(503, str(exc), "api_error", code="database_unavailable")

    async def database_value(_: Request, exc: Exception) -> Response:
        return error_response(400, str(exc), "invalid_request_error", code="invalid_value")

    async def unexpected(request: Request, exc: Exception) -> Response:
        # the exception's text (e.g. a driver's message quoting hosts or values) stays in our log
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = "The gateway failed to handle the request"
        return error_response(500, message, "api_error", code="internal_error")

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(AuthError, auth_error)
    app.add_exception_handler(KeyNotFoundError, not_found)
    app.add_exception_handler(InvalidKeyUpdateError, invalid_update)
    app.add_exception_handler(DatabaseUnavailableError, database_unavailable)
    app.add_exception_handler(DatabaseValueError, database_value)
    app.add_exception_handler(Exception, unexpected)  # last resort: OpenAI's format, no raw text
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
