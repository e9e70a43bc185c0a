"""Gateway fixtures: a migrated database on SQLite and on the local PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


async def _pg(statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: a SQLite file, or a fresh PostgreSQL database dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
        return
    yield from _fresh_postgres()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database (dropped afterwards)."""
    yield from _fresh_postgres()


@pytest.fixture
def drop_database() -> Callable[[str], None]:
    """Drops a PostgreSQL database by its URL, connections and all: the database gone under a gateway."""

    def drop(url: str) -> None:
        asyncio.run(_pg(f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))

    return drop


def _fresh_postgres() -> Iterator[str]:
    name = f"gw_{uuid.uuid4().hex[:12]}"
    asyncio.run(_pg(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(_pg(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
