"""The request-log writer: batches, flush on stop, bounded memory, idempotent writes, values no
column can hold cleaned, a row the database refuses isolated, rows kept through outages (spool)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from sqlalchemy import func, select

from gateway.config.settings import GatewaySettings
from gateway.store.db import create_db, session_factory
from gateway.store.log_retention import LogRetention
from gateway.store.log_spool import LogSpool
from gateway.store.migrate import upgrade
from gateway.store.models import RequestLog, UsageDaily
from gateway.store.request_log import RequestLogWriter
from tests.fakes.tcp_proxy import TcpProxy, tcp_proxy


def _row(i: int) -> dict[str, object]:
    return {"id": f"r{i}", "created_at": datetime.now(UTC), "status": 200, "attempts": 1, "prompt_tokens": i}


def _dropped(registry: CollectorRegistry) -> dict[str, float]:
    """gateway_request_log_dropped_total by reason, the reasons with drops only."""
    found: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "gateway_request_log_dropped_total" and sample.value:
                found[sample.labels["reason"]] = sample.value
    return found


async def _count(url: str) -> int:
    db = create_db(url)
    async with session_factory(db)() as s:
        n = (await s.execute(select(func.count()).select_from(RequestLog))).scalar_one()
    await db.dispose()
    return int(n)


def test_rows_are_written_in_batches_and_flushed_on_stop(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = create_db(database_url)
        writer = RequestLogWriter(db, CollectorRegistry(), batch_size=7, interval=10.0)
        writer.start()
        for i in range(30):
            writer.queue(_row(i))
        await asyncio.sleep(0.3)
        assert await _count(database_url) == 28  # four full batches; two rows wait for the interval
        await writer.stop()
        assert await _count(database_url) == 30
        await db.dispose()

    asyncio.run(run())


def test_memory_is_bounded_while_nothing_can_take_the_rows(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = create_db(database_url)
        registry = CollectorRegistry()
        writer = RequestLogWriter(db, registry, max_queue=3)  # no spool: memory is the only bound
        for i in range(10_005):  # the writer is not running: the queue fills up
            writer.queue(_row(i))
        assert _dropped(registry) == {"queue_full": 2}  # past 3 + 10,000 rows
        assert registry.get_sample_value("gateway_request_log_queue_depth") == 10_003
        await db.dispose()

    asyncio.run(run())


def test_the_batch_interval_is_gateway_log_flush_seconds(database_url: str, tmp_path: Path) -> None:
    upgrade(database_url)

    async def written_within(flush: float, wait: float) -> int:
        settings = GatewaySettings(database_url=database_url, data_dir=tmp_path, log_flush_seconds=flush)
        db = create_db(database_url)
        writer = RequestLogWriter.from_settings(db, CollectorRegistry(), settings)
        writer.start()
        before = await _count(database_url)
        writer.queue(_row(int(flush * 1000)))  # one row: it waits for the interval
        await asyncio.sleep(wait)
        n = await _count(database_url) - before
        await writer.stop()
        await db.dispose()
        return n

    assert asyncio.run(written_within(60.0, 1.0)) == 0
    assert asyncio.run(written_within(0.05, 1.0)) == 1
    with pytest.raises(ValidationError):
        GatewaySettings(log_flush_seconds=0)


def test_a_row_written_twice_is_stored_and_summed_once(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> tuple[int, int]:
        db = create_db(database_url)
        registries = [CollectorRegistry(), CollectorRegistry()]
        for registry in registries:  # a retried batch, a replayed spool: the same ids again
            writer = RequestLogWriter(db, registry, interval=0.05)
            writer.start()
            writer.queue(_row(1))
            writer.queue(_row(1))
            writer.queue(_row(2))
            await writer.stop()
        async with session_factory(db)() as s:
            summed = sum(d.requests for d in (await s.execute(select(UsageDaily))).scalars())
        await db.dispose()
        first, second = registries
        assert first.get_sample_value("gateway_request_log_written_total") == 2
        assert first.get_sample_value("gateway_request_log_duplicates_total") == 1
        assert second.get_sample_value("gateway_request_log_written_total") == 0
        assert second.get_sample_value("gateway_request_log_duplicates_total") == 3
        assert _dropped(first) == _dropped(second) == {}
        return await _count(database_url), summed

    assert asyncio.run(run()) == (2, 2)


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
        db = create_db(database_url)
        writer = RequestLogWriter(db, CollectorRegistry())
        writer.start()
        writer.queue(row)
        await writer.stop()
        async with session_factory(db)() as s:
            stored = (await s.execute(select(RequestLog))).scalar_one()
        await db.dispose()
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
        db = create_db(database_url)
        writer = RequestLogWriter(db, CollectorRegistry(), batch_size=100, interval=0.05)
        writer.start()
        for row in rows:
            writer.queue(row)
        await writer.stop()
        writer = RequestLogWriter(db, CollectorRegistry(), interval=0.05)
        writer.start()
        writer.queue({"id": "dup", "created_at": day2, "status": 200, "key_id": "k9"})  # skipped: same id
        await writer.stop()
        async with session_factory(db)() as s:
            daily = list(
                (await s.execute(select(UsageDaily).order_by(UsageDaily.day, UsageDaily.key_id))).scalars()
            )
        await db.dispose()
        return daily, await _count(database_url)

    daily, raw = asyncio.run(run())
    assert raw == 7
    assert sum(d.requests for d in daily) == 7 and sum(d.errors for d in daily) == 1
    assert not any(d.key_id == "k9" for d in daily)  # the skipped row left no aggregate behind
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
        db = create_db(database_url)
        writer = RequestLogWriter(db, CollectorRegistry(), interval=0.05)
        writer.start()
        for i in range(25):  # 20 rows 40 days old, 5 from yesterday
            created = datetime(2026, 10, 13, tzinfo=UTC) if i < 20 else datetime(2026, 11, 21, tzinfo=UTC)
            writer.queue({"id": f"r{i}", "created_at": created, "status": 200, "key_id": "k",
                           "cost_picousd": Decimal("0.001")})  # fmt: skip
        await writer.stop()
        removed = await LogRetention(db, days=30, chunk=7).purge(now)
        async with session_factory(db)() as s:
            daily = sum(d.requests for d in (await s.execute(select(UsageDaily))).scalars())
        await db.dispose()
        return removed, await _count(database_url), daily

    assert asyncio.run(run()) == (20, 5, 25)


def _hostile(i: int) -> dict[str, object]:
    """A row as a hostile client and a faulty upstream could shape it."""
    return {
        "id": f"bad{i}", "created_at": datetime.now(UTC), "status": 200, "key_id": "k\x00",
        "requested_model": "gpt\x00-4", "team": "caf\udce9", "backend": b"\xffraw", "error_type": 42,
        "prompt_tokens": 2**70, "completion_tokens": -5, "cached_tokens": "lots", "attempts": 2**31,
        "latency_ms": float("nan"), "ttft_ms": 1e12, "overhead_ms": "fast", "complexity_score": float("inf"),
        "cost_picousd": Decimal("1e30"), "reference_cost_picousd": Decimal("-1"),
        "request_body": '{"content": "\x00\ud800"}', "route_reason": "r" * 900,
    }  # fmt: skip


def test_values_no_column_can_hold_are_cleaned_so_the_batch_is_written(database_url: str) -> None:
    upgrade(database_url)
    rows = [_row(i) for i in range(20)] + [_hostile(0)] + [_row(i) for i in range(20, 40)]

    async def run() -> tuple[CollectorRegistry, RequestLog]:
        db = create_db(database_url)
        registry = CollectorRegistry()
        writer = RequestLogWriter(db, registry, batch_size=100, interval=0.05)
        writer.start()
        for row in rows:
            writer.queue(row)
        await writer.stop()
        async with session_factory(db)() as s:
            stored = (await s.execute(select(RequestLog).where(RequestLog.id == "bad0"))).scalar_one()
        await db.dispose()
        return registry, stored

    registry, stored = asyncio.run(run())
    assert asyncio.run(_count(database_url)) == 41
    assert registry.get_sample_value("gateway_request_log_written_total") == 41
    assert registry.get_sample_value("gateway_request_log_sanitized_total") == 1
    assert _dropped(registry) == {}
    assert (stored.requested_model, stored.key_id, stored.team) == ("gpt\ufffd-4", "k\ufffd", "caf\ufffd")
    assert (stored.backend, stored.error_type) == ("\ufffdraw", "42")
    assert (stored.prompt_tokens, stored.completion_tokens, stored.cached_tokens) == (None, None, None)
    assert stored.attempts == 1 and stored.cost_usd is None and stored.reference_cost_usd is None
    assert (stored.latency_ms, stored.ttft_ms, stored.overhead_ms, stored.complexity_score) == (None,) * 4
    assert stored.cost_estimated is True  # the usage is not the reported one any more
    assert stored.request_body == '{"content": "\ufffd\ufffd"}'
    assert stored.route_reason is not None and len(stored.route_reason) == 500


def _refuse_team(url: str, team: str) -> None:
    """A rule the sanitizer cannot know: the database refuses rows of `team` (a trigger or CHECK)."""

    async def install() -> None:
        db = create_db(url)
        async with db.begin() as conn:
            if db.dialect.name == "sqlite":
                await conn.exec_driver_sql(
                    f"CREATE TRIGGER refuse BEFORE INSERT ON request_logs WHEN NEW.team = '{team}' "
                    "BEGIN SELECT RAISE(ABORT, 'refused team'); END"
                )
            else:
                await conn.exec_driver_sql(
                    f"ALTER TABLE request_logs ADD CONSTRAINT refuse CHECK (team IS NULL OR team <> '{team}')"
                )
        await db.dispose()

    asyncio.run(install())


def test_a_row_the_database_still_refuses_is_dropped_alone_and_logged_with_its_id(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    upgrade(database_url)
    _refuse_team(database_url, "evil")
    rows = [{**_row(i), "team": "evil" if i == 23 else "good"} for i in range(40)]

    async def run() -> CollectorRegistry:
        db = create_db(database_url)
        registry = CollectorRegistry()
        writer = RequestLogWriter(db, registry, batch_size=40, interval=0.05)
        writer.start()
        for row in rows:
            writer.queue(row)
        await writer.stop()
        await db.dispose()
        return registry

    caplog.set_level(logging.ERROR, logger="gateway.store.request_log")
    registry = asyncio.run(run())
    assert asyncio.run(_count(database_url)) == 39
    assert registry.get_sample_value("gateway_request_log_written_total") == 39
    assert _dropped(registry) == {"refused": 1}
    assert any("request r23" in r.getMessage() for r in caplog.records)


def _through(url: str, proxy: TcpProxy) -> str:
    return url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")


async def _wait_for(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_rows_recorded_while_the_database_is_away_are_spooled_then_written_once(
    postgres_url: str, tmp_path: Path
) -> None:
    upgrade(postgres_url)

    async def run(proxy: TcpProxy) -> CollectorRegistry:
        db = create_db(_through(postgres_url, proxy))
        registry = CollectorRegistry()
        spool = LogSpool(tmp_path / "spool", 10 << 20)
        writer = RequestLogWriter(db, registry, spool, max_queue=10, batch_size=5, interval=0.05,
                                  spill_after=0.5, write_timeout=2.0)  # fmt: skip
        writer.start()
        for i in range(10):
            writer.queue(_row(i))
        await _wait_for(lambda: _counted(registry, "written", 10))
        proxy.cut()
        for i in range(10, 60):  # 50 rows while the database is away: past the queue's 10
            writer.queue(_row(i))
            await asyncio.sleep(0.02)
        await _wait_for(lambda: _counted(registry, "spooled", 50))
        assert spool.segments() and await _count(postgres_url) == 10
        proxy.restore()
        for i in range(60, 70):
            writer.queue(_row(i))
        await _wait_for(lambda: _counted(registry, "written", 70))
        assert spool.segments() == []
        await writer.stop()
        await db.dispose()
        return registry

    with tcp_proxy("127.0.0.1", 5432) as proxy:
        registry = asyncio.run(run(proxy))
    assert asyncio.run(_count(postgres_url)) == 70
    assert _dropped(registry) == {}
    spooled = registry.get_sample_value("gateway_request_log_spooled_total")
    assert registry.get_sample_value("gateway_request_log_replayed_total") == spooled
    assert spooled is not None and spooled >= 50  # rows recorded before the first retry succeeds too


async def _counted(registry: CollectorRegistry, name: str, at_least: float) -> bool:
    return (registry.get_sample_value(f"gateway_request_log_{name}_total") or 0) >= at_least


def test_a_writer_stopped_during_an_outage_spools_and_the_next_one_replays_without_duplicates(
    postgres_url: str, tmp_path: Path
) -> None:
    upgrade(postgres_url)
    spool_dir = tmp_path / "spool"

    async def first(proxy: TcpProxy) -> CollectorRegistry:
        db = create_db(_through(postgres_url, proxy))
        registry = CollectorRegistry()
        writer = RequestLogWriter(db, registry, LogSpool(spool_dir, 10 << 20), interval=0.05,
                                  write_timeout=2.0)  # fmt: skip
        writer.start()
        for i in range(5):
            writer.queue(_row(i))
        await _wait_for(lambda: _counted(registry, "written", 5))
        proxy.cut()
        for i in range(5, 30):
            writer.queue(_row(i))
        await writer.stop()  # the process ends while the database is away
        await db.dispose()
        return registry

    async def second() -> CollectorRegistry:
        db = create_db(postgres_url)
        registry = CollectorRegistry()
        writer = RequestLogWriter(db, registry, LogSpool(spool_dir, 10 << 20), interval=0.05)
        writer.start()  # the next process: replays the spool first
        await _wait_for(lambda: _counted(registry, "replayed", 30))
        await writer.stop()
        async with session_factory(db)() as s:
            summed = sum(d.requests for d in (await s.execute(select(UsageDaily))).scalars())
        assert summed == 30
        await db.dispose()
        return registry

    with tcp_proxy("127.0.0.1", 5432) as proxy:
        stopped = asyncio.run(first(proxy))
    assert stopped.get_sample_value("gateway_request_log_spooled_total") == 25
    assert _dropped(stopped) == {}
    segments = LogSpool(spool_dir, 0).segments()
    assert len(segments) == 1 and segments[0].stat().st_mode & 0o777 == 0o600
    assert spool_dir.stat().st_mode & 0o777 == 0o700
    # as if the process had died after writing some rows and before removing the segment
    lines = segments[0].read_bytes().splitlines()
    with segments[0].open("ab") as f:
        f.write(b"\n".join([*lines[:5], b'{"id": "cut-mid-li']) + b"\n")
    replaying = asyncio.run(second())
    assert asyncio.run(_count(postgres_url)) == 30  # 5 + 25, none twice
    assert replaying.get_sample_value("gateway_request_log_duplicates_total") == 5
    assert _dropped(replaying) == {"unreadable": 1}
    assert LogSpool(spool_dir, 0).segments() == []


def test_a_database_that_stops_answering_costs_a_timeout_and_the_rows_are_spooled(
    postgres_url: str, tmp_path: Path
) -> None:
    upgrade(postgres_url)
    spool = LogSpool(tmp_path / "spool", 10 << 20)

    async def run(proxy: TcpProxy) -> tuple[CollectorRegistry, float]:
        db = create_db(_through(postgres_url, proxy))
        registry = CollectorRegistry()
        writer = RequestLogWriter(db, registry, spool, interval=0.05, write_timeout=1.0)
        writer.start()
        proxy.cut(hang=True)  # connections accepted, never answered
        for i in range(20):
            writer.queue(_row(i))
        await _wait_for(lambda: _is_down(registry))
        started = time.monotonic()
        await writer.stop()  # one more try (1 s), then the spool: shutdown is not held hostage
        took = time.monotonic() - started
        proxy.restore()
        await db.dispose()
        return registry, took

    with tcp_proxy("127.0.0.1", 5432) as proxy:
        registry, took = asyncio.run(run(proxy))
    assert took < 5
    assert registry.get_sample_value("gateway_request_log_spooled_total") == 20
    assert _dropped(registry) == {} and asyncio.run(_count(postgres_url)) == 0
    assert sum(len(spool.read(s).rows) for s in spool.segments()) == 20


async def _is_down(registry: CollectorRegistry) -> bool:
    return registry.get_sample_value("gateway_request_log_database_down") == 1
