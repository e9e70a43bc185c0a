"""Console logouts (store/console_logouts.py) under stress: the database gone answers every console
page and call 503, never 500; logouts of one session at once from two replicas both succeed; a
logout holds while its cookie could still be taken, a TTL raised since included."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from gateway.config.settings import GatewaySettings
from gateway.console import login, web
from gateway.console.session import COOKIE
from gateway.main import create_app
from gateway.store.migrate import upgrade
from tests.gateway.console.test_console import BASE, HTML, MASTER, _client, _login


def test_the_database_gone_answers_console_pages_and_the_logout_503(
    postgres_url: str, drop_database: Callable[[str], None]
) -> None:
    upgrade(postgres_url)
    with _client(postgres_url) as browser:
        csrf = _login(browser)
        drop_database(postgres_url)
        page = browser.get("/ui/keys", headers=HTML)
        assert page.status_code == 503 and "text/html" in page.headers["content-type"], page.text
        assert browser.get("/ui/api/overview").status_code == 503
        assert browser.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 503


def test_one_session_logged_out_at_once_on_two_replicas_is_ended_on_both(database_url: str) -> None:
    upgrade(database_url)
    with _client(database_url) as browser, _client(database_url) as other_replica:
        csrf = _login(browser)
        cookie = browser.cookies.get(COOKIE, domain="127.0.0.1", path="/ui")
        assert cookie is not None
        other_replica.cookies.set(COOKIE, cookie, domain="127.0.0.1", path="/ui")
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda c: c.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False).status_code,
                [browser, other_replica] * 4,
            ))  # fmt: skip
        assert set(answers) <= {303, 401} and 303 in answers, answers
        other_replica.cookies.set(COOKIE, cookie, domain="127.0.0.1", path="/ui")
        assert other_replica.get("/ui/api/overview").status_code == 401


class _Clock:
    """time.time for the console's modules, moved by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


def test_a_logout_outlives_a_raised_session_ttl(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # was: the row went with the next logout once the session's expiry at logout time had passed,
    # and a replica whose TTL had since been raised took a copy of the cookie again
    upgrade(database_url)
    clock = _Clock()
    monkeypatch.setattr(login, "time", clock)
    monkeypatch.setattr(web, "time", clock)

    def client(ttl: int) -> TestClient:
        settings = GatewaySettings(master_key=SecretStr(MASTER), key_secret=SecretStr("hmac"),
                                   database_url=database_url,
                                   console_session_ttl=ttl)  # fmt: skip
        return TestClient(create_app(settings), base_url=BASE)

    with client(3600) as before, client(86400) as raised:
        csrf = _login(before)
        cookie = before.cookies.get(COOKIE, domain="127.0.0.1", path="/ui")
        assert cookie is not None
        assert before.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
        clock.now += 4000  # past the session's end under the old TTL, not under the raised one
        other = _login(raised)  # another session's logout purges what it may
        assert raised.post("/ui/logout", data={"csrf": other}, follow_redirects=False).status_code == 303
        raised.cookies.set(COOKIE, cookie, domain="127.0.0.1", path="/ui")
        assert raised.get("/ui/api/overview").status_code == 401
