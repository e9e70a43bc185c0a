"""Who may read /metrics: the metrics token (GATEWAY_METRICS_TOKEN, what Prometheus sends) or the master key.

The metrics name keys, teams, models and backends, and their spend: not for every client.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.api.services import ServicesDep
from gateway.governance.keys import AuthError


async def require_metrics_reader(request: Request, services: ServicesDep) -> None:
    """Dependency: `Authorization: Bearer <metrics token or master key>`, compared in constant time."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not presented:
        raise AuthError(
            401,
            "Missing credentials: send 'Authorization: Bearer <metrics token or master key>'",
            "missing_api_key",
        )
    keys = services.keys
    client = (request.client.host, request.client.port) if request.client else None
    keys.refuse_if_blocked(client)  # the master key is accepted here too: no faster guessing through /metrics
    metrics_token = services.settings.metrics_token
    accepted = [services.secrets.master_key.encode()]
    if metrics_token is not None and metrics_token.get_secret_value().strip():
        accepted.append(metrics_token.get_secret_value().strip().encode())
    # every candidate is compared: the time taken does not say which one nearly matched
    matches = [hmac.compare_digest(presented, secret) for secret in accepted]
    if not any(matches):
        keys.failed(client, "a wrong metrics token")
        raise AuthError(403, "/metrics needs the metrics token or the master key", "not_metrics_reader")
