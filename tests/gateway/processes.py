"""Starting the gateway for tests: a subprocess (migrate, then serve a policy), or in this process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.config.settings import GatewaySettings
from gateway.main import create_app
from gateway.store.db import create_db
from gateway.store.migrate import upgrade
from tests.engine.server_proc import ManagedServer, free_port

if TYPE_CHECKING:
    from gateway.telemetry.tracing import GatewayTracing


def gateway_cli(env: dict[str, str], *args: str) -> str:
    """Run `python -m gateway ARGS` with `env` added; returns its stdout."""
    full = dict(os.environ, **env)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", *args], env=full, check=True, capture_output=True, text=True
    )
    return done.stdout


def start_gateway(
    policy: Path, env: dict[str, str], *serve_args: str, process_group: bool = False
) -> ManagedServer:
    """Migrate the configured database, then serve `policy` (`serve_args`: more `serve` options,
    as `--workers 2`; `process_group`: in a group of its own); ready once /health answers. Its
    request log writes every 0.05 s unless `env` says otherwise: the tests that wait for a row do
    not wait for production's 0.5 s batch interval."""
    gateway_cli(env, "db", "upgrade")
    return ManagedServer(
        lambda port: [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(port),
                      *serve_args],
        60,
        {"GATEWAY_LOG_FLUSH_SECONDS": "0.05", **env},
        process_group=process_group,
    )  # fmt: skip


@contextmanager
def gateway_in_front(
    engine_url: str, model: str, root: Path, alias: str = "tiny"
) -> Iterator[tuple[ManagedServer, str]]:
    """A gateway subprocess (SQLite in `root`) whose policy serves `alias` from the engine server at
    `engine_url` (its model `model`); yields (the gateway, a key's plaintext) and stops it after."""
    policy = root / "policy.yaml"
    policy.write_text(f'backends:\n  local: {{type: engine, urls: ["{engine_url}"]}}\n'
                      f"models:\n  {alias}: {{backend: local, model: {model}}}\n")  # fmt: skip
    env = {
        "GATEWAY_MASTER_KEY": "m",
        "GATEWAY_KEY_SECRET": "s",
        "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'g.db'}",
    }
    gateway = start_gateway(policy, env)
    try:
        yield gateway, create_key_cli(env, alias)
    finally:
        assert gateway.stop() == 0


def create_key_cli(env: dict[str, str], name: str) -> str:
    """A new key through the CLI; returns its plaintext."""
    return str(json.loads(gateway_cli(env, "keys", "create", "--name", name))["key"])


def read_log_rows(database_url: str, table: str = "request_logs") -> list[dict[str, Any]]:
    """Every row of the request log (or of another table), as dicts."""

    async def read() -> list[dict[str, Any]]:
        db = create_db(database_url)
        try:
            async with db.connect() as conn:
                return [dict(r._mapping) for r in await conn.execute(text(f"SELECT * FROM {table}"))]
        finally:
            await db.dispose()

    return asyncio.run(read())


class InProcessGateway:
    """The gateway app served by uvicorn in a thread of this process (its spans, metrics and logs
    are this process's to inspect); a SQLite database in `root`, migrated first."""

    def __init__(
        self, root: Path, policy: Path, master_key: str, tracing: GatewayTracing | None = None
    ) -> None:
        url = f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        upgrade(url)
        settings = GatewaySettings(
            master_key=SecretStr(master_key), key_secret=SecretStr("in-process-secret"), database_url=url,
            policy_path=policy,
            otlp_endpoint=None, otlp_traces_endpoint=None,
        )  # fmt: skip
        self.app = create_app(settings, tracing)
        self.base_url = f"http://127.0.0.1:{(port := free_port())}"
        self._master = master_key
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.02)

    def create_key(self, **body: Any) -> str:
        """A new virtual key through the admin API; returns its plaintext."""
        r = httpx.post(f"{self.base_url}/admin/keys", json=body,
                       headers={"Authorization": f"Bearer {self._master}"})  # fmt: skip
        r.raise_for_status()
        return str(r.json()["key"])

    def stop(self) -> None:
        """Shut down (the lifespan flushes the request log and the spans)."""
        self._server.should_exit = True
        self._thread.join(30)


class FailingPairStack:
    """A subprocess gateway in front of two fake upstreams, `ok` and `bad` (answers 500 to everything).

    Models: `fast` (ok, priced), `shaky` (bad, then `fast`), `broken` (bad only). The `bad`
    replica's breaker opens after two failures and stays open for a minute. With `otlp_endpoint`
    the gateway exports its spans there (batched every 50 ms).
    """

    MASTER = "sk-master-observed"

    def __init__(self, root: Path, log_bodies: bool = False, otlp_endpoint: str | None = None) -> None:
        self.ok, self.bad = (
            ManagedServer(
                lambda port: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(port)], 60
            )
            for _ in range(2)
        )
        httpx.post(f"{self.bad.base_url}/control", json={"fail_status": 500}).raise_for_status()
        self.policy = root / "policy.yaml"
        self.write_policy(log_bodies)
        self.database_url = f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        env = {"GATEWAY_MASTER_KEY": self.MASTER, "GATEWAY_KEY_SECRET": "observed-secret",
               "GATEWAY_DATABASE_URL": self.database_url}  # fmt: skip
        if otlp_endpoint is not None:
            env.update(OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint, OTEL_BSP_SCHEDULE_DELAY="50")
        self.gateway = start_gateway(self.policy, env)
        r = httpx.post(f"{self.gateway.base_url}/admin/keys", json={"name": "observed", "team": "search"},
                       headers={"Authorization": f"Bearer {self.MASTER}"})  # fmt: skip
        r.raise_for_status()
        self.key = str(r.json()["key"])
        self.key_prefix = str(r.json()["key_prefix"])

    def write_policy(self, log_bodies: bool) -> None:
        """(Re)write the policy; a running gateway picks a change up within a second."""
        self.policy.write_text(f"""
backends:
  ok: {{type: engine, urls: ["{self.ok.base_url}"], price: {{input_per_mtok: 1.0, output_per_mtok: 2.0}}}}
  bad: {{type: engine, urls: ["{self.bad.base_url}"], timeouts: {{connect: 1, total: 5}}}}
models:
  fast: {{backend: ok, model: fake-model}}
  shaky: {{backend: bad, model: fake-model, fallbacks: [fast]}}
  broken: {{backend: bad, model: fake-model}}
health:
  interval: 0.5
  breaker: {{consecutive_failures: 2, cooldown: 60}}
log_bodies: {"true" if log_bodies else "false"}
""")  # fmt: skip

    def chat(self, model: str, content: str, key: str | None = None, **extra: Any) -> httpx.Response:
        """POST /v1/chat/completions (a streamed answer is read whole)."""
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        headers = {"Authorization": f"Bearer {key or self.key}"}
        return httpx.post(
            f"{self.gateway.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
        )

    def close(self) -> None:
        """Stop the gateway, then the fakes."""
        self.gateway.stop()
        self.ok.stop()
        self.bad.stop()


def insert_rows(database_url: str, rows: Sequence[object]) -> None:
    """ORM rows added to the database in one transaction (tests that need history in the log)."""

    async def write() -> None:
        db = create_db(database_url)
        try:
            async with async_sessionmaker(db)() as session, session.begin():
                session.add_all(rows)
        finally:
            await db.dispose()

    asyncio.run(write())
