"""/ui/login, /ui/logout, the console's static files, and console paths with a trailing slash."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from gateway.api.services import Database, ServicesDep
from gateway.config.settings import CONSOLE_SESSION_MAX_TTL
from gateway.console.session import COOKIE
from gateway.console.web import (
    HERE,
    SECURITY_HEADERS,
    CheckedForm,
    ConsoleSession,
    local_path,
    page,
    read_form,
    redirect,
    same_origin,
    signer,
)
from gateway.errors import GatewayError
from gateway.governance.keys import AuthError
from gateway.store.console_logouts import end_session

router = APIRouter(prefix="/ui")

STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}
FILES = {name: (HERE / "static" / name).read_bytes() for name in STATIC}  # read once, at import


@router.get("/login")
async def login_form(next_: Annotated[str | None, Query(alias="next")] = None) -> Response:
    """The login form."""
    return page("login.html", {"title": "Log in", "next": local_path(next_)})


@router.post("/login")
async def login(request: Request, services: ServicesDep) -> Response:
    """Check the master key once; answer with a session cookie, never the key."""
    form = await read_form(request)
    if not same_origin(request):  # another site's page posting here: refused before the key is checked
        message = "The login form came from another site: open the console's own page"
        raise GatewayError(403, message, "permission_error", code="csrf_failed")
    target = local_path(form.get("next"))
    client = (request.client.host, request.client.port) if request.client else None
    try:
        services.keys.check_master(form.get("master_key", ""), services.secrets.master_key, client)
    except AuthError as exc:
        status = 429 if exc.status == 429 else 401
        message = "Too many failed attempts: wait a minute" if status == 429 else "That is not the master key"
        answer = page("login.html", {"title": "Log in", "next": target, "error": message}, status)
        for name, value in exc.headers():  # Retry-After on a 429, as the admin API sends it
            answer.headers[name.decode()] = value.decode()
        return answer
    cookie, _ = signer(services).issue(time.time())
    response = redirect(target)
    secure = services.settings.console_cookie_secure == "always" or request.url.scheme == "https"
    response.set_cookie(
        COOKIE, cookie, max_age=services.settings.console_session_ttl, path="/ui",
        secure=secure, httponly=True, samesite="strict",
    )  # fmt: skip
    return response


@router.post("/logout")
async def logout(_: CheckedForm, session: ConsoleSession, db: Database, services: ServicesDep) -> Response:
    """End the session: refused from now on by every replica, whoever holds its cookie (it is
    dropped in this browser too)."""
    # kept while any TTL could still take the cookie: a replica's setting may be raised later
    issued = session.expires - services.settings.console_session_ttl
    await end_session(db, session.nonce, issued + CONSOLE_SESSION_MAX_TTL, int(time.time()))
    response = redirect("/ui/login")
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    """The console's own stylesheet and script (no other file is served)."""
    if name not in STATIC:
        raise GatewayError(404, "No such file", code="not_found")
    headers = {**SECURITY_HEADERS, "Cache-Control": "public, max-age=300"}
    return Response(FILES[name], media_type=STATIC[name], headers=headers)


@router.get("/", include_in_schema=False)
@router.get("/{rest:path}/", include_in_schema=False)
async def without_slash(request: Request) -> Response:
    """/ui/ and any console path with a trailing slash: a relative redirect to it without, with the
    console's headers. Starlette's own answer built an absolute URL from the client's Host header
    (a poisoned cache could send others elsewhere) and carried none of the console's headers."""
    path = request.url.path.rstrip("/")
    query = request.url.query
    return redirect(local_path(f"{path}?{query}" if query else path), 307)
