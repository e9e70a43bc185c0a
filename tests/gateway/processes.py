"""Starting the gateway as a subprocess for tests: migrate, then serve a policy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import text

from gateway.db import create_engine
from tests.engine.server_proc import ManagedServer


def gateway_cli(env: dict[str, str], *args: str) -> str:
    """Run `python -m gateway ARGS` with `env` added; returns its stdout."""
    full = dict(os.environ, **env)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", *args], env=full, check=True, capture_output=True, text=True
    )
    return done.stdout


def start_gateway(policy: Path, env: dict[str, str]) -> ManagedServer:
    """Migrate the configured database, then serve `policy`; ready once /health answers."""
    gateway_cli(env, "db", "upgrade")
    return ManagedServer(
        lambda port: [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)],
        60,
        env,
    )


def create_key_cli(env: dict[str, str], name: str) -> str:
    """A new key through the CLI; returns its plaintext."""
    return str(json.loads(gateway_cli(env, "keys", "create", "--name", name))["key"])


def read_log_rows(database_url: str, table: str = "request_logs") -> list[dict[str, Any]]:
    """Every row of the request log (or of another table), as dicts."""

    async def read() -> list[dict[str, Any]]:
        engine = create_engine(database_url)
        try:
            async with engine.connect() as conn:
                return [dict(r._mapping) for r in await conn.execute(text(f"SELECT * FROM {table}"))]
        finally:
            await engine.dispose()

    return asyncio.run(read())
