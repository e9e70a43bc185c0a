"""Budgets: periods, reservations all or nothing, settlement, reseeding from the aggregates."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from gateway.governance.budgets import (
    Budget,
    BudgetExceededError,
    BudgetUnavailableError,
    Charge,
    LocalBudgetStore,
    RedisBudgetStore,
    SpendUnavailableError,
)
from gateway.governance.periods import period_bounds
from gateway.governance.redis_pool import RedisPoolConfig
from gateway.governance.spend_seed import spend_seed
from gateway.pipeline.admission import _unreserved
from gateway.store.db import create_db
from gateway.store.migrate import upgrade
from gateway.store.models import to_picousd
from gateway.store.request_log import RequestLogWriter
from tests.fakes.tcp_proxy import TcpProxy, tcp_proxy

REDIS = "redis://127.0.0.1:6379/0"


def _at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.mark.parametrize(("period", "now", "start", "reset"), [
    ("daily", _at(2026, 11, 22, 23, 59), _at(2026, 11, 22), _at(2026, 11, 23)),
    ("weekly", _at(2026, 11, 22, 12), _at(2026, 11, 16), _at(2026, 11, 23)),  # Sunday -> Monday 16th
    ("monthly", _at(2026, 12, 31, 23), _at(2026, 12, 1), _at(2027, 1, 1)),
    ("monthly", _at(2026, 2, 10), _at(2026, 2, 1), _at(2026, 3, 1)),
])  # fmt: skip
def test_periods_start_and_reset_at_utc_midnight(
    period: str, now: datetime, start: datetime, reset: datetime
) -> None:
    assert period_bounds(period, now) == (start, reset)  # type: ignore[arg-type]
    assert period_bounds("total", now)[1] is None


async def _nothing_spent(budget: Budget, start: datetime) -> int:
    return 0


def _charge(budget: Budget, now: datetime, usd: str) -> Charge:
    counter, start, reset = budget.counter(now)
    return Charge(budget, counter, start, reset, to_picousd(Decimal(usd)))


def test_reservations_refuse_past_the_limit_and_settle_to_the_real_cost() -> None:
    store = LocalBudgetStore()
    key = Budget("key", "k1", Decimal("1.00"), "daily")
    now = _at(2026, 11, 22, 10)

    async def run() -> None:
        first = _charge(key, now, "0.60")
        await store.reserve([first], _nothing_spent)
        with pytest.raises(BudgetExceededError) as info:
            await store.reserve([_charge(key, now, "0.50")], _nothing_spent)
        assert info.value.reset == _at(2026, 11, 23) and "resets at 2026-11-23" in str(info.value)
        await store.settle(first, to_picousd(Decimal("0.10")))  # it really cost 10 cents
        await store.reserve([_charge(key, now, "0.50")], _nothing_spent)

    asyncio.run(run())


def test_a_refusal_says_what_the_request_may_cost_and_waits_only_when_waiting_helps() -> None:
    store = LocalBudgetStore()
    key = Budget("key", "k1", Decimal("1.00"), "daily")
    now = _at(2026, 11, 22, 10)

    async def run() -> None:
        await store.reserve([_charge(key, now, "0.60")], _nothing_spent)
        with pytest.raises(BudgetExceededError) as left:  # 0.40 left: after the reset it fits
            await store.reserve([_charge(key, now, "0.50")], _nothing_spent)
        assert "has too little left for this request (it may cost up to $0.5)" in str(left.value)
        assert "spent" not in str(left.value) and [h for h, _ in left.value.headers()][:2] == [
            b"retry-after",
            b"x-budget-reset",
        ]
        with pytest.raises(BudgetExceededError) as never:  # more than the whole budget: never fits
            await store.reserve([_charge(key, now, "1.50")], _nothing_spent)
        assert "cannot cover this request even unspent (it may cost up to $1.5): lower max_tokens" in str(
            never.value
        )
        assert never.value.headers() == [(b"x-should-retry", b"false")]  # waiting would not help

    asyncio.run(run())


def test_a_new_period_starts_from_nothing() -> None:
    store = LocalBudgetStore()
    key = Budget("key", "k1", Decimal("1.00"), "daily")

    async def run() -> None:
        await store.reserve([_charge(key, _at(2026, 11, 22, 23, 59), "1.00")], _nothing_spent)
        with pytest.raises(BudgetExceededError):
            await store.reserve([_charge(key, _at(2026, 11, 22, 23, 59, 59), "0.01")], _nothing_spent)
        await store.reserve([_charge(key, _at(2026, 11, 23, 0, 0, 1), "1.00")], _nothing_spent)

    asyncio.run(run())


def test_key_and_team_are_charged_together_or_not_at_all() -> None:
    store = LocalBudgetStore()
    key, team = Budget("key", "k1", Decimal("10"), "monthly"), Budget("team", "t", Decimal("1"), "monthly")
    now = _at(2026, 11, 22)

    async def run() -> None:
        with pytest.raises(BudgetExceededError) as info:
            await store.reserve([_charge(key, now, "5"), _charge(team, now, "5")], _nothing_spent)
        assert info.value.budget is team
        await store.reserve([_charge(key, now, "10")], _nothing_spent)  # the refusal spent nothing

    asyncio.run(run())


def test_spend_is_reseeded_from_the_daily_aggregates(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> tuple[int, int, int]:
        db = create_db(database_url)
        writer = RequestLogWriter(db, CollectorRegistry(), interval=0.05)
        writer.start()
        for i, day in enumerate((_at(2026, 10, 31, 12), _at(2026, 11, 1, 12), _at(2026, 11, 21, 12))):
            writer.queue({"id": f"r{i}", "created_at": day, "status": 200, "key_id": "k1", "team": "t",
                           "cost_picousd": Decimal("0.25")})  # fmt: skip
        await writer.stop()
        seed = spend_seed(db)
        month = await seed(Budget("key", "k1", Decimal(5), "monthly"), _at(2026, 11, 1))
        team = await seed(Budget("team", "t", Decimal(5), "total"), _at(1970, 1, 1))
        other = await seed(Budget("key", "k2", Decimal(5), "monthly"), _at(2026, 11, 1))
        await db.dispose()
        return month, team, other

    assert asyncio.run(run()) == (to_picousd(Decimal("0.50")), to_picousd(Decimal("0.75")), 0)


def test_redis_budget_admits_no_more_than_the_budget_under_concurrency() -> None:
    subject = uuid.uuid4().hex
    budget = Budget("key", subject, Decimal("1.00"), "daily")
    now = datetime.now(UTC)
    seeded = []

    async def seed(b: Budget, start: datetime) -> int:
        seeded.append(b.subject)
        return to_picousd(Decimal("0.30"))  # already spent this period

    async def run() -> int:
        a, b = RedisBudgetStore(REDIS), RedisBudgetStore(REDIS)

        async def one(store: RedisBudgetStore) -> bool:
            try:
                await store.reserve([_charge(budget, now, "0.05")], seed)
                return True
            except BudgetExceededError:
                return False

        admitted = sum(await asyncio.gather(*(one(a if i % 2 else b) for i in range(100))))
        await a.close()
        await b.close()
        return admitted

    assert asyncio.run(run()) == 14  # (1.00 - 0.30) / 0.05
    assert 1 <= len(seeded) <= 100 and set(seeded) == {subject}


def test_redis_charges_key_and_team_together_or_not_at_all() -> None:
    subject = uuid.uuid4().hex
    key, team = (
        Budget("key", subject, Decimal("10"), "monthly"),
        Budget("team", subject, Decimal("1"), "monthly"),
    )
    now = datetime.now(UTC)

    async def run() -> None:
        store = RedisBudgetStore(REDIS)
        await store.reserve([_charge(key, now, "0.5"), _charge(team, now, "0.5")], _nothing_spent)
        with pytest.raises(BudgetExceededError) as info:
            await store.reserve([_charge(key, now, "0.6"), _charge(team, now, "0.6")], _nothing_spent)
        assert info.value.budget is team
        await store.reserve([_charge(key, now, "9.5")], _nothing_spent)  # the refusal spent nothing of key's
        with pytest.raises(BudgetExceededError):
            await store.reserve([_charge(key, now, "0.000001")], _nothing_spent)
        await store.close()

    asyncio.run(run())


def test_unreachable_redis_fails_budgets_closed_by_default_or_open_when_asked() -> None:
    budget = Budget("key", "k", Decimal("1"), "daily")
    now = datetime.now(UTC)

    async def run() -> None:
        closed = RedisBudgetStore("redis://127.0.0.1:1/0")
        with pytest.raises(BudgetUnavailableError, match="Redis is unreachable"):
            await closed.reserve([_charge(budget, now, "0.1")], _nothing_spent)
        opened = RedisBudgetStore("redis://127.0.0.1:1/0", fail_open=True)
        await opened.reserve([_charge(budget, now, "0.1")], _nothing_spent)
        await closed.close()
        await opened.close()

    asyncio.run(run())


def test_one_redis_script_admits_limits_and_budgets_all_or_nothing() -> None:
    from gateway.governance.ratelimit import Limit, RateLimitedError

    subject = uuid.uuid4().hex
    budget = Budget("key", subject, Decimal("1"), "daily")
    rpm = Limit(f"key:{subject}:rpm", 2, 1, "requests per minute for this key")
    now = datetime.now(UTC)

    async def run() -> None:
        store = RedisBudgetStore(REDIS)
        prefix = "switchboard:rl:"
        first = _charge(budget, now, "0.9")
        await store.admit([rpm], prefix, [first], _nothing_spent)
        with pytest.raises(BudgetExceededError):  # refused by the budget: the limit is not spent
            await store.admit([rpm], prefix, [_charge(budget, now, "0.2")], _nothing_spent)
        await store.admit([rpm], prefix, [_charge(budget, now, "0.1")], _nothing_spent)  # rpm unit 2 of 2
        with pytest.raises(RateLimitedError):  # refused by the limit: the budget is not spent
            await store.admit([rpm], prefix, [], _nothing_spent)
        await store.settle(first, 0)  # the first request cost nothing after all
        await store.admit([], prefix, [_charge(budget, now, "0.9")], _nothing_spent)
        await store.close()

    asyncio.run(run())


def test_spend_seed_reports_an_unreachable_database_as_the_database() -> None:
    async def run() -> None:
        db = create_db("postgresql+asyncpg://postgres@127.0.0.1:1/test")  # refuses connections
        with pytest.raises(SpendUnavailableError, match="ConnectionRefusedError"):
            await spend_seed(db)(Budget("key", "k", Decimal(1), "daily"), datetime.now(UTC))
        await db.dispose()

    asyncio.run(run())


@pytest.mark.parametrize("redis_url", [None, REDIS])
def test_a_database_gone_while_seeding_answers_503_naming_the_database(
    postgres_url: str, tmp_path: Path, redis_url: str | None
) -> None:
    from fastapi.testclient import TestClient

    from gateway.config.settings import GatewaySettings
    from gateway.main import create_app

    async def drop_database() -> None:
        import asyncpg

        conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
        await conn.execute(f'DROP DATABASE "{postgres_url.rsplit("/", 1)[1]}" WITH (FORCE)')
        await conn.close()

    upgrade(postgres_url)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        'backends:\n  gone: {type: engine, urls: ["http://127.0.0.1:9"], price: {input_per_mtok: 1, '
        "output_per_mtok: 2}}\nmodels:\n  fast: {backend: gone}\n"
    )
    settings = GatewaySettings(master_key="m", key_secret="s", database_url=postgres_url, redis_url=redis_url,
                               policy_path=policy, key_cache_ttl=60)  # fmt: skip
    with TestClient(create_app(settings)) as client:
        created = client.post("/admin/keys", json={"name": "b", "budget_usd": "5"},
                              headers={"Authorization": "Bearer m"}).json()  # fmt: skip
        # the key stays cached, but its budget counter has never been seeded: the database must answer
        asyncio.run(drop_database())
        body = {"model": "fast", "messages": [{"role": "user", "content": "x"}]}
        r = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {created['key']}"}
        )
    error = r.json()["error"]
    assert (r.status_code, error["code"]) == (503, "budget_unavailable")
    assert "database" in error["message"] and "Redis" not in error["message"], error["message"]


def test_budget_errors_name_redis_or_the_database_but_never_their_error_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = Budget("key", uuid.uuid4().hex, Decimal("1"), "daily")
    now = datetime.now(UTC)

    async def run() -> list[str]:
        messages = []
        redis_down = RedisBudgetStore("redis://127.0.0.1:1/0")
        with pytest.raises(BudgetUnavailableError) as info:
            await redis_down.reserve([_charge(budget, now, "0.1")], _nothing_spent)
        messages.append(str(info.value))
        await redis_down.close()
        db = create_db("postgresql+asyncpg://postgres@127.0.0.1:1/test")
        for store in (LocalBudgetStore(), RedisBudgetStore(REDIS)):
            with pytest.raises(BudgetUnavailableError) as info:
                await store.reserve([_charge(budget, now, "0.1")], spend_seed(db))
            messages.append(str(info.value))
            await store.close()
        await db.dispose()
        return messages

    messages = asyncio.run(run())
    assert "Redis is unreachable" in messages[0]
    assert all("database" in m for m in messages[1:])
    for message in messages:
        assert "127.0.0.1" not in message and "Connect call failed" not in message and "111" not in message
    assert "127.0.0.1" in caplog.text  # the details are in the gateway's log


async def _owe_a_settle(store: RedisBudgetStore, budget: Budget, now: datetime) -> str:
    """A worst case of 80 cents reserved on `budget`, then settled at its real 5 cents while Redis is
    away (kept as owed), and Redis back; returns the counter's Redis key."""
    counter = "switchboard:" + _charge(budget, now, "0").counter
    first = _charge(budget, now, "0.80")
    await store.reserve([first], _nothing_spent)
    script = store._settle_script

    async def away(**kwargs: object) -> None:
        raise redis.ConnectionError("Redis is away")

    store._settle_script = away
    await store.settle(first, to_picousd(Decimal("0.05")))  # not written: owed, retried in a second
    assert int(await store._redis.get(counter)) == to_picousd(Decimal("0.80"))
    store._settle_script = script
    return counter


