"""`python -m gateway`: each command asks only for the secrets it uses, and says which are missing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import uvicorn

from gateway import cli
from gateway.migrate import upgrade

POLICY = Path("policies/default.yaml")


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A migrated SQLite database in GATEWAY_DATABASE_URL, and no other GATEWAY_* variable."""
    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    upgrade(url)
    monkeypatch.setenv("GATEWAY_DATABASE_URL", url)
    return url


class _ServerStarted(AssertionError):
    """serve got as far as starting uvicorn."""


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve fails the test instead of listening, should it get that far."""

    def started(*args: object, **kwargs: object) -> None:
        raise _ServerStarted("serve started a server without its secrets")

    monkeypatch.setattr(cli, "_CleanExitServer", started)
    monkeypatch.setattr(uvicorn, "run", started)


@pytest.mark.usefixtures("database", "no_server")
@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({}, "GATEWAY_MASTER_KEY, GATEWAY_KEY_SECRET"),
        ({"GATEWAY_MASTER_KEY": "m"}, "GATEWAY_KEY_SECRET"),
        ({"GATEWAY_MASTER_KEY": "", "GATEWAY_KEY_SECRET": "s"}, "GATEWAY_MASTER_KEY"),
    ],
)
def test_serve_refuses_to_start_without_its_secrets_and_names_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str], missing: str
) -> None:
    monkeypatch.setenv("GATEWAY_POLICY_PATH", str(POLICY))  # serve sets it for its workers: undone after
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", "--policy", str(POLICY), "--workers", "2"]) == 2
    assert f"error: {missing} must be set to a non-empty value" in capsys.readouterr().err


@pytest.mark.usefixtures("database")
def test_keys_create_needs_the_key_secret_but_not_the_master_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["keys", "create", "--name", "app"]) == 2
    assert "error: GATEWAY_KEY_SECRET must be set" in capsys.readouterr().err
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    assert cli.main(["keys", "create", "--name", "app"]) == 0
    assert json.loads(capsys.readouterr().out)["key"].startswith("sk-")


@pytest.mark.usefixtures("database")
def test_reports_and_policy_checks_run_without_the_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    report = ["report", "spend", "--from", "2026-01-01", "--to", "2026-01-31", "--format", "json"]
    assert cli.main(report) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == []
    assert cli.main(["policy", "check", str(POLICY)]) == 0
