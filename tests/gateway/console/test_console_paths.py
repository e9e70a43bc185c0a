"""Console paths that name no page: a 404 with the console's headers, never a redirect."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.config.settings import GatewaySettings
from gateway.main import create_app
from gateway.store.migrate import upgrade

HTML = {"accept": "text/html"}


@pytest.fixture
def anon(tmp_path: Path) -> Iterator[TestClient]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    upgrade(url)
    settings = GatewaySettings(master_key="sk-master-console", key_secret="hmac", database_url=url)
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("path", ["/ui/nope", "/ui/keys/a/b", "/ui/static/x/y", "/ui/requests/a%2Fb/c"])
@pytest.mark.parametrize("accept", [HTML, {"accept": "application/json"}])
def test_an_unknown_console_path_is_404_not_a_redirect_loop_to_the_hosts_url(
    anon: TestClient, path: str, accept: dict[str, str]
) -> None:
    # was: 307 to http://<Host header>/ui/nope/, whose trailing-slash route sent it back: a loop
    answer = anon.get(path, headers={**accept, "host": "evil.example"}, follow_redirects=False)
    assert answer.status_code == 404 and "location" not in answer.headers, answer.headers
    if "html" in accept["accept"]:
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
    if "json" in accept["accept"]:
        assert answer.json()["error"]["code"] == "not_found"


def test_an_unknown_console_path_with_a_trailing_slash_ends_at_the_404(anon: TestClient) -> None:
    answer = anon.get("/ui/nope/", headers=HTML, follow_redirects=False)
    assert answer.status_code == 307 and answer.headers["location"] == "/ui/nope"
    assert anon.get("/ui/nope/", headers=HTML).status_code == 404


def test_a_post_to_an_unknown_console_path_is_404(anon: TestClient) -> None:
    answer = anon.post("/ui/keys/a/b/c", data={"csrf": "x"}, headers=HTML, follow_redirects=False)
    assert answer.status_code == 404


@pytest.mark.parametrize("depth", [254, 300, 1000])
@pytest.mark.parametrize("where", ["x", "content"])
def test_a_request_body_nested_too_deep_to_explain_is_a_400_page(
    anon: TestClient, depth: int, where: str
) -> None:
    # was: 500 in JSON (orjson cannot write back what nests past 254 levels)
    answer = anon.post(
        "/ui/login", data={"master_key": "sk-master-console"}, headers=HTML, follow_redirects=False
    )
    assert answer.status_code == 303
    found = re.search(r'name="csrf" value="([^"]+)"', anon.get("/ui/routing", headers=HTML).text)
    assert found is not None
    deep = "[" * depth + "]" * depth
    message = f'{{"role": "user", "content": {deep if where == "content" else json.dumps("hi")}}}'
    text = f'{{"messages": [{message}], "x": {deep if where == "x" else 1}}}'
    answer = anon.post("/ui/routing/explain", data={"csrf": found.group(1), "request": text}, headers=HTML)
    assert answer.status_code == 400 and "text/html" in answer.headers["content-type"], answer.text[:300]
    assert "nest" in answer.text or "depth" in answer.text
