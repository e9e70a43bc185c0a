"""AdminGate: the master key is checked from the headers before an admin request's body is read.

FastAPI reads and parses a route's body before it runs the route's dependencies, so the admin
routes' own `require_master_key` came after the body: an unauthenticated 128 MiB body took RSS from
324 to 701 MiB before its 401. The gate runs the same dependency first, at the ASGI level; the routes
keep theirs.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from gateway.api.admin_keys import require_master_key
from gateway.api.asgi import ASGIApp, Receive, Scope, Send, send_error
from gateway.api.body_limit import declared_length, may_exceed
from gateway.governance.keys import AuthError


def is_admin_path(path: str) -> bool:
    """Whether a path is under /admin (every route there needs the master key)."""
    return path == "/admin" or path.startswith("/admin/")


class AdminGate:
    """ASGI wrapper around `app`: /admin requests without the master key are refused unread."""

    def __init__(self, app: ASGIApp, api: FastAPI, max_body_bytes: int) -> None:
        self.app = app
        self.api = api  # its services hold the master key once the lifespan ran
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_admin_path(scope["path"]):
            try:
                await require_master_key(Request({**scope, "app": self.api}))
            except AuthError as exc:
                close = may_exceed(declared_length(scope), self.max_body_bytes)
                await send_error(send, exc, close)
                return
        await self.app(scope, receive, send)
