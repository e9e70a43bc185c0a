"""The replicas an engine pool wants (gateway_pool_desired_replicas): the HPA's rule on queue depth
and KV usage, clamped to the policy's bounds, following the replicas' reports scrape by scrape."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from gateway.backends.autoscale import scale_signal
from gateway.backends.engine import EnginePool
from gateway.backends.health import Replica
from gateway.config.policy import Autoscale, EngineBackend, HealthSettings
from gateway.telemetry.metrics import GatewayMetrics


def _replicas(*reports: tuple[float, float]) -> list[Replica]:
    replicas = []
    for i, (queue, kv) in enumerate(reports):
        replica = Replica(f"http://10.0.0.{i}:8001", HealthSettings())
        replica.queue_depth, replica.kv_usage = queue, kv
        replicas.append(replica)
    return replicas


def test_desired_replicas_follow_the_busiest_signal_within_bounds() -> None:
    targets = Autoscale(target_queue_depth=4, target_kv_usage=0.8, min_replicas=1, max_replicas=10)
    assert scale_signal(_replicas((8, 0.1), (8, 0.1)), targets).desired == 4  # queues twice the target
    assert scale_signal(_replicas((0, 0.9), (0, 0.9)), targets).desired == 3  # KV 1.125x its target
    assert scale_signal(_replicas((4, 0.8), (4, 0.8)), targets).desired == 2  # on target: as many
    assert scale_signal(_replicas((0, 0.0), (0, 0.0)), targets).desired == 1  # idle: the minimum
    assert scale_signal(_replicas((400, 1.0)), targets).desired == 10  # capped
    down = _replicas((50, 1.0), (0, 0.0))
    down[0].check_ok = False  # a replica whose check failed reports nothing
    signal = scale_signal(down, targets)
    assert (signal.replicas_up, signal.queue_depth, signal.desired) == (1, 0.0, 1)
    for replica in down:
        replica.check_ok = False
    assert scale_signal(down, targets).desired == 2  # nothing to measure: what it has


def test_the_gauge_follows_queue_depth() -> None:
    spec = EngineBackend(type="engine", urls=["http://10.0.0.1:8001", "http://10.0.0.2:8001"],
                         autoscale=Autoscale(target_queue_depth=2))  # fmt: skip
    pool = EnginePool("local", spec, HealthSettings())
    registry = CollectorRegistry()
    GatewayMetrics(registry, lambda: {"local": pool})

    def desired() -> float:
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith('gateway_pool_desired_replicas{backend="local"}'):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no gauge")

    try:
        assert desired() == 1
        for depth, want in ((2, 2), (5, 5), (12, 12), (1, 1)):
            for replica in pool.replicas:
                replica.queue_depth = depth
            assert desired() == want
    finally:
        asyncio.run(pool.close())
