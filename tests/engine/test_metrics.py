"""The engine's Prometheus series."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine.metrics import EngineMetrics

# vLLM's series, as a scraper reads them (request_success_total also per finished_reason)
SERIES = (
    "engine:num_requests_running",
    "engine:num_requests_waiting",
    "engine:kv_cache_usage_perc",
    "engine:prefix_cache_queries_total",
    "engine:prefix_cache_hits_total",
    "engine:num_preemptions_total",
    "engine:prompt_tokens_total",
    "engine:generation_tokens_total",
    "engine:time_to_first_token_seconds_count",
    "engine:inter_token_latency_seconds_count",
    "engine:e2e_request_latency_seconds_count",
    "engine:request_queue_time_seconds_count",
)


def test_every_series_is_exported_as_zero_before_the_first_request() -> None:
    text = generate_latest(EngineMetrics("m").registry).decode()
    samples = {line.split("{")[0]: line for line in text.splitlines() if not line.startswith("#")}
    for name in (*SERIES, "engine:request_success_total"):
        assert name in samples, name
        assert samples[name].endswith(" 0.0") and 'model_name="m"' in samples[name], samples[name]
