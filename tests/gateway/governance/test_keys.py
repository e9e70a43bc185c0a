"""Virtual keys: admin API, auth outcomes, cache TTL across replicas, no plaintext at rest."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from gateway.config.settings import GatewaySettings
from gateway.governance.keys import AuthError, KeyHasher, KeyStore
from gateway.main import create_app
from gateway.store.db import DatabaseUnavailableError, create_db, session_factory
from gateway.store.migrate import upgrade
from gateway.store.models import ApiKey
from tests.gateway.processes import insert_rows

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
    db = create_async_engine(url, poolclass=NullPool)
    return KeyStore(session_factory(db), KeyHasher(b"hmac-secret"), ttl, clock)


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
    [
        {},
        {"name": ""},
        {"name": "x", "expires_in_days": -1},
        {"name": "x", "bogus": 1},
        {"name": 5},
        {"name": "x", "rpm_limit": 2**31},  # past the column's INTEGER range
        {"name": "x", "budget_usd": "10000000"},  # past BIGINT picodollars
        {"name": "x", "rpm_limit": True},  # a limit is a number, not a flag
        {"name": "x", "tpm_limit": False},
        {"name": "x", "expires_at": "2030-01-01T00:00:00Z", "expires_in_days": 3},  # which one?
    ],
)
def test_bad_admin_bodies_are_400(admin: TestClient, body: dict[str, object]) -> None:
    r = admin.post("/admin/keys", json=body, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        '{"name": "x", "metadata": {"k": "\\ud800"}}',
        '{"name": "x", "metadata": {"\\udfff": 1}}',
        '{"name": "x", "metadata": {"deep": [{"k": "a\\u0000b"}]}}',
        '{"name": "x", "allowed_models": ["\\ud800"]}',
        '{"name": "x", "team": "\\ud800"}',
    ],
)
def test_text_that_cannot_be_stored_is_400_and_writes_nothing(admin: TestClient, raw: str) -> None:
    before = admin.get("/admin/keys", headers=ADMIN).json()["data"]
    r = admin.post("/admin/keys", content=raw, headers={**ADMIN, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert admin.get("/admin/keys", headers=ADMIN).json()["data"] == before
    made = admin.post("/admin/keys", json={"name": "ok"}, headers=ADMIN).json()
    patch = raw.replace('"name": "x", ', "")
    r = admin.patch(
        f"/admin/keys/{made['id']}", content=patch, headers={**ADMIN, "content-type": "application/json"}
    )
    assert r.status_code == 400


def test_a_stored_row_with_unreadable_metadata_does_not_break_listing(
    admin: TestClient, migrated: str
) -> None:
    made = admin.post("/admin/keys", json={"name": "old", "metadata": {"k": "v"}}, headers=ADMIN).json()

    async def spoil() -> None:  # as a row written before the admin API refused such text
        db = create_async_engine(migrated, poolclass=NullPool)
        async with db.begin() as conn:
            await conn.execute(
                text("UPDATE api_keys SET metadata = :m WHERE id = :id"),
                {"m": '{"k": "\\ud800"}', "id": made["id"]},
            )
        await db.dispose()

    asyncio.run(spoil())
    listed = admin.get("/admin/keys", headers=ADMIN)
    assert listed.status_code == 200
    assert next(k for k in listed.json()["data"] if k["id"] == made["id"])["metadata"] == {"k": "\ufffd"}
    assert admin.get(f"/admin/keys/{made['id']}", headers=ADMIN).json()["metadata"] == {"k": "\ufffd"}


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
        assert (err.value.status, err.value.code) == (401, "invalid_api_key")  # as if it never existed
        await store.revoke(info.id)
        with pytest.raises(AuthError) as err:
            await store.authenticate(key)
        assert (err.value.status, err.value.code) == (401, "invalid_api_key")

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
        assert err.value.code == "invalid_api_key"

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
        db = create_db(migrated)
        async with db.connect() as conn:
            rows = (await conn.execute(text("SELECT * FROM api_keys"))).all()
        await db.dispose()
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


# A backend nothing listens on: a request that passes admission fails over to 503, one refused
# by a limit or a budget is 429, so the answers show what admission decided.
UNREACHABLE_POLICY = """
backends:
  gone: {type: engine, urls: ["http://127.0.0.1:9"], timeouts: {connect: 1, total: 2},
         price: {input_per_mtok: 1, output_per_mtok: 2}}
