"""GatewaySettings: the gateway's configuration, read from the environment (GATEWAY_*, OTEL_*) only here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/switchboard, else ~/.local/share/switchboard."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "switchboard"


class MissingSecretsError(ValueError):
    """A command that needs the master key or the key secret runs without them outside dev mode."""


class GatewaySettings(BaseSettings):
    """Every gateway option; `GATEWAY_<NAME>` environment variables set them.

    An empty variable counts as unset (compose passes `${VAR:-}` for options left out), so an
    optional setting takes its default and a secret given as "" is refused by `require_secrets`.
    """

    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_", extra="ignore", frozen=True, env_ignore_empty=True
    )

    # The two secrets are checked by the commands that use them (serve, keys create), not here:
    # `db upgrade`, reports and policy checks run without them.
    master_key: SecretStr | None = None  # admin API credential; serving needs it unless dev_mode
    key_secret: SecretStr | None = None  # HMAC secret for virtual-key hashes; serving and key creation
    dev_mode: bool = False  # generated secrets, automatic migrations: never in production
    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str | None = None  # default: SQLite file in data_dir
    redis_url: str | None = None  # shared rate-limit counters for several replicas (else in-process)
    rate_limit_fail_open: bool = True  # Redis unreachable: admit (True) or answer 503 (False)
    log_retention_days: float | None = Field(default=None, gt=0)  # raw request-log rows; aggregates stay
    budget_fail_open: bool = False  # Redis unreachable: budgets answer 503 (False) or admit (True)
    policy_path: Path = Path("policies/default.yaml")
    key_cache_ttl: float = Field(default=5.0, ge=0.0, le=60.0)  # seconds a looked-up key may be reused
    # OpenTelemetry's own variable names (no GATEWAY_ prefix): traces are exported only when one is set
    otlp_endpoint: str | None = Field(
        default=None, validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT", "otlp_endpoint")
    )
    otlp_traces_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "otlp_traces_endpoint"),
    )
    otel_service_name: str = Field(
        default="switchboard-gateway", validation_alias=AliasChoices("OTEL_SERVICE_NAME", "otel_service_name")
    )
    otel_sdk_disabled: bool = Field(
        default=False, validation_alias=AliasChoices("OTEL_SDK_DISABLED", "otel_sdk_disabled")
    )

    def require_secrets(self, *names: Literal["master_key", "key_secret"]) -> None:
        """MissingSecretsError unless each named secret (default: both) is set and not blank, or dev_mode."""
        if self.dev_mode:
            return
        missing = [n for n in names or ("master_key", "key_secret") if not _given(getattr(self, n))]
        if missing:
            listed = ", ".join(f"GATEWAY_{n.upper()}" for n in missing)
            raise MissingSecretsError(
                f"{listed} must be set to a non-empty value (or GATEWAY_DEV_MODE=1 for local development)"
            )

    @property
    def resolved_database_url(self) -> str:
        """The configured URL, else a SQLite file in the data directory."""
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'gateway.db'}"

    @property
    def traces_endpoint(self) -> str | None:
        """Where OTLP/HTTP traces go (None: tracing off): the traces URL, else the base URL + /v1/traces."""
        if self.otel_sdk_disabled:
            return None
        if self.otlp_traces_endpoint:
            return self.otlp_traces_endpoint
        if self.otlp_endpoint:
            return self.otlp_endpoint.rstrip("/") + "/v1/traces"
        return None


def _given(secret: SecretStr | None) -> bool:
    return secret is not None and bool(secret.get_secret_value().strip())
