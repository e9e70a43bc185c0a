"""The gateway while its PostgreSQL database is gone: cached keys are served, the rest is a 503
`database_unavailable` in OpenAI's format (never a plain 500), every request is still counted and
its log row kept until the database is back (memory, then the spool). A value the database
refuses is a 400, not an outage; no driver text reaches a client.

The outage under load lasts GATEWAY_TEST_OUTAGE_SECONDS (default 5; the issue's figure is 30)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from gateway.config.settings import GatewaySettings
from gateway.governance.keys import KeyHasher, KeyStore
from gateway.main import create_app
from gateway.store.db import session_factory
from gateway.store.migrate import upgrade
from gateway.telemetry.access_log import ACCESS_LOGGER
from tests.engine.server_proc import ManagedServer
from tests.fakes.tcp_proxy import tcp_proxy

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
        db = create_async_engine(url, poolclass=NullPool)
        try:
            return (await KeyStore(session_factory(db), KeyHasher(SECRET.encode()), 0.0).create("b"))[1]
        finally:
            await db.dispose()

    return asyncio.run(create())


def _requests(client: TestClient) -> dict[tuple[str, str, str], float]:
    """gateway_requests_total by (model, backend, status), and the request-log counters by name."""
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(client.get("/metrics", headers=ADMIN).text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gateway_requests_total":
                found[(labels["model"], labels["backend"], labels["status"])] = sample.value
            elif sample.name.startswith("gateway_request_log_"):  # summed over reasons
                found[(sample.name, "", "")] = found.get((sample.name, "", ""), 0) + sample.value
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
        policy_path=policy, key_cache_ttl=60, data_dir=tmp_path,
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
        while counted[("gateway_request_log_database_down", "", "")] < 1:
            assert time.monotonic() < deadline, "the request log did not notice the database was gone"
            time.sleep(0.1)
            counted = _requests(client)
        assert counted[("gateway_request_log_queue_depth", "", "")] == 1  # kept, not dropped
        assert counted.get(("gateway_request_log_written_total", "", ""), 0) == 0
        assert counted.get(("gateway_request_log_dropped_total", "", ""), 0) == 0
    spool = settings.resolved_log_spool_dir
    spooled = [json.loads(line) for f in spool.rglob("*.jsonl") for line in f.read_text().splitlines()]
    assert [(row["key_id"], row["requested_model"]) for row in spooled] == [(key_id, "fast")]  # at shutdown
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


def _policy(tmp_path: Path, upstream: ManagedServer) -> Path:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"], price: {{input_per_mtok: 1, '
        "output_per_mtok: 2}}\nmodels:\n  fast: {backend: fake}\n"
    )
    return policy


async def _stored(url: str) -> tuple[int, int, int]:
    """Rows in the request log, distinct ids among them, requests summed in usage_daily."""
    db = create_async_engine(url, poolclass=NullPool)
    try:
        async with db.connect() as conn:
            rows, ids = (
                await conn.execute(text("SELECT count(*), count(DISTINCT id) FROM request_logs"))
            ).one()
            summed = (await conn.execute(text("SELECT coalesce(sum(requests), 0) FROM usage_daily"))).scalar()
    finally:
        await db.dispose()
    return int(rows), int(ids), int(summed or 0)


def _settled(counts: dict[tuple[str, str, str], float]) -> float:
    """Rows the request log has seen stored: written by it, or found already there on a retry."""
    return counts.get(("gateway_request_log_written_total", "", ""), 0) + counts.get(
        ("gateway_request_log_duplicates_total", "", ""), 0
    )


def test_every_request_made_while_the_database_is_cut_under_load_ends_in_exactly_one_row(
    postgres_url: str, upstream: ManagedServer, tmp_path: Path
) -> None:
    upgrade(postgres_url)
    outage = float(os.environ.get("GATEWAY_TEST_OUTAGE_SECONDS", "5"))
    with tcp_proxy("127.0.0.1", 5432) as proxy:
        settings = GatewaySettings(
            master_key=SecretStr(MASTER), key_secret=SecretStr(SECRET), key_cache_ttl=60,
            policy_path=_policy(tmp_path, upstream),
            database_url=postgres_url.replace(":5432/", f":{proxy.port}/"),
            data_dir=tmp_path, log_queue_max_rows=40,  # a small queue: the outage goes through the spool
        )  # fmt: skip
        with TestClient(create_app(settings)) as client:
            key = client.post("/admin/keys", json={"name": "load"}, headers=ADMIN).json()["key"]
            auth = {"Authorization": f"Bearer {key}"}
            answered: list[int] = []

            def load(seconds: float) -> None:
                """Four clients at once for `seconds`."""

                def one_client() -> None:
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        answered.append(
                            client.post("/v1/chat/completions", json=CHAT, headers=auth).status_code
                        )

                with ThreadPoolExecutor(4) as pool:
                    for future in [pool.submit(one_client) for _ in range(4)]:
                        future.result()

            load(1.0)
            proxy.cut()
            load(outage)
            during = _requests(client)
            proxy.restore()
            load(1.0)
            deadline = time.monotonic() + 60
            while _settled(_requests(client)) < len(answered):
                assert time.monotonic() < deadline, f"rows not written: {_requests(client)}"
                time.sleep(0.2)
            after = _requests(client)
    assert set(answered) == {200}
    assert during[("gateway_request_log_database_down", "", "")] == 1
    assert during[("gateway_request_log_spooled_total", "", "")] > 0  # the queue overflowed to disk
    assert after.get(("gateway_request_log_dropped_total", "", ""), 0) == 0
    # A commit whose acknowledgement the cut swallowed is stored yet retried: its retry finds the
    # id and counts a duplicate. The database is the judge: each request's row exactly once.
    assert _settled(after) == len(answered)
    assert asyncio.run(_stored(postgres_url)) == (len(answered),) * 3  # rows == requests, none twice
    assert not list(settings.resolved_log_spool_dir.rglob("*.jsonl"))  # all replayed


def test_a_database_gone_silent_answers_503_database_unavailable_in_bounded_time(
    postgres_url: str, upstream: ManagedServer, tmp_path: Path
) -> None:
    """No reset, no answer (a partition): asyncpg waited 60 s for a new connection and forever for a
    statement on a pooled one, so every uncached key lookup hung for as long as the silence lasted."""
    upgrade(postgres_url)
    with tcp_proxy("127.0.0.1", 5432) as proxy:
        settings = GatewaySettings(
            master_key=SecretStr(MASTER), key_secret=SecretStr(SECRET), key_cache_ttl=0,
            policy_path=_policy(tmp_path, upstream),
            database_url=postgres_url.replace(":5432/", f":{proxy.port}/"), data_dir=tmp_path,
        )  # fmt: skip
        with TestClient(create_app(settings)) as client, ThreadPoolExecutor(1) as pool:
            key = client.post("/admin/keys", json={"name": "quiet"}, headers=ADMIN).json()["key"]
            auth = {"Authorization": f"Bearer {key}"}
            assert client.post("/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
            proxy.silence()  # the pooled connections go quiet, new ones are never answered
            started = time.monotonic()
            future = pool.submit(client.post, "/v1/chat/completions", json=CHAT, headers=auth)
            try:
                refused = future.result(timeout=40)
            finally:
                elapsed = time.monotonic() - started
                proxy.restore()  # a hung request ends here, so the test can stop
            assert elapsed < 25, elapsed
            _assert_database_unavailable(refused, "the API key cannot be checked")


def test_a_gateway_told_to_stop_while_the_database_is_silent_stops_in_bounded_time(
    postgres_url: str, upstream: ManagedServer, tmp_path: Path
) -> None:
    """Its rows spooled, the gateway still waited for each pooled connection's graceful close, which
    a silent database never answers: it did not exit until the database spoke again."""
    upgrade(postgres_url)
    with tcp_proxy("127.0.0.1", 5432) as proxy, ThreadPoolExecutor(1) as pool:
        settings = GatewaySettings(
            master_key=SecretStr(MASTER), key_secret=SecretStr(SECRET),
            policy_path=_policy(tmp_path, upstream),
            database_url=postgres_url.replace(":5432/", f":{proxy.port}/"), data_dir=tmp_path,
        )  # fmt: skip
        client = TestClient(create_app(settings))
        client.__enter__()
        key = client.post("/admin/keys", json={"name": "stop"}, headers=ADMIN).json()["key"]
        answers = [client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
                   for _ in range(3)]  # fmt: skip
        assert [a.status_code for a in answers] == [200] * 3
        deadline = time.monotonic() + 10
        while asyncio.run(_stored(postgres_url))[0] < 3:  # written: the log owes nothing at the stop
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proxy.silence()
        started = time.monotonic()
        stopping = pool.submit(client.__exit__, None, None, None)
        try:
            stopping.result(timeout=90)
        finally:
            elapsed = time.monotonic() - started
            proxy.restore()
        assert elapsed < 12, elapsed  # the connections are given 5 s, not 15 s each (or forever)


def test_a_value_the_database_refuses_is_a_400_without_its_text_and_an_outage_stays_503(
    postgres_url: str, drop_database: Callable[[str], None], tmp_path: Path
) -> None:
    upgrade(postgres_url)
    settings = GatewaySettings(
        master_key=SecretStr(MASTER),
        key_secret=SecretStr(SECRET),
        database_url=postgres_url,
        data_dir=tmp_path,
    )
    with TestClient(create_app(settings)) as client:
        refused = client.post(
            "/admin/keys", json={"name": "a\x00b"}, headers=ADMIN
        )  # checked before the database
        assert refused.status_code == 400 and "NUL" in refused.json()["error"]["message"]
        assert "0x00" not in refused.text and "UTF8" not in refused.text
        for response, doing in (
            (
                client.get("/admin/keys", params={"team": "a\x00b"}, headers=ADMIN),
                "the keys cannot be listed",
            ),
        ):
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")
            assert error["message"].startswith(f"{doing}: the database refused a value"), error["message"]
            assert "0x00" not in response.text and "UTF8" not in response.text  # the driver's own words
        for response in (  # an id no key could have: 404 before the database (SQLite's answer too)
            client.get("/admin/keys/a%00b", headers=ADMIN),
            client.patch("/admin/keys/x%00", json={"team": "t"}, headers=ADMIN),
        ):
            assert response.status_code == 404 and response.json()["error"]["code"] == "key_not_found"
        assert client.post("/admin/keys", json={"name": "fine"}, headers=ADMIN).status_code == 201
        drop_database(postgres_url)
        _assert_database_unavailable(client.get("/admin/keys", headers=ADMIN), "the keys cannot be listed")
