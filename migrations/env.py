"""Alembic environment: the gateway's database URL, its ORM metadata, async drivers."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from gateway.store.db import create_db
from gateway.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return str(url)
    from gateway.config.settings import GatewaySettings

    return GatewaySettings().resolved_database_url


# PostgreSQL's advisory lock for migrations: one at a time (the second finds the first's work done)
_MIGRATION_LOCK = 7_395_622_173


def _run(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":  # held until the migration's transaction ends
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    db = create_db(_url())
    try:
        async with db.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await db.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
