"""Virtual keys: generation, keyed hashing, lookup with a short cache, and the admin operations."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import DATABASE_ERRORS, translated_errors, unavailable
from gateway.models import ApiKey

KEY_PREFIX = "sk-"
_DISPLAY_CHARS = 8  # "sk-" and the first 5 random characters


class AuthError(Exception):
    """A request's key is missing, unknown, revoked or expired, or may not use a model."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class KeyNotFoundError(LookupError):
    """No key with that id."""


class InvalidKeyUpdateError(ValueError):
    """A change the key's current state does not allow (answered as 400, naming `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


# What KeyStore.update may change (the admin API's PATCH fields)
UPDATABLE = frozenset(
    {"name", "team", "allowed_models", "expires_at", "metadata", "rpm_limit", "tpm_limit", "budget_usd",
     "budget_period"}
)  # fmt: skip


def generate_key() -> str:
    """A new plaintext key: `sk-` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyHasher:
    """HMAC-SHA256 under the server secret: a stolen table cannot be checked against guesses."""

    def __init__(self, secret: bytes) -> None:
        assert secret, "the key secret must not be empty"
        self._secret = secret

    def digest(self, key: str) -> str:
        """Hex digest of a presented key."""
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class KeyInfo:
    """What the gateway knows about a key (never its plaintext)."""

    id: str
    name: str
    key_prefix: str
    team: str | None
    allowed_models: tuple[str, ...] | None
    metadata: dict[str, Any]
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    rotated_at: datetime | None
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    budget_usd: Decimal | None = None
    budget_period: str | None = None

    def allows(self, model: str) -> bool:
        """Whether the key may call `model` (no list: every model)."""
        return self.allowed_models is None or model in self.allowed_models

    def is_expired(self, now: datetime) -> bool:
        """Past its expiry time."""
        return self.expires_at is not None and _aware(self.expires_at) <= now

    def public(self) -> dict[str, Any]:
        """JSON for the admin API."""
        return {
            "id": self.id,
            "name": self.name,
            "key_prefix": self.key_prefix,
            "team": self.team,
            "allowed_models": list(self.allowed_models) if self.allowed_models is not None else None,
            "metadata": self.metadata,
            "created_at": _iso(self.created_at),
            "expires_at": _iso(self.expires_at),
            "revoked_at": _iso(self.revoked_at),
            "rotated_at": _iso(self.rotated_at),
            "rpm_limit": self.rpm_limit,
            "tpm_limit": self.tpm_limit,
            "budget_usd": str(self.budget_usd) if self.budget_usd is not None else None,
            "budget_period": self.budget_period,
        }


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)  # SQLite drops the zone


def _iso(value: datetime | None) -> str | None:
    return None if value is None else _aware(value).isoformat()


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        name=row.name,
        key_prefix=row.key_prefix,
        team=row.team,
        allowed_models=tuple(row.allowed_models) if row.allowed_models is not None else None,
        metadata=dict(row.metadata_ or {}),
        created_at=_aware(row.created_at),
        expires_at=_aware(row.expires_at) if row.expires_at else None,
        revoked_at=_aware(row.revoked_at) if row.revoked_at else None,
        rotated_at=_aware(row.rotated_at) if row.rotated_at else None,
        rpm_limit=row.rpm_limit,
        tpm_limit=row.tpm_limit,
        budget_usd=row.budget_usd,
        budget_period=row.budget_period,
    )


