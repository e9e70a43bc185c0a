"""Admin API bounds: what a hostile or careless client sends is refused in OpenAI's format, not echoed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from gateway.config.settings import GatewaySettings
from gateway.main import create_app
from gateway.store.migrate import upgrade

MASTER = "sk-master-test"
ADMIN = {"Authorization": f"Bearer {MASTER}"}


@pytest.fixture
def admin(tmp_path: object) -> Iterator[TestClient]:
    url = f"sqlite+aiosqlite:///{tmp_path}/gateway.db"
    upgrade(url)
    settings = GatewaySettings(master_key=MASTER, key_secret="hmac-secret", database_url=url)
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("method", ["GET", "PATCH", "POST revoke", "POST rotate"])
def test_a_404_for_a_long_key_id_does_not_echo_it_whole(admin: TestClient, method: str) -> None:
    verb, _, action = method.partition(" ")
    path = "/admin/keys/" + "z" * 5000 + (f"/{action}" if action else "")
    r = admin.request(verb, path, headers=ADMIN, json={} if verb == "PATCH" else None)
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "key_not_found", r.text
    assert len(error["message"]) < 100 and "z" * 32 in error["message"], error["message"]

