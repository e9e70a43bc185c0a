"""ORM tables: virtual keys, the request log (and its daily sums), console logouts."""

from __future__ import annotations

import uuid
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

PICO = Decimal(10) ** 12


def to_picousd(value: Decimal) -> int:
    """Whole picodollars (rounded half-even): how money is stored, summed and counted."""
    return int((value * PICO).to_integral_value())


class Money(TypeDecorator[Decimal]):
    """USD as an exact Decimal, stored as whole picodollars (BIGINT) on every database.

    Integers are exact on SQLite as well as PostgreSQL, and so are their SUMs; 10^-12 USD is
    far below any per-token price (the cheapest are ~10^-9 USD).
    """

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: Decimal | None, dialect: Dialect) -> int | None:
        return None if value is None else to_picousd(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Decimal | None:
        return None if value is None else Decimal(int(value)) / PICO


class Base(DeclarativeBase):
    """Declarative base of every gateway table."""


def _uuid() -> str:
    return uuid.uuid4().hex


class ApiKey(Base):
    """A virtual key: only its keyed hash and a short display prefix are stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=_uuid)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)  # HMAC-SHA256, hex
    key_prefix: Mapped[str] = mapped_column(String(16))  # e.g. "sk-AbC1", for display only
    name: Mapped[str] = mapped_column(String(200))
    team: Mapped[str | None] = mapped_column(String(200), index=True)
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON)  # None: every model
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rotated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rpm_limit: Mapped[int | None] = mapped_column(Integer)  # requests per minute (None: no limit)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)  # tokens per minute (None: no limit)
    budget_usd: Mapped[Decimal | None] = mapped_column("budget_picousd", Money)  # None: no budget
    budget_period: Mapped[str | None] = mapped_column(String(10))  # daily | weekly | monthly | total


class RequestLog(Base):
    """One row per request through the gateway."""

    __tablename__ = "request_logs"
    __table_args__ = (
        Index("ix_request_logs_key_created", "key_id", "created_at"),
        Index("ix_request_logs_team_created", "team", "created_at"),
        Index("ix_request_logs_created", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    key_id: Mapped[str | None] = mapped_column(String(32))
    team: Mapped[str | None] = mapped_column(String(200))
    requested_model: Mapped[str | None] = mapped_column(String(200))
    backend: Mapped[str | None] = mapped_column(String(200))
    deployment: Mapped[str | None] = mapped_column(String(500))
    route_reason: Mapped[str | None] = mapped_column(String(500))
    route_tier: Mapped[str | None] = mapped_column(String(100))
    complexity_score: Mapped[float | None] = mapped_column(Float)
    failover: Mapped[str | None] = mapped_column(Text)  # what was tried before the answer, if anything
    status: Mapped[int] = mapped_column(Integer)
    error_type: Mapped[str | None] = mapped_column(String(100))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float | None] = mapped_column(Numeric(12, 3))
    ttft_ms: Mapped[float | None] = mapped_column(Numeric(12, 3))
    overhead_ms: Mapped[float | None] = mapped_column(Numeric(12, 3))
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    resumptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # streams resumed
    cost_usd: Mapped[Decimal | None] = mapped_column("cost_picousd", Money)  # what serving it cost
    reference_cost_usd: Mapped[Decimal | None] = mapped_column("reference_cost_picousd", Money)  # at frontier
    cost_estimated: Mapped[bool] = mapped_column(Boolean, default=False)  # usage counted by us, not reported
    request_body: Mapped[str | None] = mapped_column(Text)  # only when the policy opts in
    response_body: Mapped[str | None] = mapped_column(Text)


class UsageDaily(Base):
    """Per UTC day, key, team, requested model and backend: what the request log adds up to.

    Maintained by the log writer in the same transaction as the raw rows, so reports and budget
    reseeding read a few rows per day instead of scanning the log. '' stands for "none" in the
    key columns (they form the primary key).
    """

    __tablename__ = "usage_daily"
    __table_args__ = (
        Index("ix_usage_daily_key_day", "key_id", "day"),
        Index("ix_usage_daily_team_day", "team", "day"),
    )

    day: Mapped[date] = mapped_column(Date, primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    team: Mapped[str] = mapped_column(String(200), primary_key=True)
    requested_model: Mapped[str] = mapped_column(String(200), primary_key=True)
    backend: Mapped[str] = mapped_column(String(200), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_usd: Mapped[Decimal] = mapped_column("cost_picousd", Money, default=Decimal(0))
    reference_cost_usd: Mapped[Decimal] = mapped_column("reference_cost_picousd", Money, default=Decimal(0))
    # what the requests that have a reference cost really cost: savings = reference - basis
    reference_basis_usd: Mapped[Decimal] = mapped_column("reference_basis_picousd", Money, default=Decimal(0))


class ConsoleLogout(Base):
    """A console session its logout ended before it expired (console/session.py's nonce): every
    replica refuses its cookie until `expires` (Unix seconds), when the cookie is dead anyway."""

    __tablename__ = "console_logouts"

    nonce: Mapped[str] = mapped_column(String(32), primary_key=True)
    expires: Mapped[int] = mapped_column(BigInteger, index=True)
