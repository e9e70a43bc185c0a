"""Console logouts: a session ended before its cookie expires is refused by every replica.

The console's session is a signed cookie that any replica verifies alone (console/session.py); a
logout that only dropped it in the browser left a copied cookie working until it expired (8 hours
by default). The session's nonce is kept here while any TTL could still take its cookie (the
console's logout says until when); rows past their expiry are removed with each logout.
"""

from __future__ import annotations

from sqlalchemy import delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.db import DATABASE_ERRORS, unavailable
from gateway.store.models import ConsoleLogout


async def end_session(db: AsyncEngine, nonce: str, expires: int, now: int) -> None:
    """Refuse the session `nonce` from now until `expires` (Unix seconds).
    DatabaseUnavailableError when it cannot be written (the session then goes on)."""
    try:
        async with db.begin() as conn:
            await conn.execute(delete(ConsoleLogout).where(ConsoleLogout.expires <= now))
            await conn.execute(insert(ConsoleLogout).values(nonce=nonce, expires=expires))
    except IntegrityError:  # logged out twice (two tabs, two replicas): ended either way
        return
    except DATABASE_ERRORS as exc:
        raise unavailable("the console session cannot be ended", exc) from exc


async def session_ended(db: AsyncEngine, nonce: str) -> bool:
    """Whether the session `nonce` was logged out. DatabaseUnavailableError when it cannot be read
    (the console refuses then: every page of it reads the database anyway)."""
    try:
        async with db.connect() as conn:
            found = await conn.scalar(select(ConsoleLogout.nonce).where(ConsoleLogout.nonce == nonce))
    except DATABASE_ERRORS as exc:
        raise unavailable("the console session cannot be checked", exc) from exc
    return found is not None
