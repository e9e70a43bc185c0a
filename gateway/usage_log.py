"""The request log: rows queued off the request path and written in batches."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.models import RequestLog

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
        sessions: async_sessionmaker[AsyncSession],
        registry: CollectorRegistry,
        max_queue: int = 50_000,
        batch_size: int = 50,
        interval: float = 0.5,
    ) -> None:
        self._sessions = sessions
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
                async with self._sessions() as session, session.begin():
                    await session.execute(insert(RequestLog), batch)
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
