"""GatewaySettings: the environment read once; secrets required by the commands that use them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import AliasChoices, ValidationError

from gateway.config.secrets import resolve_key_secret, resolve_secrets
from gateway.config.settings import GatewaySettings, MissingSecretsError
from gateway.main import create_app

SECRETS = ("GATEWAY_MASTER_KEY", "GATEWAY_KEY_SECRET")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GATEWAY_* or OTEL_* variable of the machine running the tests leaks in."""
    for name in [n for n in os.environ if n.startswith(("GATEWAY_", "OTEL_"))]:
        monkeypatch.delenv(name)


def test_settings_load_without_the_secrets_for_commands_that_do_not_use_them() -> None:
    settings = GatewaySettings()  # db upgrade, reports, migrations/env.py
    assert settings.master_key is None and settings.key_secret is None
    assert settings.resolved_database_url.startswith("sqlite+aiosqlite:///")
    with pytest.raises(MissingSecretsError, match="GATEWAY_MASTER_KEY, GATEWAY_KEY_SECRET must be set"):
        settings.require_secrets()
    with pytest.raises(MissingSecretsError, match=r"^GATEWAY_KEY_SECRET must be set"):
        settings.require_secrets("key_secret")


def test_serving_refuses_to_start_without_the_secrets(tmp_path: Path) -> None:
    settings = GatewaySettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}")
    with pytest.raises(MissingSecretsError, match="GATEWAY_MASTER_KEY, GATEWAY_KEY_SECRET"):
        create_app(settings)  # before any worker starts, before the database is touched
    with pytest.raises(MissingSecretsError, match="GATEWAY_KEY_SECRET"):
        resolve_key_secret(settings)  # creating a key needs the key secret
    assert not (tmp_path / "gw.db").exists()


def test_secrets_from_the_environment_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_MASTER_KEY", "m")
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    monkeypatch.setenv("GATEWAY_KEY_CACHE_TTL", "2.5")
    settings = GatewaySettings()
    settings.require_secrets()
    assert resolve_secrets(settings).master_key == "m" and resolve_secrets(settings).key_secret == b"s"
    assert settings.key_cache_ttl == 2.5


def test_key_creation_needs_only_the_key_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    settings = GatewaySettings()
    assert resolve_key_secret(settings) == b"s"
    with pytest.raises(MissingSecretsError, match=r"^GATEWAY_MASTER_KEY must be set"):
        resolve_secrets(settings)


@pytest.mark.parametrize("value", ["", "   "])
def test_a_secret_given_empty_or_blank_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GATEWAY_MASTER_KEY", value)
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    with pytest.raises(MissingSecretsError, match=r"^GATEWAY_MASTER_KEY must be set to a non-empty value"):
        GatewaySettings().require_secrets()
    with pytest.raises(MissingSecretsError, match=r"^GATEWAY_KEY_SECRET must be set to a non-empty value"):
        GatewaySettings(master_key="m", key_secret=value).require_secrets()  # type: ignore[arg-type]


def test_dev_mode_generates_missing_secrets(tmp_path: Path) -> None:
    settings = GatewaySettings(dev_mode=True, data_dir=tmp_path)
    settings.require_secrets()
    generated = resolve_secrets(settings)
    assert generated.master_key.startswith("sk-master-") and generated.key_secret
    assert resolve_key_secret(settings) == generated.key_secret  # kept, the same for every command


def test_empty_environment_values_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GATEWAY_LOG_RETENTION_DAYS", "GATEWAY_KEY_CACHE_TTL", "GATEWAY_DATABASE_URL",
                 "GATEWAY_REDIS_URL", "GATEWAY_RATE_LIMIT_FAIL_OPEN", "GATEWAY_BUDGET_FAIL_OPEN",
                 "GATEWAY_DEV_MODE", "GATEWAY_POLICY_PATH", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED"):  # fmt: skip
        monkeypatch.setenv(name, "")
    settings = GatewaySettings()
    defaults = GatewaySettings.model_construct()  # every field at its default, nothing read
    assert settings.log_retention_days is None and settings.key_cache_ttl == 5.0
    assert settings.database_url is None and settings.redis_url is None
    assert settings.rate_limit_fail_open and not settings.budget_fail_open and not settings.dev_mode
    assert settings.policy_path == defaults.policy_path == Path("policies/default.yaml")
    assert settings.traces_endpoint is None and settings.otel_service_name == "switchboard-gateway"


@pytest.mark.parametrize("value", ["0", "-1", "ninety"])
def test_log_retention_days_still_refuses_bad_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GATEWAY_LOG_RETENTION_DAYS", value)
    with pytest.raises(ValidationError, match="log_retention_days"):
        GatewaySettings()


def _documented_variables() -> set[str]:
    """The variables of docs/gateway.md's settings table (`| `NAME` | default | meaning |` rows)."""
    doc = (Path(__file__).parents[3] / "docs" / "gateway.md").read_text()
    table = doc.split("## Settings", 1)[1].split("\n## ", 1)[0]
    return {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}


def test_every_setting_is_a_row_of_the_settings_table_in_docs_gateway_md() -> None:
    variables = set()
    for name, field in GatewaySettings.model_fields.items():
        alias = field.validation_alias
        variables.add(alias.choices[0] if isinstance(alias, AliasChoices) else f"GATEWAY_{name.upper()}")
    assert variables == _documented_variables()
