"""A console logout ends the session on the server: a copy of its cookie is refused afterwards, by
this replica and by another one on the same database (SQLite and PostgreSQL), until it would have
expired; those rows go with a later logout."""

from __future__ import annotations

import asyncio
import re

from sqlalchemy import select

from gateway.console.session import COOKIE
from gateway.store.console_logouts import end_session, session_ended
from gateway.store.db import create_db
from gateway.store.migrate import upgrade
from gateway.store.models import ConsoleLogout
from tests.gateway.console.test_console import HTML, _client, _login


def test_a_logged_out_sessions_cookie_is_refused_by_every_replica(database_url: str) -> None:
    upgrade(database_url)
    with _client(database_url) as browser, _client(database_url) as other_replica:
        csrf = _login(browser)
        cookie = browser.cookies.get(COOKIE, domain="127.0.0.1", path="/ui")
        assert cookie is not None
        other_replica.cookies.set(COOKIE, cookie, domain="127.0.0.1", path="/ui")  # a copy of it
        assert other_replica.get("/ui/keys", headers=HTML).status_code == 200
        answer = browser.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
        assert answer.status_code == 303 and answer.headers["location"] == "/ui/login"
        # the copy no longer opens a page nor makes a change, on either replica
        refused = other_replica.get("/ui/keys", headers=HTML, follow_redirects=False)
        assert refused.status_code == 303 and refused.headers["location"].startswith("/ui/login")
        assert other_replica.get("/ui/api/overview").status_code == 401
        made = other_replica.post("/ui/keys", data={"csrf": csrf, "name": "after-logout"})
        assert made.status_code == 401
        browser.cookies.set(COOKIE, cookie, domain="127.0.0.1", path="/ui")
        assert browser.get("/ui/api/overview").status_code == 401
        # a new login is a new session
        browser.cookies.clear()
        _login(browser)
        assert browser.get("/ui/api/overview").status_code == 200


def test_logouts_are_kept_until_the_session_would_have_expired_and_no_longer(database_url: str) -> None:
    upgrade(database_url)

    async def main() -> tuple[bool, bool, list[str]]:
        db = create_db(database_url)
        try:
            await end_session(db, "old", expires=1_000, now=500)
            await end_session(db, "old", expires=1_000, now=600)  # twice (two tabs): no error
            ended_old = await session_ended(db, "old")
            await end_session(db, "new", expires=5_000, now=2_000)  # "old" has expired: removed
            async with db.connect() as conn:
                kept = list(await conn.scalars(select(ConsoleLogout.nonce)))
            return ended_old, await session_ended(db, "never-logged-out"), kept
        finally:
            await db.dispose()

    ended_old, ended_other, kept = asyncio.run(main())
    assert ended_old and not ended_other and kept == ["new"]


def test_the_logout_form_needs_its_csrf_token(database_url: str) -> None:
    upgrade(database_url)
    with _client(database_url) as browser:
        _login(browser)
        assert browser.post("/ui/logout", data={"csrf": "forged"}).status_code == 403
        page = browser.get("/ui/keys", headers=HTML)  # still logged in
        assert page.status_code == 200 and re.search(r'name="csrf"', page.text)