models:
  fast: {backend: gone}
"""


@pytest.fixture
def gateway(migrated: str, tmp_path: Path) -> Iterator[TestClient]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(UNREACHABLE_POLICY)
    settings = GatewaySettings(
        master_key=MASTER, key_secret="hmac-secret", database_url=migrated, policy_path=policy
    )
    with TestClient(create_app(settings)) as client:
        yield client


def _ask(client: TestClient, key: str) -> tuple[int, dict[str, Any]]:
    r = client.post(
        "/v1/chat/completions",
        json={"model": "fast", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
    )
    return r.status_code, r.json()["error"]


def _patch(client: TestClient, key_id: str, **body: object) -> dict[str, Any]:
    r = client.patch(f"/admin/keys/{key_id}", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_patched_limits_and_budget_are_stored_and_admission_applies_them_at_once(gateway: TestClient) -> None:
    created = gateway.post("/admin/keys", json={"name": "app"}, headers=ADMIN).json()
    key, key_id = created["key"], created["id"]
    assert [_ask(gateway, key)[0] for _ in range(2)] == [503, 503]  # admitted, then no upstream

    patched = _patch(gateway, key_id, rpm_limit=1, tpm_limit=100_000)
    assert (patched["rpm_limit"], patched["tpm_limit"], patched["name"]) == (1, 100_000, "app")
    stored = gateway.get(f"/admin/keys/{key_id}", headers=ADMIN).json()
    assert (stored["rpm_limit"], stored["tpm_limit"]) == (1, 100_000)
    assert _ask(gateway, key)[0] == 503
    status, error = _ask(gateway, key)
    assert (status, error["code"], error["type"]) == (429, "rate_limit_exceeded", "requests")

    _patch(gateway, key_id, rpm_limit=None, tpm_limit=1)  # null lifts a limit
    status, error = _ask(gateway, key)
    assert (status, error["code"], error["type"]) == (429, "rate_limit_exceeded", "tokens")

    patched = _patch(gateway, key_id, tpm_limit=None, budget_usd="0.000000000001")
    assert Decimal(patched["budget_usd"]) == Decimal("1e-12") and patched["budget_period"] == "monthly"
    status, error = _ask(gateway, key)
    assert (status, error["code"]) == (429, "budget_exceeded") and "monthly budget" in error["message"]
    patched = _patch(gateway, key_id, budget_period="daily")
    assert Decimal(patched["budget_usd"]) == Decimal("1e-12") and patched["budget_period"] == "daily"
    status, error = _ask(gateway, key)
    assert (status, error["code"]) == (429, "budget_exceeded") and "daily budget" in error["message"]

    _patch(gateway, key_id, budget_usd="100")  # a raised budget applies to the period's counter at once
    assert _ask(gateway, key)[0] == 503
    patched = _patch(gateway, key_id, budget_usd=None)  # null removes the budget and its period
    assert (patched["budget_usd"], patched["budget_period"]) == (None, None)
    stored = gateway.get(f"/admin/keys/{key_id}", headers=ADMIN).json()
    assert (stored["rpm_limit"], stored["tpm_limit"], stored["budget_usd"]) == (None, None, None)


@pytest.mark.parametrize(
    "body", [{"budget_period": "daily"}, {"budget_usd": None, "budget_period": "weekly"}]
)
def test_a_budget_period_without_a_budget_is_400_at_creation_as_in_a_patch(
    admin: TestClient, body: dict[str, object]
) -> None:
    """It was created without the period (and without a word); PATCH refused it already."""
    r = admin.post("/admin/keys", json={"name": "app", **body}, headers=ADMIN)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("budget_period", "invalid_value")
    assert not [k for k in admin.get("/admin/keys", headers=ADMIN).json()["data"] if k["name"] == "app"]
    r = admin.post(
        "/admin/keys", json={"name": "app", "budget_usd": "5", "budget_period": "daily"}, headers=ADMIN
    )
    assert r.status_code == 201 and r.json()["budget_period"] == "daily"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"rpm_limit": 0}, "rpm_limit"),
        ({"tpm_limit": -5}, "tpm_limit"),
        ({"rpm_limit": "many"}, "rpm_limit"),
        ({"rpm_limit": 2**31}, "rpm_limit"),  # past the column's INTEGER range
        ({"budget_usd": "0"}, "budget_usd"),
        ({"budget_usd": "-1"}, "budget_usd"),
        ({"budget_usd": "10000000"}, "budget_usd"),  # past BIGINT picodollars
        ({"budget_period": "yearly"}, "budget_period"),
        ({"budget_period": None}, "budget_period"),
        ({"budget_period": "daily"}, "budget_period"),  # the key has no budget to give a period
        ({"budget_usd": None, "budget_period": "daily"}, "budget_period"),
        ({"name": None}, "name"),
        ({"metadata": None}, "metadata"),
        ({"allowed_models": ["fast", 7]}, "allowed_models[1]"),  # a list's item, named as OpenAI does
    ],
)
def test_bad_limit_and_budget_patches_are_400_and_change_nothing(
    admin: TestClient, body: dict[str, object], param: str
) -> None:
    created = admin.post("/admin/keys", json={"name": "app", "rpm_limit": 7}, headers=ADMIN).json()
    r = admin.patch(f"/admin/keys/{created['id']}", json=body, headers=ADMIN)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "invalid_value")
    assert param in error["message"]
    stored = admin.get(f"/admin/keys/{created['id']}", headers=ADMIN).json()
    assert (stored["name"], stored["rpm_limit"], stored["budget_usd"]) == ("app", 7, None)


def test_a_limit_change_reaches_another_replica_within_the_cache_ttl(migrated: str) -> None:
    async def run() -> None:
        clock = FakeClock()
        a, b = _store(migrated, clock, ttl=5.0), _store(migrated, clock, ttl=5.0)
        info, key = await a.create("shared", rpm_limit=10)
        assert (await b.authenticate(key)).rpm_limit == 10  # replica B caches it
        await a.update(info.id, rpm_limit=2, budget_usd=Decimal("3"), budget_period="weekly")
        changed = await a.authenticate(key)  # at once where it was changed
        assert (changed.rpm_limit, changed.budget_usd, changed.budget_period) == (2, Decimal(3), "weekly")
        clock.now += 4.9
        assert (await b.authenticate(key)).rpm_limit == 10  # B may use the old limits until its TTL ends
        clock.now += 0.2
        assert (await b.authenticate(key)).rpm_limit == 2

    asyncio.run(run())


def test_every_key_operation_names_the_database_when_it_refuses_connections() -> None:
    async def run() -> None:
        clock = FakeClock()
        store = _store("postgresql+asyncpg://postgres@127.0.0.1:1/test", clock)  # nothing listens on port 1
        unavailable = r": the database is unavailable \(ConnectionRefusedError\)$"
        with pytest.raises(DatabaseUnavailableError, match="^the API key cannot be checked" + unavailable):
            await store.authenticate("sk-anything")
        with pytest.raises(DatabaseUnavailableError, match="^the key cannot be created" + unavailable):
            await store.create("app")
        with pytest.raises(DatabaseUnavailableError, match="^the keys cannot be listed" + unavailable):
            await store.list()
        with pytest.raises(DatabaseUnavailableError, match="^the key cannot be read" + unavailable):
            await store.get("some-id")
        for change in (store.revoke("some-id"), store.rotate("some-id"), store.update("some-id", name="x")):
            with pytest.raises(DatabaseUnavailableError, match="^the key cannot be changed" + unavailable):
                await change

    asyncio.run(run())


def test_a_cached_key_keeps_working_while_the_database_is_gone_until_its_ttl_ends(
    postgres_url: str, drop_database: Callable[[str], None]
) -> None:
    upgrade(postgres_url)
    clock = FakeClock()
    store = _store(postgres_url, clock, ttl=5.0)
    info, key = asyncio.run(store.create("app"))  # the replica that created it has it cached
    drop_database(postgres_url)
    clock.now += 4.9
    assert asyncio.run(store.authenticate(key)).id == info.id
    with pytest.raises(DatabaseUnavailableError, match=r"^the API key cannot be checked: the database"):
        asyncio.run(store.authenticate("sk-not-cached"))  # a key not cached needs the database
    clock.now += 0.2
    with pytest.raises(DatabaseUnavailableError, match=r"^the API key cannot be checked: the database"):
        asyncio.run(store.authenticate(key))  # past the TTL: no stale entries


@pytest.mark.parametrize(
    "raw",
    [
        '{"name": "x", "expires_in_days": 1e308}',  # a timedelta past datetime's range: was a 500
        '{"name": "x", "expires_in_days": 1e400}',  # parsed as inf
        '{"name": "x", "expires_in_days": Infinity}',
        '{"name": "x", "expires_in_days": NaN}',
        '{"name": "x", "expires_in_days": -Infinity}',
        '{"name": "x", "expires_in_days": 0}',
        '{"name": "x", "expires_in_days": 36501}',  # past the 100-year bound
        '{"name": "x", "expires_in_days": "soon"}',
        '{"name": "x", "rpm_limit": 1e308}',
        '{"name": "x", "rpm_limit": NaN}',
        '{"name": "x", "rpm_limit": Infinity}',
        '{"name": "x", "rpm_limit": -5}',
        '{"name": "x", "rpm_limit": 1.5}',
        '{"name": "x", "tpm_limit": 99999999999999999999999999999}',
        '{"name": "x", "tpm_limit": -Infinity}',
        '{"name": "x", "budget_usd": 1e308}',
        '{"name": "x", "budget_usd": NaN}',
        '{"name": "x", "budget_usd": "NaN"}',
        '{"name": "x", "budget_usd": "Infinity"}',
        '{"name": "x", "budget_usd": "-1"}',
        '{"name": "x", "budget_usd": "1e-30"}',
        '{"name": "x", "expires_at": 1e308}',
        '{"name": "x", "expires_at": "+99999-01-01T00:00:00Z"}',
    ],
)
def test_hostile_numbers_in_a_new_key_are_400_in_openai_format(admin: TestClient, raw: str) -> None:
    r = admin.post("/admin/keys", content=raw, headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value" and error["message"]
    assert admin.get("/admin/keys", headers=ADMIN).json()["data"] == []  # nothing was created


@pytest.mark.parametrize(
    "raw",
    ['{"rpm_limit": 1e308}', '{"tpm_limit": NaN}', '{"budget_usd": "Infinity"}', '{"budget_usd": -1e308}',
     '{"expires_at": 1e308}', '{"expires_at": "-infinity"}'],
)  # fmt: skip
def test_hostile_numbers_in_a_key_update_are_400(admin: TestClient, raw: str) -> None:
    created = admin.post("/admin/keys", json={"name": "x"}, headers=ADMIN).json()
    r = admin.patch(f"/admin/keys/{created['id']}", content=raw,
                    headers={**ADMIN, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_value"


def test_the_longest_allowed_expiry_is_accepted(admin: TestClient) -> None:
    r = admin.post("/admin/keys", json={"name": "x", "expires_in_days": 36500}, headers=ADMIN)
    assert r.status_code == 201, r.text
    assert datetime.fromisoformat(r.json()["expires_at"]).year >= datetime.now(UTC).year + 99


def test_keys_list_in_keyset_pages_on_both_databases(migrated: str) -> None:
    start = datetime(2026, 11, 1, tzinfo=UTC)
    rows = [ApiKey(id=f"key{i:03d}", key_hash=f"{i:064x}", key_prefix="sk-x", name=f"k{i}",
                   created_at=start + timedelta(seconds=i // 4)) for i in range(37)]  # fmt: skip
    newest_first = [r.id for r in sorted(rows, key=lambda r: (-r.created_at.timestamp(), r.id))]
    insert_rows(migrated, rows)
    store = _store(migrated, FakeClock())

    async def pages() -> list[list[str]]:
        found: list[list[str]] = []
        after = None
        for _ in range(10):  # a loop that cannot hang
            page = await store.list(None, True, 10, after)
            found.append([k.id for k in page])
            if len(page) < 10:
                break
            after = page[-1].id
        return found

    found = asyncio.run(pages())
    assert [len(p) for p in found] == [10, 10, 10, 7]
    assert [k for p in found for k in p] == newest_first  # ties on the time kept in id order


def test_admin_lists_keys_in_pages_after_an_id(admin: TestClient) -> None:
    ids = [admin.post("/admin/keys", json={"name": f"k{i}"}, headers=ADMIN).json()["id"] for i in range(5)]
    whole = admin.get("/admin/keys", headers=ADMIN).json()
    assert sorted(k["id"] for k in whole["data"]) == sorted(ids) and whole["has_more"] is False
    seen: list[str] = []
    url = "/admin/keys?limit=2"
    pages = []
    for _ in range(10):  # a loop that cannot hang
        page = admin.get(url, headers=ADMIN).json()
        pages.append(len(page["data"]))
        seen += [k["id"] for k in page["data"]]
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        if not page["has_more"]:
            break
        url = f"/admin/keys?limit=2&after={page['last_id']}"
    assert pages == [2, 2, 1] and seen == [k["id"] for k in whole["data"]]  # the same order, in pages
    for bad, param in (("limit=0", "limit"), ("limit=1001", "limit"), ("after=nope", "after")):
        r = admin.get(f"/admin/keys?{bad}", headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ('{"name": "x", "metadata": {"k": NaN}}', "metadata.k"),
        ('{"name": "x", "metadata": {"k": 1e400}}', "metadata.k"),
        ('{"name": "x", "metadata": {"a": [1, {"b": -Infinity}]}}', "metadata.a[1].b"),
    ],
)
def test_non_finite_metadata_is_400_naming_it_on_both_databases(
    admin: TestClient, raw: str, where: str
) -> None:
    headers = {**ADMIN, "Content-Type": "application/json"}
    r = admin.post("/admin/keys", content=raw, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_value" and error["param"] == "metadata" and where in error["message"]
    assert admin.get("/admin/keys", headers=ADMIN).json()["data"] == []  # nothing was stored
    made = admin.post("/admin/keys", json={"name": "ok"}, headers=ADMIN).json()
    patch = admin.patch(
        f"/admin/keys/{made['id']}", content=raw.replace('"name": "x", ', ""), headers=headers
    )
    assert patch.status_code == 400 and patch.json()["error"]["param"] == "metadata"


def test_expiry_with_an_offset_is_stored_as_the_same_instant_in_utc_on_both_databases(
    admin: TestClient,
) -> None:
    made = admin.post(
        "/admin/keys", json={"name": "x", "expires_at": "2030-01-01T02:00:00+02:00"}, headers=ADMIN
    )
    assert made.status_code == 201 and made.json()["expires_at"] == "2030-01-01T00:00:00+00:00"
    key_id = made.json()["id"]
    assert (
        admin.get(f"/admin/keys/{key_id}", headers=ADMIN).json()["expires_at"] == "2030-01-01T00:00:00+00:00"
    )
    patched = admin.patch(
        f"/admin/keys/{key_id}", json={"expires_at": "2031-06-30T20:00:00-05:00"}, headers=ADMIN
    )
    assert patched.json()["expires_at"] == "2031-07-01T01:00:00+00:00"
    naive = admin.patch(f"/admin/keys/{key_id}", json={"expires_at": "2032-01-01T00:00:00"}, headers=ADMIN)
    assert naive.json()["expires_at"] == "2032-01-01T00:00:00+00:00"  # no zone: UTC


@pytest.mark.parametrize("when", ["9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00"])
def test_an_expiry_that_leaves_the_calendar_in_utc_is_400_on_both_databases(
    admin: TestClient, when: str
) -> None:
    r = admin.post("/admin/keys", json={"name": "x", "expires_at": when}, headers=ADMIN)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "expires_at" and "UTC" in r.json()["error"]["message"]
    made = admin.post("/admin/keys", json={"name": "ok"}, headers=ADMIN).json()
    patch = admin.patch(f"/admin/keys/{made['id']}", json={"expires_at": when}, headers=ADMIN)
    assert patch.status_code == 400 and patch.json()["error"]["param"] == "expires_at"


def test_a_body_that_is_not_json_is_400_without_a_param_named_after_its_offset(admin: TestClient) -> None:
    for raw in (b"{bad", b'{"name": "x",}', b"\xff"):
        r = admin.post("/admin/keys", content=raw, headers={**ADMIN, "content-type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "invalid_value", r.text
        assert error["param"] is None and "JSON" in error["message"], r.text  # was param "1"


def test_a_bad_query_parameter_is_named_as_the_client_named_it(admin: TestClient) -> None:
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("after=", "after")):
        r = admin.get(f"/admin/keys?{query}", headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text  # not query.limit
        assert f"'{param}'" in r.json()["error"]["message"]
