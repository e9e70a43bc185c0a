"""GatewaySettings: the gateway's configuration, read from the environment (GATEWAY_*, OTEL_*) only here."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# the longest a console login may last, whatever GATEWAY_CONSOLE_SESSION_TTL says (a logout is kept as long)
CONSOLE_SESSION_MAX_TTL = 30 * 86400


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
    # request-log rows waiting for the database are held in memory up to this many, then spilled to
    # the spool (a folder of JSON-lines files, default data_dir/request-log-spool) up to its size;
    # a spool size of 0 turns the spool off (rows past the memory bound are then dropped)
    log_queue_max_rows: int = Field(default=50_000, ge=1)
    log_flush_seconds: float = Field(default=0.5, ge=0.01, le=60.0)  # how long a row may wait for its batch
    log_spool_dir: Path | None = None
    log_spool_max_bytes: int = Field(default=1 << 30, ge=0)
    budget_fail_open: bool = False  # Redis unreachable: budgets answer 503 (False) or admit (True)
    policy_path: Path = Path("policies/default.yaml")
    key_cache_ttl: float = Field(default=5.0, ge=0.0, le=60.0)  # seconds a looked-up key may be reused
    key_cache_size: int = Field(default=100_000, ge=1)  # keys cached per replica (least recently used go)
    key_miss_cache_size: int = Field(default=50_000, ge=0)  # unknown keys remembered per replica (LRU)
    key_miss_cache_ttl: float = Field(default=60.0, ge=0.0, le=3600.0)  # seconds an unknown key stays unknown
    auth_failures_per_minute: int = Field(default=30, ge=0)  # per client address and replica; 0: no limit
    redis_max_connections: int = Field(default=512, ge=1)  # per Redis client (limiter, budgets) and replica
    redis_pool_timeout: float = Field(default=5.0, gt=0.0, le=60.0)  # seconds to wait for a free connection
    redis_socket_timeout: float = Field(default=5.0, gt=0.0, le=60.0)  # seconds per Redis command or connect
    # the web console (/ui): how long a login lasts, and whether its cookie is marked Secure (auto:
    # when the request reached the gateway over https; behind a TLS-terminating proxy: always)
    console_session_ttl: int = Field(default=8 * 3600, ge=60, le=CONSOLE_SESSION_MAX_TTL)
    console_cookie_secure: Literal["auto", "always"] = "auto"
    # Who may read /metrics besides the master key (Prometheus gets this, not the master key)
    metrics_token: SecretStr | None = None
    # HTTP limits (docs/gateway.md "Limits"); refusals are 413/431/408/503 in OpenAI's error format
    max_body_bytes: int = Field(default=8 << 20, ge=1 << 10)  # completion routes' request body
    max_admin_body_bytes: int = Field(default=64 << 10, ge=1 << 10)  # every other route's body
    max_header_bytes: int = Field(default=32 << 10, ge=4 << 10)  # request line and headers
    header_timeout: float = Field(default=10.0, gt=0.0)  # seconds to send a request's headers
    body_timeout: float = Field(default=30.0, gt=0.0)  # seconds to send its body once the headers are in
    limit_concurrency: int = Field(default=1000, ge=1)  # connections or requests per process; then 503
    keep_alive_timeout: int = Field(default=5, ge=1)  # seconds an idle kept-alive connection stays open
    backlog: int = Field(default=2048, ge=1)  # connections the kernel queues before accept
    # seconds a stopping gateway (SIGTERM) lets requests in flight finish; then they are cancelled
    # (logged, their reservations released) so that it exits: a stream to a client that stopped
    # reading, or a long one, held it up for good, past any orchestrator's grace period
    shutdown_timeout: int = Field(default=30, ge=1, le=3600)
    # the proxies whose X-Forwarded-For / -Proto are believed (comma-separated addresses or CIDR
    # ranges, or *): the client address the failed-auth and login limits count is the one they name
    forwarded_allow_ips: str = "127.0.0.1"
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

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxies(cls, value: str) -> str:
        """Addresses or CIDR ranges, comma-separated, or `*` (a typo would trust nobody, silently)."""
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        for entry in entries:
            if entry != "*":
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    raise ValueError(f"{entry!r} is not an IP address, a CIDR range or *") from None
        return ",".join(entries)

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
        """The configured URL, else a SQLite file in the data directory; a URL of another driver is a
        ValueError that says which to use (it was SQLAlchemy's traceback, or a missing module's)."""
        url = self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'gateway.db'}"
        if not url.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError(
                "GATEWAY_DATABASE_URL must be sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB "
                f"(the async drivers the gateway uses), not {url.partition(':')[0] or 'that'}:..."
            )
        return url

    @property
    def resolved_log_spool_dir(self) -> Path:
        """Where request-log rows wait while the database is away (one subfolder per database)."""
        return self.log_spool_dir or self.data_dir / "request-log-spool"

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
