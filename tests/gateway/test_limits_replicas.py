"""Two gateway replicas sharing Redis and PostgreSQL enforce one limit, not two."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import start_gateway

MASTER = "sk-master-limits"


@pytest.fixture
def replicas(tmp_path: Path, postgres_url: str) -> Iterator[tuple[list[ManagedServer], ManagedServer]]:
    upstream = ManagedServer(
        lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60
    )
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"]}}\n'
        "models:\n  fast: {backend: fake, model: fake-model}\n"
        "teams:\n  squad: {rpm: 30}\n"
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


async def _burst(gateways: list[ManagedServer], key: str, n: int) -> list[httpx.Response]:
    body = {"model": "fast", "messages": [{"role": "user", "content": "count me"}]}
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
    first, second = _key(gateways[0], team="squad"), _key(gateways[1], team="squad")

    async def both() -> list[httpx.Response]:
        a, b = await asyncio.gather(_burst(gateways, first, 30), _burst(gateways, second, 30))
        return [*a, *b]

    answers = asyncio.run(both())
    assert 29 <= sum(r.status_code == 200 for r in answers) <= 31
    refused = [r for r in answers if r.status_code == 429]
    assert refused and "team squad" in refused[0].json()["error"]["message"]
