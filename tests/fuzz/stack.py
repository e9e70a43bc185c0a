"""A gateway subprocess in front of the hostile upstream (as an engine and as a hosted backend).

Shared by tests/gateway/pipeline/test_hostile_upstream.py and the fuzz run: the policy, the keys, reading
the request log and the gateway's resident memory.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import read_log_rows, start_gateway

MASTER = "sk-master-hostile"
PROVIDER_KEY = "sk-provider-secret-hostile"
ENGINE_KEY = "engine-pool-secret-hostile"  # the engine pool's key (no sk- prefix: masked as itself)
# Prices that make a reservation worth noticing: max_tokens=4000 reserves $0.008 of a $0.02 budget,
# so three requests whose reservations leaked would lock the key out.
PRICE = "{input_per_mtok: 1.0, output_per_mtok: 2.0}"


def hostile_server() -> ManagedServer:
    """tests/fakes/hostile_upstream.py in a subprocess on a free port."""
    return ManagedServer(
        lambda port: [sys.executable, "tests/fakes/hostile_upstream.py", "--port", str(port)], 60
    )


class HostileStack:
    """The hostile upstream, an "attacker" server that must never be called, and a gateway.

    Models: `eng` (engine backend on the hostile upstream) and `host` (hosted backend through
    litellm's openai/ provider with base_url on the hostile upstream and a provider key). The
    breaker never opens and nothing retries, so each request meets exactly the misbehaviour it asked
    for. Timeouts: first token 5 s, total 6 s.
    """

    def __init__(self, root: Path, database_url: str | None = None, total_timeout: float = 6.0) -> None:
        self.upstream = hostile_server()
        self.attacker = hostile_server()
        # first token 5 s: ~100 pathological requests at once on 2 busy cores kept a hosted 500 from
        # being read within 3 s once (a 504 where the test asserts the 500's 502)
        first_token = min(5.0, total_timeout)
        timeouts = f"{{connect: 1, first_token: {first_token:g}, total: {total_timeout:g}}}"
        self.policy = root / "policy.yaml"
        self.policy.write_text(f"""
backends:
  engine: {{type: engine, urls: ["{self.upstream.base_url}"], timeouts: {timeouts}, price: {PRICE},
           api_key_env: HOSTILE_ENGINE_KEY}}
  hosted: {{type: hosted, model: openai/fake-model, api_key_env: HOSTILE_PROVIDER_KEY,
           base_url: "{self.upstream.base_url}/v1", timeouts: {timeouts}, price: {PRICE}}}
models:
  eng: {{backend: engine, model: fake-model}}
  host: {{backend: hosted}}
health:
  interval: 0.5
  breaker: {{consecutive_failures: 1000000, error_rate: 1.0, min_requests: 1000000, cooldown: 0.1}}
""")  # fmt: skip
        self.database_url = database_url or f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        env = {
            "GATEWAY_MASTER_KEY": MASTER,
            "GATEWAY_KEY_SECRET": "hostile-secret",
            "GATEWAY_DATABASE_URL": self.database_url,
            "HOSTILE_PROVIDER_KEY": PROVIDER_KEY,
            "HOSTILE_ENGINE_KEY": ENGINE_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        try:
            self.gateway = start_gateway(self.policy, env)
        except BaseException:
            self.upstream.stop()
            self.attacker.stop()
            raise
        self.url = self.gateway.base_url
        self.key = self.create_key(name="hostile")

    def create_key(self, **body: Any) -> str:
        """A new virtual key (admin API); returns its plaintext."""
        r = httpx.post(f"{self.url}/admin/keys", json=body, headers={"Authorization": f"Bearer {MASTER}"})
        r.raise_for_status()
        return str(r.json()["key"])

    def received(self, server: ManagedServer | None = None) -> list[dict[str, Any]]:
        """The completion requests a fake received (method, path, headers, body)."""
        stats = httpx.get(f"{(server or self.upstream).base_url}/stats", timeout=10).json()
        return list(stats["requests"])

    def log_rows(self) -> list[dict[str, Any]]:
        """Every request-log row."""
        return read_log_rows(self.database_url)

    def rows_for(self, ids: set[str], timeout: float = 20.0) -> dict[str, dict[str, Any]]:
        """The rows of these request ids, once all are written (the writer batches every 0.05 s here)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = {r["id"]: r for r in self.log_rows() if r["id"] in ids}
            if len(rows) == len(ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)

    def rss_kib(self) -> int:
        """The gateway process's resident memory (VmRSS), in KiB."""
        for line in Path(f"/proc/{self.gateway.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    def close(self) -> int:
        """Stop the gateway (its exit code: 0 once the log is flushed), then the fakes."""
        try:
            return self.gateway.stop()
        finally:
            self.upstream.stop()
            self.attacker.stop()
