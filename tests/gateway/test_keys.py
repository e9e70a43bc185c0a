"""Virtual keys: admin API, auth outcomes, cache TTL across replicas, no plaintext at rest."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from gateway.auth import AuthError, KeyHasher, KeyStore
from gateway.db import create_engine, session_factory
from gateway.main import create_app
from gateway.migrate import upgrade
from gateway.settings import GatewaySettings

MASTER = "sk-master-test"
ADMIN = {"Authorization": f"Bearer {MASTER}"}


@pytest.fixture
def migrated(database_url: str) -> str:
    upgrade(database_url)
    return database_url


@pytest.fixture
def admin(migrated: str) -> Iterator[TestClient]:
    settings = GatewaySettings(master_key=MASTER, key_secret="hmac-secret", database_url=migrated)
    with TestClient(create_app(settings)) as client:
        yield client


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(url: str, clock: FakeClock, ttl: float = 5.0) -> KeyStore:
    # NullPool: no connection outlives its session (and the event loop of the test that used it)
    engine = create_async_engine(url, poolclass=NullPool)
    return KeyStore(session_factory(engine), KeyHasher(b"hmac-secret"), ttl, clock)


def test_admin_creates_lists_gets_updates_revokes_and_rotates(admin: TestClient) -> None:
    r = admin.post(
        "/admin/keys",
        json={
            "name": "app",
            "team": "legal",
            "allowed_models": ["fast"],
            "expires_in_days": 30,
            "metadata": {"o": 1},
        },
        headers=ADMIN,
    )
    assert r.status_code == 201, r.text
    created = r.json()
    key_id, plaintext = created["id"], created["key"]
    assert plaintext.startswith("sk-") and len(plaintext) > 40
    assert created["key_prefix"] == plaintext[:8] and created["team"] == "legal"
    listed = admin.get("/admin/keys", headers=ADMIN).json()["data"]
    assert [k["id"] for k in listed] == [key_id] and "key" not in listed[0]
    assert admin.get(f"/admin/keys/{key_id}", headers=ADMIN).json()["allowed_models"] == ["fast"]
    updated = admin.patch(f"/admin/keys/{key_id}", json={"allowed_models": ["fast", "smart"]}, headers=ADMIN)
    assert updated.json()["allowed_models"] == ["fast", "smart"] and updated.json()["name"] == "app"
    rotated = admin.post(f"/admin/keys/{key_id}/rotate", headers=ADMIN).json()
    assert rotated["id"] == key_id and rotated["key"] != plaintext and rotated["rotated_at"]
    revoked = admin.post(f"/admin/keys/{key_id}/revoke", headers=ADMIN).json()
    assert revoked["revoked_at"] is not None
    assert admin.get("/admin/keys?include_revoked=false", headers=ADMIN).json()["data"] == []
    assert admin.post(f"/admin/keys/{key_id}/rotate", headers=ADMIN).status_code == 409


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Bearer wrong"}, 403), ({"Authorization": MASTER}, 401)],
)
def test_admin_api_needs_the_master_key(admin: TestClient, headers: dict[str, str], status: int) -> None:
    r = admin.get("/admin/keys", headers=headers)
    assert r.status_code == status
    assert r.json()["error"]["message"]


def test_a_virtual_key_is_not_an_admin_key(admin: TestClient) -> None:
    plaintext = admin.post("/admin/keys", json={"name": "x"}, headers=ADMIN).json()["key"]
    r = admin.get("/admin/keys", headers={"Authorization": f"Bearer {plaintext}"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


@pytest.mark.parametrize(
    "body",
    [{}, {"name": ""}, {"name": "x", "expires_in_days": -1}, {"name": "x", "bogus": 1}, {"name": 5}],
)
def test_bad_admin_bodies_are_400(admin: TestClient, body: dict[str, object]) -> None:
    r = admin.post("/admin/keys", json=body, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_unknown_key_id_is_404(admin: TestClient) -> None:
    r = admin.get("/admin/keys/nope", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "key_not_found"


def test_authentication_outcomes(migrated: str) -> None:
    async def run() -> None:
        clock = FakeClock()
        store = _store(migrated, clock)
        info, key = await store.create("a", team="t", allowed_models=["fast"])
        assert (await store.authenticate(key)).id == info.id
        assert info.allows("fast") and not info.allows("smart")
        for presented, status, code in (
            (None, 401, "missing_api_key"),
            ("sk-unknown", 401, "invalid_api_key"),
        ):
            with pytest.raises(AuthError) as err:
                await store.authenticate(presented)
            assert (err.value.status, err.value.code) == (status, code)
        _, old = await store.create("b", expires_at=datetime.now(UTC) - timedelta(seconds=1))
        with pytest.raises(AuthError) as err:
            await store.authenticate(old)
        assert (err.value.status, err.value.code) == (403, "key_expired")
        await store.revoke(info.id)
        with pytest.raises(AuthError) as err:
            await store.authenticate(key)
        assert (err.value.status, err.value.code) == (403, "key_revoked")

    asyncio.run(run())


def test_revocation_reaches_another_replica_within_the_cache_ttl(migrated: str) -> None:
    async def run() -> None:
        clock = FakeClock()
        a, b = _store(migrated, clock, ttl=5.0), _store(migrated, clock, ttl=5.0)
        info, key = await a.create("shared")
        assert (await b.authenticate(key)).id == info.id  # replica B caches it
        await a.revoke(info.id)
        with pytest.raises(AuthError):
            await a.authenticate(key)  # at once where it was revoked
        clock.now += 4.9
        assert (await b.authenticate(key)).id == info.id  # B may serve it until its TTL ends
        clock.now += 0.2
        with pytest.raises(AuthError) as err:
            await b.authenticate(key)
        assert err.value.code == "key_revoked"

    asyncio.run(run())


def test_rotation_retires_the_old_secret(migrated: str) -> None:
    async def run() -> None:
        store = _store(migrated, FakeClock())
        info, old = await store.create("r")
        rotated, new = await store.rotate(info.id)
        assert rotated.id == info.id and new != old
        assert (await store.authenticate(new)).id == info.id
        with pytest.raises(AuthError) as err:
            await store.authenticate(old)
        assert err.value.status == 401

    asyncio.run(run())


def test_no_plaintext_key_is_stored(migrated: str, tmp_path: Path) -> None:
    async def run() -> tuple[str, str]:
        store = _store(migrated, FakeClock())
        _, key = await store.create("secret-holder", metadata={"note": "x"})
        engine = create_engine(migrated)
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT * FROM api_keys"))).all()
        await engine.dispose()
        return key, repr(rows)

    key, dump = asyncio.run(run())
    assert key not in dump and key[8:] not in dump
    import hashlib

    assert hashlib.sha256(key.encode()).hexdigest() not in dump  # keyed hash, not a plain digest


def test_cli_migrates_and_creates_a_key_that_authenticates(database_url: str) -> None:
    import json
    import os
    import subprocess
    import sys

    env = dict(
        os.environ,
        GATEWAY_MASTER_KEY=MASTER,
        GATEWAY_KEY_SECRET="hmac-secret",
        GATEWAY_DATABASE_URL=database_url,
    )
    run = [sys.executable, "-m", "gateway"]
    refused = subprocess.run(
        [*run, "keys", "create", "--name", "cli"], env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "python -m gateway db upgrade" in refused.stderr
    subprocess.run([*run, "db", "upgrade"], env=env, check=True, capture_output=True)
    out = subprocess.run(
        [*run, "keys", "create", "--name", "cli", "--team", "ops", "--models", "fast,smart"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    created = json.loads(out)
    assert created["allowed_models"] == ["fast", "smart"]
    info = asyncio.run(_store(database_url, FakeClock()).authenticate(created["key"]))
    assert info.id == created["id"] and info.team == "ops"
