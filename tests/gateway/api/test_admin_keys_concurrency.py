"""Concurrent PATCHes of one key: the stored key is some serial order of them, never a mix."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from gateway.config.settings import GatewaySettings
from gateway.main import create_app
from gateway.store.migrate import upgrade

MASTER = "sk-master-test"
ADMIN = {"Authorization": f"Bearer {MASTER}"}


@pytest.fixture
def admin(database_url: str) -> Iterator[TestClient]:
    upgrade(database_url)
    settings = GatewaySettings(master_key=MASTER, key_secret="hmac-secret", database_url=database_url)
    with TestClient(create_app(settings)) as client:
        yield client


def _body(i: int) -> dict[str, Any]:
    # a budget of i + 1 dollars and model m<i>; no budget (nor its period) and model m<i>; a weekly period
    if i % 3 == 2:
        return {"budget_period": "weekly"}  # 400 when it lands on a key without a budget
    return {"budget_usd": str(i + 1) if i % 3 == 0 else None, "allowed_models": [f"m{i}"]}


def _patch(admin: TestClient, path: str, i: int) -> Response:
    return admin.patch(path, json=_body(i), headers=ADMIN)


def test_twenty_concurrent_patches_leave_one_of_their_states_on_both_databases(admin: TestClient) -> None:
    for _ in range(8):
        made = admin.post("/admin/keys", json={"name": "race", "budget_usd": "100"}, headers=ADMIN).json()
        path = f"/admin/keys/{made['id']}"
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(partial(_patch, admin, path), range(20)))
        assert {r.status_code for r in answers} <= {200, 400}, [r.text for r in answers]
        final = admin.get(f"/admin/keys/{made['id']}", headers=ADMIN).json()
        budget = _body(int(final["allowed_models"][0][1:]))["budget_usd"]
        assert final["budget_usd"] == budget, final  # the model and the budget of one request
        assert (final["budget_usd"] is None) == (final["budget_period"] is None), final
