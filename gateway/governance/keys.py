"""Virtual keys: generation, keyed hashing, lookup with a short cache, and the admin operations."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from functools import partial
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config.settings import GatewaySettings
from gateway.errors import GatewayError, retry_after_header
from gateway.governance.auth_failures import FailedAuthLimiter
from gateway.governance.key_cache import KeyCache
from gateway.governance.singleflight import SingleFlight
from gateway.store.db import DATABASE_ERRORS, translated_errors, unavailable
from gateway.store.models import ApiKey
from gateway.store.row_sanitizer import clean_json

logger = logging.getLogger(__name__)

KEY_PREFIX = "sk-"
_DISPLAY_CHARS = 8  # "sk-" and the first 5 random characters


class AuthError(GatewayError):
    """A request's key is missing, unknown, revoked or expired, or may not use a model (401, 403,
    409); or its address failed too often (429, `retry_after` seconds)."""

    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None) -> None:
        super().__init__(status, message, _AUTH_ERROR_TYPES.get(status, "permission_error"), code=code)
        self.retry_after = retry_after

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers the refusal needs (`Retry-After` for a 429)."""
        return [] if self.retry_after is None else [(b"retry-after", retry_after_header(self.retry_after))]


_AUTH_ERROR_TYPES = {401: "authentication_error", 429: "requests"}  # OpenAI's type by status


# One answer for every key that does not work: unknown, revoked or expired alike, so that nobody
# holding a leaked key can tell whether it was ever real.
_INVALID_KEY = ("Incorrect API key provided", "invalid_api_key")


class KeyNotFoundError(GatewayError, LookupError):
    """No key with that id: 404 `key_not_found`."""

    def __init__(self, key_id: str) -> None:
        # an id is 32 characters: a longer one is named by its start, not echoed whole
        shown = key_id if len(key_id) <= 32 else f"{key_id[:32]}... ({len(key_id)} characters)"
        super().__init__(404, f"no key with id {shown}", code="key_not_found")
        self.key_id = key_id


