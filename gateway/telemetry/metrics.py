"""The gateway's Prometheus metrics: requests, latency, tokens, cost, failovers, replica state.

One GatewayMetrics per app, registered as a collector on the app's own CollectorRegistry (wired in
the lifespan). Each request is recorded once, from its log row, into plain numbers: a dictionary
lookup per label set, additions, and a bisect per histogram. They become Prometheus families
only when /metrics is scraped. prometheus_client's own Counter and Histogram take a lock per
update: the six updates of a request cost ~17 us that way on the 2-core dev machine, ~5 us here.
The proxy runs on one event loop and /metrics is served on the same loop, so nothing is read
while it is being written. Replica state is read at scrape time too. Label values are bounded:
model and route names from the policy (anything else is "unknown"), backend names, HTTP
statuses, tiers, failover reasons.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.backends.autoscale import scale_signal
from gateway.backends.base import Upstream
from gateway.backends.health import BreakerState
from gateway.config.policy import EngineBackend
from gateway.store.record import RequestRecord, Tried

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OVERHEAD_BUCKETS = (0.0002, 0.0004, 0.0006, 0.0008, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)
_BREAKER_VALUES = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 1.0, BreakerState.OPEN: 2.0}
NONE = "none"  # the label value for "no backend" / "no tier"
UNKNOWN = "unknown"  # the label value for a model name the policy does not know


class _Histogram:
    """Bucket counts (not cumulative: the last one is +Inf) and the sum of the observations."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts in it
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        family.add_metric(labels, buckets, self.sum)


class _Series:
    """What one (model, backend) pair has added up."""

    __slots__ = ("cost", "input_tokens", "latency", "output_tokens", "ttft")

    def __init__(self) -> None:
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.ttft = _Histogram(LATENCY_BUCKETS)
        self.input_tokens = 0
        self.output_tokens = 0
        self.cost = 0.0


class GatewayMetrics(Collector):
    """Every request-level metric of the gateway; registers itself (and the replica gauges)."""

    def __init__(
        self, registry: CollectorRegistry, pools: Callable[[], Mapping[str, Upstream]] | None = None
    ) -> None:
        self._requests: dict[tuple[str, str, str, str], int] = {}  # (model, backend, status, tier)
        self._series: dict[tuple[str, str], _Series] = {}  # (model, backend)
        self._failovers: dict[tuple[str, str, str], int] = {}  # (from backend, to backend, reason)
        self._overhead = _Histogram(OVERHEAD_BUCKETS)
        self._resumptions: dict[tuple[str, str], int] = {}  # (backend, reason)
        self._resumed_tokens: dict[str, int] = {}  # backend: output tokens streams were resumed from
        self._pools = pools  # the active policy's upstreams, read at scrape time
        registry.register(self)

    def record(self, rec: RequestRecord) -> None:
        """One finished request (a RecordSink); the requested model is a label only if the policy has it."""
        row = rec.row
        model = row["requested_model"] if rec.known_model and row["requested_model"] is not None else UNKNOWN
        backend = row["backend"] or NONE
        key = (model, backend, str(row["status"]), row["route_tier"] or NONE)
        self._requests[key] = self._requests.get(key, 0) + 1
        series = self._series.get((model, backend))
        if series is None:
            series = self._series[(model, backend)] = _Series()
        series.latency.observe(row["latency_ms"] / 1e3)
        self._overhead.observe(row["overhead_ms"] / 1e3)
        if row["ttft_ms"] is not None:
            series.ttft.observe(row["ttft_ms"] / 1e3)
        series.input_tokens += row["prompt_tokens"] or 0
        series.output_tokens += row["completion_tokens"] or 0
        if row["cost_picousd"] is not None:
            series.cost += float(row["cost_picousd"])
        if rec.attempts:
            self._count_failovers(rec.attempts, row["backend"])
        for resumed in rec.resumptions:
            pair = (resumed.backend, resumed.reason)
            self._resumptions[pair] = self._resumptions.get(pair, 0) + 1
            before = self._resumed_tokens.get(resumed.backend, 0)
            self._resumed_tokens[resumed.backend] = before + resumed.tokens

    def _count_failovers(self, attempts: Sequence[Tried], served: str | None) -> None:
        """Each attempt that did not serve moved the request on: to the next attempt's backend."""
        for i, attempt in enumerate(attempts):
            to = attempts[i + 1].backend if i + 1 < len(attempts) else (served or NONE)
            key = (attempt.backend, to, attempt.reason)
            self._failovers[key] = self._failovers.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        """The families, built from the sums now (on /metrics)."""
        pair = ["model", "backend"]
        requests = CounterMetricFamily(
            "gateway_requests",
            "Completion requests answered, by requested model, serving backend, HTTP status and route tier.",
            labels=["model", "backend", "status", "tier"],
        )
        for request_labels, count in self._requests.items():
            requests.add_metric(list(request_labels), count)
        latency = HistogramMetricFamily(
            "gateway_request_duration_seconds",
            "Seconds from the request reaching the proxy to its end (streams: the last event).",
            labels=pair,
        )
        ttft = HistogramMetricFamily(
            "gateway_time_to_first_token_seconds",
            "Seconds from the request reaching the proxy to the first streamed event (streams only).",
            labels=pair,
        )
        input_tokens = CounterMetricFamily(
            "gateway_input_tokens", "Prompt tokens, as reported (or counted).", labels=pair
        )
        output_tokens = CounterMetricFamily(
            "gateway_output_tokens", "Completion tokens, as reported (or counted).", labels=pair
        )
        cost = CounterMetricFamily(
            "gateway_cost_usd", "What the requests cost, in USD (backends with a price).", labels=pair
        )
        for (model, backend), series in self._series.items():
            labels = [model, backend]
            series.latency.add_to(latency, labels)
            if sum(series.ttft.counts):
                series.ttft.add_to(ttft, labels)
            input_tokens.add_metric(labels, series.input_tokens)
            output_tokens.add_metric(labels, series.output_tokens)
            cost.add_metric(labels, series.cost)
        overhead = HistogramMetricFamily(
            "gateway_overhead_seconds",
            "Seconds spent inside the gateway per request (total minus waiting on the upstream).",
        )
        self._overhead.add_to(overhead, [])
        failovers = CounterMetricFamily(
            "gateway_failovers",
            "Moves away from a backend that could not serve (to the next replica or model; 'none': gave up).",
            labels=["from_backend", "to_backend", "reason"],
        )
        for failover_labels, count in self._failovers.items():
            failovers.add_metric(list(failover_labels), count)
        resumptions = CounterMetricFamily(
            "gateway_stream_resumptions",
            "Streams that broke mid-answer and went on on another replica of the pool, by why they broke.",
            labels=["backend", "reason"],
        )
        for resumption_labels, count in self._resumptions.items():
            resumptions.add_metric(list(resumption_labels), count)
        resumed_tokens = CounterMetricFamily(
            "gateway_stream_resumed_tokens",
            "Output tokens resumed streams went on from (the client had them; the new replica re-read them).",
            labels=["backend"],
        )
        for backend_name, count in self._resumed_tokens.items():
            resumed_tokens.add_metric([backend_name], count)
        yield from (requests, latency, ttft, overhead, input_tokens, output_tokens, cost, failovers)
        yield from (resumptions, resumed_tokens)
        if self._pools is not None:
            yield from _replica_families(self._pools())

    def describe(self) -> Iterator[Metric]:
        """Nothing to check at registration (the label sets grow with traffic)."""
        return iter(())