def test_a_settle_redis_could_not_take_is_written_once_it_is_back() -> None:
    """Dropping it left the whole worst-case reservation on the budget until the counter expired."""
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")
    now = datetime.now(UTC)

    async def run() -> None:
        store = RedisBudgetStore(REDIS)
        counter = await _owe_a_settle(store, budget, now)
        await asyncio.sleep(1.05)  # the next admission a second later writes what is owed first
        await store.reserve([_charge(budget, now, "0.90")], _nothing_spent)  # fits only once settled
        assert int(await store._redis.get(counter)) == to_picousd(Decimal("0.95"))
        assert store._owed.pending == {}
        await store._redis.delete(counter)
        await store.close()

    asyncio.run(run())


def test_settles_owed_when_the_gateway_stops_are_written_on_close() -> None:
    """A total budget's counter never expires: a worst case left on it would stay for good."""
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")
    now = datetime.now(UTC)

    async def run() -> int:
        store = RedisBudgetStore(REDIS)
        counter = await _owe_a_settle(store, budget, now)
        await store.close()  # the gateway stops at once
        reader = RedisBudgetStore(REDIS)
        try:
            value = int(await reader._redis.get(counter))
            await reader._redis.delete(counter)
        finally:
            await reader.close()
        return value

    assert asyncio.run(run()) == to_picousd(Decimal("0.05"))


