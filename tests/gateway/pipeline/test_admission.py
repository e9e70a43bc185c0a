"""Admission: a key's rate limits and budget spent together, and which store an outage is blamed on.

The database and Redis that refuse connections are real addresses nothing listens on; the working
Redis is the one on 127.0.0.1:6379.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from gateway.config.policy import parse_policy
from gateway.governance.budgets import (
    Budget,
    BudgetExceededError,
    BudgetUnavailableError,
    LocalBudgetStore,
    RedisBudgetStore,
    Seed,
    SpendUnavailableError,
)
from gateway.governance.costs import PriceBook
from gateway.governance.keys import KeyInfo
from gateway.governance.ratelimit import LocalRateLimiter, RateLimitedError, RedisRateLimiter
from gateway.governance.spend_seed import spend_seed
from gateway.pipeline.admission import Admission, RedisAdmission
from gateway.pipeline.failover import Failover
from gateway.pipeline.runtime import Runtime
from gateway.routing.router import RouteDecision, Router
from gateway.store.db import create_db
from gateway.store.models import to_picousd

REDIS = "redis://127.0.0.1:6379/0"
NO_REDIS = "redis://127.0.0.1:1/0"
NO_DATABASE = "postgresql+asyncpg://postgres@127.0.0.1:1/test"
POLICY = """
backends:
  local: {type: engine, urls: ["http://127.0.0.1:9"], price: {input_per_mtok: 1, output_per_mtok: 2}}
models:
  fast: {backend: local}
