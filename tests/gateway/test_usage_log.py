"""The request-log writer: batches, flush on stop, drops counted under back-pressure."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from gateway.db import create_engine, session_factory
from gateway.migrate import upgrade
from gateway.models import RequestLog
from gateway.usage_log import RequestLogWriter


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
        writer = RequestLogWriter(session_factory(engine), CollectorRegistry(), batch_size=7, interval=10.0)
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
        writer = RequestLogWriter(session_factory(engine), registry, max_queue=3)
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
        writer = RequestLogWriter(session_factory(engine), registry, interval=0.05)
        writer.start()
        writer.record(_row(1))
        writer.record(_row(1))  # duplicate primary key: the batch fails twice
        await writer.stop()
        assert registry.get_sample_value("gateway_request_log_dropped_total") == 2
        await engine.dispose()

    asyncio.run(run())
