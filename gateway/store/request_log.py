"""The request log: rows queued off the request path, written in batches, kept through outages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.config.settings import GatewaySettings
from gateway.store.db import Failure, classify
from gateway.store.log_insert import BatchInsert
from gateway.store.log_spool import LogSpool
from gateway.store.record import RequestRecord
from gateway.store.row_sanitizer import RowSanitizer

logger = logging.getLogger(__name__)

_FIRST_BACKOFF = 0.5  # s before the first retry of a database that went away; doubles up to:
_MAX_BACKOFF = 5.0
_SPOOL_CHECK_INTERVAL = 60.0  # s between looks for segments other processes left
_DROP_REASONS = ("refused", "spool_full", "queue_full", "unreadable")


class RequestLogWriter:
    """Rows buffered in memory, written by one task: a full batch at once, the rest every `interval` s.

    `record()` (and `queue()`, for a bare row) never blocks and costs a list append. What can go
    wrong, and what is kept:

    - a value no column can hold (NUL, a lone surrogate, 2^40 tokens, a str for a count) is cleaned
      or set to NULL by RowSanitizer before the insert, counted and logged with its request id;
    - a batch the database still refuses for its values is split in halves until the one bad row
      is found: the others are written, that one is dropped, counted (`reason="refused"`) and logged;
    - a batch that fails because the database is away (refused or cut connections, a timeout, a
      server restarting, the database missing) is kept: retried with a backoff up to 5 s, held in
      memory up to `max_queue` rows or `spill_after` s, then spilled to the on-disk LogSpool and
      replayed, oldest first, when the database answers again (and when a writer starts, for
      rows a previous process spilled). Inserts skip ids already stored, so nothing is written twice.

    Rows are dropped (counted by reason) only past the bounds: the spool's size (`spool_full`),
    or `max_queue` + max(`max_queue`, 10,000) rows in memory while the spool cannot be written
    (`queue_full`). A full queue is spilled by a task of its own, so that rows keep flowing to disk
    while the writer waits on a database that does not answer.
    """

    def __init__(
        self,
        db: AsyncEngine,
        registry: CollectorRegistry,
        spool: LogSpool | None = None,
        max_queue: int = 50_000,
        batch_size: int = 50,
        interval: float = 0.5,
        spill_after: float = 10.0,
        write_timeout: float = 15.0,
    ) -> None:
        self._db = db
        self._insert = BatchInsert(db)
        self._sanitize = RowSanitizer()
        self._spool = spool
        self._pending: list[Mapping[str, Any]] = []  # cleaned rows, in the order recorded
        self._max_queue = max_queue
        # rows keep coming while a spill is being written: room for them, and the bound when the
        # spool cannot be written at all
        self._hard_limit = max_queue + max(max_queue, 10_000)
        self._spill_task: asyncio.Task[None] | None = None
        self._spilling = False
        self._batch_size = batch_size
        self._replay_batch = max(batch_size, 500)
        self._interval = interval
        self._spill_after = spill_after
        self._write_timeout = write_timeout
        self._outage_since: float | None = None  # monotonic; None while the database answers
        self._last_error: BaseException | None = None  # what the last failed write raised (for the log)
        self._backoff = _FIRST_BACKOFF
        self._retry_at = 0.0
        self._replay_due = spool is not None  # at start: rows a previous process spilled
        self._next_spool_check = 0.0
        self._spool_bytes = 0
        self._wake = asyncio.Event()
        self._written_waiters: list[asyncio.Future[bool]] = []  # write_now(): answered by the next cycle
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.written = Counter("gateway_request_log_written", "Request-log rows written.", registry=registry)
        self.dropped = Counter(
            "gateway_request_log_dropped",
            "Request-log rows lost: refused (a row the database refused even once cleaned), spool_full, "
            "queue_full (memory bound reached while the spool failed), unreadable (a spool line).",
            ["reason"],
            registry=registry,
        )
        for reason in _DROP_REASONS:
            self.dropped.labels(reason)  # every reason reads 0 from the start
        self.sanitized = Counter(
            "gateway_request_log_sanitized",
            "Request-log rows stored with values cleaned or nulled (NUL, invalid Unicode, out of range).",
            registry=registry,
        )
        self.spooled = Counter(
            "gateway_request_log_spooled", "Request-log rows spilled to the on-disk spool.", registry=registry
        )
        self.replayed = Counter(
            "gateway_request_log_replayed",
            "Request-log rows read back from the spool into the database.",
            registry=registry,
        )
        self.duplicates = Counter(
            "gateway_request_log_duplicates",
            "Request-log rows skipped because their id was already stored (retries and replays).",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "gateway_request_log_queue_depth", "Request-log rows waiting in memory.", registry=registry
        )
        self.queue_depth.set_function(lambda: len(self._pending))  # read at scrape time only
        spool_bytes = Gauge(
            "gateway_request_log_spool_bytes", "Bytes of request-log rows in the spool.", registry=registry
        )
        spool_bytes.set_function(lambda: self._spool_bytes)
        down = Gauge(
            "gateway_request_log_database_down",
            "1 while the request log cannot reach the database (rows are kept meanwhile).",
            registry=registry,
        )
        down.set_function(lambda: 0 if self._outage_since is None else 1)

    @classmethod
    def from_settings(
        cls, db: AsyncEngine, registry: CollectorRegistry, settings: GatewaySettings
    ) -> RequestLogWriter:
        """The writer with the configured queue and the spool for this database."""
        spool = (
            LogSpool.for_database(
                settings.resolved_log_spool_dir, settings.resolved_database_url, settings.log_spool_max_bytes
            )
            if settings.log_spool_max_bytes > 0
            else None
        )
        return cls(
            db, registry, spool, max_queue=settings.log_queue_max_rows, interval=settings.log_flush_seconds
        )

    def start(self) -> None:
        """Start the writer task (which first replays what the spool holds)."""
        self._task = asyncio.create_task(self._run(), name="request-log-writer")

    def record(self, rec: RequestRecord) -> None:
        """Queue one finished request's row (never waits): the request log as a RecordSink."""
        self.queue(rec.row)

    def queue(self, row: Mapping[str, Any]) -> None:
        """Queue one row (never waits)."""
        if len(self._pending) >= self._hard_limit:
            self._drop(1, "queue_full", row.get("id"))
            return
        # cleaned here, a few µs per request: 50 rows cleaned at once held the loop ~0.2 ms (the p99)
        self._pending.append(self._clean(row))
        depth = len(self._pending)
        if depth == self._batch_size:
            self._wake.set()
        elif depth >= self._max_queue and self._spool is not None and self._spill_task is None:
            # not the writer's job: it may be waiting on a database that does not answer
            self._spill_task = asyncio.create_task(self._spill_full_queue(), name="request-log-spill")

    async def write_now(self) -> bool:
        """Write every row queued so far now: True once they are all in the database, False when it
        is away (they stay queued, or spooled, as ever).

        A budget counter lost in Redis is seeded again from the database: the rows of requests that
        settled into the lost counter but still wait here for the batch interval would be missed.
        The database is tried at once, whatever an outage's backoff says.
        """
        if self._task is None or self._task.done():
            return not self._pending
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._written_waiters.append(waiter)
        self._wake.set()
        return await waiter

    async def stop(self) -> None:
        """Write everything queued, or spill it to the spool if the database is away; stop the task."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        await self._task
        self._task = None

    # ------------------------------------------------------------------ the writer task
    async def _run(self) -> None:
        while True:
            woken = await self._sleep()
            waiters, self._written_waiters = self._written_waiters, []
            if self._stopping:
                await self._flush_at_stop()
                _answer(waiters + self._written_waiters, self._caught_up())
                return
            try:
                if not waiters and self._outage_since is not None and time.monotonic() < self._retry_at:
                    await self._spill_if_due()  # woken by a full queue: the retry keeps its backoff
                else:  # a cycle that empties the queue unless the database is away
                    await self._cycle(whole_batches_only=woken and not waiters)
            except Exception:  # never let the task die: rows would pile up unwritten
                logger.exception("request log writer: unexpected error (rows are kept)")
                self._enter_outage()
            _answer(waiters, self._caught_up())

    def behind(self) -> bool:
        """Whether rows wait for the database now (an outage, a spool to replay): a row queued now
        may reach it much later (budgets' owed settles read this: owed_settles.py)."""
        return self._outage_since is not None or self._replay_due

    def _caught_up(self) -> bool:
        """Whether every row queued so far is in the database (none waits here or in the spool)."""
        return self._outage_since is None and not self._pending and not self._replay_due

    async def _sleep(self) -> bool:
        """Wait for a full batch, a stop, or the interval (the retry time during an outage)."""
        if self._outage_since is None:
            timeout = self._interval
        else:
            timeout = max(0.0, self._retry_at - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                await self._wake.wait()
            woken = True
        except TimeoutError:
            woken = False
        self._wake.clear()
        return woken

    async def _cycle(self, whole_batches_only: bool) -> None:
        """Spooled rows first (they are older), then the queue; stop at the first sign of an outage."""
        if self._spool is not None and time.monotonic() >= self._next_spool_check:
            self._replay_due = True  # e.g. rows another process spilled before it died
        if self._replay_due and not await self._replay():
            self._enter_outage()
            await self._spill_if_due()
            return
        # self._pending is read afresh after each await: a spill may have swapped the list meanwhile
        while len(self._pending) >= self._batch_size or (self._pending and not whole_batches_only):
            batch = self._pending[: self._batch_size]  # cleaned by record()
            del self._pending[: self._batch_size]
            if not await self._write(batch):
                self._pending[:0] = batch  # back at the head
                self._enter_outage()
                await self._spill_if_due()
                return
        self._leave_outage()

    async def _write(self, rows: list[Mapping[str, Any]]) -> bool:
        """True: each row is stored, or was refused for its values (dropped, counted, logged).
        False: the database is away and nothing may be dropped (the caller keeps the rows)."""
        try:
            async with asyncio.timeout(self._write_timeout):
                inserted = await self._insert(rows)
        except Exception as exc:
            if classify(exc) is Failure.OUTAGE or not await self._reachable():
                self._last_error = exc
                return False
            if len(rows) > 1:  # the database answers, so some row is bad: find it, keep the others
                half = len(rows) // 2
                return await self._write(rows[:half]) and await self._write(rows[half:])
            self._drop(1, "refused", rows[0]["id"], exc)
            return True
        self.written.inc(inserted)
        if inserted < len(rows):
            self.duplicates.inc(len(rows) - inserted)
        return True

    async def _reachable(self) -> bool:
        """Whether the database answers `SELECT 1` (told apart: a bad row from a lost database)."""
        try:
            async with asyncio.timeout(self._write_timeout), self._db.connect() as conn:
                await conn.exec_driver_sql("SELECT 1")
            return True
        except Exception:
            return False

    def _clean(self, row: Mapping[str, Any]) -> Mapping[str, Any]:
        clean, changed = self._sanitize(row)
        if changed:
            self.sanitized.inc()
            logger.warning(
                "request log: request %s had values no column can hold in %s (stored cleaned or NULL)",
                clean["id"],
                ", ".join(changed),
            )
        return clean

    # ------------------------------------------------------------------ outages and the spool
    def _enter_outage(self) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            self._backoff = _FIRST_BACKOFF
            error = self._last_error
            logger.warning(
                "request log: the database is unavailable (%s); keeping rows in memory, then in the spool",
                type(error).__name__ if error is not None else "unexpected error",
            )
        else:
            self._backoff = min(self._backoff * 2, _MAX_BACKOFF)
        self._retry_at = now + self._backoff

    def _leave_outage(self) -> None:
        if self._outage_since is not None:
            self._last_error = None
            logger.warning(
                "request log: the database is back after %.1f s", time.monotonic() - self._outage_since
            )
            self._outage_since = None
            self._replay_due = self._spool is not None

    async def _spill_full_queue(self) -> None:
        try:
            await self._spill_if_due()
        finally:
            self._spill_task = None

    async def _spill_if_due(self, force: bool = False) -> None:
        """Move the queue to the spool when it is full, or when the outage has lasted `spill_after` s."""
        if not self._pending or self._spilling:
            return
        long_outage = (
            self._outage_since is not None and time.monotonic() - self._outage_since >= self._spill_after
        )
        full = len(self._pending) >= self._max_queue
        if not (force or full or (long_outage and self._spool is not None)):
            return
        rows, self._pending = self._pending, []
        if self._spool is None:  # no spool: memory is the only bound
            self._drop(len(rows), "spool_full", rows[0].get("id"))
            return
        try:
            self._spilling = True
            kept = await asyncio.to_thread(self._spill, self._spool, rows)
        except Exception:  # a full or read-only disk: memory is the bound until it can be written
            logger.exception("request log: cannot write the spool in %s", self._spool.directory)
            self._pending[:0] = rows  # kept in memory, up to the hard limit
            excess = len(self._pending) - self._hard_limit
            if excess > 0:
                self._drop(excess, "queue_full", self._pending[0].get("id"))
                del self._pending[:excess]
            return
        finally:
            self._spilling = False
        self.spooled.inc(kept)
        if kept < len(rows):
            self._drop(len(rows) - kept, "spool_full", rows[kept].get("id"))
        self._replay_due = True
        logger.info("request log: spilled %d row(s) to %s", kept, self._spool.directory)

    def _spill(self, spool: LogSpool, rows: list[Mapping[str, Any]]) -> int:
        """In a thread: append the rows (cleaned by record(): the spool's JSON holds no lone surrogate)."""
        kept = spool.append(rows)
        self._spool_bytes = spool.size()
        return kept

    async def _replay(self) -> bool:
        """Write every spooled segment, oldest first, removing each once stored; False on an outage."""
        spool = self._spool
        assert spool is not None
        self._replay_due = False  # a spill while replaying sets it again
        for segment in await asyncio.to_thread(spool.segments):
            rows, unreadable = await asyncio.to_thread(self._load, spool, segment)
            if unreadable:
                self._drop(unreadable, "unreadable", None)
                logger.error("request log: %d unreadable line(s) in %s", unreadable, segment)
            for start in range(0, len(rows), self._replay_batch):
                if self._stopping:  # a long backlog must not hold shutdown: the next start goes on
                    self._replay_due = True
                    return True
                if not await self._write(rows[start : start + self._replay_batch]):
                    self._replay_due = True  # the whole segment again next time: stored rows are skipped
                    return False
                self._leave_outage()  # the database answers
                await self._spill_if_due()  # new rows pile up meanwhile: bounded like in an outage
            await asyncio.to_thread(spool.remove, segment)
            self.replayed.inc(len(rows))
            logger.info("request log: replayed %d row(s) from %s", len(rows), segment.name)
        self._next_spool_check = time.monotonic() + _SPOOL_CHECK_INTERVAL
        self._spool_bytes = await asyncio.to_thread(spool.size)
        return True

    def _load(self, spool: LogSpool, segment: Path) -> tuple[list[Mapping[str, Any]], int]:
        read = spool.read(segment)
        return [self._clean(row) for row in read.rows], read.unreadable

    async def _flush_at_stop(self) -> None:
        """Write the queue while the database takes it; spill what is left (the next start replays it)."""
        if self._spill_task is not None:
            await self._spill_task
        while self._pending:  # one try even during an outage: the database may be back
            batch = self._pending[: self._batch_size]  # cleaned by record()
            del self._pending[: self._batch_size]
            if not await self._write(batch):
                self._pending[:0] = batch
                break
        await self._spill_if_due(force=True)

    def _drop(self, count: int, reason: str, request_id: object, exc: BaseException | None = None) -> None:
        self.dropped.labels(reason).inc(count)
        if exc is not None:  # the driver's text goes to our log only, never to a client
            detail = str(exc).splitlines()[0] if str(exc) else ""
            logger.error(
                "request log: dropped the row of request %s, refused by the database (%s: %s)",
                request_id,
                type(exc).__name__,
                detail,
            )
        else:
            logger.error("request log: dropped %d row(s) (%s), first request %s", count, reason, request_id)


def _answer(waiters: list[asyncio.Future[bool]], written: bool) -> None:
    for waiter in waiters:
        if not waiter.done():  # its caller may have given up (cancelled)
            waiter.set_result(written)
