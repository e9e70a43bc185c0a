"""BatchInsert: request-log rows written straight through the driver, idempotently, with their daily sums."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC
from decimal import Decimal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.models import RequestLog, to_picousd

_SQLITE_ROWS_PER_STATEMENT = 500  # x 27 columns: well under SQLite's 32,766 bound parameters


class BatchInsert:
    """Rows keyed by column name holding the ORM's Python values (a Decimal for money); returns
    how many were new.

    Idempotent: a row whose id is already stored is skipped (`ON CONFLICT (id) DO NOTHING`), and
    only the rows the statement really inserted (`RETURNING id`) are added to `usage_daily`, in
    the same transaction. So a batch retried after a lost connection, or a spool segment replayed
    twice, never counts a request twice.

    PostgreSQL gets one `INSERT ... SELECT FROM unnest($1::type[], ...)`: one array per column, in
    asyncpg's binary format as COPY would send them, but able to skip conflicts. SQLite gets
    multi-row VALUES. Values go through the dialect's own bind processors, so they are stored
    exactly as SQLAlchemy would store them, without its statement machinery (half the event-loop
    CPU per row, measured with COPY: 200 rows, 4.5 -> 2.3 ms on SQLite, 5.6 -> 2.9 ms on PostgreSQL).
    Rows must have gone through RowSanitizer: every column present, every value storable.
    """

    def __init__(self, db: AsyncEngine) -> None:
        table = RequestLog.__table__
        self._db = db
        self._columns = [c.name for c in table.columns]
        self._processors = [c.type.bind_processor(db.dialect) for c in table.columns]
        self._postgres = db.dialect.name == "postgresql"
        names = ", ".join(self._columns)
        head = f"INSERT INTO {RequestLog.__tablename__} ({names}) "
        tail = " ON CONFLICT (id) DO NOTHING RETURNING id"
        arrays = ", ".join(
            f"${i}::{c.type.compile(db.dialect)}[]" for i, c in enumerate(table.columns, start=1)
        )
        self._pg_sql = f"{head}SELECT * FROM unnest({arrays}){tail}"
        self._sqlite_head, self._sqlite_tail = head + "VALUES ", tail
        self._sqlite_row = "(" + ", ".join("?" for _ in self._columns) + ")"

    async def __call__(self, rows: list[Mapping[str, Any]]) -> int:
        # column by column: one list per column is what unnest takes, and a column without a bind
        # processor (most of them) is a plain list comprehension
        columns = [
            [row.get(name) for row in rows]
            if process is None
            else [None if (v := row.get(name)) is None else process(v) for row in rows]
            for name, process in zip(self._columns, self._processors, strict=True)
        ]
        async with self._db.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            if self._postgres:  # one transaction: the raw rows and the aggregates never disagree
                async with driver.transaction():
                    inserted = await driver.fetch(self._pg_sql, *columns)
                    totals = _daily_totals(_new(rows, {r[0] for r in inserted}))
                    await driver.executemany(_upsert_sql("$"), totals)
                return len(inserted)
            values = [value for record in zip(*columns, strict=True) for value in record]
            width = len(self._columns)
            try:
                ids: set[str] = set()
                for start in range(0, len(rows), _SQLITE_ROWS_PER_STATEMENT):
                    count = min(_SQLITE_ROWS_PER_STATEMENT, len(rows) - start)
                    sql = self._sqlite_head + ", ".join([self._sqlite_row] * count) + self._sqlite_tail
                    chunk = values[start * width : (start + count) * width]
                    cursor = await driver.execute(sql, chunk)
                    ids.update(r[0] for r in await cursor.fetchall())
                    await cursor.close()
                totals = _daily_totals(_new(rows, ids))
                await driver.executemany(_upsert_sql("?"), [(d.isoformat(), *rest) for d, *rest in totals])
                await driver.commit()
            except BaseException:
                await driver.rollback()
                raise
            return len(ids)


def _new(rows: list[Mapping[str, Any]], inserted: set[str]) -> list[Mapping[str, Any]]:
    """The rows the statement inserted: the first of each id it returned."""
    new, waiting = [], set(inserted)
    for row in rows:
        if row["id"] in waiting:
            waiting.discard(row["id"])  # a second row with the same id in the batch was skipped
            new.append(row)
    return new


_GROUP = ("day", "key_id", "team", "requested_model", "backend")
UNKNOWN_MODEL = "(unknown model)"  # usage_daily's requested_model for requests naming no known model
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


def _daily_totals(rows: list[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """The batch summed per (UTC day, key, team, requested model, backend); money in picodollars."""
    totals: dict[tuple[Any, ...], list[int]] = {}
    for row in rows:
        created = row["created_at"]
        # a name no model has (404) is the client's own text: one group for all, not one per name
        model = (
            UNKNOWN_MODEL if row.get("error_type") == "model_not_found" else row.get("requested_model") or ""
        )
        group = (created.astimezone(UTC).date() if created.tzinfo else created.date(),
                 row.get("key_id") or "", row.get("team") or "", model, row.get("backend") or "")  # fmt: skip
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
