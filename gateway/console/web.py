"""The console's HTTP plumbing: sessions from cookies, CSRF checks, forms, pages with strict headers.

Pages are rendered on the server from Jinja2 templates with autoescaping on (every value a key's
owner or a request wrote is hostile), plain HTML forms post changes (they work without
JavaScript), and one small script of our own refreshes the overview. The Content-Security-Policy
lets a page load only its own origin's script and style, so injected markup could run nothing.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from fastapi import Depends, Request, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from gateway.api.services import Services, ServicesDep
from gateway.console.session import COOKIE, Session, SessionSigner
from gateway.errors import GatewayError
from gateway.store.console_logouts import session_ended
from gateway.store.reports import usd

HERE = Path(__file__).parent
MAX_FORM_FIELDS = 40

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

_PRINTABLE = re.compile(r"[\x21-\x7e]{1,2000}")

templates = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["usd"] = usd  # exact amounts without exponents


class LoginRequired(GatewayError):
    """No valid session: a page redirects to the login form, a JSON call answers 401."""

    def __init__(self, path: str) -> None:
        super().__init__(401, "Log in to the console first", "authentication_error", code="login_required")
        self.path = path


def signer(services: Services) -> SessionSigner:
    """The session signer of this gateway's master key (deriving it is one HMAC)."""
    return SessionSigner(services.secrets.master_key, services.settings.console_session_ttl)


async def console_session(request: Request, services: ServicesDep) -> Session:
    """Dependency: the request's valid session, else LoginRequired (a logged-out one too, on every
    replica: store/console_logouts.py)."""
    session = signer(services).verify(request.cookies.get(COOKIE), time.time())
    if session is None or await session_ended(services.db, session.nonce):
        raise LoginRequired(request.url.path)
    return session


ConsoleSession = Annotated[Session, Depends(console_session)]


def same_origin(request: Request) -> bool:
    """Whether the request's Origin (else Referer), when sent, is this gateway's own."""
    source = request.headers.get("origin") or request.headers.get("referer")
    if source is None:
        return True  # SameSite=Strict already keeps the cookie off other sites' requests
    parts = urlsplit(source)
    return parts.scheme in ("http", "https") and parts.netloc == request.headers.get("host")


async def read_form(request: Request) -> dict[str, str]:
    """A posted urlencoded form (the body is already bounded by BodyLimit); first value per field."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise GatewayError(415, "The console posts urlencoded forms", code="unsupported_media_type")
    try:
        text = (await request.body()).decode()
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS)
    except (UnicodeDecodeError, ValueError) as exc:
        raise GatewayError(400, "The form could not be read", code="invalid_form") from exc
    form: dict[str, str] = {}
    for name, value in pairs:
        form.setdefault(name, value)
    return form


async def checked_form(request: Request, session: ConsoleSession) -> dict[str, str]:
    """Dependency for every change: the form, once its CSRF token and origin are checked."""
    form = await read_form(request)
    if not same_origin(request) or not SessionSigner.csrf_matches(session, form.get("csrf")):
        message = "The form is stale or came from another site: reload the page"
        raise GatewayError(403, message, "permission_error", code="csrf_failed")
    return form


CheckedForm = Annotated[dict[str, str], Depends(checked_form)]


def page(name: str, context: dict[str, Any], status: int = 200, session: Session | None = None) -> Response:
    """Template `name` rendered with `context` (plus the session's CSRF token), strict headers."""
    html = templates.get_template(name).render(**context, csrf=session.csrf if session else "")
    return Response(html, status_code=status, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


def redirect(location: str, status: int = 303) -> Response:
    """A redirect to a console path (never to a URL a client gave)."""
    return Response(status_code=status, headers={**SECURITY_HEADERS, "Location": location})


def local_path(target: str | None, default: str = "/ui") -> str:
    """`target` when it is a console path, else `default`: no open redirect after login, and no
    Location header that could not be sent (only printable ASCII: a browser percent-encodes the rest)."""
    if not target or "\\" in target or not _PRINTABLE.fullmatch(target):
        return default
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not _under_console(parts.path):
        return default
    return target


def _under_console(path: str) -> bool:
    """Whether `path` stays under /ui as a browser resolves it: /ui/../../evil leaves it, and a
    browser resolves percent-encoded dots (%2e%2e) as it resolves '..', so no dot segment at all."""
    if path != "/ui" and not path.startswith("/ui/"):
        return False  # /uix is not the console either
    return not {".", ".."} & set(unquote(path).split("/"))
