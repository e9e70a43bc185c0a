"""A console path that does not exist is a 404, not a redirect (there was a loop of them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.config.settings import GatewaySettings
from gateway.main import create_app
from gateway.store.migrate import upgrade


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    database = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    upgrade(database)
    settings = GatewaySettings(master_key="sk-master", key_secret="hmac", database_url=database)
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("accept", ["text/html", "application/json"])
@pytest.mark.parametrize("path", ["/ui/nonexistent", "/ui/keys/x/y", "/ui/nonexistent/"])
def test_an_unknown_console_path_is_404_without_a_host_built_redirect(
    client: TestClient, path: str, accept: str
) -> None:
    # Starlette's slash redirect sent /ui/x to http://<Host>/ui/x/, which the console sent back to /ui/x
    answer = client.get(path, headers={"accept": accept, "host": "evil.example"}, follow_redirects=False)
    if path.endswith("/"):  # the console's own relative redirect, then the 404
        assert answer.status_code == 307 and answer.headers["location"] == path.rstrip("/")
        answer = client.get(path.rstrip("/"), headers={"accept": accept}, follow_redirects=False)
    assert answer.status_code == 404, answer.headers.get("location")
    if accept == "application/json":
        assert answer.json()["error"]["code"] == "not_found"
    else:
        assert answer.headers["x-content-type-options"] == "nosniff"
