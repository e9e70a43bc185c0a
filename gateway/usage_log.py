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
    """A bounded queue drained by one task: every `interval` s or `batch_size` rows, one INSERT.

    `record()` never blocks: when the queue is full the row is dropped, counted and logged.
    A batch the database refuses is retried once, then counted as lost and logged.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        registry: CollectorRegistry,
        max_queue: int = 50_000,
        batch_size: int = 500,
        interval: float = 0.5,
    ) -> None:
        self._sessions = sessions
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(max_queue)  # None: stop
        self._batch_size = batch_size
        self._interval = interval
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
        try:
            self._queue.put_nowait(row)
        except asyncio.QueueFull:
            self.dropped.inc()
            logger.error("request log queue full: dropped the row of request %s", row.get("id"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            first = await self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = loop.time() + self._interval
            while len(batch) < self._batch_size:
                try:
                    row = await asyncio.wait_for(self._queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    break
                if row is None:
                    stopping = True
                    break
                batch.append(row)
            await self._write(batch)

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
        await self._queue.put(None)  # behind every queued row
        await self._task
        self._task = None
