"""The engine pool against a real fake replica: breakers fed by passive signals, in-flight counts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.backends.base import UpstreamStreamError, UpstreamUnavailableError
from gateway.backends.engine import EnginePool
from gateway.backends.health import BreakerState
from gateway.config.policy import Breaker, EngineBackend, HealthSettings
from tests.engine.server_proc import ManagedServer
from tests.fakes.hostile_upstream import SHAPES
from tests.fuzz.stack import hostile_server

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


@pytest.fixture(scope="module")
def hostile() -> Iterator[ManagedServer]:
    server = hostile_server()
    try:
        yield server
    finally:
        server.stop()


def _asking(mode: str, stream: bool) -> bytes:
    message = {"role": "user", "content": f"mode={mode}"}
    return orjson.dumps({"model": "m", "messages": [message], "stream": stream})


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_whole_answer_a_client_cannot_read_is_the_replicas_failure(
    hostile: ManagedServer, shape: str
) -> None:
    """A 200 of the wrong shape (no choices, `content: 12345`, ...) was a success for the breaker,
    relayed and billed: now it is not an answer (reply.answer None; failover tries another
    replica) and enough of them open the replica's breaker."""
    health = HealthSettings(breaker=Breaker(consecutive_failures=3, cooldown=60))

    async def run() -> EnginePool:
        pool = _pool(hostile.base_url, health)
        for _ in range(3):
            reply = await pool.send("/v1/chat/completions", _asking(f"shape:{shape}", False))
            assert reply.status == 200 and reply.answer is None
        await pool.close()
        return pool

    assert asyncio.run(run()).replicas[0].breaker.state is BreakerState.OPEN
    ok = asyncio.run(_one_answer(hostile.base_url))  # an honest one: parsed once, here
    assert ok is not None and isinstance(ok["choices"], list)


async def _one_answer(url: str) -> dict[str, Any] | None:
    pool = _pool(url, HealthSettings())
    try:
        return (await pool.send("/v1/chat/completions", _asking("ok", False))).answer
    finally:
        await pool.close()


def test_streams_that_break_after_their_first_token_open_the_breaker(hostile: ManagedServer) -> None:
    """Each such stream was a success (its first token) and its break ignored: a replica whose every
    stream broke mid-answer was never left."""
    # each stream a success (its first token), then a failure: the run of failures never grows past
    # one, the error rate is all of them
    breaker = Breaker(consecutive_failures=100, error_rate=0.9, min_requests=3, cooldown=60)
    health = HealthSettings(first_token_slo=5, breaker=breaker)

    async def run() -> EnginePool:
        pool = _pool(hostile.base_url, health)
        for _ in range(3):
            with pytest.raises(UpstreamStreamError):
                async with pool.stream("/v1/chat/completions", _asking("cut", True)) as upstream:
                    async for _ in upstream.lines:
                        pass
        await pool.close()
        return pool

    assert asyncio.run(run()).replicas[0].breaker.state is BreakerState.OPEN
