"""Database engine and sessions (SQLAlchemy 2.0 asyncio), for SQLite and PostgreSQL."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

logger = logging.getLogger(__name__)

# What a failing database raises: a refused or broken connection, or an unknown host, is a bare
# OSError (asyncpg), a timeout TimeoutError, a server-side refusal (e.g. a dropped database) a
# DBAPIError, a full pool sqlalchemy's TimeoutError.
DATABASE_ERRORS: tuple[type[Exception], ...] = (OSError, TimeoutError, sa_exc.DBAPIError, sa_exc.TimeoutError)
# ... except these, which say a statement's values were wrong, not that the database is away
_STATEMENT_ERRORS = (sa_exc.IntegrityError, sa_exc.DataError)


class DatabaseUnavailableError(Exception):
    """The database did not answer; the client gets 503 `database_unavailable` (OpenAI's format)."""


def unavailable(doing: str, exc: BaseException) -> DatabaseUnavailableError:
    """The error to raise for `exc` while `doing` (e.g. "the API key cannot be checked"), logged."""
    # the client's message names the database and the exception's class; the driver's own text
    # (hosts, database names) goes to the gateway's log only
    detail = str(exc).splitlines()[0] if str(exc) else ""
    logger.warning("%s: the database is unavailable (%s: %s)", doing, type(exc).__name__, detail)
    return DatabaseUnavailableError(f"{doing}: the database is unavailable ({type(exc).__name__})")


@asynccontextmanager
async def translated_errors(doing: str) -> AsyncIterator[None]:
    """Turn the database failing inside the block into DatabaseUnavailableError (see `unavailable`)."""
    try:
        yield
    except _STATEMENT_ERRORS:
        raise
    except DATABASE_ERRORS as exc:
        raise unavailable(doing, exc) from exc


def create_engine(url: str) -> AsyncEngine:
    """An async engine; SQLite gets its folder created, WAL journaling (synchronous=NORMAL), foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url)

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: object, _record: object) -> None:
            cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: no fsync per commit, no corruption
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_async_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions that keep loaded objects usable after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)
