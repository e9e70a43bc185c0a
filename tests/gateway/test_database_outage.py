"""The gateway while its PostgreSQL database is gone: cached keys are served, the rest is a 503
`database_unavailable` in OpenAI's format (never a plain 500), and every request is still counted."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from gateway.access_log import ACCESS_LOGGER
from gateway.auth import KeyHasher, KeyStore
from gateway.db import session_factory
from gateway.main import create_app
from gateway.migrate import upgrade
from gateway.settings import GatewaySettings
from tests.engine.server_proc import ManagedServer

MASTER = "sk-master-outage"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
SECRET = "outage-secret"
CHAT = {"model": "fast", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def upstream() -> Iterator[ManagedServer]:
    server = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(port)], 60
    )
    try:
        yield server
    finally:
        server.stop()


def _key_created_elsewhere(url: str) -> str:
    """A key made by another replica: the gateway under test has never looked it up."""

    async def create() -> str:
        engine = create_async_engine(url, poolclass=NullPool)
        try:
            return (await KeyStore(session_factory(engine), KeyHasher(SECRET.encode()), 0.0).create("b"))[1]
        finally:
            await engine.dispose()

    return asyncio.run(create())


def _requests(client: TestClient) -> dict[tuple[str, str, str], float]:
    """gateway_requests_total by (model, backend, status), and the request-log counters by name."""
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gateway_requests_total":
                found[(labels["model"], labels["backend"], labels["status"])] = sample.value
            elif sample.name.startswith("gateway_request_log_"):
                found[(sample.name, "", "")] = sample.value
    return found


class _Answer(Protocol):
    """What the test client returns (httpx's Response, or httpx2's)."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def _assert_database_unavailable(response: _Answer, doing: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("api_error", None, "database_unavailable")
    assert error["message"].startswith(f"{doing}: the database is unavailable"), error["message"]


def test_with_the_database_gone_cached_keys_are_served_and_the_rest_is_503_database_unavailable(
    postgres_url: str,
    drop_database: Callable[[str], None],
    upstream: ManagedServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upgrade(postgres_url)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"], price: {{input_per_mtok: 1, '
        "output_per_mtok: 2}}\nmodels:\n  fast: {backend: fake}\n"
    )
    settings = GatewaySettings(
        master_key=SecretStr(MASTER), key_secret=SecretStr(SECRET), database_url=postgres_url,
        policy_path=policy, key_cache_ttl=60,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with TestClient(create_app(settings)) as client:
        created = client.post("/admin/keys", json={"name": "a"}, headers=ADMIN).json()
        cached = {"Authorization": f"Bearer {created['key']}"}  # cached by the replica that created it
        uncached = {"Authorization": f"Bearer {_key_created_elsewhere(postgres_url)}"}
        drop_database(postgres_url)

        served = client.post("/v1/chat/completions", json=CHAT, headers=cached)
        assert (
            served.status_code == 200
            and served.json()["choices"][0]["message"]["content"] == "echo: hello there"
        )
        assert [m["id"] for m in client.get("/v1/models", headers=cached).json()["data"]] == ["fast"]

        refused = client.post("/v1/chat/completions", json=CHAT, headers=uncached)
        _assert_database_unavailable(refused, "the API key cannot be checked")
        assert refused.headers["x-request-id"].startswith("req-")
        _assert_database_unavailable(
            client.get("/v1/models", headers=uncached), "the API key cannot be checked"
        )

        key_id = created["id"]
        _assert_database_unavailable(client.get("/admin/keys", headers=ADMIN), "the keys cannot be listed")
        _assert_database_unavailable(
            client.get(f"/admin/keys/{key_id}", headers=ADMIN), "the key cannot be read"
        )
        _assert_database_unavailable(
            client.post("/admin/keys", json={"name": "c"}, headers=ADMIN), "the key cannot be created"
        )
        for response in (
            client.patch(f"/admin/keys/{key_id}", json={"rpm_limit": 5}, headers=ADMIN),
            client.post(f"/admin/keys/{key_id}/revoke", headers=ADMIN),
            client.post(f"/admin/keys/{key_id}/rotate", headers=ADMIN),
        ):
            _assert_database_unavailable(response, "the key cannot be changed")
        spend = client.get("/admin/reports/spend?from=2026-01-01&to=2026-01-31", headers=ADMIN)
        _assert_database_unavailable(spend, "the spend report cannot be read")

        counted = _requests(client)
        assert counted[("fast", "fake", "200")] == 1  # served: counted although its log row cannot be written
        assert counted[("unknown", "none", "503")] == 1  # refused before the key was known
        deadline = time.monotonic() + 10
        while counted[("gateway_request_log_dropped_total", "", "")] < 1:  # one try, 0.2 s, one more
            assert time.monotonic() < deadline, "the served request's log row was neither written nor dropped"
            time.sleep(0.1)
            counted = _requests(client)
        assert counted.get(("gateway_request_log_written_total", "", ""), 0) == 0
    lines = [
        json.loads(line)
        for r in caplog.records
        if r.name == ACCESS_LOGGER
        for line in r.getMessage().splitlines()
    ]
    by_status: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_status.setdefault(line["status"], []).append(line)
    assert [(line["key_id"], line["model"]) for line in by_status[200]] == [(key_id, "fast")]
    assert [(line["error"], line["level"]) for line in by_status[503]] == [("database_unavailable", "error")]
    assert by_status[503][0]["request_id"] == refused.headers["x-request-id"]