def _replica_families(pools: Mapping[str, Upstream]) -> Iterator[Metric]:
    """Gauges of the active policy's engine replicas: breaker state, check result, requests in flight."""
    labels = ["backend", "replica"]
    state = GaugeMetricFamily(
        "gateway_circuit_breaker_state",
        "Circuit breaker of each engine replica: 0 closed, 1 half-open, 2 open.",
        labels=labels,
    )
    up = GaugeMetricFamily(
        "gateway_replica_up", "1 when the replica's last health check passed.", labels=labels
    )
    in_flight = GaugeMetricFamily(
        "gateway_replica_in_flight", "Requests this gateway has in flight to the replica.", labels=labels
    )
    affinity = CounterMetricFamily(
        "gateway_affinity_requests",
        "Calls of prefix_affinity pools: to the prefix's home replica (hit) or another one (spill).",
        labels=["backend", "outcome"],
    )
    prefixes = GaugeMetricFamily(
        "gateway_affinity_prefixes",
        "Prefixes whose home is each replica of a prefix_affinity pool (used in the last 10 minutes).",
        labels=labels,
    )
    desired = GaugeMetricFamily(
        "gateway_pool_desired_replicas",
        "Replicas each engine pool wants: ceil(replicas up x max(queue / target, KV usage / target)), "
        "clamped to the policy's autoscale bounds (for the HPA or KEDA).",
        labels=["backend"],
    )
    pool_queue = GaugeMetricFamily(
        "gateway_pool_queue_depth", "Mean queue depth of each pool's replicas up.", labels=["backend"]
    )
    pool_kv = GaugeMetricFamily(
        "gateway_pool_kv_cache_usage", "Mean KV-cache usage of each pool's replicas up.", labels=["backend"]
    )
    pool_up = GaugeMetricFamily("gateway_pool_replicas_up", "Replicas up in each pool.", labels=["backend"])
    for name, pool in pools.items():
        spec = getattr(pool, "spec", None)
        if isinstance(spec, EngineBackend):
            signal = scale_signal(pool.replicas, spec.autoscale)  # type: ignore[attr-defined]
            desired.add_metric([name], float(signal.desired))
            pool_queue.add_metric([name], signal.queue_depth)
            pool_kv.add_metric([name], signal.kv_usage)
            pool_up.add_metric([name], float(signal.replicas_up))
        for replica in getattr(pool, "replicas", ()):
            values = [name, replica.url]
            state.add_metric(values, _BREAKER_VALUES[replica.breaker.state])
            up.add_metric(values, 1.0 if replica.check_ok else 0.0)
            in_flight.add_metric(values, float(replica.in_flight))
        counts = getattr(pool, "affinity_counts", None)  # engine pools that balance by prefix
        for outcome, count in (counts or {}).items():
            affinity.add_metric([name, outcome], float(count))
        homes = getattr(pool, "homes", None)
        if homes is not None:
            placed = homes.placed()
            for replica in pool.replicas:  # type: ignore[attr-defined]
                prefixes.add_metric([name, replica.url], float(placed.get(replica.url, 0)))
    yield from (state, up, in_flight, affinity, prefixes, desired, pool_queue, pool_kv, pool_up)