def test_a_counter_seeded_again_mid_flight_takes_what_the_requests_in_flight_owe() -> None:
    """Flushed (or evicted) while a request held 80 cents, the counter is seeded again from a log
    without that request and without its reservation. Its settle (5 cents owed) used to take the
    80 back from the new counter (below zero, room beyond the budget; then clamped to zero, 5 cents
    and the other request's 10 lost); the new seed tells it to add all it owes."""
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")
    now = datetime.now(UTC)

    async def run() -> tuple[int, int | None]:
        store = RedisBudgetStore(REDIS)
        try:
            first = _charge(budget, now, "0.80")
            await store.reserve([first], _nothing_spent)
            counter = "switchboard:" + first.counter
            await store._redis.delete(counter)  # flushed mid-flight
            await store.reserve([_charge(budget, now, "0.10")], _nothing_spent)  # seeded at 0, +10 cents
            await store.settle(first, to_picousd(Decimal("0.05")))
            value = int(await store._redis.get(counter))
            ttl = await store._redis.ttl(counter)
            await store._redis.delete(counter, counter + ":seed")
            return value, ttl
        finally:
            await store.close()

    value, ttl = asyncio.run(run())
    assert value == to_picousd(Decimal("0.15"))  # the 10 cents reserved since, and the 5 owed
    assert ttl == -1  # a total budget's counter still never expires


