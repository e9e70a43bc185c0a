"""Where a policy may send requests, and which secret goes with them: URL and `api_key_env` checks.

They run when the policy is parsed, so `policy check`, `serve` and a hot reload agree: a URL the
connection pool could not open (a port out of range, a broken IPv6 literal, no host) is a policy
error naming its path, never a traceback while pools are built. Credentials have one way in,
`api_key_env`: a password inside a URL would be shown wherever the URL is (logs, metrics labels,
the request log, the console), and the gateway's own secrets are never an upstream's key.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator

# the gateway's own settings (master key, key secret, database URL, ...): gateway/config/settings.py
# reads them case-insensitively, so `gateway_master_key` names the master key too; and the
# OpenTelemetry exporter's (OTEL_EXPORTER_OTLP_HEADERS carries the trace collector's token)
_OWN_PREFIXES = ("GATEWAY_", "OTEL_")


def check_upstream_url(url: str, *, query_allowed: bool = False) -> str:
    """`url` if it names an http(s) server the gateway can connect to; else ValueError saying why.

    The message never repeats a URL that holds credentials: it goes to logs and GET /admin/policy."""
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError("must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when out of 0-65535 or not a number
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None  # the text may hold user:password@
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "must not hold credentials (user:password@); put the key in the variable named by api_key_env"
        )
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"has no host: {url!r}")
    if port == 0:
        raise ValueError(f"port must be 1 to 65535: {url!r}")
    if not query_allowed and (parts.query or parts.fragment):
        raise ValueError(f"must not have a query or fragment (they would be ignored): {url!r}")
    return url


def check_key_env(name: str) -> str:
    """`name` unless it is one of the gateway's own variables, whose secret must never go upstream."""
    if name.upper().startswith(_OWN_PREFIXES):
        raise ValueError(
            f"{name!r} is one of the gateway's own settings (GATEWAY_*: master key, key secret, "
            "database URL, ...; OTEL_*: the trace exporter's); name a variable that holds only this "
            "backend's key"
        )
    return name


# an engine replica: the wire pool uses scheme, host, port and path only
ReplicaUrl = Annotated[str, AfterValidator(check_upstream_url)]
# a hosted base_url goes to the provider's SDK as it is, which may need a query (some proxies do)
BaseUrl = Annotated[str, AfterValidator(lambda url: check_upstream_url(url, query_allowed=True))]
KeyEnv = Annotated[str, AfterValidator(check_key_env)]
