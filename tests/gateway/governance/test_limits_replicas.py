"""Two gateway replicas sharing Redis and PostgreSQL enforce one limit, not two."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from gateway.store.models import PICO
from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import read_log_rows, start_gateway

MASTER = "sk-master-limits"
TEAM = f"squad-{uuid.uuid4().hex[:8]}"  # Redis counters outlive a test run: a name of its own
PRICE = "price: {input_per_mtok: 1000, output_per_mtok: 2000}"  # $0.001 and $0.002 per token


@pytest.fixture
def replicas(tmp_path: Path, postgres_url: str) -> Iterator[tuple[list[ManagedServer], ManagedServer]]:
    upstream = ManagedServer(
        lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60
    )
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"], {PRICE}}}\n'
        "models:\n  fast: {backend: fake, model: fake-model}\n"
        f"teams:\n  {TEAM}: {{rpm: 30}}\n"
    )
    env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": postgres_url,
           "GATEWAY_REDIS_URL": "redis://127.0.0.1:6379/0"}  # fmt: skip
    gateways = [start_gateway(policy, env), start_gateway(policy, env)]
    try:
        yield gateways, upstream
    finally:
        for g in gateways:
            g.stop()
        upstream.stop()


def _key(gateway: ManagedServer, **body: object) -> str:
    r = httpx.post(f"{gateway.base_url}/admin/keys", json={"name": "limited", **body},
                   headers={"Authorization": f"Bearer {MASTER}"})  # fmt: skip
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


async def _burst(
    gateways: list[ManagedServer], key: str, n: int, max_tokens: int | None = None
) -> list[httpx.Response]:
    body: dict[str, object] = {"model": "fast", "messages": [{"role": "user", "content": "count me"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    async with httpx.AsyncClient(timeout=30) as client:
        return await asyncio.gather(*(
            client.post(f"{gateways[i % 2].base_url}/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {key}"})
            for i in range(n)
        ))  # fmt: skip


def test_two_replicas_admit_one_key_rpm_limit_between_them(
    replicas: tuple[list[ManagedServer], ManagedServer],
) -> None:
    gateways, _ = replicas
    key = _key(gateways[0], rpm_limit=20)
    answers = asyncio.run(_burst(gateways, key, 100))
    admitted = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert 19 <= len(admitted) <= 21, len(admitted)
    assert {r.status_code for r in refused} == {429}
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)


def test_a_team_limit_is_shared_by_its_keys_across_replicas(
    replicas: tuple[list[ManagedServer], ManagedServer],
) -> None:
    gateways, _ = replicas
    first, second = _key(gateways[0], team=TEAM), _key(gateways[1], team=TEAM)

    async def both() -> list[httpx.Response]:
        a, b = await asyncio.gather(_burst(gateways, first, 30), _burst(gateways, second, 30))
        return [*a, *b]

    answers = asyncio.run(both())
    assert 29 <= sum(r.status_code == 200 for r in answers) <= 31
    refused = [r for r in answers if r.status_code == 429]
    assert refused and f"team {TEAM}" in refused[0].json()["error"]["message"]


def test_two_replicas_cannot_overspend_one_budget_by_more_than_a_reservation(
    replicas: tuple[list[ManagedServer], ManagedServer], postgres_url: str
) -> None:
    gateways, _ = replicas
    key = _key(gateways[0], budget_usd="0.10", budget_period="daily")
    answers = asyncio.run(_burst(gateways, key, 100, max_tokens=5))
    for g in gateways:
        assert g.stop() == 0  # flushes the request log
    admitted = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert admitted and refused
    assert {r.status_code for r in refused} == {429}
    assert all(r.json()["error"]["code"] == "budget_exceeded" for r in refused)
    assert "resets at" in refused[0].json()["error"]["message"] and "retry-after" in refused[0].headers
    rows = [r for r in read_log_rows(postgres_url) if r["status"] == 200]
    spent = sum(Decimal(int(r["cost_picousd"])) for r in rows) / PICO
    body_bytes = len(b'{"model":"fast","messages":[{"role":"user","content":"count me"}],"max_tokens":5}')
    reservation = Decimal(body_bytes) * Decimal("0.001") + 5 * Decimal("0.002")  # a token a byte, at most
    assert len(rows) == len(admitted) and spent <= Decimal("0.10") + reservation


def test_with_redis_down_budgets_fail_closed_and_rate_limits_fail_open(tmp_path: Path) -> None:
    upstream = ManagedServer(
        lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60
    )
    policy = tmp_path / "policy.yaml"
    policy.write_text(f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"], {PRICE}}}\n'
                      "models:\n  fast: {backend: fake, model: fake-model}\n")  # fmt: skip
    env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "s",
           "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
           "GATEWAY_REDIS_URL": "redis://127.0.0.1:1/0"}  # fmt: skip
    gateway = start_gateway(policy, env)
    try:
        budgeted, limited, plain = (_key(gateway, budget_usd="5"), _key(gateway, rpm_limit=5), _key(gateway))
        answers = {k: asyncio.run(_burst([gateway, gateway], k, 1))[0] for k in (budgeted, limited, plain)}
        assert answers[budgeted].status_code == 503
        assert answers[budgeted].json()["error"]["code"] == "budget_unavailable"
        assert answers[limited].status_code == 200 and answers[plain].status_code == 200
    finally:
        gateway.stop()
        upstream.stop()


def test_rpm_and_budget_hold_with_400_concurrent_requests_per_key_on_each_replica(
    replicas: tuple[list[ManagedServer], ManagedServer],
) -> None:
    """More requests at once than redis-py's default pool (100): once they failed open (RPM 20
    admitted 220 of 300) and budgets answered 503."""
    gateways, _ = replicas
    key = _key(gateways[0], rpm_limit=20, budget_usd="100000", budget_period="daily")  # RPM decides
    body = {"model": "fast", "messages": [{"role": "user", "content": "count me"}]}

    async def burst() -> tuple[list[httpx.Response], float]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            started = time.monotonic()
            answers = await asyncio.gather(*(
                client.post(f"{gateways[i % 2].base_url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"})
                for i in range(800)
            ))  # fmt: skip
            return list(answers), time.monotonic() - started

    answers, elapsed = asyncio.run(burst())
    statuses = [r.status_code for r in answers]
    errors = {
        r.json()["error"]["code"]: r.json()["error"]["message"] for r in answers if r.status_code == 503
    }
    assert set(statuses) <= {200, 429}, errors  # no 503: a busy pool makes requests wait
    # a minute's worth at once, then one more every 3 s while the burst lasts
    assert 20 <= statuses.count(200) <= 20 + int(elapsed / 3) + 1, (statuses.count(200), elapsed)
