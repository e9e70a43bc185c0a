"""Hot reload: the gateway picks up a valid policy change within 2 s and refuses a broken one."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import start_gateway

MASTER = "sk-master-reload"


class Reloadable:
    def __init__(self, root: Path) -> None:
        self.upstream = ManagedServer(
            lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60
        )
        self.policy = root / "policy.yaml"
        self.write(["first"])
        env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "s",
               "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'g.db'}"}  # fmt: skip
        self.gateway = start_gateway(self.policy, env)
        r = httpx.post(f"{self.gateway.base_url}/admin/keys", json={"name": "r"},
                       headers={"Authorization": f"Bearer {MASTER}"})  # fmt: skip
        self.key = str(r.json()["key"])

    def write(self, models: list[str], extra: str = "") -> None:
        lines = "".join(f"  {m}: {{backend: fake, model: fake-model}}\n" for m in models)
        backend = f'  fake: {{type: engine, urls: ["{self.upstream.base_url}"]}}\n'
        self.policy.write_text(f"backends:\n{backend}models:\n{lines}{extra}")

    def models(self) -> list[str]:
        r = httpx.get(f"{self.gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {self.key}"})
        return [m["id"] for m in r.json()["data"]]

    def status(self) -> dict[str, object]:
        r = httpx.get(f"{self.gateway.base_url}/admin/policy", headers={"Authorization": f"Bearer {MASTER}"})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def metric(self, name: str) -> float:
        for line in httpx.get(
            f"{self.gateway.base_url}/metrics", headers={"Authorization": f"Bearer {MASTER}"}
        ).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Reloadable]:
    s = Reloadable(tmp_path)
    try:
        yield s
    finally:
        s.gateway.stop()
        s.upstream.stop()


def _within(seconds: float, check: object) -> float:
    start = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_valid_change_applies_within_two_seconds_and_an_invalid_one_is_refused(stack: Reloadable) -> None:
    before = stack.status()
    assert stack.models() == ["first"] and before["last_error"] is None
    stack.write(["first", "second"])
    _within(2.0, lambda: stack.models() == ["first", "second"])
    applied = stack.status()
    assert applied["version"] != before["version"] and applied["last_error"] is None
    assert stack.metric("gateway_policy_reloads_total") == 1

    tiers = ("routes:\n  auto:\n    tiers:\n      - {name: a, threshold: 0, candidates: [first]}\n"
             "      - {name: b, threshold: 1.5, candidates: [second]}\n")  # fmt: skip
    stack.write(["first", "second"], tiers)
    _within(2.0, lambda: stack.status()["last_error"] is not None)
    refused = stack.status()
    assert "routes.auto.tiers[1].threshold: must be between 0 and 1" in str(refused["last_error"])
    assert refused["version"] == applied["version"]  # still serving the last valid policy
    assert stack.metric("gateway_policy_reload_failures_total") == 1
    r = httpx.post(f"{stack.gateway.base_url}/v1/chat/completions",
                   json={"model": "second", "messages": [{"role": "user", "content": "still here"}]},
                   headers={"Authorization": f"Bearer {stack.key}"})  # fmt: skip
    assert r.status_code == 200 and "still here" in r.text


def test_requests_in_flight_finish_on_the_policy_they_started_with(stack: Reloadable) -> None:
    httpx.post(f"{stack.upstream.base_url}/control", json={"latency_ms": 1500})
    try:
        with httpx.Client(timeout=30) as client:
            result: dict[str, int] = {}

            def call() -> None:
                r = client.post(f"{stack.gateway.base_url}/v1/chat/completions",
                                json={"model": "first", "messages": [{"role": "user", "content": "slow"}]},
                                headers={"Authorization": f"Bearer {stack.key}"})  # fmt: skip
                result["status"] = r.status_code

            thread = threading.Thread(target=call)
            thread.start()
            time.sleep(0.3)
            stack.write(["renamed"])  # `first` disappears while its request is in flight
            _within(2.0, lambda: stack.models() == ["renamed"])
            thread.join(10)
        assert result["status"] == 200
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"latency_ms": 0})


def test_admin_policy_needs_the_master_key(stack: Reloadable) -> None:
    r = httpx.get(f"{stack.gateway.base_url}/admin/policy", headers={"Authorization": f"Bearer {stack.key}"})
    assert r.status_code == 403
    assert "fake" in stack.status()["backends"]  # type: ignore[operator]
