"""Prefix affinity: a prefix's requests keep to one replica, under bounded load; a replica leaving
moves only its keys; unhealthy and saturated replicas are passed over; end to end through the
gateway in front of two replicas."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import httpx

from gateway.backends.affinity import AffinityRing, prefix_key
from gateway.backends.health import Replica
from gateway.config.policy import HealthSettings
from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import create_key_cli, start_gateway

URLS = [f"http://10.0.0.{i}:8001" for i in range(1, 5)]
SYSTEM = "You are a support agent for ACME. " * 40


def _replicas(urls: list[str] = URLS) -> list[Replica]:
    return [Replica(u, HealthSettings(max_queue_depth=4)) for u in urls]


def _chat(system: str, question: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_the_key_is_the_leading_messages_or_a_lone_prompts_whole_blocks() -> None:
    assert prefix_key(_chat(SYSTEM, "where is my order?")) == prefix_key(_chat(SYSTEM, "refund please"))
    assert prefix_key(_chat(SYSTEM, "q")) != prefix_key(_chat(SYSTEM + " Be brief.", "q"))
    shared = "x" * 640
    assert prefix_key({"prompt": shared + "first question"}) == prefix_key({"prompt": shared + "other"})
    assert prefix_key({"messages": [{"role": "user", "content": shared + "a"}]}) == prefix_key(
        {"messages": [{"role": "user", "content": shared + "bb"}]}
    )
    assert prefix_key({"prompt": "short"}) is None and prefix_key({"messages": []}) is None
    ids = list(range(100))
    assert prefix_key({"prompt": ids + [7]}) == prefix_key({"prompt": ids + [8, 9]})  # 96 = 6 whole blocks
    batched = prefix_key({"prompt": [ids, [1]]})
    assert batched == prefix_key({"prompt": [ids]}) != prefix_key({"prompt": [5] * 32})
    assert prefix_key({"prompt": [3] * 10}) is None and prefix_key({"prompt": [{"x": 1}]}) is None


def test_requests_sharing_a_prefix_go_to_one_replica() -> None:
    ring, replicas = AffinityRing(URLS), _replicas()
    key = prefix_key(_chat(SYSTEM, "q"))
    assert key is not None
    chosen = {ring.choose(key, replicas, frozenset(), 1.25)[0].url for _ in range(20)}  # type: ignore[union-attr]
    assert len(chosen) == 1
    homes = {ring.order(random.Random(i).getrandbits(64))[0] for i in range(400)}
    assert homes == set(URLS)  # and different prefixes spread over every replica


def test_load_stays_bounded_when_one_prefix_is_hot() -> None:
    ring, replicas = AffinityRing(URLS), _replicas()
    key = random.Random(1).getrandbits(64)
    hits = 0
    for _ in range(200):  # one hot prefix, nothing finishes: its home fills to the bound, then spills
        replica, home = ring.choose(key, replicas, frozenset(), 1.25)
        assert replica is not None
        replica.in_flight += 1
        hits += home
        assert max(r.in_flight for r in replicas) <= -(-1.25 * sum(r.in_flight for r in replicas) // 4) + 1
    assert 40 < hits < 200 and min(r.in_flight for r in replicas) > 0


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    four, three = AffinityRing(URLS), AffinityRing(URLS[:3])
    keys = [random.Random(i).getrandbits(64) for i in range(1000)]
    moved = [k for k in keys if four.order(k)[0] != three.order(k)[0]]
    assert moved and all(four.order(k)[0] == URLS[3] for k in moved)


def test_unhealthy_saturated_and_avoided_replicas_are_passed_over() -> None:
    ring, replicas = AffinityRing(URLS), _replicas()
    key = random.Random(2).getrandbits(64)
    order = ring.order(key)
    by_url = {r.url: r for r in replicas}
    by_url[order[0]].check_ok = False  # failed its health check
    by_url[order[1]].queue_depth = 10  # over max_queue_depth
    chosen, home = ring.choose(key, replicas, frozenset({order[2]}), 1.25)
    assert chosen is not None and chosen.url == order[3] and not home


def test_through_the_gateway_a_prefixs_requests_keep_to_one_replica(tmp_path: Path) -> None:
    fakes = [ManagedServer(lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port)])
             for _ in range(2)]  # fmt: skip
    gateway = None
    try:
        urls = ", ".join(f'"{f.base_url}"' for f in fakes)
        policy = tmp_path / "policy.yaml"
        policy.write_text(f"backends:\n  pool: {{type: engine, urls: [{urls}], balance: prefix_affinity}}\n"
                          "models:\n  fast: {backend: pool}\n")  # fmt: skip
        env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s",
               "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"}  # fmt: skip
        gateway = start_gateway(policy, env)
        headers = {"authorization": f"Bearer {create_key_cli(env, 'affinity')}"}
        served = lambda: [httpx.get(f"{f.base_url}/stats").json()["requests"] for f in fakes]  # noqa: E731
        used = set()
        for group in range(12):
            before = served()
            for user in range(4):
                body = {"model": "fast", **_chat(f"System prompt number {group}. " * 30, f"question {user}")}
                r = httpx.post(
                    f"{gateway.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
                )
                assert r.status_code == 200
            grew = [after - b for after, b in zip(served(), before, strict=True)]
            assert sorted(grew) == [0, 4]  # the group's four requests on one replica
            used.add(grew.index(4))
        assert used == {0, 1}  # and the groups over both
        metrics = httpx.get(f"{gateway.base_url}/metrics", headers={"authorization": "Bearer m"}).text
        assert 'gateway_affinity_requests_total{backend="pool",outcome="hit"} 48.0' in metrics
    finally:
        if gateway is not None:
            gateway.stop()
        for fake in fakes:
            fake.stop()
