"""Schema migrations (Alembic, scripts in the repository's migrations/) and the start-up check."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from gateway.store.db import create_db

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
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database down to `revision` ("base" drops everything)."""
    command.downgrade(alembic_config(url), revision)


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


async def ensure_schema(url: str, auto_upgrade: bool) -> None:
    """Refuse to start on an out-of-date schema (or upgrade it, in dev mode)."""
    current, head = await current_revision(url), head_revision()
    if current == head:
        return
    if auto_upgrade:
        await asyncio.to_thread(upgrade, url)
        return
    raise SchemaMismatchError(
        f"the database schema is at revision {current or 'none'} but this gateway needs {head}: "
        "run `python -m gateway db upgrade` (with the same GATEWAY_DATABASE_URL) first"
    )
