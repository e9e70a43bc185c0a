"""A budget's periods: when each starts and resets (UTC), the period a key's budget counts over,
and when a budget's change restarts its counter."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal

Period = Literal["daily", "weekly", "monthly", "total"]
PERIODS: tuple[Period, ...] = ("daily", "weekly", "monthly", "total")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def period_bounds(period: Period, now: datetime) -> tuple[datetime, datetime | None]:
    """(start, next reset) of the period containing `now`, in UTC; a total budget never resets."""
    day = datetime(now.year, now.month, now.day, tzinfo=UTC)
    if period == "daily":
        return day, day + timedelta(days=1)
    if period == "weekly":
        start = day - timedelta(days=day.weekday())  # Monday
        return start, start + timedelta(days=7)
    if period == "monthly":
        start = day.replace(day=1)
        following = (
            start.replace(year=start.year + 1, month=1)
            if start.month == 12
            else start.replace(month=start.month + 1)
        )
        return start, following
    return _EPOCH, None


def counted_period(period: str | None) -> Period:
    """The period a key's budget counts over: its own, else monthly (a budget given without one)."""
    return period if period in PERIODS else "monthly"


def counter_restarts(was: Period | None, now: Period | None) -> bool:
    """Whether a budget's change (its period before and after; None: no budget) drops its counter to
    be seeded again from the log: a budget given back (its counter was not charged while it was
    gone) or put over another period. A new amount alone keeps the spend counted so far."""
    return now is not None and was != now
