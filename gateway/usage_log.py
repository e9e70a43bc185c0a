"""The request log: rows queued off the request path and written in batches."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.models import RequestLog, to_picousd

logger = logging.getLogger(__name__)


class RequestLogWriter:
    """Rows buffered in memory, written by one task: a full batch at once, the rest every `interval` s.

    `record()` never blocks and costs a list append: when `max_queue` rows are already waiting the
    row is dropped, counted and logged. The writer wakes once per batch (not once per row), and
    writes at most `batch_size` rows per INSERT, so the event loop is never held for long. A batch
    the database refuses is retried once, then counted as lost and logged.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        registry: CollectorRegistry,
        max_queue: int = 50_000,
        batch_size: int = 50,
        interval: float = 0.5,
    ) -> None:
        self._insert = _BatchInsert(engine)
        self._pending: list[dict[str, Any]] = []
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._interval = interval
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.written = Counter("gateway_request_log_written", "Request-log rows written.", registry=registry)
        self.dropped = Counter(
            "gateway_request_log_dropped",
            "Request-log rows lost (queue full or database error).",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "gateway_request_log_queue_depth", "Request-log rows waiting to be written.", registry=registry
        )
        self.queue_depth.set_function(lambda: len(self._pending))  # read at scrape time only

    def start(self) -> None:
        """Start the writer task."""
        self._task = asyncio.create_task(self._run(), name="request-log-writer")

    def record(self, row: dict[str, Any]) -> None:
        """Queue one row (never waits)."""
        if len(self._pending) >= self._max_queue:
            self.dropped.inc()
            logger.error("request log queue full: dropped the row of request %s", row.get("id"))
            return
        self._pending.append(row)
        if len(self._pending) == self._batch_size:
            self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._interval):
                    await self._wake.wait()
                whole_batches_only = not self._stopping
            except TimeoutError:
                whole_batches_only = False
            self._wake.clear()
            stopping = self._stopping
            while len(self._pending) >= self._batch_size or (self._pending and not whole_batches_only):
                batch = self._pending[: self._batch_size]
                del self._pending[: self._batch_size]
                await self._write(batch)
            if stopping and not self._pending:
                return

    async def _write(self, batch: list[dict[str, Any]]) -> None:
        for attempt in (1, 2):
            try:
                await self._insert(batch)
                self.written.inc(len(batch))
                return
            except Exception:
                if attempt == 2:
                    self.dropped.inc(len(batch))
                    logger.exception("request log: lost %d row(s) the database refused", len(batch))
                    return
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        """Write everything queued, then stop the task (used at shutdown)."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        await self._task
        self._task = None


class _BatchInsert:
    """Rows straight through the driver: asyncpg's binary COPY, or sqlite3's executemany.

    Rows are keyed by column name (e.g. `cost_picousd`) and hold the ORM's Python values (a Decimal
    for money); a missing key takes the column's default.

    Values go through the dialect's own bind processors, so they are stored exactly as SQLAlchemy
    would store them; skipping its statement machinery halves the CPU the event loop spends per
    row (measured: 200 rows, 4.5 -> 2.3 ms on SQLite, 5.6 -> 2.9 ms on PostgreSQL).
    """

    def __init__(self, engine: AsyncEngine) -> None:
        table = RequestLog.__table__
        self._engine = engine
        self._columns = [c.name for c in table.columns]
        self._processors = [c.type.bind_processor(engine.dialect) for c in table.columns]
        self._defaults = [
            c.default.arg if c.default is not None and c.default.is_scalar else None for c in table.columns
        ]  # a key missing from a row gets the column's Python-side default, as an ORM insert would
        self._postgres = engine.dialect.name == "postgresql"
        placeholders = ", ".join("?" for _ in self._columns)
        self._table = RequestLog.__tablename__
        self._sql = f"INSERT INTO {self._table} ({', '.join(self._columns)}) VALUES ({placeholders})"

    async def __call__(self, rows: list[dict[str, Any]]) -> None:
        columns = list(zip(self._columns, self._processors, self._defaults, strict=True))
        records = [
            tuple(
                value if process is None else process(value)
                for name, process, default in columns
                for value in (row.get(name, default),)
            )
            for row in rows
        ]
        totals = _daily_totals(rows)
        async with self._engine.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            if self._postgres:  # one transaction: the raw rows and the aggregates never disagree
                async with driver.transaction():
                    await driver.copy_records_to_table(self._table, records=records, columns=self._columns)
                    await driver.executemany(_upsert_sql("$"), totals)
            else:
                try:
                    await driver.executemany(self._sql, records)
                    await driver.executemany(
                        _upsert_sql("?"), [(d.isoformat(), *rest) for d, *rest in totals]
                    )
                    await driver.commit()
                except BaseException:
                    await driver.rollback()
                    raise


_GROUP = ("day", "key_id", "team", "requested_model", "backend")
_SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens", "cost_picousd",
         "reference_cost_picousd", "reference_basis_picousd")  # fmt: skip


def _upsert_sql(style: str) -> str:
    """INSERT ... ON CONFLICT DO UPDATE adding to the day's row (same SQL on SQLite and PostgreSQL)."""
    columns = (*_GROUP, *_SUMS)
    marks = [f"${i}" for i in range(1, len(columns) + 1)] if style == "$" else ["?"] * len(columns)
    updates = ", ".join(f"{c} = usage_daily.{c} + excluded.{c}" for c in _SUMS)
    return (
        f"INSERT INTO usage_daily ({', '.join(columns)}) VALUES ({', '.join(marks)}) "
        f"ON CONFLICT ({', '.join(_GROUP)}) DO UPDATE SET {updates}"
    )


