"""Raw request-log retention: rows older than GATEWAY_LOG_RETENTION_DAYS are deleted in chunks."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.models import RequestLog

logger = logging.getLogger(__name__)


class LogRetention:
    """Deletes raw request-log rows older than `days`, in chunks, every `interval` s; aggregates stay."""

    def __init__(self, db: AsyncEngine, days: float, interval: float = 3600.0, chunk: int = 10_000) -> None:
        self._db = db
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
            async with self._db.begin() as conn:
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
