"""Schema migrations (Alembic, scripts in the repository's migrations/) and the start-up check."""

from __future__ import annotations

import asyncio
import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy.engine import Connection, make_url

from gateway.store.db import DATABASE_ERRORS, create_db

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaMismatchError(RuntimeError):
    """The database is not at the revision this code expects."""


def alembic_config(url: str) -> Config:
    """Alembic configuration pointing at our scripts and the given database."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database up (blocking; call from a thread inside an event loop)."""
    with _one_at_a_time(url):
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database down to `revision` ("base" drops everything)."""
    with _one_at_a_time(url):
        command.downgrade(alembic_config(url), revision)


@contextmanager
def _one_at_a_time(url: str) -> Iterator[None]:
    """One migration at a time on a SQLite file, by a lock file beside it (PostgreSQL: an advisory
    lock, migrations/env.py): two run at once (two `db upgrade`, dev mode's workers) both created
    the first tables, and one failed."""
    parsed = make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:":
        yield
        return
    lock = Path(path).with_name(Path(path).name + ".migrating")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        yield


def _known(revision: str) -> bool:
    """Whether `revision` is one of this code's migration scripts."""
    try:
        return ScriptDirectory.from_config(alembic_config("")).get_revision(revision) is not None
    except CommandError:  # (alembic's ResolutionError is one)
        return False


def head_revision() -> str | None:
    """The newest revision among the scripts."""
    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


async def current_revision(url: str) -> str | None:
    """The revision the database is at (None when never migrated)."""

    def read(conn: Connection) -> str | None:
        return MigrationContext.configure(conn).get_current_revision()

    db = create_db(url)
    try:
        async with db.connect() as conn:
            return await conn.run_sync(read)
    finally:
        await db.dispose()


def require_database(url: str) -> None:
    """SchemaMismatchError when `url` names a SQLite file that does not exist: a command that only
    reads (a report) would otherwise create an empty database, and its folder, to find no schema."""
    parsed = make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:" or Path(path).exists():
        return
    raise SchemaMismatchError(
        f"there is no database at {path}: set GATEWAY_DATABASE_URL to the gateway's database "
        "(or create this one with `python -m gateway db upgrade`)"
    )


async def ensure_schema(url: str, auto_upgrade: bool) -> None:
    """Refuse to start on an out-of-date schema (or upgrade it, in dev mode)."""
    current, head = await current_revision(url), head_revision()
    if current == head:
        return
    if current is not None and not _known(current):  # a newer release migrated it: upgrading cannot help
        raise SchemaMismatchError(
            f"the database schema is at revision {current}, which this gateway does not know (a newer release"
            f" migrated it; this one needs {head}): run that release, or downgrade the database with it"
        )
    if auto_upgrade:
        await asyncio.to_thread(upgrade, url)
        return
    raise SchemaMismatchError(
        f"the database schema is at revision {current or 'none'} but this gateway needs {head}: "
        "run `python -m gateway db upgrade` (with the same GATEWAY_DATABASE_URL) first"
    )


async def wait_for_schema(url: str, timeout: float, interval: float = 2.0) -> str | None:
    """Wait until the database is at this code's revision (another process migrates it); return it.

    What a gateway replica runs before it starts where a migration job owns the schema (Kubernetes):
    an unreachable database or an older revision is waited out; after `timeout` seconds it raises
    SchemaMismatchError saying which of the two it saw last.
    """
    head = head_revision()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            current = await current_revision(url)
        except DATABASE_ERRORS as exc:
            seen = f"unreachable ({type(exc).__name__})"
        else:
            if current == head:
                return current
            seen = f"at revision {current or 'none'}"
        if loop.time() >= deadline:
            raise SchemaMismatchError(
                f"after {timeout:g} s the database is {seen} but this gateway needs {head}: "
                "has `python -m gateway db upgrade` (the migration job) run?"
            )
        await asyncio.sleep(min(interval, max(0.0, deadline - loop.time())))
