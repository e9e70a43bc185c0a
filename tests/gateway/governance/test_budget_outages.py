"""Budgets through a Redis outage: what requests admitted blind (budgets failing open) owe is
counted once, whichever replica seeds the counter again, and a replica that owes settles writes
them without waiting for a request of its own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from gateway.governance import owed_settles
from gateway.governance.budgets import Budget, Charge, RedisBudgetStore
from gateway.governance.redis_pool import RedisPoolConfig
from gateway.pipeline.admission import _unreserved
from gateway.store.models import to_picousd
from tests.fakes.tcp_proxy import TcpProxy, tcp_proxy
from tests.gateway.governance.test_budgets import REDIS, _charge, _counter, _deaf_redis_store, _nothing_spent

CENTS = to_picousd(Decimal("0.01"))


def _budget() -> Budget:
    return Budget("key", uuid.uuid4().hex, Decimal("1.00"), "total")


def _logged(cents: int):  # type: ignore[no-untyped-def]
    """A seed reading a request log whose rows cost `cents`."""

    async def seed(budget: Budget, start: datetime) -> int:
        return cents * CENTS

    return seed


async def _blind_and_owed(store: RedisBudgetStore, proxy: TcpProxy, budget: Budget) -> Charge:
    """A request admitted while Redis is away (budgets fail open), whose 5 cents are owed."""
    proxy.cut()
    charge = _charge(budget, datetime.now(UTC), "0.50")
    assert not await store.reserve([charge], _nothing_spent)  # admitted unchecked
    blind = _unreserved([charge])[0]
    await store.settle(blind, 5 * CENTS)  # Redis away: owed
    assert store._owed.pending
    return blind


async def _redis_lost(counter: str) -> None:
    """Redis restarted empty (nothing kept on disk): the counter and its seed are gone."""
    cleaner = RedisPoolConfig().client(REDIS)
    try:
        await cleaner.delete(counter, counter + ":seed")
    finally:
        await cleaner.aclose()


async def _cleanup(counter: str) -> None:
    cleaner = RedisPoolConfig().client(REDIS)
    try:
        held = [k async for k in cleaner.scan_iter(counter + ":held:*")]
        await cleaner.delete(counter, counter + ":seed", *held)
    finally:
        await cleaner.aclose()


@asynccontextmanager
async def _two_replicas(
    budget: Budget, **options: Any
) -> AsyncIterator[tuple[TcpProxy, RedisBudgetStore, RedisBudgetStore]]:
    """(Redis's proxy, a replica behind it whose budgets fail open, another replica on Redis itself);
    both closed, the budget's counter and markers gone, after."""
    counter = "switchboard:" + _charge(budget, datetime.now(UTC), "0").counter
    with tcp_proxy("127.0.0.1", 6379) as proxy:
        url = REDIS.replace(":6379/", f":{proxy.port}/")
        quick = RedisPoolConfig(timeout=0.5, socket_timeout=0.3)
        cut_off, other = RedisBudgetStore(url, True, pool=quick, **options), RedisBudgetStore(REDIS)
        try:
            yield proxy, cut_off, other
        finally:
            await cut_off.close()
            await other.close()
            await _cleanup(counter)


def test_a_counter_another_replica_seeded_from_a_log_with_the_request_does_not_count_it_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis came back empty; another replica seeded the counter from the log, which had the blind
    request's row; the owed settle then added the request again (22.5M picodollars over in five
    requests). And the replica owing it wrote it only at its next request or at shutdown."""
    monkeypatch.setattr(owed_settles, "LOGGED_SECONDS", 0.0)  # its row is in the log at once
    budget = _budget()
    counter = "switchboard:" + _charge(budget, datetime.now(UTC), "0").counter

    async def run() -> tuple[int, bool]:
        async with _two_replicas(budget) as (proxy, cut_off, other):
            await _blind_and_owed(cut_off, proxy, budget)
            await _redis_lost(counter)
            proxy.restore()
            await asyncio.sleep(0.01)
            await other.reserve([_charge(budget, datetime.now(UTC), "0.20")], _logged(5))
            await asyncio.sleep(owed_settles.RETRY_SECONDS + 0.5)  # no request on the replica owing it
            return await _counter(REDIS, counter), bool(cut_off._owed.pending)

    value, still_owed = asyncio.run(run())
    assert value == 25 * CENTS  # the 5 cents the log had, the other's 20 held: not 5 more
    assert not still_owed  # written by itself once Redis answered


def test_a_request_still_in_flight_when_its_counter_is_seeded_again_adds_its_cost() -> None:
    """The log read by the new seed did not have the request (it had not ended): its cost is added."""
    budget = _budget()
    counter = "switchboard:" + _charge(budget, datetime.now(UTC), "0").counter

    async def run() -> int:
        async with _two_replicas(budget) as (proxy, cut_off, other):
            proxy.cut()
            charge = _charge(budget, datetime.now(UTC), "0.50")
            assert not await cut_off.reserve([charge], _nothing_spent)  # admitted unchecked, in flight
            await _redis_lost(counter)
            proxy.restore()
            await other.reserve([_charge(budget, datetime.now(UTC), "0.20")], _logged(0))
            await cut_off.settle(_unreserved([charge])[0], 5 * CENTS)  # it ends now
            return await _counter(REDIS, counter)

    assert asyncio.run(run()) == 25 * CENTS


def test_the_replica_owing_a_blind_settle_writes_it_before_it_seeds_the_counter_again() -> None:
    """Redis back (empty) within the pause after the failed settle: the replica's next admission
    seeded the counter from the log (which has the request), then wrote the owed settle on top."""
    budget = _budget()
    counter = "switchboard:" + _charge(budget, datetime.now(UTC), "0").counter

    async def run() -> int:
        with tcp_proxy("127.0.0.1", 6379) as proxy:
            store = _deaf_redis_store(proxy.port, fail_open=True)
            try:
                await _blind_and_owed(store, proxy, budget)
                await _redis_lost(counter)
                proxy.restore()
                assert await store.reserve([_charge(budget, datetime.now(UTC), "0.20")], _logged(5))
                await asyncio.sleep(owed_settles.RETRY_SECONDS + 0.5)  # nothing owed is left to add
                assert not store._owed.pending
                return await _counter(REDIS, counter)
            finally:
                await store.close()
                await _cleanup(counter)

    assert asyncio.run(run()) == 25 * CENTS


def test_a_blind_settle_owed_while_the_log_cannot_write_is_added_whenever_the_counter_was_seeded() -> None:
    """Its row may reach the log long after (spooled through a database outage): a counter seeded
    meanwhile does not have it, so the time rule must not drop the settle (it undercounted)."""
    budget = _budget()
    counter = "switchboard:" + _charge(budget, datetime.now(UTC), "0").counter

    async def run() -> int:
        async with _two_replicas(budget, logged_seconds=0.0, log_behind=lambda: True) as (
            proxy,
            cut_off,
            other,
        ):
            await _blind_and_owed(cut_off, proxy, budget)
            await _redis_lost(counter)
            proxy.restore()
            await asyncio.sleep(0.01)
            await other.reserve([_charge(budget, datetime.now(UTC), "0.20")], _logged(0))  # (no row yet)
            await asyncio.sleep(owed_settles.RETRY_SECONDS + 0.5)
            return await _counter(REDIS, counter)

    assert asyncio.run(run()) == 25 * CENTS
