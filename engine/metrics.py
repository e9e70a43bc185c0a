"""Prometheus metrics of the serving engine, named like vLLM's under the `engine:` prefix."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from engine.llm_engine import EngineStats
from engine.outputs import RequestOutput
from engine.spec_decode import SpecDecodeStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Tracked:
    """What the metrics remember of one running request between steps."""

    prompt_counted: bool = False
    last_token_time: dict[int, float] = field(default_factory=dict)


class EngineMetrics:
    """Owns a registry; the engine thread records steps, the server renders `/metrics`."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        # no `*_created` series (vLLM drops them too): they only double the output
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._running = Gauge(
            "engine:num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self._waiting = Gauge(
            "engine:num_requests_waiting", "Requests waiting to be admitted.", labels, registry=r
        )
        self._kv_usage = Gauge(
            "engine:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", labels, registry=r
        )
        self._prefix_queries = Counter(
            "engine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self._prefix_hits = Counter(
            "engine:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r
        )
        self._preemptions = Counter("engine:num_preemptions", "Sequences preempted.", labels, registry=r)
        self._prompt_tokens = Counter("engine:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self._generation_tokens = Counter("engine:generation_tokens", "Tokens generated.", labels, registry=r)
        self._finished = Counter(
            "engine:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._ttft = Histogram(
            "engine:time_to_first_token_seconds",
            "Seconds from arrival to the first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._itl = Histogram(
            "engine:inter_token_latency_seconds",
            "Seconds between consecutive tokens of a sequence.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            "engine:e2e_request_latency_seconds",
            "Seconds from arrival to the end of a request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._queue = Histogram(
            "engine:request_queue_time_seconds",
            "Seconds from arrival to the first step that ran the request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._spec = _SpecDecodeMetrics(labels, r)
        self._model = model_name
        self._tracked: dict[str, _Tracked] = {}
        self._last_stats: EngineStats | None = None
        # every series exported (as 0) before the first request, as a scraper expects
        every: list[Gauge | Counter | Histogram] = [self._running, self._waiting, self._kv_usage]
        every += [self._prefix_queries, self._prefix_hits, self._preemptions, self._prompt_tokens]
        every += [self._generation_tokens, self._ttft, self._itl, self._e2e, self._queue]
        for series in every:
            series.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self._finished.labels(model_name, reason)

    def record_stats(self, stats: EngineStats) -> None:
        """Set the gauges and advance the counters from an engine snapshot."""
        m = self._model
        self._running.labels(m).set(stats.num_running)
        self._waiting.labels(m).set(stats.num_waiting)
        self._kv_usage.labels(m).set(stats.kv_cache_usage)
        prev = self._last_stats
        self._prefix_queries.labels(m).inc(
            stats.prefix_cache_queries - (prev.prefix_cache_queries if prev else 0)
        )
        self._prefix_hits.labels(m).inc(stats.prefix_cache_hits - (prev.prefix_cache_hits if prev else 0))
        self._preemptions.labels(m).inc(stats.num_preemptions - (prev.num_preemptions if prev else 0))
        if stats.spec_decode is not None:
            self._spec.record(m, stats.spec_decode, prev.spec_decode if prev else None)
        self._last_stats = stats

    def record_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Token counters and latency histograms from one step's deltas (`now`: monotonic seconds)."""
        m = self._model
        new_tokens = 0
        for out in outputs:
            tracked = self._tracked.setdefault(out.request_id, _Tracked())
            for comp in out.outputs:
                count = len(comp.token_ids)
                if not count:
                    continue
                new_tokens += count
                last = tracked.last_token_time.get(comp.index)
                if last is not None:
                    # several tokens in one step (accepted speculative drafts) share the gap
                    gap = (now - last) / count
                    for _ in range(count):
                        self._itl.labels(m).observe(gap)
                tracked.last_token_time[comp.index] = now
            if not tracked.prompt_counted and out.metrics.first_token_time is not None:
                tracked.prompt_counted = True
                self._prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
                ttft = out.metrics.time_to_first_token
                if ttft is not None:
                    self._ttft.labels(m).observe(ttft)
                queue = out.metrics.queue_time
                if queue is not None:
                    self._queue.labels(m).observe(queue)
            if out.finished:
                self._finish(out, now)
        if new_tokens:
            self._generation_tokens.labels(m).inc(new_tokens)

    def record_aborted(self, out: RequestOutput, now: float) -> None:
        """A request stopped by the client or by shutdown."""
        self._finish(out, now)

    def _finish(self, out: RequestOutput, now: float) -> None:
        self._tracked.pop(out.request_id, None)
        m = self._model
        reasons = {c.finish_reason or "abort" for c in out.outputs}
        reason = "abort" if "abort" in reasons else ("length" if reasons == {"length"} else "stop")
        self._finished.labels(m, reason).inc()
        self._e2e.labels(m).observe(now - out.metrics.arrival_time)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class _SpecDecodeMetrics:
    """Speculative decoding's counters (vLLM's spec_decode names), advanced from engine snapshots."""

    def __init__(self, labels: list[str], registry: CollectorRegistry) -> None:
        r = registry
        self.drafts = Counter(
            "engine:spec_decode_num_drafts", "Verify passes of a sequence with drafts.", labels, registry=r
        )
        self.draft_tokens = Counter(
            "engine:spec_decode_num_draft_tokens", "Tokens proposed for verification.", labels, registry=r
        )
        self.accepted = Counter(
            "engine:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", labels, registry=r
        )
        self.per_pos = Counter(
            "engine:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the draft (0: the first).",
            [*labels, "position"],
            registry=r,
        )

    def record(self, model: str, now: SpecDecodeStats, before: SpecDecodeStats | None) -> None:
        self.drafts.labels(model).inc(now.num_drafts - (before.num_drafts if before else 0))
        self.draft_tokens.labels(model).inc(now.num_draft_tokens - (before.num_draft_tokens if before else 0))
        self.accepted.labels(model).inc(
            now.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        )
        for pos, count in enumerate(now.accepted_per_pos):
            earlier = before.accepted_per_pos[pos] if before else 0
            self.per_pos.labels(model, str(pos)).inc(count - earlier)