class KeyStore:
    """Keys in the database; lookups are cached for `ttl` seconds so requests skip the database.

    A change made here updates this process's cache at once; other replicas see it within `ttl`.
    The database failing raises DatabaseUnavailableError (gateway/db.py), answered as 503.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        hasher: KeyHasher,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions = sessions
        self._hasher = hasher
        self._ttl = ttl
        self._clock = clock
        self._cache: dict[str, tuple[float, KeyInfo | None]] = {}  # digest -> (fetched at, key)

    async def authenticate(self, presented: str | None) -> KeyInfo:
        """The key behind an `Authorization` value; AuthError (401/403), or DatabaseUnavailableError."""
        if not presented:
            raise AuthError(401, "Missing API key: send 'Authorization: Bearer sk-...'", "missing_api_key")
        digest = self._hasher.digest(presented)
        info = await self._lookup(digest)
        if info is None:
            raise AuthError(401, "Incorrect API key provided", "invalid_api_key")
        if info.revoked_at is not None:
            raise AuthError(403, "This API key has been revoked", "key_revoked")
        if info.is_expired(datetime.now(UTC)):
            raise AuthError(403, "This API key has expired", "key_expired")
        return info

    async def _lookup(self, digest: str) -> KeyInfo | None:
        now = self._clock()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        try:  # a cache miss only: a cached key keeps working while the database is down
            async with self._sessions() as session:
                row = (
                    await session.execute(select(ApiKey).where(ApiKey.key_hash == digest))
                ).scalar_one_or_none()
        except DATABASE_ERRORS as exc:
            raise unavailable("the API key cannot be checked", exc) from exc
        info = _info(row) if row is not None and hmac.compare_digest(row.key_hash, digest) else None
        if len(self._cache) > 100_000:  # a flood of random keys must not grow memory without bound
            self._cache.clear()
        self._cache[digest] = (now, info)
        return info

    def _remember(self, digest: str, info: KeyInfo | None) -> None:
        self._cache[digest] = (self._clock(), info)

    # ------------------------------------------------------------------ admin
    async def create(
        self,
        name: str,
        team: str | None = None,
        allowed_models: list[str] | None = None,
        expires_at: datetime | None = None,
        metadata: dict[str, Any] | None = None,
        rpm_limit: int | None = None,
        tpm_limit: int | None = None,
        budget_usd: Decimal | None = None,
        budget_period: str | None = None,
    ) -> tuple[KeyInfo, str]:
        """A new key; returns it with its plaintext (shown once, never stored)."""
        plaintext = generate_key()
        digest = self._hasher.digest(plaintext)
        row = ApiKey(
            key_hash=digest,
            key_prefix=plaintext[:_DISPLAY_CHARS],
            name=name,
            team=team,
            allowed_models=allowed_models,
            metadata_=metadata or {},
            expires_at=expires_at,
            rpm_limit=rpm_limit,
            tpm_limit=tpm_limit,
            budget_usd=budget_usd,
            budget_period=budget_period,
        )
        async with translated_errors("the key cannot be created"), self._sessions() as session:
            session.add(row)
            await session.commit()
            await session.refresh(row)
        info = _info(row)
        self._remember(digest, info)
        return info, plaintext

    async def list(self, team: str | None = None, include_revoked: bool = True) -> list[KeyInfo]:
        """Keys, newest first."""
        query = select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id)
        if team is not None:
            query = query.where(ApiKey.team == team)
        if not include_revoked:
            query = query.where(ApiKey.revoked_at.is_(None))
        async with translated_errors("the keys cannot be listed"), self._sessions() as session:
            return [_info(r) for r in (await session.execute(query)).scalars()]

    async def get(self, key_id: str) -> KeyInfo:
        """One key by id (KeyNotFoundError if none)."""
        async with translated_errors("the key cannot be read"), self._sessions() as session:
            row = await session.get(ApiKey, key_id)
            if row is None:
                raise KeyNotFoundError(key_id)
            return _info(row)

    async def update(self, key_id: str, **fields: Any) -> KeyInfo:
        """Change the given UPDATABLE fields; None clears an optional one.

        Rate limits and budget are read from the key at each admission: the change applies to this
        process's next request at once, and on other replicas once their cached copy (`ttl`) expires.
        A budget without a period gets `monthly`; removing the budget removes its period.
        InvalidKeyUpdateError: a period for a key that has no budget.
        """
        assert set(fields) <= UPDATABLE, set(fields) - UPDATABLE
        return await self._modify(key_id, lambda row: _apply(row, fields))

    async def revoke(self, key_id: str) -> KeyInfo:
        """The key stops working (here at once, on other replicas within the cache TTL)."""

        def revoke(row: ApiKey) -> None:
            if row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)

        return await self._modify(key_id, revoke)

    async def rotate(self, key_id: str) -> tuple[KeyInfo, str]:
        """A new secret for the same key record (same id, limits and history); the old one stops."""
        plaintext = generate_key()

        def rotate(row: ApiKey) -> None:
            if row.revoked_at is not None:
                raise AuthError(409, "a revoked key cannot be rotated", "key_revoked")
            row.key_hash = self._hasher.digest(plaintext)
            row.key_prefix = plaintext[:_DISPLAY_CHARS]
            row.rotated_at = datetime.now(UTC)

        return await self._modify(key_id, rotate), plaintext

    async def _modify(self, key_id: str, change: Callable[[ApiKey], None]) -> KeyInfo:
        async with translated_errors("the key cannot be changed"), self._sessions() as session:
            row = await session.get(ApiKey, key_id, with_for_update=True)
            if row is None:
                raise KeyNotFoundError(key_id)
            old_digest = row.key_hash
            change(row)
            await session.commit()
            await session.refresh(row)
        info = _info(row)
        self._cache.pop(old_digest, None)
        self._remember(row.key_hash, info)
        return info


def _apply(row: ApiKey, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        setattr(row, "metadata_" if name == "metadata" else name, value)
    if row.budget_usd is None:
        if fields.get("budget_period") is not None:
            raise InvalidKeyUpdateError(
                "budget_period", "the key has no budget to give a period: set budget_usd as well"
            )
        row.budget_period = None
    elif row.budget_period is None:
        row.budget_period = "monthly"  # the default, as when a key is created with a budget
