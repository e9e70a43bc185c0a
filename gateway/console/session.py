"""Console sessions: a signed cookie that expires, and the CSRF token that goes with it.

Logging in with the master key yields `v2.<issued>.<nonce>.<mac>`: the login time (Unix seconds),
16 random bytes, and an HMAC-SHA256 of both under a key derived from the master key. A session
ends `GATEWAY_CONSOLE_SESSION_TTL` after its login as that setting is now: lowering it shortens the
sessions already open (v1 cookies carried their expiry, which outlived a lowered setting). Any gateway
replica verifies it without shared state, and changing the master key ends every session. The
master key itself never reaches the browser. Each change a console page makes carries the
session's CSRF token, HMAC("csrf", nonce) under the same key: another site can neither read it
nor guess it, and the cookie is SameSite=Strict besides.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass

VERSION = "v2"
COOKIE = "switchboard_console"
MAX_COOKIE_CHARS = 200  # a real cookie is ~80 characters: anything longer is not ours


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True, slots=True)
class Session:
    """A verified console session."""

    nonce: str
    expires: int  # Unix seconds
    csrf: str  # the token every change must carry


class SessionSigner:
    """Issues and verifies session cookies under a key derived from the master key."""

    def __init__(self, master_key: str, ttl_seconds: int) -> None:
        self._key = hmac.new(master_key.encode(), b"switchboard console session", hashlib.sha256).digest()
        self.ttl = ttl_seconds

    def _mac(self, message: str) -> str:
        return _b64(hmac.new(self._key, message.encode(), hashlib.sha256).digest())

    def issue(self, now: float) -> tuple[str, Session]:
        """A new session's cookie value and the session."""
        nonce, issued = _b64(secrets.token_bytes(16)), int(now)
        body = f"{VERSION}.{issued}.{nonce}"
        return f"{body}.{self._mac(body)}", self._session(nonce, issued + self.ttl)

    def verify(self, cookie: str | None, now: float) -> Session | None:
        """The session `cookie` holds, or None when it is missing, forged, malformed or expired."""
        if not cookie or len(cookie) > MAX_COOKIE_CHARS:
            return None
        parts = cookie.split(".")
        if len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit():
            return None
        body = ".".join(parts[:3])
        # bytes: compare_digest raises TypeError on a str with non-ASCII, and a cookie is client text
        if not hmac.compare_digest(self._mac(body).encode(), parts[3].encode("utf-8", "surrogatepass")):
            return None
        expires = int(parts[1]) + self.ttl
        return self._session(parts[2], expires) if now < expires else None

    def _session(self, nonce: str, expires: int) -> Session:
        return Session(nonce, expires, self._mac(f"csrf.{nonce}"))

    def seal(self, session: Session, text: str, now: float) -> str:
        """`text` for a later page of this session to read back (`unseal`): MAC'd under the
        session's key and nonce with the time, so that no other session, and no planted cookie, reads
        as it, and it is good for a short while only."""
        body = f"{int(now)}.{_b64(text.encode())}"
        return f"{body}.{self._mac(f'seal.{session.nonce}.{body}')}"

    def unseal(self, session: Session, value: str, now: float, seconds: float) -> str | None:
        """What `seal` sealed for this session at most `seconds` ago, else None."""
        parts = value.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or not 0 <= now - int(parts[0]) <= seconds:
            return None
        body = f"{parts[0]}.{parts[1]}"
        if not hmac.compare_digest(self._mac(f"seal.{session.nonce}.{body}").encode(),
                                   parts[2].encode("utf-8", "surrogatepass")):  # fmt: skip
            return None
        try:
            return base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
        except (binascii.Error, ValueError):
            return None

    @staticmethod
    def csrf_matches(session: Session, presented: str | None) -> bool:
        """Whether `presented` is `session`'s CSRF token (constant time)."""
        return presented is not None and hmac.compare_digest(session.csrf.encode(), presented.encode())
