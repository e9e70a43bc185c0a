"""What looking up keys costs under attack: database queries per burst, bounded caches, failures per address,
and one answer for every key that does not work."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from gateway.config.settings import GatewaySettings
from gateway.governance.keys import AuthError, AuthLimits, KeyHasher, KeyStore
from gateway.main import create_app
from gateway.store.db import session_factory
from gateway.store.migrate import upgrade

MASTER = "sk-master-test"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
CLIENT = ("203.0.113.7", 40000)
UNLIMITED = AuthLimits(failures_per_minute=0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class KeyQueries:
    """Counts the SELECTs on api_keys a database runs."""

    def __init__(self, db: AsyncEngine) -> None:
        self.count = 0

        @event.listens_for(db.sync_engine, "before_cursor_execute")
        def _count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if statement.lstrip().upper().startswith("SELECT") and "api_keys" in statement:
                self.count += 1


@pytest.fixture
def migrated(database_url: str) -> str:
    upgrade(database_url)
    return database_url


def _store(url: str, clock: FakeClock, limits: AuthLimits = UNLIMITED) -> tuple[KeyStore, KeyQueries]:
    db = create_async_engine(url, poolclass=NullPool)
    queries = KeyQueries(db)
    return KeyStore(session_factory(db), KeyHasher(b"hmac-secret"), 5.0, clock, limits), queries


async def _refusal(store: KeyStore, key: str, client: tuple[str, int] | None = CLIENT) -> AuthError:
    with pytest.raises(AuthError) as info:
        await store.authenticate(key, client)
    return info.value


def test_a_burst_for_one_uncached_key_costs_one_database_query(migrated: str) -> None:
    async def run() -> int:
        creator, _ = _store(migrated, FakeClock())
        info, key = await creator.create("busy")
        replica, queries = _store(migrated, FakeClock())  # another replica: nothing cached
        found = await asyncio.gather(*(replica.authenticate(key, CLIENT) for _ in range(100)))
        assert {k.id for k in found} == {info.id}
        return queries.count

    assert asyncio.run(run()) == 1


def test_a_burst_for_one_unknown_key_costs_one_database_query(migrated: str) -> None:
    async def run() -> int:
        store, queries = _store(migrated, FakeClock())
        outcomes = await asyncio.gather(
            *(store.authenticate("sk-nobody", CLIENT) for _ in range(50)), return_exceptions=True
        )
        assert all(isinstance(o, AuthError) and o.status == 401 for o in outcomes)
        return queries.count

    assert asyncio.run(run()) == 1


def test_an_unknown_key_stays_unknown_without_the_database_for_the_miss_ttl(migrated: str) -> None:
    async def run() -> list[int]:
        clock = FakeClock()
        store, queries = _store(migrated, clock, AuthLimits(miss_ttl=60.0, failures_per_minute=0))
        counts = []
        for step in (0.0, 10.0, 40.0, 11.0):  # 0, 10, 50 s: cached (past the 5 s key TTL); 61 s: asked
            clock.now += step
            await _refusal(store, "sk-nobody")
            counts.append(queries.count)
        return counts

    assert asyncio.run(run()) == [1, 1, 1, 2]


def test_a_flood_of_unknown_keys_is_bounded_and_never_evicts_valid_keys(migrated: str) -> None:
    async def run() -> None:
        limits = AuthLimits(miss_cache_size=50, failures_per_minute=0)
        store, queries = _store(migrated, FakeClock(), limits)
        info, key = await store.create("valuable")
        await store.authenticate(key, CLIENT)
        for i in range(300):
            await _refusal(store, f"sk-random-{i}")
        assert store._cache.sizes() == (1, 50)  # the misses are bounded, the valid key still there
        before = queries.count
        assert (await store.authenticate(key, CLIENT)).id == info.id
        assert queries.count == before  # from the cache: the flood cost the valid key nothing

    asyncio.run(run())


def test_a_revoked_or_expired_key_is_answered_exactly_like_an_unknown_one(migrated: str) -> None:
    async def run() -> list[tuple[int, str, str]]:
        store, _ = _store(migrated, FakeClock())
        revoked, revoked_key = await store.create("revoked")
        await store.revoke(revoked.id)
        _, expired_key = await store.create("expired", expires_at=datetime.now(UTC) - timedelta(seconds=1))
        errors = [await _refusal(store, k) for k in ("sk-never-existed", revoked_key, expired_key)]
        return [(e.status, e.message, e.code) for e in errors]

    unknown, revoked, expired = asyncio.run(run())
    assert unknown == revoked == expired == (401, "Incorrect API key provided", "invalid_api_key")


def test_failed_authentications_are_limited_per_client_address(migrated: str) -> None:
    async def run() -> None:
        clock = FakeClock()
        store, queries = _store(migrated, clock, AuthLimits(failures_per_minute=3))
        _, key = await store.create("real")
        for i in range(3):
            assert (await _refusal(store, f"sk-guess-{i}")).status == 401
        refused = await _refusal(store, key)  # even a valid key: no oracle for a list of leaked keys
        assert (refused.status, refused.code) == (429, "too_many_failed_authentications")
        assert refused.retry_after == pytest.approx(20.0)  # 60 s / 3: one more failure may come then
        assert refused.headers() == [(b"retry-after", b"20")]
        looked_up = queries.count
        await _refusal(store, "sk-guess-more")
        assert queries.count == looked_up  # refused before any lookup
        assert (await store.authenticate(key, ("198.51.100.1", 1))).name == "real"  # other addresses work
        clock.now += 20.0
        assert (await store.authenticate(key, CLIENT)).name == "real"

    asyncio.run(run())


def test_a_missing_key_does_not_count_as_a_failed_authentication(migrated: str) -> None:
    async def run() -> None:
        store, _ = _store(migrated, FakeClock(), AuthLimits(failures_per_minute=1))
        for _ in range(5):
            assert (await _refusal(store, "")).code == "missing_api_key"
        assert (await _refusal(store, "sk-wrong")).status == 401
        assert (await _refusal(store, "sk-wrong")).status == 429

    asyncio.run(run())


@pytest.fixture
def gateway(migrated: str, tmp_path: Path) -> Iterator[TestClient]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        'backends:\n  gone: {type: engine, urls: ["http://127.0.0.1:9"]}\nmodels:\n  fast: {backend: gone}\n'
    )
    settings = GatewaySettings(master_key=MASTER, key_secret="hmac-secret", database_url=migrated,
                               policy_path=policy, auth_failures_per_minute=2)  # fmt: skip
    with TestClient(create_app(settings)) as client:
        yield client


def test_the_gateway_answers_too_many_failed_authentications_with_429_and_retry_after(
    gateway: TestClient,
) -> None:
    created = gateway.post("/admin/keys", json={"name": "app"}, headers=ADMIN).json()
    revoked = gateway.post("/admin/keys", json={"name": "old"}, headers=ADMIN).json()
    gateway.post(f"/admin/keys/{revoked['id']}/revoke", headers=ADMIN)
    body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}]}

    def ask(path: str, key: str) -> Any:
        headers = {"Authorization": f"Bearer {key}"}
        if path == "/v1/models":
            return gateway.get(path, headers=headers)
        return gateway.post(path, json=body, headers=headers)

    unknown = ask("/v1/chat/completions", "sk-unknown")
    gone = ask("/v1/models", revoked["key"])
    assert (unknown.status_code, gone.status_code) == (401, 401)
    assert unknown.json() == gone.json()  # the revoked key tells nothing more than an unknown one
    for path in ("/v1/chat/completions", "/v1/models"):
        r = ask(path, created["key"])  # the TestClient's address failed twice: refused
        assert r.status_code == 429 and int(r.headers["retry-after"]) == 30
        assert r.json()["error"] == {
            "message": "Too many failed authentication attempts from this address; retry later",
            "type": "requests", "param": None, "code": "too_many_failed_authentications",
        }  # fmt: skip


def test_wrong_master_keys_and_metrics_tokens_count_against_the_address_like_wrong_keys(
    gateway: TestClient,
) -> None:
    wrong = {"Authorization": "Bearer sk-master-guess"}
    assert gateway.get("/admin/keys", headers=wrong).status_code == 403
    assert gateway.get("/metrics", headers=wrong).status_code == 403
    for path in ("/admin/keys", "/metrics"):  # two failures: the limit; the master key is refused too
        r = gateway.get(path, headers=ADMIN)
        assert r.status_code == 429 and int(r.headers["retry-after"]) == 30, r.text
        assert r.json()["error"]["code"] == "too_many_failed_authentications"
    r = gateway.post("/admin/keys", json={"name": "x"}, headers=wrong)  # refused before the body is read
    assert r.status_code == 429 and r.headers["retry-after"] == "30"


class CountingHasher(KeyHasher):
    """A KeyHasher that counts the digests it computes."""

    def __init__(self, secret: bytes) -> None:
        super().__init__(secret)
        self.computed = 0

    def digest(self, key: str) -> str:
        self.computed += 1
        return super().digest(key)


def test_a_key_that_authenticated_is_not_hashed_again_and_unknown_keys_are_never_remembered(
    migrated: str,
) -> None:
    async def run() -> None:
        hasher = CountingHasher(b"hmac-secret")
        db = create_async_engine(migrated, poolclass=NullPool)
        limits = AuthLimits(cache_size=2, failures_per_minute=0)
        store = KeyStore(session_factory(db), hasher, 5.0, FakeClock(), limits)
        keys = [(await store.create(f"k{i}"))[1] for i in range(3)]
        hasher.computed = 0  # creating hashed each once
        for _ in range(3):
            await store.authenticate(keys[0], CLIENT)
        assert hasher.computed == 1  # an HMAC per key, not per request
        for i in range(20):
            await _refusal(store, f"sk-random-{i}")
            await _refusal(store, f"sk-random-{i}")
        assert hasher.computed == 1 + 40  # an unknown key is hashed every time it is presented
        assert list(store._digests) == [keys[0]]
        await store.authenticate(keys[1], CLIENT)
        await store.authenticate(keys[2], CLIENT)  # bounded by the key cache's size: the oldest goes
        assert list(store._digests) == keys[1:]
        assert (await store.authenticate(keys[0], CLIENT)).name == "k0"  # hashed again, still works
        assert hasher.computed == 1 + 40 + 3
        revoked = await store.authenticate(keys[2], CLIENT)
        await store.revoke(revoked.id)
        await _refusal(store, keys[2])
        assert keys[2] not in store._digests  # a key that stopped working leaves no trace
        await db.dispose()

    asyncio.run(run())
