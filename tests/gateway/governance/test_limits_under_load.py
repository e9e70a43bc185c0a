"""Rate limits and budgets stay exact under bursts bigger than a default Redis pool, across two replicas.

Each "replica" is its own Admission with its own RedisRateLimiter and RedisBudgetStore (so its own
connection pools) on the shared Redis at 127.0.0.1:6379, as two gateway processes would be. The
old clients used redis-py's default pool (100 connections, an error at once when all are busy):
past 100 concurrent admissions the limiter failed open and budgets answered 503.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from decimal import Decimal

from gateway.governance.budgets import Budget, BudgetExceededError, LocalBudgetStore, RedisBudgetStore, Seed
from gateway.governance.keys import KeyInfo
from gateway.governance.ratelimit import RateLimitedError, RedisRateLimiter
from gateway.governance.redis_pool import RedisPoolConfig
from gateway.pipeline.admission import Admission, RedisAdmission
from gateway.store.models import PICO, to_picousd
from tests.gateway.pipeline.test_admission import BODY, DECISION, REDIS, _runtime  # the same one-model policy

PER_REPLICA = 400  # concurrent admissions for one key on each of the two replicas


def _key(rpm_limit: int | None, budget_usd: Decimal) -> KeyInfo:
    now = datetime.now(UTC)
    return KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, now, None, None, None,
                   rpm_limit=rpm_limit, budget_usd=budget_usd, budget_period="daily")  # fmt: skip


class CountingSeed:
    """A database seed that takes a while (as a real query does) and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, budget: Budget, start: datetime) -> int:
        self.calls += 1
        await asyncio.sleep(0.05)
        return 0


async def _burst(key: KeyInfo, seed: Seed) -> list[str]:
    """PER_REPLICA admissions on each of two replicas at once; each outcome's name."""
    rt = _runtime()
    replicas = [
        RedisAdmission(
            RedisRateLimiter(REDIS, fail_open=True), RedisBudgetStore(REDIS, fail_open=False), seed
        )
        for _ in range(2)
    ]

    async def one(admission: Admission) -> str:
        try:
            await admission.admit(rt, key, DECISION, BODY, 100)
            return "admitted"
        except (RateLimitedError, BudgetExceededError) as exc:
            return type(exc).__name__
        except Exception as exc:  # the outcome under test: anything else is a failure to report
            return f"{type(exc).__name__}: {exc}"

    try:
        return list(await asyncio.gather(*(one(replicas[i % 2]) for i in range(2 * PER_REPLICA))))
    finally:
        for admission in replicas:
            await admission.close()


def test_rpm_is_exact_with_400_concurrent_requests_per_key_on_each_of_two_replicas() -> None:
    seed = CountingSeed()
    outcomes = asyncio.run(_burst(_key(rpm_limit=20, budget_usd=Decimal(1)), seed))
    assert outcomes.count("admitted") == 20, sorted(set(outcomes))
    assert set(outcomes) == {"admitted", "RateLimitedError"}  # never a 503 for a busy pool
    assert seed.calls <= 2  # the cold budget counter: one query per replica, not one per request


def test_budget_is_exact_with_400_concurrent_requests_per_key_on_each_of_two_replicas() -> None:
    amount = to_picousd(_runtime().prices.worst_case(DECISION.chain, BODY, 100))
    seed = CountingSeed()
    outcomes = asyncio.run(_burst(_key(rpm_limit=None, budget_usd=Decimal(14 * amount) / PICO), seed))
    assert outcomes.count("admitted") == 14, sorted(set(outcomes))
    assert set(outcomes) == {"admitted", "BudgetExceededError"}
    assert seed.calls <= 2


def test_a_redis_limiter_admits_exactly_its_rpm_out_of_300_concurrent_requests() -> None:
    from gateway.governance.ratelimit import Limit

    limit = Limit(f"burst-{uuid.uuid4().hex}:rpm", 20, 1, "requests per minute for this key")

    async def run() -> int:
        limiter = RedisRateLimiter(REDIS, fail_open=True)

        async def one() -> bool:
            try:
                await limiter.acquire([limit])
                return True
            except RateLimitedError:
                return False

        try:
            return sum(await asyncio.gather(*(one() for _ in range(300))))
        finally:
            await limiter.close()

    assert asyncio.run(run()) == 20


def test_a_full_pool_makes_requests_wait_for_a_connection_not_fail() -> None:
    from gateway.governance.ratelimit import Limit

    limit = Limit(f"tiny-pool-{uuid.uuid4().hex}:rpm", 1000, 1, "requests per minute for this key")

    async def run() -> int:
        limiter = RedisRateLimiter(REDIS, fail_open=False, pool=RedisPoolConfig(max_connections=2))
        try:
            await asyncio.gather(*(limiter.acquire([limit]) for _ in range(200)))  # raises if one failed
            return 200
        finally:
            await limiter.close()

    assert asyncio.run(run()) == 200


def test_a_cold_burst_seeds_a_local_budget_counter_with_one_query() -> None:
    seed = CountingSeed()
    budget = Budget("key", uuid.uuid4().hex, Decimal(1), "daily")
    counter, start, reset = budget.counter(datetime.now(UTC))

    async def run() -> None:
        from gateway.governance.budgets import Charge

        store = LocalBudgetStore()
        charge = Charge(budget, counter, start, reset, 1)
        await asyncio.gather(*(store.reserve([charge], seed) for _ in range(50)))

    asyncio.run(run())
    assert seed.calls == 1


def test_a_pooled_connection_redis_closed_while_idle_is_not_taken_for_an_outage() -> None:
    """Redis closes idle connections (its `timeout`, a restart, a proxy): the next admission on
    one used to fail (budgets 503, limits skipped) although Redis answered."""

    async def run() -> None:
        from gateway.governance.budgets import Charge

        store = RedisBudgetStore(REDIS, pool=RedisPoolConfig(max_connections=1))
        killer = RedisPoolConfig().client(REDIS)
        budget = Budget("key", f"idle-{uuid.uuid4().hex}", Decimal(1), "total")
        counter, start, reset = budget.counter(datetime.now(UTC))
        charge = Charge(budget, counter, start, reset, 1)
        try:
            assert await store.reserve([charge], CountingSeed())  # the one pooled connection is made
            own = await store._redis.client_id()
            assert await killer.client_kill_filter(_id=own) == 1  # closed by the server meanwhile
            assert await store.reserve([charge], CountingSeed())  # not an outage: Redis is there
        finally:
            await store.close()
            await killer.aclose()

    asyncio.run(run())