"""
BODY = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
DECISION = RouteDecision("fast", ("fast",), "test")

# (budgets fail open, seed) -> admission, for each way admission may spend: all in-process, budgets
# alone in Redis, and limits and budgets in one Redis script
Stores = Callable[[bool, Seed], Admission]
STORES: dict[str, Stores] = {
    "local": lambda fail_open, seed: Admission(LocalRateLimiter(), LocalBudgetStore(fail_open), seed),
    "redis-budgets": lambda fail_open, seed: Admission(
        LocalRateLimiter(), RedisBudgetStore(REDIS, fail_open), seed
    ),
    "redis-together": lambda fail_open, seed: RedisAdmission(
        RedisRateLimiter(REDIS), RedisBudgetStore(REDIS, fail_open), seed
    ),
}


def _runtime() -> Runtime:
    policy = parse_policy(POLICY)
    return Runtime(
        policy, Router(policy), Failover(policy, {}), {}, "test", datetime.now(UTC), PriceBook(policy)
    )


def _key(rpm_limit: int | None = None) -> KeyInfo:
    now = datetime.now(UTC)
    return KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, now, None, None, None,
                   rpm_limit=rpm_limit, budget_usd=Decimal(1), budget_period="daily")  # fmt: skip


async def _counter_exists(key: KeyInfo) -> bool:
    import redis.asyncio as aioredis

    counter, _, _ = Budget("key", key.id, Decimal(1), "daily").counter(datetime.now(UTC))
    client = aioredis.from_url(REDIS)
    try:
        return bool(await client.exists("switchboard:" + counter))
    finally:
        await client.aclose()


@pytest.mark.parametrize("stores", STORES)
def test_a_database_down_while_seeding_a_budget_is_blamed_on_the_database_not_redis(stores: str) -> None:
    async def run() -> str:
        db = create_db(NO_DATABASE)
        admission = STORES[stores](False, spend_seed(db))
        try:
            with pytest.raises(BudgetUnavailableError) as info:
                await admission.admit(_runtime(), _key(rpm_limit=5), DECISION, BODY, 100)
            return str(info.value)
        finally:
            await admission.close()
            await db.dispose()

    message = asyncio.run(run())
    assert "database" in message and "ConnectionRefusedError" in message
    assert "Redis" not in message


@pytest.mark.parametrize("stores", STORES)
def test_budgets_failing_open_admit_without_a_budget_while_the_database_is_down_and_keep_rate_limits(
    stores: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = _key(rpm_limit=1)

    async def run() -> None:
        db = create_db(NO_DATABASE)
        admission = STORES[stores](True, spend_seed(db))
        try:
            ticket = await admission.admit(_runtime(), key, DECISION, BODY, 100)
            assert ticket is not None and [c.amount for c in ticket.charges] == [0]  # owed, not held
            admission.release(ticket, {"prompt_tokens": 1, "completion_tokens": 1}, Decimal("0.5"))
            with pytest.raises(RateLimitedError):  # Redis works: the key's rpm_limit of 1 still holds
                await admission.admit(_runtime(), key, DECISION, BODY, 100)
        finally:
            await admission.close()
            await db.dispose()
        if stores != "local":
            assert not await _counter_exists(key)  # to be seeded once the database is back

    with caplog.at_level(logging.WARNING, logger="gateway.governance.budgets"):
        asyncio.run(run())
    assert "budgets not enforced: the spend so far cannot be read from the database" in caplog.text


class FlakyDatabase:
    """A seed whose database is down until `up` is set; then all but a thousandth of a cent is spent."""

    def __init__(self) -> None:
        self.up = False

    async def __call__(self, budget: Budget, start: datetime) -> int:
        if not self.up:
            raise SpendUnavailableError("ConnectionRefusedError: the test's database is down")
        return to_picousd(Decimal("0.99999"))  # the next request (~$0.00005) does not fit


@pytest.mark.parametrize("stores", STORES)
def test_an_unbudgeted_admission_leaves_no_counter_behind_so_the_next_request_is_seeded(stores: str) -> None:
    key = _key()

    async def run() -> None:
        database = FlakyDatabase()
        seed: Seed = database
        admission = STORES[stores](True, seed)
        try:
            ticket = await admission.admit(_runtime(), key, DECISION, BODY, 100)
            assert ticket is not None
            admission.release(ticket, {"prompt_tokens": 1, "completion_tokens": 1}, Decimal("0.5"))
            await asyncio.sleep(0.05)  # the settlement, if any, runs in the background
            database.up = True
            with pytest.raises(BudgetExceededError):  # seeded with what was spent, not a stray settlement
                await admission.admit(_runtime(), key, DECISION, BODY, 100)
        finally:
            await admission.close()

    asyncio.run(run())


@pytest.mark.parametrize("budget_fail_open", [False, True])
def test_redis_down_is_still_blamed_on_redis(budget_fail_open: bool) -> None:
    async def run() -> str:
        db = create_db(NO_DATABASE)  # down too: Redis is asked first
        limiter, budgets = RedisRateLimiter(NO_REDIS), RedisBudgetStore(NO_REDIS, budget_fail_open)
        admission = RedisAdmission(limiter, budgets, spend_seed(db))
        try:
            if budget_fail_open:  # and rate limits fail open by default: admitted, nothing reserved
                ticket = await admission.admit(_runtime(), _key(rpm_limit=5), DECISION, BODY, 100)
                assert ticket is not None and [c.amount for c in ticket.charges] == [0]  # owed, not held
                return ""
            with pytest.raises(BudgetUnavailableError) as info:
                await admission.admit(_runtime(), _key(rpm_limit=5), DECISION, BODY, 100)
            return str(info.value)
        finally:
            await admission.close()
            await db.dispose()

    message = asyncio.run(run())
    assert budget_fail_open or ("Redis is unreachable" in message and "database" not in message)


async def _nothing_spent(budget: Budget, start: datetime) -> int:
    return 0


@pytest.mark.parametrize("stores", STORES)
def test_a_narrowed_reservation_frees_room_at_once_and_the_release_still_charges_exactly_the_cost(
    stores: str,
) -> None:
    # The reservation of a finished request whose tokens are still being counted is narrowed to an
    # upper bound at once: the client's next request fits; the release then charges the real cost.
    key = _key()  # $1 a day
    big = {**BODY, "max_tokens": 400_000}  # reserves about $0.80 at $2 per million output tokens

    async def run() -> None:
        admission = STORES[stores](False, _nothing_spent)
        try:
            first = await admission.admit(_runtime(), key, DECISION, big, 100)
            assert first is not None
            with pytest.raises(BudgetExceededError):
                await admission.admit(_runtime(), key, DECISION, big, 100)
            admission.narrow(first, {"prompt_tokens": 100, "completion_tokens": 400}, Decimal("0.01"))
            await asyncio.sleep(0.05)  # settlements run in the background
            second = await admission.admit(_runtime(), key, DECISION, big, 100)
            assert second is not None
            admission.release(first, {"prompt_tokens": 5, "completion_tokens": 3}, Decimal("0.15"))
            admission.release(second, {"prompt_tokens": 5, "completion_tokens": 3}, Decimal("0.15"))
            await asyncio.sleep(0.05)
            # $0.30 spent: another $0.80 reservation does not fit; with the narrowed amount released
            # twice (a wrong settlement) it would
            with pytest.raises(BudgetExceededError):
                await admission.admit(_runtime(), key, DECISION, big, 100)
            small = await admission.admit(_runtime(), key, DECISION, {**big, "max_tokens": 300_000}, 100)
            assert small is not None  # $0.30 + $0.60 fits: the exact cost was charged, no more
        finally:
            await admission.close()

    asyncio.run(run())


@pytest.mark.parametrize("stores", ["redis-budgets", "redis-together"])
def test_spend_admitted_while_budgets_fail_open_reaches_the_counter_once_redis_answers(stores: str) -> None:
    # A request admitted while Redis was away held nothing on its budget, but its cost is owed: the
    # release writes it to the counter when Redis answers again (it used to be lost until the
    # counter expired, a whole budget for a total one).
    key = _key()  # $1 a day
    big = {**BODY, "max_tokens": 400_000}  # reserves about $0.80

    async def run() -> None:
        admission = STORES[stores](True, _nothing_spent)
        budgets = admission.budgets
        assert isinstance(budgets, RedisBudgetStore)
        try:
            seeded = await admission.admit(_runtime(), key, DECISION, BODY, 100)  # the counter exists
            assert seeded is not None
            admission.release(seeded, {}, Decimal(0))
            real = budgets._admit

            async def away(**_: object) -> object:
                raise ConnectionError("Redis is away")

            budgets._admit = away
            unchecked = await admission.admit(_runtime(), key, DECISION, BODY, 100)  # fails open
            budgets._admit = real
            assert unchecked is not None
            admission.release(unchecked, {"prompt_tokens": 5, "completion_tokens": 3}, Decimal("0.5"))
            await asyncio.sleep(0.05)  # settlements run in the background
            with pytest.raises(BudgetExceededError):  # $0.50 spent + $0.80 reserved > $1
                await admission.admit(_runtime(), key, DECISION, big, 100)
        finally:
            await admission.close()

    asyncio.run(run())
