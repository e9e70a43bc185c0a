"""install_console(app): the console's routes, and its errors as pages a person can read."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError

from gateway.api.errors import error_response
from gateway.console import keys, login, overview, request_log, routing, spend
from gateway.console.web import LoginRequired, page, redirect
from gateway.errors import GatewayError


def _wants_page(request: Request) -> bool:
    """A console page asked for by a browser (not /ui/api, not a script asking for JSON)."""
    path = request.url.path
    accepts = request.headers.get("accept", "")
    return path.startswith("/ui") and not path.startswith("/ui/api/") and "text/html" in accepts


Handler = Callable[[Request, Exception], Any]


async def _no_such_page() -> None:
    """Any other /ui path, last: 404. Without it Starlette answered 307 to the path with a slash, as
    an absolute URL built from the Host header, and the trailing-slash route sent that back: a loop."""
    raise GatewayError(404, "No such console page", code="not_found")


async def _delegate(handler: Handler, request: Request, exc: Exception) -> Response:
    """What the gateway's own handler answers (it may be sync or async)."""
    answer = handler(request, exc)
    response: Response = await answer if inspect.isawaitable(answer) else answer
    return response


def install_console(app: FastAPI) -> None:
    """Add the console's routes to `app`; its errors become pages for browsers, JSON for the rest."""
    for module in (login, overview, keys, spend, routing, request_log):
        app.include_router(module.router)
    app.add_api_route("/ui/{rest:path}", _no_such_page, methods=["GET", "POST"], include_in_schema=False)
    previous = app.exception_handlers.get(GatewayError)
    invalid = app.exception_handlers.get(RequestValidationError)

    async def login_required(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, LoginRequired)
        if request.method == "GET" and _wants_page(request):
            return redirect(f"/ui/login?next={quote(request.url.path)}")
        if _wants_page(request):
            return redirect("/ui/login")
        return error_response(exc)

    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        if not _wants_page(request):
            return error_response(exc) if previous is None else await _delegate(previous, request, exc)
        context = {"title": "Something went wrong", "error": exc.message}
        return page("message.html", context, exc.status)

    async def validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        if not _wants_page(request) and invalid is not None:
            return await _delegate(invalid, request, exc)
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body"))
        context = {"title": "Something went wrong", "error": f"{where or 'request'}: {first.get('msg')}"}
        return page("message.html", context, 400)

    app.add_exception_handler(LoginRequired, login_required)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(GatewayError, gateway_error)
