"""A key's edit form saved as it is rendered changes nothing it did not touch (an empty model list
stays empty, a model name holding a comma stays whole), and a budget given back through the
console restarts its counter as PATCH /admin/keys does."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.config.settings import GatewaySettings
from gateway.governance.budgets import Budget, LocalBudgetStore
from gateway.main import GatewayApp, create_app
from gateway.store.migrate import upgrade

MASTER = "sk-master-console"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
HTML = {"accept": "text/html"}


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    upgrade(url)
    settings = GatewaySettings(
        master_key=MASTER, key_secret="hmac", database_url=url, auth_failures_per_minute=5
    )
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8000") as client:
        answer = client.post("/ui/login", data={"master_key": MASTER}, headers=HTML, follow_redirects=False)
        assert answer.status_code == 303
        found = re.search(r'name="csrf" value="([^"]+)"', client.get("/ui/keys", headers=HTML).text)
        assert found is not None
        yield client, found.group(1)


class _Form(HTMLParser):
    """The fields a browser would post for the page's key form, as rendered."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}
        self._select: str | None = None
        self._textarea: str | None = None  # the field whose text is being read (a textarea, an option)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        name = a.get("name")
        if tag == "input" and name and a.get("type") not in ("submit", "button"):
            self.fields[name] = a.get("value") or ""
        elif tag == "select" and name:
            self._select = name
        elif tag == "option" and self._select is not None and "selected" in a:
            if "value" in a:
                self.fields[self._select] = a["value"] or ""
            else:  # a browser posts the option's text
                self._textarea, self.fields[self._select] = self._select, ""
        elif tag == "textarea" and name:
            self._textarea, self.fields[name] = name, ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "select":
            self._select = None
        if tag in ("textarea", "option"):
            self._textarea = None

    def handle_data(self, data: str) -> None:
        if self._textarea is not None:
            self.fields[self._textarea] += data


def _rendered_fields(client: TestClient, key_id: str) -> dict[str, str]:
    page = client.get(f"/ui/keys/{key_id}", headers=HTML)
    assert page.status_code == 200
    form = _Form()
    form.feed(page.text)
    return form.fields


