"""Spend reports read the daily aggregates; their totals equal the sum of the raw request rows."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from gateway.config.settings import GatewaySettings
from gateway.main import create_app
from gateway.store.db import create_db
from gateway.store.migrate import upgrade
from gateway.store.models import PICO
from gateway.store.report_html import html_report
from gateway.store.reports import SpendRow, render, spend
from gateway.store.request_log import RequestLogWriter
from tests.gateway.processes import read_log_rows


def _rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(60):
        self_hosted = i % 3 != 0
        rows.append({
            "id": f"r{i}", "created_at": datetime(2026, 11, 20 + i % 3, 12, i % 60, tzinfo=UTC),
            "status": 200 if i % 7 else 500, "key_id": f"k{i % 4}", "team": "red" if i % 2 else "blue",
            "requested_model": "auto" if i % 5 else "gpt", "backend": "pool" if self_hosted else "openai",
            "prompt_tokens": 100 + i, "completion_tokens": 10 + i % 9, "cached_tokens": i % 4,
            "cost_picousd": Decimal("0.000123456789") * (i + 1),
            "reference_cost_picousd": Decimal("0.002") * (i + 1) if self_hosted else None,
        })  # fmt: skip
    return rows


def _write(url: str, rows: list[dict[str, object]] | None = None) -> None:
    """The rows (default `_rows()`) through the request-log writer, in batches of 17."""
    upgrade(url)

    async def run() -> None:
        db = create_db(url)
        writer = RequestLogWriter(db, CollectorRegistry(), batch_size=17, interval=0.05)
        writer.start()
        for row in _rows() if rows is None else rows:
            writer.queue(row)
        await writer.stop()
        await db.dispose()

    asyncio.run(run())


@pytest.mark.parametrize("by", ["key", "team", "model", "backend", "day"])
def test_report_totals_equal_the_raw_rows(database_url: str, by: str) -> None:
    _write(database_url)

    async def run() -> list:  # type: ignore[type-arg]
        db = create_db(database_url)
        try:
            return await spend(db, date(2026, 11, 1), date(2026, 11, 30), by)  # type: ignore[arg-type]
        finally:
            await db.dispose()

    report = asyncio.run(run())
    raw = read_log_rows(database_url)
    assert sum(r.requests for r in report) == len(raw) == 60
    assert sum(r.errors for r in report) == sum(1 for r in raw if r["status"] != 200)
    assert sum(r.prompt_tokens for r in report) == sum(r["prompt_tokens"] for r in raw)
    assert (
        sum((r.cost_usd for r in report), Decimal(0))
        == Decimal(sum(int(r["cost_picousd"]) for r in raw)) / PICO
    )
    want_savings = sum(
        (Decimal(int(r["reference_cost_picousd"]) - int(r["cost_picousd"])) / PICO
         for r in raw if r["reference_cost_picousd"] is not None), Decimal(0),
    )  # fmt: skip
    assert sum((r.savings_usd for r in report), Decimal(0)) == want_savings
    if by == "day":
        assert [r.group for r in report] == ["2026-11-20", "2026-11-21", "2026-11-22"]


def test_a_range_selects_whole_days_and_formats_agree(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    _write(url)

    async def run() -> list:  # type: ignore[type-arg]
        db = create_db(url)
        try:
            return await spend(db, date(2026, 11, 21), date(2026, 11, 21), "team")
        finally:
            await db.dispose()

    report = asyncio.run(run())
    assert sum(r.requests for r in report) == 20  # one day of three
    as_json = json.loads(render(report, "json", "team"))
    assert as_json["total"]["requests"] == 20 and Decimal(as_json["total"]["cost_usd"]) == sum(
        (r.cost_usd for r in report), Decimal(0)
    )
    as_csv = render(report, "csv", "team").splitlines()
    assert as_csv[0].startswith("group,label,requests") and len(as_csv) == 1 + len(report)
    assert "total" in render(report, "table", "team")


def test_report_cli_and_admin_endpoint(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    _write(url)
    env = dict(os.environ, GATEWAY_MASTER_KEY="m", GATEWAY_KEY_SECRET="s", GATEWAY_DATABASE_URL=url)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "report", "spend", "--from", "2026-11-01", "--to", "2026-11-30",
         "--by", "backend", "--format", "json"], env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert {r["group"] for r in json.loads(done.stdout)["rows"]} == {"pool", "openai"}
    settings = GatewaySettings(master_key="m", key_secret="s", database_url=url)  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as client:
        month = {"from": "2026-11-01", "to": "2026-11-30", "by": "day", "format": "csv"}
        r = client.get("/admin/reports/spend", params=month, headers={"Authorization": "Bearer m"})
        assert (
            r.status_code == 200 and r.text.count("\n") == 4
        )  # header and 3 days (no total to double-count)
        bad = client.get("/admin/reports/spend", params={"from": "2026-11-30", "to": "2026-11-01"},
                         headers={"Authorization": "Bearer m"})  # fmt: skip
        assert bad.status_code == 400 and "before it starts" in bad.json()["error"]["message"]
        for day in ("20261128", "1764288000", "2026-11-28T00:00"):  # what the CLI refuses too
            odd = client.get("/admin/reports/spend", params={"from": day, "to": "2026-11-30"},
                             headers={"Authorization": "Bearer m"})  # fmt: skip
            error = odd.json()["error"]
            assert odd.status_code == 400 and error["param"] == "from", odd.text  # the client's name
            assert "must be a day as YYYY-MM-DD" in error["message"] and "Value error" not in error["message"]
        assert (
            client.get("/admin/reports/spend", params={"from": "2026-11-01", "to": "2026-11-02"}).status_code
            == 401
        )


def test_html_report_is_one_self_contained_file_with_its_charts(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    _write(url)
    policy = tmp_path / "p.yaml"
    pool = '  pool: {type: engine, urls: ["http://127.0.0.1:1"]}\n'
    policy.write_text(
        f"backends:\n{pool}  openai: {{type: hosted, model: openai/x}}\nmodels:\n  m: {{backend: pool}}\n"
    )
    env = dict(os.environ, GATEWAY_MASTER_KEY="m", GATEWAY_KEY_SECRET="s", GATEWAY_DATABASE_URL=url)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "report", "spend", "--from", "2026-11-20", "--to", "2026-11-22",
         "--format", "html", "--policy", str(policy)], env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    html = done.stdout
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 5
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    for heading in ("Daily spend by backend", "Top keys", "Top teams", "self-hosted vs frontier",
                    "actual cost vs the reference model"):  # fmt: skip
        assert heading in html
    raw = read_log_rows(url)
    own = sum(r["prompt_tokens"] + r["completion_tokens"] for r in raw if r["backend"] == "pool")
    whole = sum(r["prompt_tokens"] + r["completion_tokens"] for r in raw)
    assert f"{100 * own / whole:.1f}%" in html
    total = Decimal(sum(int(r["cost_picousd"]) for r in raw)) / PICO
    assert f"${total:,.4f}" in html


def test_html_report_over_a_long_range_draws_no_chart_day_by_day(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    _write(url)

    async def run(start: date, end: date) -> str:
        db = create_db(url)
        try:
            return await html_report(db, start, end, frozenset({"pool"}))
        finally:
            await db.dispose()

    # 0001-01-01..9999-12-31 drew 3.65M days: an 817 MB file, built in 2.5 GB of memory
    decades = asyncio.run(run(date(2000, 1, 1), date(2026, 12, 31)))
    assert "No daily chart over more than 366 days" in decades and decades.count("<rect") < 100
    total = Decimal(sum(int(r["cost_picousd"]) for r in read_log_rows(url))) / PICO
    assert f"${total:,.4f}" in decades  # the figures are all there
    year = asyncio.run(run(date(2026, 1, 1), date(2026, 12, 31)))  # 365 days: still drawn
    assert "No daily chart" not in year and year.count("<rect") > 365


def test_names_no_model_has_are_one_group_in_the_aggregates(database_url: str) -> None:
    rows = [
        {"id": f"u{i}", "created_at": datetime(2026, 11, 20, 12, tzinfo=UTC), "status": 404, "key_id": "k1",
         "requested_model": f"=bogus-{i}", "error_type": "model_not_found"}
        for i in range(30)
    ] + [{"id": "ok", "created_at": datetime(2026, 11, 20, 12, tzinfo=UTC), "status": 200, "key_id": "k1",
          "requested_model": "fast", "backend": "pool", "prompt_tokens": 5, "completion_tokens": 2,
          "cost_picousd": Decimal(7)}]  # fmt: skip

    _write(database_url, rows)

    async def run() -> list:  # type: ignore[type-arg]
        db = create_db(database_url)
        try:
            return await spend(db, date(2026, 11, 20), date(2026, 11, 20), "model")
        finally:
            await db.dispose()

    report = asyncio.run(run())
    assert {(r.group, r.requests, r.errors) for r in report} == {("(unknown model)", 30, 30), ("fast", 1, 0)}
    logged = {r["id"]: r["requested_model"] for r in read_log_rows(database_url)}
    assert logged["u3"] == "=bogus-3"  # the request log keeps what the client asked for


def test_a_team_named_none_is_not_the_requests_without_a_team(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    day = datetime(2026, 11, 20, 12, tzinfo=UTC)
    base = {"created_at": day, "status": 200, "cost_picousd": Decimal(5)}
    _write(url, [
        {**base, "id": "a", "key_id": "k1", "team": "(none)"},
        {**base, "id": "b", "key_id": "k2"},
        {**base, "id": "c", "key_id": "k2", "team": ""},
    ])  # fmt: skip

    async def run() -> list[SpendRow]:
        db = create_db(url)
        try:
            return await spend(db, date(2026, 11, 20), date(2026, 11, 20), "team")
        finally:
            await db.dispose()

    report = asyncio.run(run())
    assert {(r.group, r.label, r.requests) for r in report} == {("(none)", "(none)", 1), ("", "(none)", 2)}
    groups = {r["group"]: r["requests"] for r in json.loads(render(report, "json", "team"))["rows"]}
    assert groups == {"(none)": 1, "": 2}


def _row(label: str, cost: str) -> SpendRow:
    return SpendRow(label, label, 1, 0, 10, 5, 0, Decimal(cost), Decimal(0), Decimal(0))


def test_the_table_shows_names_with_no_control_character_a_terminal_would_act_on() -> None:
    hostile = [
        "\x1b]0;owned\x07",
        "\x1b[31mred",
        "a\r\nforged 9",
        "\x9b2J",
        "\u202egnp.exe",
        "\u2028x",
        "x\\x1b",
    ]
    table = render([_row(name, "1") for name in hostile], "table", "key")
    assert not [c for c in table if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F)]
    assert "\u202e" not in table and "\u2028" not in table and len(table.splitlines()) == 3 + len(hostile)
    for shown in (
        "\\x1b]0;owned\\x07",
        "\\x1b[31mred",
        "a\\x0d\\x0aforged 9",
        "\\x9b2J",
        "\\u202egnp",
        "\\u2028x",
    ):
        assert shown in table, shown
    assert "x\\\\x1b" in table  # a name's own backslash is doubled: no forged escape either
    assert "caf\u00e9 team" in render([_row("caf\u00e9 team", "1")], "table", "team")


def test_the_table_shows_every_amount_exactly_so_the_rows_add_up_to_the_total() -> None:
    rows = [_row("a", "0.00000074"), _row("b", "0.00000074"), _row("c", "1.5")]
    lines = render(rows, "table", "key").splitlines()[2:]
    costs = [Decimal(line.split()[-2]) for line in lines]
    assert costs == [Decimal("0.00000074"), Decimal("0.00000074"), Decimal("1.5"), Decimal("1.50000148")]
    assert sum(costs[:-1]) == costs[-1]
    assert len({len(line) for line in lines}) == 1  # aligned: every amount has the same decimals
    cents = render([_row("a", "2"), _row("b", "0.25")], "table", "key").splitlines()
    assert cents[-1].split()[-2] == "2.25"  # at least cents, no more than needed
