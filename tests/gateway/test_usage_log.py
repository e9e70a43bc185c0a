"""The request-log writer: batches, flush on stop, drops counted under back-pressure."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from decimal import Decimal

from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from gateway.db import create_engine, session_factory
from gateway.migrate import upgrade
from gateway.models import RequestLog, UsageDaily
from gateway.usage_log import LogRetention, RequestLogWriter


def _row(i: int) -> dict[str, object]:
    return {"id": f"r{i}", "created_at": datetime.now(UTC), "status": 200, "attempts": 1, "prompt_tokens": i}


async def _count(url: str) -> int:
    engine = create_engine(url)
    async with session_factory(engine)() as s:
        n = (await s.execute(select(func.count()).select_from(RequestLog))).scalar_one()
    await engine.dispose()
    return int(n)


def test_rows_are_written_in_batches_and_flushed_on_stop(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        engine = create_engine(database_url)
        writer = RequestLogWriter(engine, CollectorRegistry(), batch_size=7, interval=10.0)
        writer.start()
        for i in range(30):
            writer.record(_row(i))
        await asyncio.sleep(0.3)
        assert await _count(database_url) == 28  # four full batches; two rows wait for the interval
        await writer.stop()
        assert await _count(database_url) == 30
        await engine.dispose()

    asyncio.run(run())


def test_a_full_queue_drops_and_counts_instead_of_blocking(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        engine = create_engine(database_url)
        registry = CollectorRegistry()
        writer = RequestLogWriter(engine, registry, max_queue=3)
        for i in range(5):  # the writer is not running: the queue fills up
            writer.record(_row(i))
        assert registry.get_sample_value("gateway_request_log_dropped_total") == 2
        writer.start()
        await writer.stop()
        assert await _count(database_url) == 3
        assert registry.get_sample_value("gateway_request_log_written_total") == 3
        await engine.dispose()

    asyncio.run(run())


def test_rows_the_database_refuses_are_counted_as_lost(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        engine = create_engine(database_url)
        registry = CollectorRegistry()
        writer = RequestLogWriter(engine, registry, interval=0.05)
        writer.start()
        writer.record(_row(1))
        writer.record(_row(1))  # duplicate primary key: the batch fails twice
        await writer.stop()
        assert registry.get_sample_value("gateway_request_log_dropped_total") == 2
        await engine.dispose()

    asyncio.run(run())


def test_rows_read_back_through_the_orm_exactly_as_recorded(database_url: str) -> None:
    upgrade(database_url)
    created = datetime(2026, 11, 22, 10, 0, 0, 0, tzinfo=UTC)  # no microseconds: a formatting edge
    finished = datetime(2026, 11, 22, 10, 0, 1, 250_001, tzinfo=UTC)
    row = {
        "id": "full", "created_at": created, "finished_at": finished, "key_id": "k1", "team": "legal",
        "requested_model": "auto", "backend": "local", "deployment": "http://10.0.0.1:8001",
        "route_reason": "tier simple", "status": 200, "error_type": None, "prompt_tokens": 12,
        "completion_tokens": 34, "cached_tokens": 8, "latency_ms": 1250.123, "ttft_ms": 80.5,
        "overhead_ms": 0.431, "attempts": 2, "cost_picousd": Decimal("0.000012345678"),
        "reference_cost_picousd": None, "request_body": '{"ü": "日本"}', "response_body": None,
    }  # fmt: skip

    async def run() -> RequestLog:
        engine = create_engine(database_url)
        writer = RequestLogWriter(engine, CollectorRegistry())
        writer.start()
        writer.record(row)
        await writer.stop()
        async with session_factory(engine)() as s:
            stored = (await s.execute(select(RequestLog))).scalar_one()
        await engine.dispose()
        return stored

    stored = asyncio.run(run())
    assert stored.created_at.replace(tzinfo=UTC) == created
    assert stored.finished_at is not None and stored.finished_at.replace(tzinfo=UTC) == finished
    assert (stored.team, stored.attempts, stored.cached_tokens) == ("legal", 2, 8)
    assert float(stored.latency_ms or 0) == 1250.123 and float(stored.overhead_ms or 0) == 0.431
    assert stored.request_body == '{"ü": "日本"}' and stored.error_type is None
    assert stored.cost_usd == Decimal("0.000012345678") and stored.reference_cost_usd is None
    assert stored.cost_estimated is False


def test_daily_aggregates_add_up_to_the_raw_rows_in_the_same_transaction(database_url: str) -> None:
    upgrade(database_url)
    day1 = datetime(2026, 11, 20, 23, 59, 59, tzinfo=UTC)
    day2 = datetime(2026, 11, 21, 0, 0, 1, tzinfo=UTC)
    rows = [
        {"id": f"a{i}", "created_at": day1 if i < 3 else day2, "status": 200 if i != 4 else 502,
         "key_id": "k1" if i % 2 else "k2", "team": "t", "requested_model": "auto", "backend": "pool",
         "prompt_tokens": 10 + i, "completion_tokens": 5, "cached_tokens": i,
         "cost_picousd": Decimal("0.000001") * (i + 1), "reference_cost_picousd": Decimal("0.00002")}
        for i in range(6)
    ]  # fmt: skip
    rows.append({"id": "dup", "created_at": day2, "status": 200, "attempts": 1})

    async def run() -> tuple[list[UsageDaily], int]:
        engine = create_engine(database_url)
        writer = RequestLogWriter(engine, CollectorRegistry(), batch_size=100, interval=0.05)
        writer.start()
        for row in rows:
            writer.record(row)
        await writer.stop()
        writer = RequestLogWriter(engine, CollectorRegistry(), interval=0.05)
        writer.start()
        writer.record({"id": "dup", "created_at": day2, "status": 200, "key_id": "k9"})  # refused: same id
        await writer.stop()
        async with session_factory(engine)() as s:
            daily = list(
                (await s.execute(select(UsageDaily).order_by(UsageDaily.day, UsageDaily.key_id))).scalars()
            )
        await engine.dispose()
        return daily, await _count(database_url)

    daily, raw = asyncio.run(run())
    assert raw == 7
    assert sum(d.requests for d in daily) == 7 and sum(d.errors for d in daily) == 1
    assert not any(d.key_id == "k9" for d in daily)  # the refused batch left no aggregate behind
    assert sum(d.prompt_tokens for d in daily) == sum(10 + i for i in range(6))
    assert sum((d.cost_usd for d in daily), Decimal(0)) == Decimal("0.000021")
    assert sum((d.reference_cost_usd for d in daily), Decimal(0)) == Decimal("0.00012")
    by_day = {(str(d.day), d.key_id): d.requests for d in daily}
    assert by_day[("2026-11-20", "k1")] == 1 and by_day[("2026-11-20", "k2")] == 2
    assert by_day[("2026-11-21", "")] == 1  # no key: ''


def test_retention_removes_old_raw_rows_and_never_the_aggregates(database_url: str) -> None:
    upgrade(database_url)
    now = datetime(2026, 11, 22, 12, tzinfo=UTC)

    async def run() -> tuple[int, int, int]:
        engine = create_engine(database_url)
        writer = RequestLogWriter(engine, CollectorRegistry(), interval=0.05)
        writer.start()
        for i in range(25):  # 20 rows 40 days old, 5 from yesterday
            created = datetime(2026, 10, 13, tzinfo=UTC) if i < 20 else datetime(2026, 11, 21, tzinfo=UTC)
            writer.record({"id": f"r{i}", "created_at": created, "status": 200, "key_id": "k",
                           "cost_picousd": Decimal("0.001")})  # fmt: skip
        await writer.stop()
        removed = await LogRetention(engine, days=30, chunk=7).purge(now)
        async with session_factory(engine)() as s:
            daily = sum(d.requests for d in (await s.execute(select(UsageDaily))).scalars())
        await engine.dispose()
        return removed, await _count(database_url), daily

    assert asyncio.run(run()) == (20, 5, 25)
