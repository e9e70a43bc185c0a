"""The database and its sessions (SQLAlchemy 2.0 asyncio), for SQLite and PostgreSQL.

In the gateway `db` always names the SQLAlchemy `AsyncEngine` (never `engine`: that word is our
inference server), hence `create_db` rather than SQLAlchemy's `create_engine`.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from decimal import InvalidOperation
from enum import Enum
from pathlib import Path

import asyncpg
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from gateway.errors import GatewayError

logger = logging.getLogger(__name__)

# What a failing database raises: a refused or broken connection, or an unknown host, is a bare
# OSError (asyncpg), a timeout TimeoutError, a server-side refusal (e.g. a dropped database) a
# DBAPIError, a full pool sqlalchemy's TimeoutError.
DATABASE_ERRORS: tuple[type[Exception], ...] = (OSError, TimeoutError, sa_exc.DBAPIError, sa_exc.TimeoutError)


# Errors that say the values of a statement were wrong, wherever they are raised: the server
# (SQLSTATE class 22 data exception, 23 integrity violation), the driver encoding a value (asyncpg's
# client-side DataError, a str that is not UTF-8), or Python converting one (e.g. a Decimal NaN).
_VALUE_ERRORS: tuple[type[BaseException], ...] = (
    sa_exc.IntegrityError,
    sa_exc.DataError,
    asyncpg.exceptions.DataError,
    asyncpg.exceptions.IntegrityConstraintViolationError,
    asyncpg.exceptions._base.DataError,  # the client-side one ("invalid input for query argument")
    sqlite3.IntegrityError,
    sqlite3.DataError,
    sqlite3.ProgrammingError,  # e.g. a parameter of a type sqlite3 cannot bind
    UnicodeError,
    InvalidOperation,
    OverflowError,
    TypeError,
    ValueError,
)
# Errors that say the database is away or cannot work now: refused, reset or timed-out connections,
# a server starting up or shutting down (57P), out of connections or disk (53), a database that
# does not exist (3D000: dropped, or not created yet), a full pool, a locked or unreachable SQLite file.
_OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    sa_exc.TimeoutError,
    sa_exc.DisconnectionError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.InvalidCatalogNameError,
    asyncpg.exceptions.InterfaceError,  # "connection is closed", "another operation is in progress"
    sqlite3.OperationalError,
)


class Failure(Enum):
    """What a database error says: the statement's values were wrong, or the database is away."""

    VALUES = "values"
    OUTAGE = "outage"
    UNKNOWN = "unknown"


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what it wraps: SQLAlchemy's `orig`, then the `__cause__`/`__context__` chain."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        # explicit wrapping only: an implicit __context__ may be any error met while handling another
        todo += [orig if isinstance(orig, BaseException) else None, current.__cause__]


def classify(exc: BaseException) -> Failure:
    """VALUES if anything in the chain names bad values, else OUTAGE if it names a lost database."""
    chain = list(_causes(exc))
    # values first: asyncpg's client-side DataError is also an InterfaceError (an outage class)
    if any(isinstance(e, _VALUE_ERRORS) for e in chain):
        return Failure.VALUES
    if any(isinstance(e, _OUTAGE_ERRORS) for e in chain):
        return Failure.OUTAGE
    return Failure.UNKNOWN


class DatabaseUnavailableError(GatewayError):
    """The database did not answer; the client gets 503 `database_unavailable` (OpenAI's format)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "api_error", code="database_unavailable")


class DatabaseValueError(GatewayError):
    """The database refused a value of the request (e.g. a NUL character): 400 `invalid_value`.

    The message names what was being done, never the driver's text (it may quote the value, the
    table or the constraint); that goes to the gateway's log.
    """

    def __init__(self, message: str) -> None:
        super().__init__(400, message, code="invalid_value")


def refused(doing: str, exc: BaseException) -> DatabaseValueError:
    """The error to raise for `exc`, a value the database refused while `doing`, logged."""
    detail = str(exc).splitlines()[0] if str(exc) else ""
    logger.warning("%s: the database refused a value (%s: %s)", doing, type(exc).__name__, detail)
    return DatabaseValueError(
        f"{doing}: the database refused a value of the request "
        "(e.g. a NUL character, invalid Unicode or a number out of range)"
    )


def unavailable(doing: str, exc: BaseException) -> DatabaseUnavailableError:
    """The error to raise for `exc` while `doing` (e.g. "the API key cannot be checked"), logged."""
    # the client's message names the database and the exception's class; the driver's own text
    # (hosts, database names) goes to the gateway's log only
    detail = str(exc).splitlines()[0] if str(exc) else ""
    logger.warning("%s: the database is unavailable (%s: %s)", doing, type(exc).__name__, detail)
    return DatabaseUnavailableError(f"{doing}: the database is unavailable ({type(exc).__name__})")


# StatementError: a value SQLAlchemy could not bind; UnicodeEncodeError: one sqlite3 could not
_TRANSLATED: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, sa_exc.StatementError, UnicodeEncodeError)


@asynccontextmanager
async def translated_errors(doing: str) -> AsyncIterator[None]:
    """The database failing inside the block as DatabaseUnavailableError (see `unavailable`), or, when
    it refused a value of the request, as DatabaseValueError (see `refused`)."""
    try:
        yield
    except _TRANSLATED as exc:
        if classify(exc) is Failure.VALUES:
            raise refused(doing, exc) from exc
        if isinstance(exc, DATABASE_ERRORS):
            raise unavailable(doing, exc) from exc
        raise


# A serving gateway's bounds on PostgreSQL. asyncpg waits 60 s for a new connection and forever for
# a statement, so a database gone silent (a partition, a stalled proxy: no reset) held every key
# lookup, budget seed and admin call for as long as the silence lasted. The statement bound is the
# request log's write timeout. Not for migrations: a schema change on a big table may take longer.
SERVING_CONNECT_TIMEOUT = 5.0  # s
SERVING_STATEMENT_TIMEOUT = 15.0  # s, each statement (the pool's pre-ping too)
DISPOSE_SECONDS = 5.0  # s a stopping gateway gives its connections to close gracefully


def create_db(url: str, serving: bool = False) -> AsyncEngine:
    """The AsyncEngine; SQLite gets its folder created, WAL journaling (synchronous=NORMAL), foreign keys.

    `serving`: PostgreSQL connections and statements are bounded (a silent database is an outage).
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        db = create_async_engine(url)

        @event.listens_for(db.sync_engine, "connect")
        def _pragmas(dbapi_conn: object, _record: object) -> None:
            cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: no fsync per commit, no corruption
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return db
    bounds = (
        {"timeout": SERVING_CONNECT_TIMEOUT, "command_timeout": SERVING_STATEMENT_TIMEOUT} if serving else {}
    )
    return create_async_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True, connect_args=bounds)


def session_factory(db: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions that keep loaded objects usable after commit."""
    return async_sessionmaker(db, expire_on_commit=False)


async def dispose(db: AsyncEngine) -> None:
    """Close the pool's connections, giving up after DISPOSE_SECONDS (what is left is reset when the
    process exits). A graceful close waits for the server's goodbye: with PostgreSQL silent, a
    gateway told to stop never exited, its request log long spooled."""
    try:
        async with asyncio.timeout(DISPOSE_SECONDS):
            await db.dispose()
    except TimeoutError:
        logger.warning("the database did not answer: its connections were not closed gracefully")
