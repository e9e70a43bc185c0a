"""Which proxies the gateway believes about the client's address (GATEWAY_FORWARDED_ALLOW_IPS)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from gateway.config.settings import GatewaySettings
from tests.gateway.processes import start_gateway


def _statuses(base_url: str, forwarded_for: list[str]) -> list[int]:
    """A wrong key from each address in turn (as a proxy in front would name it)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    return [
        httpx.post(f"{base_url}/v1/chat/completions", json=body,
                   headers={"Authorization": "Bearer sk-wrong", "X-Forwarded-For": address}).status_code
        for address in forwarded_for
    ]  # fmt: skip


@pytest.mark.parametrize(("allowed", "trusted"), [(None, True), ("10.9.9.9, 192.168.0.0/16", False)])
def test_failed_authentications_are_counted_per_forwarded_address_only_from_trusted_proxies(
    tmp_path: Path, allowed: str | None, trusted: bool
) -> None:
    """Two failures allowed per address: a trusted proxy's X-Forwarded-For names three clients (each
    may fail twice); an untrusted one's is ignored, and every failure counts against the sender."""
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", "GATEWAY_AUTH_FAILURES_PER_MINUTE": "2",
           "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"}  # fmt: skip
    if allowed is not None:
        env["GATEWAY_FORWARDED_ALLOW_IPS"] = allowed
    gateway = start_gateway(Path("policies/default.yaml"), env)
    try:
        statuses = _statuses(gateway.base_url, ["203.0.113.1", "203.0.113.1", "203.0.113.2", "203.0.113.3"])
    finally:
        gateway.stop()
    assert statuses == ([401] * 4 if trusted else [401, 401, 429, 429])


def test_forwarded_allow_ips_takes_addresses_ranges_or_a_star_and_refuses_anything_else() -> None:
    ok = GatewaySettings(forwarded_allow_ips=" 10.0.0.1, 10.1.0.0/16 ,::1,")
    assert ok.forwarded_allow_ips == "10.0.0.1,10.1.0.0/16,::1"
    assert GatewaySettings(forwarded_allow_ips="*").forwarded_allow_ips == "*"
    for bad in ("proxy.internal", "10.0.0.300", "10.0.0.0/40"):
        with pytest.raises(ValidationError, match="not an IP address"):
            GatewaySettings(forwarded_allow_ips=bad)
