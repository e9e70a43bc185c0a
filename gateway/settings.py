"""GatewaySettings: the gateway's configuration, read from the environment (GATEWAY_*, OTEL_*) only here."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/switchboard, else ~/.local/share/switchboard."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "switchboard"


class GatewaySettings(BaseSettings):
    """Every gateway option; `GATEWAY_<NAME>` environment variables set them."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore", frozen=True)

    master_key: SecretStr | None = None  # admin API credential; required unless dev_mode
    key_secret: SecretStr | None = None  # HMAC secret for virtual-key hashes; required unless dev_mode
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

    @model_validator(mode="after")
    def _secrets_outside_dev_mode(self) -> GatewaySettings:
        if self.dev_mode:
            return self
        missing = [n for n in ("master_key", "key_secret") if getattr(self, n) is None]
        if missing:
            names = ", ".join(f"GATEWAY_{n.upper()}" for n in missing)
            raise ValueError(f"{names} must be set (or GATEWAY_DEV_MODE=1 for local development)")
        return self

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
