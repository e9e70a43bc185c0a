"""The web console, server side: sessions, CSRF, every page and action behind the master key, keys
managed from forms, the spend page's figures equal to `gateway report spend`, the request log
paginated by index, hostile values escaped."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.config.settings import GatewaySettings
from gateway.console.session import COOKIE, SessionSigner
from gateway.console.web import local_path
from gateway.main import create_app
from gateway.store.migrate import upgrade
from gateway.store.models import ApiKey, RequestLog, UsageDaily
from tests.gateway.processes import insert_rows

MASTER = "sk-master-console"
HTML = {"accept": "text/html"}
BASE = "http://127.0.0.1:8000"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def url(tmp_path: Path) -> str:
    database = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    upgrade(database)
    return database


def _client(url: str, master: str = MASTER) -> TestClient:
    settings = GatewaySettings(
        master_key=master, key_secret="hmac", database_url=url, auth_failures_per_minute=5
    )
    return TestClient(create_app(settings), base_url=BASE)


@pytest.fixture
def anon(url: str) -> Iterator[TestClient]:
    with _client(url) as client:
        yield client


def _login(client: TestClient, key: str = MASTER) -> str:
    """Log in; returns a CSRF token from the keys page."""
    answer = client.post("/ui/login", data={"master_key": key}, headers=HTML, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    page = client.get("/ui/keys", headers=HTML)
    assert page.status_code == 200
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


@pytest.fixture
def ops(url: str) -> Iterator[tuple[TestClient, str]]:
    with _client(url) as client:
        yield client, _login(client)


PAGES = ["/ui", "/ui/keys", "/ui/spend", "/ui/routing", "/ui/requests", "/ui/requests/abc", "/ui/keys/abc"]
ACTIONS = [
    "/ui/keys",
    "/ui/keys/abc",
    "/ui/keys/abc/revoke",
    "/ui/keys/abc/rotate",
    "/ui/routing/explain",
    "/ui/logout",
]


def test_every_page_and_action_needs_a_session(anon: TestClient) -> None:
    for path in PAGES:
        answer = anon.get(path, headers=HTML, follow_redirects=False)
        assert answer.status_code == 303 and answer.headers["location"] == f"/ui/login?next={path}", path
    overview = anon.get("/ui/api/overview")
    assert overview.status_code == 401 and overview.json()["error"]["code"] == "login_required"
    for path in ACTIONS:
        answer = anon.post(path, data={"csrf": "x", "name": "sneaky"}, follow_redirects=False)
        assert answer.status_code == 401, path
    # a forged or foreign cookie is no session either
    anon.cookies.set(COOKIE, "v1.9999999999.bm9uY2U.forged", domain="127.0.0.1", path="/ui")
    assert anon.get("/ui/keys", headers=HTML, follow_redirects=False).status_code == 303
    assert anon.post("/ui/keys", data={"csrf": "x", "name": "sneaky"}).status_code == 401
    assert "sneaky" not in anon.get("/admin/keys", headers={"Authorization": f"Bearer {MASTER}"}).text


def test_login_sets_a_strict_httponly_expiring_cookie_and_never_echoes_the_key(anon: TestClient) -> None:
    wrong = anon.post("/ui/login", data={"master_key": "guess"}, headers=HTML)
    assert wrong.status_code == 401 and COOKIE not in wrong.headers.get("set-cookie", "")
    answer = anon.post("/ui/login", data={"master_key": MASTER, "next": "/ui/spend"}, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/ui/spend"
    cookie = answer.headers["set-cookie"]
    assert (
        "HttpOnly" in cookie
        and "SameSite=strict" in cookie
        and "Path=/ui" in cookie
        and "Max-Age=28800" in cookie
    )
    assert MASTER not in cookie
    for path in PAGES[:5]:
        page = anon.get(path, headers=HTML)
        assert page.status_code == 200 and MASTER not in page.text, path
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"


def test_wrong_master_keys_are_limited_like_any_failed_authentication(anon: TestClient) -> None:
    statuses = [anon.post("/ui/login", data={"master_key": f"guess{i}"}).status_code for i in range(7)]
    assert statuses[:5] == [401] * 5 and statuses[-1] == 429
    assert anon.post("/ui/login", data={"master_key": MASTER}, follow_redirects=False).status_code == 429


def test_sessions_expire_are_bound_to_the_master_key_and_verify_in_constant_form() -> None:
    signer = SessionSigner(MASTER, ttl_seconds=60)
    cookie, session = signer.issue(now=1000.0)
    assert signer.verify(cookie, 1059.0) == session
    assert signer.verify(cookie, 1060.0) is None  # expired
    assert SessionSigner("another master key", 60).verify(cookie, 1000.0) is None
    version, issued, nonce, mac = cookie.split(".")
    assert signer.verify(f"{version}.{int(issued) + 3600}.{nonce}.{mac}", 1059.0) is None  # extended: forged
    assert SessionSigner(MASTER, 30).verify(cookie, 1029.0) == replace(session, expires=1030)
    assert SessionSigner(MASTER, 30).verify(cookie, 1030.0) is None  # a lowered TTL ends it sooner
    assert SessionSigner(MASTER, 600).verify(cookie, 1599.0) is not None  # a raised one later
    for junk in ("", "v1", "v1.x.y.z", "v1." + cookie[3:], cookie + "." + mac, "v1." * 100):
        assert signer.verify(junk, 1000.0) is None
    assert signer.csrf_matches(session, session.csrf) and not signer.csrf_matches(
        session, session.csrf[:-1] + "x"
    )
    assert not signer.csrf_matches(session, None) and session.csrf != signer.issue(1000.0)[1].csrf


@pytest.mark.parametrize("mac", ["\u00e9", "\u00c3\u00a9", "\udc80", "\u20ac" * 10])
def test_a_cookie_whose_mac_is_not_ascii_is_no_session(anon: TestClient, mac: str) -> None:
    signer = SessionSigner(MASTER, ttl_seconds=60)
    cookie, _ = signer.issue(now=1000.0)
    forged = cookie.rsplit(".", 1)[0] + "." + mac
    assert signer.verify(forged, 1000.0) is None  # compare_digest on a non-ASCII str raised TypeError
    raw = f"{COOKIE}={forged}".encode("utf-8", "surrogatepass")  # the raw bytes a client can send
    for path in ("/ui/keys", "/ui/login"):
        answer = anon.get(path, headers={"accept": b"text/html", "cookie": raw}, follow_redirects=False)
        assert answer.status_code in (200, 303), path


def test_non_ascii_secrets_are_wrong_secrets_not_errors(ops: tuple[TestClient, str]) -> None:
    client, csrf = ops
    guess = "sk-\u00e9\u20ac"
    assert client.post("/ui/keys", data={"csrf": csrf[:-1] + "\u00e9", "name": "x"}).status_code == 403
    assert client.post("/ui/login", data={"master_key": guess}, headers=HTML).status_code == 401
    bearer = f"Bearer {guess}".encode()  # raw UTF-8 bytes in the header, as a client may send them
    for path, status in (("/admin/keys", 403), ("/metrics", 403), ("/v1/models", 401)):
        assert client.get(path, headers={"authorization": bearer}).status_code == status, path


def test_a_new_master_key_ends_every_session(url: str) -> None:
    with _client(url) as client:
        _login(client)
        cookie = client.cookies.get(COOKIE)
    with _client(url, master="sk-rotated-master") as client:
        client.cookies.set(COOKIE, str(cookie), domain="127.0.0.1", path="/ui")
        assert client.get("/ui/keys", headers=HTML, follow_redirects=False).status_code == 303


def test_changes_need_the_sessions_csrf_token_and_the_gateways_own_origin(
    ops: tuple[TestClient, str],
) -> None:
    client, csrf = ops
    for token in (None, "", "forged", csrf + "x"):
        data = {"name": "evil"} if token is None else {"name": "evil", "csrf": token}
        assert client.post("/ui/keys", data=data).status_code == 403
    other = {"origin": "https://evil.example"}
    assert client.post("/ui/keys", data={"name": "evil", "csrf": csrf}, headers=other).status_code == 403
    assert (
        client.post(
            "/ui/keys", content=b'{"name": "evil"}', headers={"content-type": "application/json"}
        ).status_code
        == 415
    )
    assert "evil" not in client.get("/admin/keys", headers={"Authorization": f"Bearer {MASTER}"}).text
    own = {"origin": BASE, **HTML}
    assert client.post("/ui/keys", data={"name": "good", "csrf": csrf}, headers=own).status_code == 200


def test_login_redirects_only_to_console_paths() -> None:
    for target in (
        "//evil.example/ui",
        "https://evil.example/ui",
        "/ui\\..\\x",
        "/admin/keys",
        "javascript:x",
        None,
        "/ui/../../evil",  # same origin, but it leaves the console
        "/ui/%2e%2e/admin/keys",  # a browser resolves encoded dots alike
        "/ui/keys/.%2E/../x",
        "/ui/./keys",
        "/uievil",
    ):
        assert local_path(target) == "/ui", target
    assert local_path("/ui/spend?from=2026-01-01") == "/ui/spend?from=2026-01-01"


@pytest.mark.parametrize(
    ("path", "location"),
    [("/ui/", "/ui"), ("/ui/keys/", "/ui/keys"), ("/ui/spend/?by=team", "/ui/spend?by=team")],
)
def test_a_trailing_slash_is_a_relative_redirect_with_the_consoles_headers(
    anon: TestClient, path: str, location: str
) -> None:
    answer = anon.get(path, headers={**HTML, "host": "evil.example"}, follow_redirects=False)
    assert answer.status_code == 307 and answer.headers["location"] == location  # not the Host's URL
    assert answer.headers["x-frame-options"] == "DENY" and answer.headers["cache-control"] == "no-store"


def test_the_login_form_never_sends_a_browser_out_of_the_console(anon: TestClient) -> None:
    form = anon.get("/ui/login", params={"next": "/ui/../../evil"}, headers=HTML).text
    assert "evil" not in form
    answer = anon.post(
        "/ui/login", data={"master_key": MASTER, "next": "/ui/../../evil"}, follow_redirects=False
    )
    assert answer.status_code == 303 and answer.headers["location"] == "/ui"


def _plaintext(html: str) -> str:
    found = re.search(r'id="new-key"[^>]*value="([^"]+)"', html)
    assert found is not None, "the new key's plaintext should be on the page once"
    return found.group(1)


def test_a_reload_after_a_create_or_rotate_shows_nothing_and_does_nothing_again(
    ops: tuple[TestClient, str],
) -> None:
    """The POST's answer was the page with the secret: reloading it (the browser resubmits) made a
    second key, or rotated again and killed the secret just handed out. Now the POST redirects, and
    the page it leads to shows the secret once."""
    client, csrf = ops
    admin = {"Authorization": f"Bearer {MASTER}"}
    made = client.post("/ui/keys", data={"csrf": csrf, "name": "once"}, headers=HTML, follow_redirects=False)
    assert made.status_code == 303 and made.headers["location"] == "/ui/keys"
    cookie = made.headers["set-cookie"].lower()
    assert "httponly" in cookie and "path=/ui/keys" in cookie and "samesite=strict" in cookie
    assert "max-age" not in cookie and "expires" not in cookie  # kept in memory, never on disk
    sealed = client.cookies.get("switchboard_console_shown")
    assert sealed is not None and sealed.count(".") == 2  # time, text, MAC (bound to this session)
    shown = client.get("/ui/keys", headers=HTML)
    plaintext = _plaintext(shown.text)
    assert "Created once" in shown.text and "max-age=0" in shown.headers["set-cookie"].lower()
    again = client.get("/ui/keys", headers=HTML).text
    assert plaintext not in again and 'id="new-key"' not in again
    assert [k["name"] for k in client.get("/admin/keys", headers=admin).json()["data"]].count("once") == 1
    key_id = client.get("/admin/keys", headers=admin).json()["data"][0]["id"]
    rotated = client.post(f"/ui/keys/{key_id}/rotate", data={"csrf": csrf}, follow_redirects=False)
    assert rotated.status_code == 303 and plaintext not in rotated.text
    fresh = _plaintext(client.get("/ui/keys", headers=HTML).text)
    assert 'id="new-key"' not in client.get("/ui/keys", headers=HTML).text
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {fresh}"}).status_code == 200
    client.cookies.set("switchboard_console_shown", "bm90IGpzb24", path="/ui/keys")  # not ours: ignored
    assert client.get("/ui/keys", headers=HTML).status_code == 200
    forged = sealed.rsplit(".", 1)[0] + ".AAAA"  # another session's, or made up: never shown
    client.cookies.set("switchboard_console_shown", forged, path="/ui/keys")
    assert 'id="new-key"' not in client.get("/ui/keys", headers=HTML).text


def test_keys_are_created_used_edited_rotated_and_revoked_from_the_forms(ops: tuple[TestClient, str]) -> None:
    client, csrf = ops
    made = client.post(
        "/ui/keys",
        data={
            "csrf": csrf,
            "name": "app",
            "team": "legal",
            "rpm_limit": "60",
            "budget_usd": "2.5",
            "budget_period": "weekly",
        },
        headers=HTML,
    )
    assert made.status_code == 200
    plaintext = _plaintext(made.text)
    listing = client.get("/ui/keys", headers=HTML).text
    assert plaintext not in listing and "legal" in listing and "2.5" in listing and "weekly" in listing
    api = {"Authorization": f"Bearer {plaintext}"}
    assert client.get("/v1/models", headers=api).status_code == 200
    key_id = re.search(r'data-key-id="([0-9a-f]+)"', listing).group(1)  # type: ignore[union-attr]
    edited = client.post(
        f"/ui/keys/{key_id}",
        data={"csrf": csrf, "name": "app", "rpm_limit": "", "tpm_limit": "900", "budget_usd": ""},
        follow_redirects=False,
    )
    assert edited.status_code == 303
    admin = client.get(f"/admin/keys/{key_id}", headers={"Authorization": f"Bearer {MASTER}"}).json()
    assert admin["rpm_limit"] is None and admin["tpm_limit"] == 900 and admin["budget_usd"] is None
    assert admin["team"] is None  # an empty team field lifts the team too
    rotated = client.post(f"/ui/keys/{key_id}/rotate", data={"csrf": csrf}, headers=HTML)
    fresh = _plaintext(rotated.text)
    assert fresh != plaintext and client.get("/v1/models", headers=api).status_code == 401
    new_api = {"Authorization": f"Bearer {fresh}"}
    assert client.get("/v1/models", headers=new_api).status_code == 200
    assert (
        client.post(f"/ui/keys/{key_id}/revoke", data={"csrf": csrf}, follow_redirects=False).status_code
        == 303
    )
    assert client.get("/v1/models", headers=new_api).status_code == 401
    assert 'class="state-revoked"' in client.get("/ui/keys", headers=HTML).text


def test_the_edit_form_shows_the_expiry_keeps_it_and_empty_removes_it(ops: tuple[TestClient, str]) -> None:
    client, csrf = ops
    admin = {"Authorization": f"Bearer {MASTER}"}
    made = client.post("/admin/keys", json={"name": "exp", "expires_in_days": 1}, headers=admin).json()
    expiry = made["expires_at"]
    edit = client.get(f"/ui/keys/{made['id']}", headers=HTML).text
    assert f'name="expires_at" value="{expiry}"' in edit

    def save(**fields: str) -> str | None:
        data = {"csrf": csrf, "name": "exp", **fields}
        assert client.post(f"/ui/keys/{made['id']}", data=data, follow_redirects=False).status_code == 303
        answer: str | None = client.get(f"/admin/keys/{made['id']}", headers=admin).json()["expires_at"]
        return answer

    assert save(expires_at=expiry) == expiry  # saved unchanged: exactly the same expiry
    assert save(expires_at="") is None  # "empty: never", as the form says
    assert save(expires_at="", expires_in_days="2") is not None
    assert save(expires_at="2030-01-01T02:00:00+02:00") == "2030-01-01T00:00:00+00:00"
    bad = client.post(f"/ui/keys/{made['id']}", data={"csrf": csrf, "name": "exp", "expires_at": "soon"})
    assert bad.status_code == 400 and "expires_at" in bad.text


def test_bad_form_values_are_refused_with_the_reason_and_change_nothing(ops: tuple[TestClient, str]) -> None:
    client, csrf = ops
    for field, value in (
        ("rpm_limit", "-3"),
        ("budget_usd", "NaN"),
        ("expires_in_days", "1e308"),
        ("name", ""),
    ):
        data = {"csrf": csrf, "name": "bad", field: value}
        answer = client.post("/ui/keys", data=data, headers=HTML)
        assert answer.status_code == 400 and 'class="error"' in answer.text, field
    assert client.get("/admin/keys", headers={"Authorization": f"Bearer {MASTER}"}).json()["data"] == []
    assert client.post("/ui/keys/nope/revoke", data={"csrf": csrf}, headers=HTML).status_code == 404


def test_values_someone_else_wrote_are_escaped(ops: tuple[TestClient, str]) -> None:
    client, csrf = ops
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    assert client.post("/ui/keys", data={"csrf": csrf, "name": hostile, "team": hostile}).status_code == 200
    page = client.get("/ui/keys", headers=HTML).text
    assert hostile not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def _seed_usage(url: str, days: list[date]) -> None:
    rows = [
        UsageDaily(
            day=day,
            key_id=key,
            team=team,
            requested_model="fast",
            backend=backend,
            requests=3 + i,
            errors=i % 2,
            prompt_tokens=100 * (i + 1),
            completion_tokens=40,
            cached_tokens=0,
            cost_usd=Decimal("0.000125") * (i + 1),
            reference_cost_usd=Decimal("0.001") if backend == "local" else Decimal(0),
            reference_basis_usd=Decimal("0.0001") if backend == "local" else Decimal(0),
        )
        for i, day in enumerate(days)
        for key, team, backend in (("k1", "legal", "local"), ("k2", "", "openai"))
    ]

    insert_rows(url, rows)


def test_the_spend_page_shows_the_reports_figures_and_one_bar_a_day(url: str, tmp_path: Path) -> None:
    today = datetime.now(UTC).date()
    days = [today - timedelta(days=d) for d in (0, 2, 3, 9)]
    _seed_usage(url, days)
    start, end = today - timedelta(days=9), today
    with _client(url) as client:
        _login(client)
        page = client.get(f"/ui/spend?from={start}&to={end}&by=backend", headers=HTML).text
        csv_text = client.get(f"/ui/spend?from={start}&to={end}&by=backend&format=csv").text
    shown = dict(re.findall(r'<tr data-group="([^"]+)">.*?<td class="cost">([^<]+)</td>', page, re.S))
    env = {"GATEWAY_DATABASE_URL": url, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "report",
            "spend",
            "--from",
            str(start),
            "--to",
            str(end),
            "--by",
            "backend",
            "--format",
            "json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = {row["group"]: row["cost_usd"] for row in json.loads(out.stdout)["rows"]}
    assert report and {g: Decimal(v) for g, v in shown.items()} == {g: Decimal(v) for g, v in report.items()}
    assert csv_text.splitlines()[0].startswith("group,label,requests")
    assert len(csv_text.splitlines()) == 1 + len(report)
    assert len(re.findall(r'<g class="bar"', page)) == (end - start).days + 1  # every day, spent or not
    assert 'id="self-hosted-share">' in page


def _seed_requests(url: str, count: int) -> list[str]:
    start = datetime(2026, 11, 1, tzinfo=UTC)
    rows = [
        RequestLog(
            id=f"req-{i:04d}",
            created_at=start + timedelta(seconds=i // 2),
            key_id="k1" if i % 3 else "k2",
            requested_model="fast",
            backend="local" if i % 2 else "openai",
            status=200 if i % 5 else 429,
            prompt_tokens=10,
            completion_tokens=5,
            latency_ms=12.5,
            attempts=1,
            cost_usd=Decimal("7.4E-7") if i == 7 else None,
        )
        for i in range(count)
    ]
    newest_first = [r.id for r in sorted(rows, key=lambda r: (r.created_at, r.id), reverse=True)]

    insert_rows(url, rows)
    return newest_first


def test_the_request_log_pages_by_index_and_filters(url: str) -> None:
    newest_first = _seed_requests(url, 125)
    with _client(url) as client:
        _login(client)
        seen: list[str] = []
        path: str | None = "/ui/requests"
        while path is not None:
            page = client.get(path, headers=HTML).text
            seen += re.findall(r'href="/ui/requests/(req-\d+)"', page)
            nxt = re.search(r'<a href="([^"]+)" rel="next">', page)
            path = nxt.group(1).replace("&amp;", "&") if nxt else None
        assert seen == newest_first  # no row twice, none lost, at equal times too
        filtered = client.get("/ui/requests?status=429&backend=openai", headers=HTML).text
        ids = re.findall(r'href="/ui/requests/(req-\d+)"', filtered)
        assert ids and all(int(i[4:]) % 5 == 0 and int(i[4:]) % 2 == 0 for i in ids)
        detail = client.get("/ui/requests/req-0007", headers=HTML)
        assert detail.status_code == 200 and "Not logged" in detail.text
        assert "<dt>cost_usd</dt><dd>0.00000074</dd>" in detail.text and "picousd" not in detail.text
        listed = client.get("/ui/requests?until=2026-11-01T00:00:04Z", headers=HTML).text
        assert "<td>0.00000074</td>" in listed  # the list's cost column (it used to stay empty)
        assert client.get("/ui/requests/nope", headers=HTML).status_code == 404
        assert client.get("/ui/requests?status=abc", headers=HTML).status_code == 400
        assert client.get("/ui/requests?since=yesterday", headers=HTML).status_code == 400


def test_the_keys_page_pages_by_index(url: str) -> None:
    start = datetime(2026, 11, 1, tzinfo=UTC)
    keys = [
        ApiKey(id=f"key{i:04d}", key_hash=f"{i:064x}", key_prefix="sk-x", name=f"name-{i:04d}",
               created_at=start + timedelta(seconds=i // 3))  # three keys a second: ties on the time
        for i in range(230)
    ]  # fmt: skip
    newest_first = [k.id for k in sorted(keys, key=lambda k: (-k.created_at.timestamp(), k.id))]
    insert_rows(url, keys)
    with _client(url) as client:
        _login(client)
        seen: list[str] = []
        pages = 0
        path: str | None = "/ui/keys"
        while path is not None and pages < 10:
            page = client.get(path, headers=HTML).text
            found = re.findall(r'data-key-id="(key\d+)"', page)
            assert 0 < len(found) <= 100 and ("back to the newest" in page) == (pages > 0)
            seen += found
            pages += 1
            nxt = re.search(r'<a href="([^"]+)" rel="next">', page)
            path = nxt.group(1).replace("&amp;", "&") if nxt else None
        assert pages == 3 and seen == newest_first  # no key twice, none lost, at equal times too
        assert client.get("/ui/keys?after=nonsense", headers=HTML).status_code == 200  # the newest
        assert client.get(f"/ui/keys?after={'x' * 400}", headers=HTML).status_code == 400


def test_overview_and_routing_explain(ops: tuple[TestClient, str]) -> None:
    client, csrf = ops
    data = client.get("/ui/api/overview").json()
    assert set(data) >= {"hour", "day", "failovers", "backends", "policy"} and data["hour"]["requests"] == 0
    routing = client.get("/ui/routing", headers=HTML).text
    assert "policies/default.yaml" in routing or "default.yaml" in routing
    explained = client.post(
        "/ui/routing/explain",
        data={"csrf": csrf, "request": "Prove that there are infinitely many primes, step by step."},
        headers=HTML,
    )
    assert explained.status_code == 200 and "score " in explained.text and "chain " in explained.text
    body = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    refused = client.post("/ui/routing/explain", data={"csrf": csrf, "request": body}, headers=HTML)
    assert refused.status_code == 400 and "neither a model nor a route" in refused.text
    broken = client.post("/ui/routing/explain", data={"csrf": csrf, "request": "{not json"}, headers=HTML)
    assert broken.status_code == 400 and "not valid JSON" in broken.text


def test_the_routing_page_says_why_the_policy_file_cannot_be_shown(url: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_bytes((ROOT / "policies" / "default.yaml").read_bytes())
    settings = GatewaySettings(master_key=MASTER, key_secret="hmac", database_url=url, policy_path=policy)
    with TestClient(create_app(settings), base_url=BASE) as client:
        csrf = _login(client)
        for damage, reason in (
            (policy.unlink, "cannot read policy"),
            (lambda: policy.write_bytes(b"a: \xff\n"), "not UTF-8"),
        ):
            damage()  # the loaded version still serves: the page shows it and why the file is not shown
            page = client.get("/ui/routing", headers=HTML)
            assert page.status_code == 200 and reason in page.text and 'id="policy-unreadable"' in page.text
            form = {"csrf": csrf, "request": "hello there"}
            explained = client.post("/ui/routing/explain", data=form, headers=HTML)
            assert explained.status_code == 200 and "chain " in explained.text and reason in explained.text


def test_a_login_posted_from_another_site_is_refused_and_not_counted_as_a_failure(anon: TestClient) -> None:
    foreign = {"origin": "http://evil.example"}
    posts = [anon.post("/ui/login", data={"master_key": "x"}, headers=foreign) for _ in range(7)]
    statuses = [answer.status_code for answer in posts]
    assert statuses == [403] * 7  # a page elsewhere cannot lock the operator out
    assert anon.post("/ui/login", data={"master_key": MASTER}, headers=foreign).status_code == 403
    own = {"origin": BASE}
    answer = anon.post("/ui/login", data={"master_key": MASTER}, headers=own, follow_redirects=False)
    assert answer.status_code == 303


@pytest.mark.parametrize("target", ["/ui/€", "/ui\r\nX-Evil: 1", "/ui/\u2028", "/ui/a b", "/ui/\x00"])
def test_a_next_target_that_cannot_be_a_location_header_falls_back_to_the_console(
    anon: TestClient, target: str
) -> None:
    assert local_path(target) == "/ui"
    form = anon.get("/ui/login", params={"next": target}, headers=HTML)
    assert form.status_code == 200
    answer = anon.post("/ui/login", data={"master_key": MASTER, "next": target}, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/ui"


def test_spend_ranges_at_the_calendars_start_and_money_without_exponents(url: str) -> None:
    day = date(2026, 11, 2)
    insert_rows(
        url,
        [
            UsageDaily(day=day, key_id="k1", team="=HYPERLINK(\"http://x\")", requested_model="@SUM(A1)",
                       backend="local", requests=1, errors=0, prompt_tokens=3, completion_tokens=1,
                       cached_tokens=0, cost_usd=Decimal("7.4E-7"), reference_cost_usd=Decimal(0),
                       reference_basis_usd=Decimal(0))
        ],
    )  # fmt: skip
    with _client(url) as client:
        _login(client)
        for query in ("to=0001-01-01", "to=0001-01-06", "from=0001-01-01&to=0001-01-01"):
            assert client.get(f"/ui/spend?{query}", headers=HTML).status_code == 200, query
        odd = client.get("/ui/spend?from=20261128", headers=HTML)  # what the CLI refuses too
        assert odd.status_code == 400 and "from: must be a day as YYYY-MM-DD" in odd.text
        page = client.get(f"/ui/spend?from={day}&to={day}&by=model", headers=HTML).text
        csv_text = client.get(f"/ui/spend?from={day}&to={day}&by=team&format=csv").text
        model_csv = client.get(f"/ui/spend?from={day}&to={day}&by=model&format=csv").text
    assert '<td class="cost">0.00000074</td>' in page, re.findall(r"<tr data-group.*?</tr>", page, re.S)
    assert '<span class="figure" id="total-cost">0.00000074</span>' in page  # the tiles were "0.000001"
    assert "0.000001" not in page and "E-7" not in page
    assert "E-7" not in csv_text and ",0.00000074," in csv_text
    assert '\n"\'=HYPERLINK(""http://x"")",' in csv_text  # a text cell, not a formula
    assert "\n'@SUM(A1),'@SUM(A1)," in model_csv


def test_the_keys_page_shows_spend_exactly(url: str) -> None:
    """Rounded to six places, $0.00000331 read 0.000003 beside a budget of 0.000003 (and a meter at 100%)."""
    with _client(url) as client:
        _login(client)
        admin = {"Authorization": f"Bearer {MASTER}"}
        body = {"name": "tiny", "budget_usd": "0.000004", "budget_period": "daily"}
        made = client.post("/admin/keys", json=body, headers=admin).json()
        insert_rows(url, [UsageDaily(day=datetime.now(UTC).date(), key_id=made["id"], team="",
                                     requested_model="m", backend="local", requests=1, errors=0,
                                     prompt_tokens=3, completion_tokens=1, cached_tokens=0,
                                     cost_usd=Decimal("0.00000331"), reference_cost_usd=Decimal(0),
                                     reference_basis_usd=Decimal(0))])  # fmt: skip
        page = client.get("/ui/keys", headers=HTML).text
    assert "<td>0.00000331 / 0.000004 daily" in page, re.findall(r"<td>[0-9.]+ /[^<]*", page)


def test_request_log_filters_read_zones_and_refuse_control_characters(url: str) -> None:
    _seed_requests(url, 10)  # 2026-11-01T00:00:00Z .. 00:00:04Z
    with _client(url) as client:
        _login(client)

        def ids(query: str) -> list[str]:
            page = client.get(f"/ui/requests?{query}", headers=HTML)
            assert page.status_code == 200, page.text
            return re.findall(r'href="/ui/requests/(req-\d+)"', page.text)

        # 2026-10-31T19:00:03-05:00 is 00:00:03Z: the rows from then on, not every row
        later = ["req-0006", "req-0007", "req-0008", "req-0009"]
        assert sorted(ids("since=2026-10-31T19:00:03-05:00")) == later
        assert ids("until=2026-11-01T05:00:01%2B05:00") == ["req-0001", "req-0000"]  # before 00:00:01Z
        for query in ("model=%00", "key=a%00b", "backend=%01", "since=9999-12-31T23:59:59-14:00",
                      "until=0001-01-01T00:00:00%2B14:00"):  # fmt: skip
            answer = client.get(f"/ui/requests?{query}", headers=HTML)
            assert answer.status_code == 400, query
        assert client.get("/ui/requests/%00", headers=HTML).status_code == 404
        assert len(ids("after=9999-12-31T23:59:59-14:00|x")) == 10  # a cursor no page made: the first page
        assert len(ids("after=2026-11-01T00:00:09Z|a%00")) == 10


def test_a_sealed_text_reads_back_only_in_its_session_and_for_its_while() -> None:
    signer = SessionSigner("master", 3600)
    _, session = signer.issue(1000.0)
    _, other = signer.issue(1000.0)
    sealed = signer.seal(session, "the secret", 1000.0)
    assert signer.unseal(session, sealed, 1030.0, 60) == "the secret"
    assert signer.unseal(other, sealed, 1030.0, 60) is None  # another session's
    assert signer.unseal(session, sealed, 1061.0, 60) is None  # too old
    assert SessionSigner("other master", 3600).unseal(session, sealed, 1030.0, 60) is None
    stamp, _, mac = sealed.split(".")
    other_text = base64.urlsafe_b64encode(b"another secret").decode().rstrip("=")
    assert signer.unseal(session, f"{stamp}.{other_text}.{mac}", 1030.0, 60) is None  # its text changed
