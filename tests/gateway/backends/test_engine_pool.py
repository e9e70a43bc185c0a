"""The engine pool against a real fake replica: breakers fed by passive signals, in-flight counts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import httpx
import pytest

from gateway.backends.base import UpstreamUnavailableError
from gateway.backends.engine import EnginePool
from gateway.backends.health import BreakerState
from gateway.config.policy import Breaker, EngineBackend, HealthSettings
from tests.engine.server_proc import ManagedServer

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "a b c"}], "stream": true}'


@pytest.fixture(scope="module")
def fake() -> Iterator[ManagedServer]:
    server = ManagedServer(lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60)
    try:
        yield server
    finally:
        server.stop()


def _pool(url: str, health: HealthSettings) -> EnginePool:
    return EnginePool("pool", EngineBackend(type="engine", urls=[url]), health)


async def _drain(pool: EnginePool) -> None:
    async with pool.stream("/v1/chat/completions", BODY) as upstream:
        assert upstream.status == 200
        async for _ in upstream.lines:
            pass


def test_first_tokens_slower_than_the_slo_open_the_breaker(fake: ManagedServer) -> None:
    httpx.post(f"{fake.base_url}/control", json={"latency_ms": 150})
    try:
        health = HealthSettings(first_token_slo=0.05, breaker=Breaker(consecutive_failures=2, cooldown=60))

        async def run() -> EnginePool:
            pool = _pool(fake.base_url, health)
            for _ in range(2):
                await _drain(pool)
            await pool.close()
            return pool

        pool = asyncio.run(run())
    finally:
        httpx.post(f"{fake.base_url}/control", json={"latency_ms": 0})
    replica = pool.replicas[0]
    assert replica.breaker.state is BreakerState.OPEN and replica.in_flight == 0
    assert pool.unavailable_reason is not None and "circuit open" in pool.unavailable_reason


def test_fast_first_tokens_and_4xx_keep_it_closed_and_5xx_open_it(fake: ManagedServer) -> None:
    health = HealthSettings(first_token_slo=5, breaker=Breaker(consecutive_failures=2, cooldown=60))

    async def run() -> EnginePool:
        pool = _pool(fake.base_url, health)
        await _drain(pool)
        httpx.post(f"{fake.base_url}/control", json={"fail_status": 400})
        for _ in range(3):
            assert (await pool.send("/v1/chat/completions", BODY)).status == 400
        assert pool.replicas[0].breaker.state is BreakerState.CLOSED
        httpx.post(f"{fake.base_url}/control", json={"fail_status": 503})
        for _ in range(2):
            assert (await pool.send("/v1/chat/completions", BODY)).status == 503
        with pytest.raises(UpstreamUnavailableError, match="no healthy replica"):
            await pool.send("/v1/chat/completions", BODY)
        await pool.close()
        return pool

    try:
        pool = asyncio.run(run())
    finally:
        httpx.post(f"{fake.base_url}/control", json={"fail_status": None})
    assert pool.replicas[0].breaker.state is BreakerState.OPEN and pool.replicas[0].in_flight == 0
