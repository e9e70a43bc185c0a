"""GCRA rate limits, in-process and in Redis (the real one on 127.0.0.1:6379)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.governance.ratelimit import (
    Limit,
    LimiterUnavailableError,
    LocalRateLimiter,
    RateLimitedError,
    RedisRateLimiter,
)

REDIS = "redis://127.0.0.1:6379/0"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rpm(name: str, per_minute: int, cost: int = 1) -> Limit:
    return Limit(name, per_minute, cost, "requests per minute for this key")


def test_a_full_minute_is_admitted_at_once_then_one_unit_per_interval() -> None:
    clock = Clock()
    limiter = LocalRateLimiter(clock)

    async def run() -> None:
        for _ in range(6):
            await limiter.acquire([_rpm("k", 6)])
        with pytest.raises(RateLimitedError) as info:
            await limiter.acquire([_rpm("k", 6)])
        assert info.value.retry_after == pytest.approx(10.0)  # 60 s / 6
        assert info.value.headers() == [  # Retry-After, and OpenAI's headers for the limit reached
            (b"retry-after", b"10"),
            (b"x-ratelimit-limit-requests", b"6"),
            (b"x-ratelimit-remaining-requests", b"0"),
            (b"x-ratelimit-reset-requests", b"10s"),
        ]
        clock.now += 10.0
        await limiter.acquire([_rpm("k", 6)])

    asyncio.run(run())


def test_counters_are_spent_all_or_nothing() -> None:
    limiter = LocalRateLimiter(Clock())

    async def run() -> None:
        await limiter.acquire([_rpm("tight", 1)])
        with pytest.raises(RateLimitedError):
            await limiter.acquire([_rpm("loose", 100), _rpm("tight", 1)])
        for _ in range(100):  # the refused request spent nothing of `loose`
            await limiter.acquire([_rpm("loose", 100)])

    asyncio.run(run())


def test_token_limits_are_reserved_then_reconciled() -> None:
    clock = Clock()
    limiter = LocalRateLimiter(clock)
    tokens = Limit("t", 1000, 800, "tokens per minute for this key")

    async def run() -> None:
        await limiter.acquire([tokens])
        with pytest.raises(RateLimitedError):
            await limiter.acquire([tokens])
        await limiter.adjust(tokens, -700)  # it really used 100
        await limiter.acquire([tokens])
        with pytest.raises(RateLimitedError, match="needs 5000 units"):
            await limiter.acquire([Limit("t2", 1000, 5000, "tokens per minute for this key")])

    asyncio.run(run())


def test_redis_shares_one_limit_between_limiters_under_concurrency() -> None:
    name = f"test:{uuid.uuid4().hex}:rpm"

    async def run() -> int:
        a, b = RedisRateLimiter(REDIS), RedisRateLimiter(REDIS)  # two replicas, two connections

        async def one(limiter: RedisRateLimiter) -> bool:
            try:
                await limiter.acquire([_rpm(name, 20)])
                return True
            except RateLimitedError as exc:
                assert 0 < exc.retry_after <= 3.0 + 1e-6
                return False

        results = await asyncio.gather(*(one(a if i % 2 else b) for i in range(100)))
        await a.close()
        await b.close()
        return sum(results)

    assert asyncio.run(run()) == 20


def test_redis_refuses_all_or_nothing_and_reconciles_tokens() -> None:
    prefix = f"test:{uuid.uuid4().hex}"

    async def run() -> None:
        limiter = RedisRateLimiter(REDIS)
        tight, loose = _rpm(f"{prefix}:tight", 1), _rpm(f"{prefix}:loose", 2)
        await limiter.acquire([tight])
        with pytest.raises(RateLimitedError, match="1 requests per minute"):
            await limiter.acquire([loose, tight])
        await limiter.acquire([loose])
        await limiter.acquire([loose])  # both of loose's units were still free
        tokens = Limit(f"{prefix}:tpm", 1000, 900, "tokens per minute for this key")
        await limiter.acquire([tokens])
        await limiter.adjust(tokens, -800)
        await limiter.acquire([tokens])
        await limiter.close()

    asyncio.run(run())


def test_unreachable_redis_fails_open_or_closed_as_configured() -> None:
    async def run() -> None:
        open_ = RedisRateLimiter("redis://127.0.0.1:1/0", fail_open=True)
        await open_.acquire([_rpm("x", 1)])
        closed = RedisRateLimiter("redis://127.0.0.1:1/0", fail_open=False)
        with pytest.raises(LimiterUnavailableError, match="Redis is unreachable"):
            await closed.acquire([_rpm("x", 1)])
        await open_.close()
        await closed.close()

    asyncio.run(run())


def test_an_unreachable_redis_is_named_to_the_client_without_its_error_text_which_goes_to_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> str:
        closed = RedisRateLimiter("redis://127.0.0.1:1/0", fail_open=False)
        try:
            with pytest.raises(LimiterUnavailableError) as info:
                await closed.acquire([_rpm("x", 1)])
            return str(info.value)
        finally:
            await closed.close()

    message = asyncio.run(run())
    assert message == "rate limits cannot be checked: Redis is unreachable"
    assert "127.0.0.1:1" in caplog.text  # the address, for the operator only


def test_a_limiter_error_built_with_details_shows_the_client_none_of_them() -> None:
    error = LimiterUnavailableError("Error 111 connecting to redis-internal:6379. Connection refused.")
    assert "redis-internal" not in str(error) and "redis-internal" in error.detail


@pytest.mark.parametrize("per_minute", [1, 3, 7, 60, 1000])
def test_a_burst_at_one_instant_admits_exactly_the_limit_whatever_the_clock_reads(per_minute: int) -> None:
    # float rounding of `tat + interval - now - window` once refused the last request a full
    # minute allows (an rpm_limit of 1 refused its first request at a monotonic clock of 4.32 s)
    clock = Clock()

    async def run() -> None:
        for now in (4.323456789, 1000.0, 6234.80723528, 98765.4321, 1_700_000_000.123456):
            clock.now = now
            limiter = LocalRateLimiter(clock)
            for _ in range(per_minute):
                await limiter.acquire([_rpm("k", per_minute)])
            with pytest.raises(RateLimitedError):
                await limiter.acquire([_rpm("k", per_minute)])

    asyncio.run(run())


@pytest.mark.parametrize("per_minute", [1, 7, 60])
def test_redis_admits_exactly_the_limit_in_a_burst(per_minute: int) -> None:
    async def run() -> None:
        limiter = RedisRateLimiter(REDIS)
        name = f"test:{uuid.uuid4().hex}"
        try:
            for _ in range(per_minute):
                await limiter.acquire([_rpm(name, per_minute)])
            with pytest.raises(RateLimitedError):
                await limiter.acquire([_rpm(name, per_minute)])
        finally:
            await limiter.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("seconds", "written"),
    [(0.0, "0ms"), (0.02, "20ms"), (6.0, "6s"), (6.25, "6.25s"), (61.5, "1m1.5s"), (5355.0, "1h29m15s")],
)
def test_a_reset_is_written_as_openai_writes_it(seconds: float, written: str) -> None:
    """It was "%.3gs": 5,355 seconds read "5.35e+03s"."""
    from gateway.governance.ratelimit import duration

    assert duration(seconds) == written