class InvalidKeyUpdateError(GatewayError, ValueError):
    """A change the key's current state does not allow: 400 `invalid_value`, naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(400, f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


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
class AuthLimits:
    """Bounds on what unauthenticated traffic can cost a replica (defaults: GatewaySettings's)."""

    cache_size: int = 100_000  # keys kept per replica; least recently used go first
    miss_ttl: float = 60.0  # seconds an unknown key is answered without the database
    miss_cache_size: int = 50_000  # unknown keys kept (their own LRU: they never evict valid keys)
    failures_per_minute: int = 30  # failed authentications per client address; 0: unlimited
    tracked_addresses: int = 100_000  # client addresses whose failures are counted

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> AuthLimits:
        """The limits set by GATEWAY_KEY_CACHE_SIZE, _KEY_MISS_CACHE_*, _AUTH_FAILURES_PER_MINUTE."""
        return cls(
            cache_size=settings.key_cache_size,
            miss_ttl=settings.key_miss_cache_ttl,
            miss_cache_size=settings.key_miss_cache_size,
            failures_per_minute=settings.auth_failures_per_minute,
        )


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
            "budget_usd": format(self.budget_usd, "f") if self.budget_usd is not None else None,
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
        # a row written before the admin API refused unstorable text: read with U+FFFD in its place
        metadata=clean_json(dict(row.metadata_ or {})),
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
    Concurrent lookups of one key share one query; unknown keys are cached apart (AuthLimits) and
    each costs its sender's address one failure. The database failing raises
    DatabaseUnavailableError (gateway/store/db.py), answered as 503.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        hasher: KeyHasher,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        limits: AuthLimits = AuthLimits(),
    ) -> None:
        self._sessions = sessions
        self._hasher = hasher
        self._ttl = ttl
        self._clock = clock
        self._cache: KeyCache[KeyInfo] = KeyCache(
            ttl, limits.cache_size, limits.miss_ttl, limits.miss_cache_size, clock
        )
        self._lookups: SingleFlight[str, KeyInfo | None] = SingleFlight()
        # the digests of keys that authenticated, by the key presented: an HMAC costs about 50 us on
        # a cold CPU cache (a request after an idle moment), a dict lookup about 1; unknown keys are
        # never kept, so a flood of random ones cannot grow it
        self._digests: dict[str, str] = {}
        self._digests_size = limits.cache_size
        self._failures = FailedAuthLimiter(limits.failures_per_minute, limits.tracked_addresses, clock)

    async def authenticate(self, presented: str | None, client: tuple[str, int] | None = None) -> KeyInfo:
        """The key behind an `Authorization` value, sent from `client` (the ASGI scope's (host, port)).

        AuthError: 401 for a missing key and, alike, for an unknown, revoked or expired one; 429 while
        the client's address is over its failed-authentication limit. DatabaseUnavailableError.
        """
        if not presented:
            raise AuthError(401, "Missing API key: send 'Authorization: Bearer sk-...'", "missing_api_key")
        address = client[0] if client else None
        wait = self._failures.blocked(address)
        if wait is not None:
            raise AuthError(429, "Too many failed authentication attempts from this address; retry later",
                            "too_many_failed_authentications", retry_after=wait)  # fmt: skip
        digest = self._digests.get(presented) or self._hasher.digest(presented)
        info = await self._lookup(digest)
        if info is not None and info.revoked_at is None and not info.is_expired(datetime.now(UTC)):
            if self._digests_size > 0 and presented not in self._digests:
                if len(self._digests) >= self._digests_size:  # the oldest goes (insertion order)
                    del self._digests[next(iter(self._digests))]
                self._digests[presented] = digest
            return info
        self._failures.failed(address)
        self._digests.pop(presented, None)  # a key that worked once keeps no trace once it does not
        if info is not None:  # a real key that no longer works: worth an operator's look (leaked?)
            state = "revoked" if info.revoked_at is not None else "expired"
            logger.warning("%s key %s (%s) presented by %s", state, info.id, info.key_prefix, address)
        raise AuthError(401, *_INVALID_KEY)

    def check_master(self, presented: str, expected: str, client: tuple[str, int] | None) -> None:
        """The admin API's check: `presented` must be the master key (compared in constant time).

        A wrong master key counts against the client's address like a wrong virtual key, so the
        master key cannot be guessed faster than the failed-authentication limit allows.
        AuthError: 429 while the address is over that limit, 403 for a wrong key.
        """
        self.refuse_if_blocked(client)
        if not hmac.compare_digest(presented.encode(), expected.encode()):
            self.failed(client, "a wrong master key")
            raise AuthError(403, "The admin API needs the master key", "not_master_key")

    def refuse_if_blocked(self, client: tuple[str, int] | None) -> None:
        """AuthError 429 (with Retry-After) while `client`'s address is over its failure limit."""
        wait = self._failures.blocked(client[0] if client else None)
        if wait is not None:
            raise AuthError(429, "Too many failed authentication attempts from this address; retry later",
                            "too_many_failed_authentications", retry_after=wait)  # fmt: skip

    def failed(self, client: tuple[str, int] | None, what: str) -> None:
        """A secret other than a virtual key (master key, metrics token) was wrong: counted, logged."""
        address = client[0] if client else None
        self._failures.failed(address)
        logger.warning("%s was presented by %s", what, address)

    async def _lookup(self, digest: str) -> KeyInfo | None:
        cached, info = self._cache.get(digest)
        if cached:
            return info
        # a cache miss only: a cached key keeps working while the database is down
        return await self._lookups.run(digest, partial(self._fetch, digest))

    async def _fetch(self, digest: str) -> KeyInfo | None:
        try:
            async with self._sessions() as session:
                row = (
                    await session.execute(select(ApiKey).where(ApiKey.key_hash == digest))
                ).scalar_one_or_none()
        except DATABASE_ERRORS as exc:
            raise unavailable("the API key cannot be checked", exc) from exc
        info = _info(row) if row is not None and hmac.compare_digest(row.key_hash, digest) else None
        self._cache.put(digest, info)
        return info

    def _remember(self, digest: str, info: KeyInfo | None) -> None:
        self._cache.put(digest, info)

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

    async def list(
        self,
        team: str | None = None,
        include_revoked: bool = True,
        limit: int | None = None,
        after: str | None = None,
    ) -> list[KeyInfo]:
        """Keys, newest first; at most `limit`, those that come after the key with id `after` in that
        order (keyset paging, never by offset: no key is skipped or shown twice as keys are added).
        KeyNotFoundError when there is no key `after`."""
        query = select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id)
        if team is not None:
            query = query.where(ApiKey.team == team)
        if not include_revoked:
            query = query.where(ApiKey.revoked_at.is_(None))
        if after is not None:  # the database's own time of that key: compared as it stores times
            at = select(ApiKey.created_at).where(ApiKey.id == after).scalar_subquery()
            query = query.where(or_(ApiKey.created_at < at, and_(ApiKey.created_at == at, ApiKey.id > after)))
        if limit is not None:
            query = query.limit(limit)
        if after is not None and not _could_be_id(after):
            raise KeyNotFoundError(after)
        async with translated_errors("the keys cannot be listed"), self._sessions() as session:
            if after is not None and await session.get(ApiKey, after) is None:
                raise KeyNotFoundError(after)
            return [_info(r) for r in (await session.execute(query)).scalars()]

    async def get(self, key_id: str) -> KeyInfo:
        """One key by id (KeyNotFoundError if none)."""
        if not _could_be_id(key_id):
            raise KeyNotFoundError(key_id)
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
        if not _could_be_id(key_id):
            raise KeyNotFoundError(key_id)
        async with translated_errors("the key cannot be changed"), self._sessions() as session:
            if session.get_bind().dialect.name == "sqlite":  # no FOR UPDATE: take the write lock first
                # (else two changes read one state and each writes only what differs from it: a mix)
                await session.execute(_no_op.where(ApiKey.id == key_id))
            row = await session.get(ApiKey, key_id, with_for_update=True)
            if row is None:
                raise KeyNotFoundError(key_id)
            old_digest = row.key_hash
            change(row)
            await session.commit()
            await session.refresh(row)
        info = _info(row)
        self._cache.forget(old_digest)
        self._remember(row.key_hash, info)
        return info


def _could_be_id(key_id: str) -> bool:
    """Whether `key_id` could name a key (ids are 32 printable ASCII characters): one that cannot
    is not found without asking the database, which answered a NUL in it 404 on SQLite and 400 on
    PostgreSQL."""
    return len(key_id) <= 32 and key_id.isascii() and key_id.isprintable()


_no_op = update(ApiKey).values(id=ApiKey.id).execution_options(synchronize_session=False)


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
