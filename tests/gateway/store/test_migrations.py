"""Alembic migrations: up and down cleanly, and the result matches the ORM models."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from gateway.config.settings import GatewaySettings
from gateway.main import create_app
from gateway.store.db import create_db
from gateway.store.migrate import SchemaMismatchError, current_revision, downgrade, head_revision, upgrade
from gateway.store.models import Base


async def _inspect(url: str) -> tuple[list[object], set[str]]:
    def run(conn: Connection) -> tuple[list[object], set[str]]:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        return list(diff), set(inspect(conn).get_table_names())

    db = create_db(url)
    try:
        async with db.connect() as conn:
            return await conn.run_sync(run)
    finally:
        await db.dispose()


def test_upgrade_builds_the_models_schema_and_downgrade_removes_it(database_url: str) -> None:
    assert asyncio.run(current_revision(database_url)) is None
    upgrade(database_url)
    assert asyncio.run(current_revision(database_url)) == head_revision()
    diff, tables = asyncio.run(_inspect(database_url))
    assert diff == []  # the migration creates exactly what the ORM declares
    assert {"api_keys", "request_logs"} <= tables
    downgrade(database_url, "base")
    _, tables = asyncio.run(_inspect(database_url))
    assert tables <= {"alembic_version"}
    upgrade(database_url)  # and back up again
    assert asyncio.run(current_revision(database_url)) == head_revision()


def test_gateway_refuses_an_unmigrated_database_and_says_what_to_run(database_url: str) -> None:
    from fastapi.testclient import TestClient

    settings = GatewaySettings(master_key="m", key_secret="s", database_url=database_url)
    with (
        pytest.raises(SchemaMismatchError, match="python -m gateway db upgrade"),
        TestClient(create_app(settings)),
    ):
        pass


def test_dev_mode_upgrades_by_itself(database_url: str, tmp_path: object) -> None:
    from fastapi.testclient import TestClient

    settings = GatewaySettings(dev_mode=True, database_url=database_url, data_dir=tmp_path)
    with TestClient(create_app(settings)) as client:
        assert client.get("/health").status_code == 200
    assert asyncio.run(current_revision(database_url)) == head_revision()


def test_db_upgrade_runs_without_the_gateway_secrets(database_url: str) -> None:
    env = {n: v for n, v in os.environ.items() if not n.startswith("GATEWAY_")}
    env["GATEWAY_DATABASE_URL"] = database_url  # no GATEWAY_MASTER_KEY, GATEWAY_KEY_SECRET, dev mode
    for command in (["upgrade"], ["current"], ["downgrade", "base"], ["upgrade"]):
        done = subprocess.run([sys.executable, "-m", "gateway", "db", *command], env=env, capture_output=True,
                              text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "database at revision" in done.stdout
    assert asyncio.run(current_revision(database_url)) == head_revision()


def test_two_upgrades_at_once_both_succeed(database_url: str) -> None:
    """Two `db upgrade` at once (or dev mode's workers) both created the first tables: one failed
    (5 runs of 8 on SQLite, 2 of 4 on PostgreSQL). One waits for the other now, then has nothing to do."""
    env = {n: v for n, v in os.environ.items() if not n.startswith("GATEWAY_")}
    env["GATEWAY_DATABASE_URL"] = database_url
    command = [sys.executable, "-m", "gateway", "db", "upgrade"]
    for _ in range(2):
        downgrade(database_url, "base")
        both = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]  # fmt: skip
        for process in both:
            _, err = process.communicate(timeout=120)
            assert process.returncode == 0, err
    assert asyncio.run(current_revision(database_url)) == head_revision()


def _db_wait(url: str, timeout: float) -> subprocess.Popen[str]:
    env = {n: v for n, v in os.environ.items() if not n.startswith("GATEWAY_")}
    env["GATEWAY_DATABASE_URL"] = url
    command = [sys.executable, "-m", "gateway", "db", "wait", "--timeout", str(timeout)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_db_wait_returns_once_another_process_has_migrated(database_url: str) -> None:
    waiting = _db_wait(database_url, 60)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(3)  # an empty database: it keeps waiting
        upgrade(database_url)  # what the migration job does
        out, err = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
    assert waiting.returncode == 0, err
    assert f"database at revision {head_revision()}" in out


@pytest.mark.parametrize("reachable", [True, False])
def test_db_wait_gives_up_after_its_timeout_and_says_what_it_saw(database_url: str, reachable: bool) -> None:
    url = database_url if reachable else "postgresql+asyncpg://nobody@127.0.0.1:1/none"
    waiting = _db_wait(url, 1)
    _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 2
    assert "at revision none" in err if reachable else "unreachable" in err
    assert "migration job" in err and "Traceback" not in err
