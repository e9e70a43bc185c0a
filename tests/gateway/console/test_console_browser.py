"""The console in a real browser: Playwright driving Chromium against a gateway process.

Playwright cannot download its own browser here (no network but package registries), so the test
uses Debian's `chromium`, installing it with apt-get when it is missing; it skips only when no
browser can be installed at all. CONSOLE_SCREENSHOTS=<folder> keeps a screenshot of each page
(docs/console/ holds the ones docs/console.md shows).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.store.migrate import upgrade
from gateway.store.models import UsageDaily
from tests.gateway.processes import insert_rows, start_gateway

MASTER = "sk-master-browser"
ROOT = Path(__file__).resolve().parents[3]
CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def _installed() -> str | None:
    return next((c for c in CANDIDATES if Path(c).exists()), None)


def _chromium() -> str | None:
    """A Chromium binary: Debian's, installed now with apt-get if need be; None when impossible."""
    found = _installed()
    if found is not None or shutil.which("apt-get") is None or os.geteuid() != 0:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    for command in (install, ["apt-get", "update", "-q"], install):
        subprocess.run(command, env=env, capture_output=True, timeout=600, check=False)
        if _installed() is not None:
            break
    return _installed()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    binary = _chromium()
    if binary is None:
        pytest.skip("no Chromium could be installed")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=binary, args=["--disable-gpu"])
        try:
            yield chromium
        finally:
            chromium.close()


DAYS = 7


def _seed_spend(url: str, today: datetime) -> None:
    """Spend on 3 of the last 7 days, on two backends."""
    rows = [
        UsageDaily(
            day=(today - timedelta(days=back)).date(),
            key_id="seed",
            team="finance",
            requested_model="fast",
            backend=backend,
            requests=4,
            errors=0,
            prompt_tokens=400,
            completion_tokens=100,
            cached_tokens=0,
            cost_usd=Decimal(cost),
            reference_cost_usd=Decimal(0),
            reference_basis_usd=Decimal(0),
        )
        for back, backend, cost in ((0, "local", "0.0004"), (2, "openai", "0.03"), (5, "local", "0.0011"))
    ]

    insert_rows(url, rows)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("console")
    url = f"sqlite+aiosqlite:///{root / 'g.db'}"
    upgrade(url)
    _seed_spend(url, datetime.now(UTC))
    env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": url}
    server = start_gateway(ROOT / "policies" / "default.yaml", env)
    try:
        yield server.base_url
    finally:
        assert server.stop() == 0


def _shot(page: Any, name: str) -> None:
    folder = os.environ.get("CONSOLE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def _refreshes_live(page: Any, gateway: str) -> None:
    """A request made after the page loaded shows up in its figures at the next refresh."""
    cell = page.locator('[data-field="hour.requests"]')
    assert cell.inner_text() == "0"
    admin = {"Authorization": f"Bearer {MASTER}"}
    key = httpx.post(f"{gateway}/admin/keys", json={"name": "traffic"}, headers=admin, timeout=10).json()[
        "key"
    ]
    body = {"model": "auto", "messages": [{"role": "user", "content": "hello"}]}
    sent = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)  # fmt: skip
    assert sent.status_code >= 400  # no engine and no provider key here: an error, logged all the same
    for _ in range(40):
        page.clock.run_for(5_000)
        page.wait_for_timeout(250)  # the fetch itself is real
        if cell.inner_text() != "0":
            break
    assert cell.inner_text() == "1"
    assert page.locator("#backend-use tbody tr").count() >= 1


def test_an_operator_logs_in_creates_uses_and_revokes_a_key_reads_spend_and_explains_a_route(
    gateway: str, browser: Any
) -> None:  # the gateway first: Playwright's sync API keeps an event loop running in this thread
    context = browser.new_context(base_url=gateway, viewport={"width": 1366, "height": 900})
    context.clock.install()  # the overview's 5 s refresh, run on demand
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.goto("/ui")
    assert page.url.endswith("/ui/login?next=/ui")
    page.get_by_label("Master key").fill(MASTER)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/ui")
    assert page.get_by_role("heading", name="Overview", level=1).is_visible()
    # the key stayed on the server: no storage holds it, and the session cookie is not readable
    stored = page.evaluate("() => JSON.stringify([localStorage, sessionStorage, document.cookie])")
    assert MASTER not in stored and "switchboard_console" not in stored
    _shot(page, "overview")
    _refreshes_live(page, gateway)
    page.keyboard.press("Tab")  # the keyboard's first stop: past the navigation
    assert page.evaluate("() => document.activeElement.textContent") == "Skip to content"

    page.get_by_role("link", name="Keys").click()
    page.get_by_label("Name", exact=True).fill("browser-app")
    page.get_by_label("Requests per minute").fill("120")
    page.get_by_role("button", name="Create key").click()
    plaintext = page.locator("#new-key").input_value()
    assert plaintext.startswith("sk-")
    _shot(page, "keys")
    api = {"Authorization": f"Bearer {plaintext}"}
    assert httpx.get(f"{gateway}/v1/models", headers=api, timeout=10).status_code == 200
    page.get_by_role("button", name="Revoke browser-app").click()
    page.wait_for_selector("tr[data-key-id] .state-revoked")
    refused = httpx.get(f"{gateway}/v1/models", headers=api, timeout=10)
    assert refused.status_code == 401

    today = datetime.now(UTC).date()
    start = today - timedelta(days=DAYS - 1)
    page.goto(f"/ui/spend?from={start}&to={today}&by=backend")
    chart = page.locator("#spend-chart")
    assert chart.is_visible()
    assert page.locator("#spend-chart g.bar").count() == DAYS
    filled = page.locator("#spend-chart g.bar").evaluate_all(
        "bars => bars.filter(b => b.querySelectorAll('rect:not(.slot)').length > 0).length"
    )
    assert filled == 3
    groups = page.locator("#spend-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.group)")
    assert {"local", "openai"} <= set(groups)  # and the refused request's, which cost nothing
    _shot(page, "spend")

    page.get_by_role("link", name="Routing").click()
    page.get_by_label("A prompt, or a whole request body as JSON").fill(
        "Derive the closed form of the Fibonacci numbers and prove it by induction."
    )
    page.get_by_role("button", name="Explain").click()
    explanation = page.locator("#explanation").inner_text()
    assert "score " in explanation and "chain " in explanation
    _shot(page, "routing")

    page.get_by_role("link", name="Requests").click()
    assert page.locator("#request-table").is_visible()
    _shot(page, "requests")
    page.get_by_role("button", name="Log out").click()
    page.wait_for_url("**/ui/login")
    page.goto("/ui/keys")
    assert "/ui/login" in page.url  # logged out: back to the form
    context.close()
