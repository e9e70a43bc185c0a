"""The replicas an engine pool wants, from what its replicas report (queue depth, KV usage).

Like the Kubernetes HPA's own rule, applied to the signals that matter for an inference server
(queueing, not CPU): desired = ceil(replicas x max(mean queue depth / target, mean KV usage /
target)), clamped to [min_replicas, max_replicas]. Only replicas whose last health check passed
count: their /metrics gave the figures. With none up, the pool wants what it has (or the minimum):
there is nothing to measure, and more replicas of a broken deployment do not help.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.backends.health import Replica
from gateway.config.policy import Autoscale


@dataclass(frozen=True)
class ScaleSignal:
    """A pool's desired replicas and the inputs it came from."""

    replicas_up: int
    queue_depth: float  # mean over the replicas up
    kv_usage: float  # mean over the replicas up
    desired: int


def scale_signal(replicas: Sequence[Replica], targets: Autoscale) -> ScaleSignal:
    """The pool's signal now."""
    up = [r for r in replicas if r.check_ok]
    if not up:
        return ScaleSignal(0, 0.0, 0.0, max(targets.min_replicas, min(len(replicas), targets.max_replicas)))
    queue = sum(r.queue_depth for r in up) / len(up)
    kv = sum(r.kv_usage for r in up) / len(up)
    ratio = max(queue / targets.target_queue_depth, kv / targets.target_kv_usage)
    want = math.ceil(len(up) * ratio - 1e-9)  # a ratio of exactly 1 keeps the count
    return ScaleSignal(len(up), queue, kv, min(max(want, targets.min_replicas), targets.max_replicas))