def _daily_totals(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The batch summed per (UTC day, key, team, requested model, backend); money in picodollars."""
    totals: dict[tuple[Any, ...], list[int]] = {}
    for row in rows:
        created = row["created_at"]
        group = (created.astimezone(UTC).date() if created.tzinfo else created.date(),
                 row.get("key_id") or "", row.get("team") or "", row.get("requested_model") or "",
                 row.get("backend") or "")  # fmt: skip
        sums = totals.setdefault(group, [0] * len(_SUMS))
        sums[0] += 1
        sums[1] += row.get("status") != 200
        sums[2] += row.get("prompt_tokens") or 0
        sums[3] += row.get("completion_tokens") or 0
        sums[4] += row.get("cached_tokens") or 0
        sums[5] += _picousd(row.get("cost_picousd"))
        sums[6] += _picousd(row.get("reference_cost_picousd"))
        if row.get("reference_cost_picousd") is not None:
            sums[7] += _picousd(row.get("cost_picousd"))
    return [(*group, *sums) for group, sums in totals.items()]


def _picousd(value: Decimal | None) -> int:
    return 0 if value is None else to_picousd(value)


class LogRetention:
    """Deletes raw request-log rows older than `days`, in chunks, every `interval` s; aggregates stay."""

    def __init__(
        self, engine: AsyncEngine, days: float, interval: float = 3600.0, chunk: int = 10_000
    ) -> None:
        self._engine = engine
        self.days = days
        self._interval = interval
        self._chunk = chunk
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Purge now, then every interval."""
        self._task = asyncio.create_task(self._run(), name="request-log-retention")

    async def _run(self) -> None:
        while True:
            try:
                removed = await self.purge(datetime.now(UTC))
                if removed:
                    logger.info(
                        "request log retention: removed %d rows older than %s days", removed, self.days
                    )
            except Exception:
                logger.exception("request log retention failed (will retry)")
            await asyncio.sleep(self._interval)

    async def purge(self, now: datetime) -> int:
        """Remove rows created before now - days; returns how many."""
        cutoff = now - timedelta(days=self.days)
        doomed = (
            select(RequestLog.id).where(RequestLog.created_at < cutoff).limit(self._chunk).scalar_subquery()
        )
        removed = 0
        while True:
            async with self._engine.begin() as conn:
                count = (
                    await conn.execute(delete(RequestLog).where(RequestLog.id.in_(doomed)))
                ).rowcount or 0
            removed += count
            if count < self._chunk:
                return removed

    async def stop(self) -> None:
        """Stop purging."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