def test_a_counter_seeded_again_counts_rows_the_request_log_had_not_written_yet(tmp_path: Path) -> None:
    """A request settled at 20 cents into a counter Redis then lost; its row still waited in the
    request log's queue (the batch interval). The new seed writes the queue first: the counter
    holds those 20 cents beside the next request's 10, not the 10 alone."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    upgrade(url)
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")
    now = datetime.now(UTC)

    async def run() -> int:
        db = create_db(url)
        writer = RequestLogWriter(db, CollectorRegistry(), interval=3600.0)  # nothing written by itself
        writer.start()
        store = RedisBudgetStore(REDIS)
        try:
            first = _charge(budget, now, "0.30")
            await store.reserve([first], _nothing_spent)
            await store.settle(first, to_picousd(Decimal("0.20")))
            writer.queue({"id": uuid.uuid4().hex, "created_at": now, "status": 200, "key_id": budget.subject,
                          "cost_picousd": Decimal("0.20")})  # fmt: skip
            counter = "switchboard:" + first.counter
            await store._redis.delete(counter)  # Redis lost it
            await store.reserve([_charge(budget, now, "0.10")], spend_seed(db, writer.write_now))
            value = int(await store._redis.get(counter))
            await store._redis.delete(counter, counter + ":seed")
            return value
        finally:
            await store.close()
            await writer.stop()
            await db.dispose()

    assert asyncio.run(run()) == to_picousd(Decimal("0.30"))


def test_a_seed_fails_like_the_database_while_the_request_log_cannot_write(postgres_url: str) -> None:
    """Rows the log cannot write (its database is away) are spend the seed cannot see: the seed
    reports the database unavailable (budgets then fail closed or open, as configured) instead of
    seeding a counter short of them, and answers at once rather than after the outage's backoff."""
    upgrade(postgres_url)

    async def run(proxy: TcpProxy) -> float:
        db = create_db(postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
        writer = RequestLogWriter(db, CollectorRegistry(), interval=3600.0, write_timeout=1.0)
        writer.start()
        try:
            proxy.cut()
            writer.queue({"id": "r1", "created_at": datetime.now(UTC), "status": 200, "key_id": "k",
                          "cost_picousd": Decimal("0.20")})  # fmt: skip
            started = time.monotonic()
            with pytest.raises(SpendUnavailableError) as caught:
                seed = spend_seed(db, writer.write_now)
                await seed(Budget("key", "k", Decimal(1), "total"), _at(1970, 1, 1))
            assert caught.value.kind == "RequestLogBehind"
            took = time.monotonic() - started
            proxy.restore()
            assert await writer.write_now()  # back: the row is written on demand
            return took
        finally:
            await writer.stop()
            await db.dispose()

    with tcp_proxy("127.0.0.1", 5432) as proxy:
        took = asyncio.run(run(proxy))
    assert took < 5.0


def test_a_bound_settled_before_the_counter_was_seeded_again_is_not_taken_back_from_it() -> None:
    """A request narrowed its reservation (a part settle, 80 -> 50 cents), then the counter was
    flushed and seeded again, then it settled at 5 cents: the new counter owes it 5, not 5 - 50.
    A request that reserved after the new seed settles against it as usual (20 -> 2 cents)."""
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")
    now = datetime.now(UTC)

    async def run() -> int:
        store = RedisBudgetStore(REDIS)
        try:
            first = _charge(budget, now, "0.80")
            await store.reserve([first], _nothing_spent)
            await store.settle(first, to_picousd(Decimal("0.50")), final=False)
            counter = "switchboard:" + first.counter
            await store._redis.delete(counter)  # evicted mid-flight
            second = _charge(budget, now, "0.20")
            await store.reserve([second], _nothing_spent)  # seeded at 0, +20 cents
            await store.settle(first, to_picousd(Decimal("0.05")))
            await store.settle(second, to_picousd(Decimal("0.02")))
            value = int(await store._redis.get(counter))
            await store._redis.delete(counter, counter + ":seed")
            return value
        finally:
            await store.close()

    assert asyncio.run(run()) == to_picousd(Decimal("0.07"))


async def _counter(url: str, key: str) -> int:
    reader = RedisPoolConfig().client(url)
    try:
        return int(await reader.get(key) or 0)
    finally:
        await reader.aclose()


def _deaf_redis_store(proxy_port: int, fail_open: bool = False) -> RedisBudgetStore:
    """A store behind the proxy, quick to give up on an answer that does not come."""
    url = REDIS.replace(":6379/", f":{proxy_port}/")
    return RedisBudgetStore(url, fail_open, pool=RedisPoolConfig(timeout=0.5, socket_timeout=0.3))


def test_a_reservation_and_a_settle_whose_answers_were_lost_count_once_when_redis_is_back() -> None:
    """Half-open Redis: it runs the scripts, their answers never come. A refused request's
    reservation stayed on its counter for good, and a settle sent again was counted twice."""
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")
    now = datetime.now(UTC)
    counter = "switchboard:" + _charge(budget, now, "0").counter

    async def run() -> list[int]:
        seen = []
        with tcp_proxy("127.0.0.1", 6379) as proxy:
            store = _deaf_redis_store(proxy.port)
            try:
                first = _charge(budget, now, "0.80")
                await store.reserve([first], _nothing_spent)
                await asyncio.gather(*(store._redis.ping() for _ in range(3)))  # connections open to lose
                proxy.deafen()
                settled, refused = await asyncio.gather(  # each on an open connection: Redis runs both
                    store.settle(first, to_picousd(Decimal("0.05"))),  # unconfirmed: owed
                    store.reserve([_charge(budget, now, "0.40")], _nothing_spent),  # 40 cents held
                    return_exceptions=True,
                )
                assert settled is None and isinstance(refused, BudgetUnavailableError), refused
                seen.append(await _counter(REDIS, counter))
                proxy.restore()
                await asyncio.sleep(1.05)  # the next admission writes what is owed first
                await store.reserve([_charge(budget, now, "0.10")], _nothing_spent)
                seen.append(await _counter(REDIS, counter))
            finally:
                await store.close()
                await store_cleanup(counter)
        return seen

    during, after = asyncio.run(run())
    assert during == to_picousd(Decimal("0.45"))  # Redis did both: 5 cents spent, 40 held
    assert after == to_picousd(Decimal("0.15"))  # the 40 given back, the settle counted once


def test_a_request_admitted_blind_owes_its_cost_once_whatever_redis_did_with_its_reservation() -> None:
    """Budgets failing open while Redis ran the reservation without answering: the request's cost
    was added on top of the reservation Redis still held."""
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")
    now = datetime.now(UTC)
    counter = "switchboard:" + _charge(budget, now, "0").counter

    async def run() -> int:
        with tcp_proxy("127.0.0.1", 6379) as proxy:
            store = _deaf_redis_store(proxy.port, fail_open=True)
            try:
                await store.reserve([_charge(budget, now, "0.10")], _nothing_spent)  # in flight
                proxy.deafen()
                charge = _charge(budget, now, "0.50")
                assert not await store.reserve([charge], _nothing_spent)  # admitted unchecked
                proxy.restore()
                # what the admission settles for it: its cost, from what Redis really reserved
                await store.settle(_unreserved([charge])[0], to_picousd(Decimal("0.05")))
                return await _counter(REDIS, counter)
            finally:
                await store.close()
                await store_cleanup(counter)

    assert asyncio.run(run()) == to_picousd(Decimal("0.15"))


async def store_cleanup(counter: str) -> None:
    cleaner = RedisPoolConfig().client(REDIS)
    try:
        await cleaner.delete(counter, *[k async for k in cleaner.scan_iter(counter + ":held:*")])
    finally:
        await cleaner.aclose()


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_a_forgotten_counter_is_seeded_again_and_takes_what_the_requests_in_flight_owe(kind: str) -> None:
    """A budget removed and added back (PATCH) found its old counter, not charged meanwhile: $2.61
    spent on a $1 budget with the counter at $0.81. Forgotten, the counter is seeded from the log
    (what was really spent); a request in flight at the time settles all it owes on the new one."""
    budget = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "daily")
    other = Budget("key", uuid.uuid4().hex, Decimal("1.00"), "daily")
    now = datetime.now(UTC)

    async def spent_in_the_log(b: Budget, start: datetime) -> int:
        return to_picousd(Decimal("0.70")) if b == budget else 0

    async def run() -> tuple[int, int]:
        store = LocalBudgetStore() if kind == "local" else RedisBudgetStore(REDIS)
        try:
            flying = _charge(budget, now, "0.20")
            await store.reserve([flying, _charge(other, now, "0.30")], _nothing_spent)
            await store.forget("key", budget.subject)
            await store.reserve([_charge(budget, now, "0.01")], spent_in_the_log)  # seeded: 0.70 + 0.01
            await store.settle(flying, to_picousd(Decimal("0.05")))  # owes 5 cents, all of it here
            with pytest.raises(BudgetExceededError):  # 0.76 + 0.25 > 1: the log's spend counts
                await store.reserve([_charge(budget, now, "0.25")], _nothing_spent)
            with pytest.raises(BudgetExceededError):  # the other key's counter was left alone
                await store.reserve([_charge(other, now, "0.71")], _nothing_spent)
            return await _counted(store, budget, now), await _counted(store, other, now)
        finally:
            if isinstance(store, RedisBudgetStore):
                for b in (budget, other):
                    counter = "switchboard:" + b.counter(now)[0]
                    await store._redis.delete(counter, counter + ":seed")
            await store.close()

    counted, untouched = asyncio.run(run())
    assert counted == to_picousd(Decimal("0.76")) and untouched == to_picousd(Decimal("0.30"))


async def _counted(store: LocalBudgetStore | RedisBudgetStore, budget: Budget, now: datetime) -> int:
    counter = budget.counter(now)[0]
    if isinstance(store, LocalBudgetStore):
        return store._spent[counter]
    return int(await store._redis.get("switchboard:" + counter))
