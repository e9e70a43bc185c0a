"""A budget's spend so far, from the request log's daily aggregates: what a counter is seeded with
when it is first needed, or again after Redis lost it (budgets.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import date, datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.governance.budgets import Budget, Seed, SpendUnavailableError
from gateway.store.db import DATABASE_ERRORS
from gateway.store.models import UsageDaily, to_picousd

_WRITTEN_SECONDS = 5.0  # how long a seed waits for the request log to write what it holds


def spend_seed(db: AsyncEngine, write_now: Callable[[], Awaitable[bool]] | None = None) -> Seed:
    """What a budget's subject has spent since `start`, from the daily aggregates (picodollars).

    `write_now`: the request log's RequestLogWriter.write_now. Rows still queued there (up to its
    batch interval, longer through an outage) belong to requests that settled into the counter
    being seeded again (Redis lost it): they are written first, and a log that cannot write them
    makes the seed fail like the database, rather than leave their cost off the budget.
    A database failure becomes SpendUnavailableError, so that it is never mistaken for Redis's.
    """

    async def seed(budget: Budget, start: datetime) -> int:
        if write_now is not None:
            try:
                async with asyncio.timeout(_WRITTEN_SECONDS):
                    caught_up = await write_now()
            except TimeoutError:
                caught_up = False
            if not caught_up:
                raise SpendUnavailableError("the request log cannot write its rows yet", "RequestLogBehind")
        column = UsageDaily.key_id if budget.scope == "key" else UsageDaily.team
        first_day: date = start.date()
        query = select(func.sum(UsageDaily.cost_usd)).where(
            column == budget.subject, UsageDaily.day >= first_day
        )
        try:
            async with db.connect() as conn:
                spent = (await conn.execute(query)).scalar_one()  # USD (the Money type), None: no rows
        except DATABASE_ERRORS as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise SpendUnavailableError(f"{type(exc).__name__}: {detail}", type(exc).__name__) from exc
        return to_picousd(spent) if spent is not None else 0

    return seed