def _saved_as_rendered(client: TestClient, key_id: str, **changes: str) -> dict[str, Any]:
    fields = {**_rendered_fields(client, key_id), **changes}
    answer = client.post(f"/ui/keys/{key_id}", data=fields, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    key: dict[str, Any] = client.get(f"/admin/keys/{key_id}", headers=ADMIN).json()
    return key


def test_a_key_for_no_model_stays_for_no_model_when_its_form_is_saved(ops: tuple[TestClient, str]) -> None:
    """It became a key for every model (`[]` shown as an empty field, read back as "all")."""
    client, _ = ops
    made = client.post("/admin/keys", json={"name": "n", "allowed_models": []}, headers=ADMIN).json()
    assert _saved_as_rendered(client, made["id"], name="renamed")["allowed_models"] == []
    plaintext = made["key"]
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {plaintext}"}).json()["data"] == []


def test_model_names_survive_the_form_and_the_choice_says_all_or_only_those(
    ops: tuple[TestClient, str],
) -> None:
    client, _ = ops
    made = client.post("/admin/keys", json={"name": "m", "allowed_models": ["a,b", "c"]}, headers=ADMIN)
    key_id = made.json()["id"]
    assert _saved_as_rendered(client, key_id)["allowed_models"] == ["a,b", "c"]
    single = client.patch(f"/admin/keys/{key_id}", json={"allowed_models": ["x,y"]}, headers=ADMIN)
    assert single.status_code == 200
    assert _saved_as_rendered(client, key_id)["allowed_models"] == ["x,y"]  # one name, not two
    typed = _saved_as_rendered(client, key_id, allowed_models="p, q ,r")  # typed on one line
    assert typed["allowed_models"] == ["p", "q", "r"]
    after = _saved_as_rendered(client, key_id, allowed_models="p\nq, s")  # ", s" typed after a stored line
    assert after["allowed_models"] == ["p", "q", "s"]
    typed_on = _saved_as_rendered(client, key_id, allowed_models="gpt-4o, claude\r\n")  # Enter after it
    assert typed_on["allowed_models"] == ["gpt-4o", "claude"]
    both = client.post(f"/ui/keys/{key_id}", data={**_rendered_fields(client, key_id), "model_access": "all"})
    assert both.status_code == 400 and "only the models listed" in both.text  # names and "every model"
    assert _saved_as_rendered(client, key_id, model_access="all", allowed_models="")["allowed_models"] is None
    _saved_as_rendered(client, key_id, allowed_models="p", model_access="listed")
    assert _saved_as_rendered(client, key_id, allowed_models="", model_access="all")["allowed_models"] is None
    assert _saved_as_rendered(client, key_id)["allowed_models"] is None  # every model, kept so
    listed_none = _saved_as_rendered(client, key_id, allowed_models=" \n ", model_access="listed")
    assert listed_none["allowed_models"] == []


def test_a_new_key_from_the_form_may_be_for_no_model(ops: tuple[TestClient, str]) -> None:
    client, csrf = ops
    for access, expected in (("listed", []), ("all", None)):
        data = {"csrf": csrf, "name": f"k-{access}", "model_access": access, "allowed_models": ""}
        assert client.post("/ui/keys", data=data, headers=HTML).status_code == 200
        keys = client.get("/admin/keys", headers=ADMIN).json()["data"]
        assert next(k for k in keys if k["name"] == f"k-{access}")["allowed_models"] == expected


def test_a_budget_given_back_through_the_console_restarts_its_counter(ops: tuple[TestClient, str]) -> None:
    """The console saved the key without resetting the counter: a key spent past its new budget
    until the stale counter (not charged while it had no budget) reached it."""
    client, _ = ops
    made = client.post("/admin/keys", json={"name": "b", "budget_usd": "1", "budget_period": "daily"},
                       headers=ADMIN).json()  # fmt: skip
    app = client.app
    assert isinstance(app, GatewayApp)
    store = app.services.proxy.admission.budgets
    assert isinstance(store, LocalBudgetStore)
    daily = Budget("key", made["id"], Decimal(1), "daily").counter(datetime.now(UTC))[0]
    store._spent[daily] = 810_000_000_000
    _saved_as_rendered(client, made["id"], budget_usd="")
    assert daily in store._spent
    assert _saved_as_rendered(client, made["id"], budget_usd="1", budget_period="daily")["budget_usd"] == "1"
    assert daily not in store._spent  # seeded again from the log at the next admission
    store._spent[daily] = 810_000_000_000
    _saved_as_rendered(client, made["id"], budget_usd="2")  # raised within its period: counted on
    assert store._spent[daily] == 810_000_000_000
    _saved_as_rendered(client, made["id"], budget_period="weekly")
    assert daily not in store._spent


def test_the_login_at_its_failure_limit_says_when_to_try_again(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    upgrade(url)
    settings = GatewaySettings(
        master_key=MASTER, key_secret="hmac", database_url=url, auth_failures_per_minute=2
    )
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8000") as client:
        answers = [client.post("/ui/login", data={"master_key": "wrong"}, headers=HTML) for _ in range(4)]
    assert [a.status_code for a in answers[:2]] == [401, 401] and answers[-1].status_code == 429
    assert "retry-after" not in answers[0].headers
    assert 1 <= int(answers[-1].headers["retry-after"]) <= 60


def test_a_small_budget_saved_unchanged_is_kept(ops: tuple[TestClient, str]) -> None:
    """1e-7 was shown as "1E-7", which the form's own check then refused."""
    client, _ = ops
    made = client.post("/admin/keys", json={"name": "tiny", "budget_usd": "0.0000001"}, headers=ADMIN).json()
    assert _saved_as_rendered(client, made["id"])["budget_usd"] == "0.0000001"


def test_a_key_named_before_the_name_rules_can_still_be_edited(ops: tuple[TestClient, str]) -> None:
    """A name stored before soft hyphens were refused made every save of the form a 400: the name,
    unchanged, is kept as stored; a new one is held to the rules."""
    client, _ = ops
    made = client.post("/admin/keys", json={"name": "legacy", "allowed_models": ["m"]}, headers=ADMIN).json()
    app = client.app
    assert isinstance(app, GatewayApp)

    async def rename() -> None:  # as an older release stored it
        await app.services.keys.update(made["id"], name="soft\u00adname", allowed_models=["x\u200by"])

    client.portal.call(rename)  # type: ignore[union-attr]
    saved = _saved_as_rendered(client, made["id"], rpm_limit="60")
    assert saved["rpm_limit"] == 60 and saved["name"] == "soft\u00adname"
    assert saved["allowed_models"] == ["x\u200by"]
    renamed = client.post(
        f"/ui/keys/{made['id']}", data={**_rendered_fields(client, made["id"]), "name": "new\u00ad"}
    )
    assert renamed.status_code == 400 and "control character" in renamed.text


def test_a_name_and_team_saved_unchanged_are_kept_as_stored(ops: tuple[TestClient, str]) -> None:
    """The form trimmed them on every save: " spaced team " became "spaced team", another team to
    the spend reports and the policy's `teams:`."""
    client, _ = ops
    body = {"name": "  padded  ", "team": " spaced team "}
    made = client.post("/admin/keys", json=body, headers=ADMIN).json()
    saved = _saved_as_rendered(client, made["id"], rpm_limit="60")
    assert (saved["name"], saved["team"], saved["rpm_limit"]) == ("  padded  ", " spaced team ", 60)
    renamed = _saved_as_rendered(client, made["id"], team="  ops ")  # a team typed anew is trimmed
    assert renamed["team"] == "ops" and renamed["name"] == "  padded  "
